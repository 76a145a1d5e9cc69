"""Advantage estimators: VPO's set reward (VPO-SPEC section 3) and the baselines of section 4. Pure torch.

Shapes: B prompts, G chains (rollouts) per prompt, m candidates per chain, D reward dimensions, K weight vectors.
Every estimator in :data:`ESTIMATORS` takes ``rewards [B, G, m, D]`` in [0, 1] (+ an optional presence mask
``[B, G, m]``) and returns one advantage per rollout, ``[B, G]``, that the loss applies to every generated token.
Single-answer methods receive m = 1. Nothing here loops in Python over B, G, m, K or D.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "CHAIN_ESTIMATORS",
    "ESTIMATORS",
    "WEIGHTED_ESTIMATORS",
    "gdpo",
    "goal_conditioned_grpo",
    "group_normalize",
    "grpo",
    "max_at_k",
    "max_at_k_contributions",
    "multi_rlvr",
    "random_weight_grpo",
    "sample_weights",
    "set_rewards",
    "vpo_advantages",
]


# ----------------------------------------------------------------------------------------------- validation
def _check_rewards(rewards: Tensor, mask: Tensor | None, single: str | None = None) -> tuple[Tensor, Tensor | None]:
    """Validate ``rewards [B, G, m, D]`` in [0, 1] and ``mask [B, G, m]``; return them as float / bool tensors."""
    shape = "[B, G, 1, D]" if single else "[B, G, m, D]"
    if not isinstance(rewards, Tensor) or rewards.dim() != 4 or min(rewards.shape[1:]) < 1:
        got = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a tensor of shape {shape} with G, m, D >= 1, got {got}")
    if single and rewards.shape[2] != 1:
        raise ValueError(f"rewards must have shape {shape} for the single-answer estimator {single!r}, "
                         f"got {tuple(rewards.shape)}")
    if rewards.is_complex():
        raise ValueError(f"rewards must be real-valued, got dtype {rewards.dtype}")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if rewards.numel():
        low, high = torch.aminmax(rewards)  # NaN propagates into both, and fails the comparison below
        if not (low >= 0 and high <= 1):
            raise ValueError(f"rewards must lie in [0, 1] with no NaN, got min {low.item():.4g}, max "
                             f"{high.item():.4g}, {int(rewards.isnan().sum())} NaN")
    if mask is None:
        return rewards, None
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(rewards.shape[:3]):
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a tensor of shape [B, G, m] = {tuple(rewards.shape[:3])}, got {got}")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must be bool (True = candidate present) or hold only 0 and 1")
    return rewards, mask.to(device=rewards.device, dtype=torch.bool)


def _check_weights(weights: Tensor, num_groups: int, dim: int, like: Tensor) -> Tensor:
    """Validate ``weights [K, D]`` or ``[B, K, D]`` (finite, >= 0); return ``[B or 1, K, D]`` like ``like``."""
    expected = f"[K, D] or [B, K, D] = [{num_groups}, K, {dim}]"
    if not isinstance(weights, Tensor) or weights.dim() not in (2, 3) or weights.shape[-1] != dim:
        got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must have shape {expected}, got {got}")
    if weights.shape[-2] < 1 or (weights.dim() == 3 and weights.shape[0] != num_groups):
        raise ValueError(f"weights must have shape {expected} with K >= 1, got {tuple(weights.shape)}")
    weights = weights.to(device=like.device, dtype=like.dtype)
    if not weights.isfinite().all() or (weights < 0).any():
        raise ValueError("weights must be finite and non-negative (points of the simplex)")
    return weights if weights.dim() == 3 else weights.unsqueeze(0)  # [B or 1, K, D]


def _masked(rewards: Tensor, mask: Tensor | None) -> Tensor:
    """Absent candidates become zero rows, which never win a max (rewards and weights are >= 0)."""
    return rewards if mask is None else rewards * mask.unsqueeze(-1).to(rewards.dtype)  # [B, G, m, D]


def _znorm(x: Tensor, dim: int, eps: float) -> Tensor:
    """(x - mean) / (std + eps) along ``dim``, population std; a slice whose std < eps is all zeros."""
    if x.numel() == 0:
        return torch.zeros_like(x)
    mean = x.mean(dim=dim, keepdim=True)
    std = x.std(dim=dim, correction=0, keepdim=True)
    return torch.where(std < eps, torch.zeros_like(x), (x - mean) / (std + eps))


# ----------------------------------------------------------------------------------------------- VPO core
def _sample_log_gamma(shape: tuple[int, ...], alpha: float, generator: torch.Generator | None) -> Tensor:
    """log Gamma(alpha, 1) draws, float64 (Marsaglia-Tsang; vectorised rejection rounds, not a loop over items).

    torch's own Gamma/Dirichlet samplers take no ``generator``, so reproducibility needs this. For alpha < 1 it
    draws Gamma(alpha + 1) * U^(1/alpha), kept in log space so tiny alphas do not underflow to an all-zero row.
    """
    device = generator.device if generator is not None else torch.device("cpu")
    kw = {"generator": generator, "dtype": torch.float64, "device": device}
    a = alpha + 1.0 if alpha < 1.0 else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = torch.empty(math.prod(shape), dtype=torch.float64, device=device)
    todo = torch.arange(out.numel(), device=device)
    while todo.numel():  # each round accepts > 95% of what is left
        x, u = torch.randn(todo.numel(), **kw), torch.rand(todo.numel(), **kw)
        v = (1.0 + c * x) ** 3
        ok = (v > 0) & (u.log() < 0.5 * x * x + d - d * v + d * v.clamp_min(1e-300).log())
        out[todo[ok]] = math.log(d) + v[ok].log()
        todo = todo[~ok]
    if alpha < 1.0:
        out += torch.rand(out.numel(), **kw).clamp_min(1e-300).log() / alpha
    return out.view(shape)


def sample_weights(num_weights: int, dim: int, alpha: float = 1.0, *, num_groups: int | None = None,
                   generator: torch.Generator | None = None) -> Tensor:
    """Weight vectors w ~ Dirichlet(alpha * 1_D); alpha = 1 is uniform on the simplex.

    Args:
        num_weights: K, vectors per group.
        dim: D, reward dimensions.
        alpha: Dirichlet concentration (> 0).
        num_groups: B; ``None`` draws one set ``[K, D]`` shared by everything.
        generator: torch RNG for reproducibility; the draw is on its device (CPU when ``None``).

    Returns:
        ``[K, D]`` or ``[B, K, D]`` float32 weights, each row non-negative and summing to 1.
    """
    for name, value in (("num_weights", num_weights), ("dim", dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_groups is not None and (isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0):
        raise ValueError(f"num_groups must be None or an int >= 0, got {num_groups!r}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite float > 0, got {alpha!r}")
    shape = (num_weights, dim) if num_groups is None else (num_groups, num_weights, dim)
    if alpha == 1.0:  # normalised Exp(1) draws are exactly uniform on the simplex; -log(1 - U) ~ Exp(1)
        device = generator.device if generator is not None else None
        e = torch.rand(shape, generator=generator, device=device, dtype=torch.float32).neg_().log1p_().neg_()
        return e.div_(e.sum(dim=-1, keepdim=True).clamp_min_(torch.finfo(e.dtype).tiny))  # [(B,) K, D]
    return torch.softmax(_sample_log_gamma(shape, float(alpha), generator), dim=-1).float()  # [(B,) K, D]


def set_rewards(rewards: Tensor, weights: Tensor, mask: Tensor | None = None) -> Tensor:
    """VPO set reward R(S_g) = (1/K) sum_k max_j w_k . r_{g,j}, a Monte-Carlo estimate of E_w[max_y w.r(y)].

    Args:
        rewards: ``[B, G, m, D]`` in [0, 1].
        weights: ``[K, D]`` shared by all groups, or ``[B, K, D]`` one set per group (non-negative).
        mask: ``[B, G, m]`` bool, True = candidate present; absent candidates are zero rows (an all-absent chain
            scores 0).

    Returns:
        ``[B, G]`` set rewards.
    """
    rewards, mask = _check_rewards(rewards, mask)
    return _set_rewards(rewards, _check_weights(weights, rewards.shape[0], rewards.shape[-1], rewards), mask)


def _set_rewards(rewards: Tensor, weights: Tensor, mask: Tensor | None) -> Tensor:
    """:func:`set_rewards` on validated input; ``weights`` is ``[B or 1, K, D]``."""
    b, g, m, d = rewards.shape
    flat = _masked(rewards, mask).reshape(b, g * m, d)  # [B, G*m, D]
    scalarised = torch.matmul(flat, weights.transpose(1, 2)).view(b, g, m, weights.shape[1])  # [B, G, m, K]
    return scalarised.amax(dim=2).mean(dim=-1)  # best candidate per w, then the mean over w: [B, G]


def group_normalize(scores: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO normalisation within each group: (s - mean_G) / (std_G + eps), population std (ddof 0).

    Args:
        scores: ``[B, G]`` finite per-rollout scores.
        eps: added to the std; a group whose std < eps gets all-zero advantages (a flat group carries no signal).

    Returns:
        ``[B, G]`` advantages.
    """
    if not isinstance(scores, Tensor) or scores.dim() != 2 or scores.shape[1] < 1:
        got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a tensor of shape [B, G] with G >= 1, got {got}")
    if scores.is_complex() or not scores.isfinite().all():
        raise ValueError("scores must be real and finite (no NaN or inf)")
    return _znorm(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=1, eps=eps)  # [B, G]


def vpo_advantages(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None,
                   num_weights: int = 100, alpha: float = 1.0, eps: float = 1e-6,
                   generator: torch.Generator | None = None) -> Tensor:
    """VPO advantage: the set reward averaged over w first, then one GRPO normalisation within each group.

    Args:
        rewards: ``[B, G, m, D]`` in [0, 1].
        mask: ``[B, G, m]`` bool presence mask (absent = zero row).
        weights: ``[K, D]`` or ``[B, K, D]``, used as is; ``None`` draws ``num_weights`` Dirichlet(alpha)
            vectors per group with ``generator``, shared by the group's G chains.
        num_weights: K when sampling.
        alpha: Dirichlet concentration when sampling.
        eps: normalisation epsilon (see :func:`group_normalize`).
        generator: torch RNG for the weights.

    Returns:
        ``[B, G]`` advantages.
    """
    rewards, mask = _check_rewards(rewards, mask)
    b, d = rewards.shape[0], rewards.shape[-1]
    if weights is None:  # fresh draws are valid by construction: skip the [B, K, D] validation pass
        weights = sample_weights(num_weights, d, alpha, num_groups=b, generator=generator).to(rewards)  # [B, K, D]
    else:
        weights = _check_weights(weights, b, d, rewards)  # [B or 1, K, D]
    return _znorm(_set_rewards(rewards, weights, mask), dim=1, eps=eps)  # [B, G]


# ----------------------------------------------------------------------------------------------- baselines
def grpo(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None, num_weights: int = 100,
         alpha: float = 1.0, eps: float = 1e-6, generator: torch.Generator | None = None) -> Tensor:
    """GRPO: f(s) = mean of the D components, z-normalised within the group. ``rewards [B, G, 1, D] -> [B, G]``.

    ``weights``, ``num_weights``, ``alpha`` and ``generator`` are accepted for the shared signature and unused.
    """
    rewards, mask = _check_rewards(rewards, mask, single="grpo")
    return group_normalize(_masked(rewards, mask).mean(dim=-1).squeeze(2), eps)  # [B, G]


def multi_rlvr(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None,
               num_weights: int = 100, alpha: float = 1.0, eps: float = 1e-6,
               generator: torch.Generator | None = None) -> Tensor:
    """Multi-RLVR: per chain, the sum of f over de-duplicated candidate rows, then group z-norm.

    A candidate whose reward vector exactly equals that of an earlier present candidate of the same chain counts
    0; so does an absent one. ``rewards [B, G, m, D] -> [B, G]``; the weight arguments are unused.
    """
    rewards, mask = _check_rewards(rewards, mask)
    m = rewards.shape[2]
    present = mask if mask is not None else torch.ones(rewards.shape[:3], dtype=torch.bool, device=rewards.device)
    same = (rewards.unsqueeze(3) == rewards.unsqueeze(2)).all(dim=-1)  # [B, G, m, m]: row j equals row i
    earlier = torch.ones(m, m, dtype=torch.bool, device=rewards.device).tril(-1)  # [m, m]: i < j
    duplicate = (same & earlier & present.unsqueeze(2)).any(dim=-1)  # [B, G, m]
    counted = (present & ~duplicate).to(rewards.dtype)  # [B, G, m]
    return group_normalize((rewards.mean(dim=-1) * counted).sum(dim=-1), eps)  # [B, G]


def random_weight_grpo(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None,
                       num_weights: int = 100, alpha: float = 1.0, eps: float = 1e-6,
                       generator: torch.Generator | None = None) -> Tensor:
    """Random-weight GRPO: score w.s with one w ~ Dir(alpha) per group, shared by its G rollouts; group z-norm.

    ``weights`` ``[B, 1, D]`` (or ``[B, K, D]``/``[K, D]``, scored as the mean over K) comes from the rollout,
    which draws it before generation; ``None`` draws one vector per group with ``generator`` (``num_weights``
    is then ignored: the method is defined with a single weight vector). ``rewards [B, G, 1, D] -> [B, G]``.
    """
    rewards, mask = _check_rewards(rewards, mask, single="random_weight_grpo")
    b, d = rewards.shape[0], rewards.shape[-1]
    if weights is None:
        weights = sample_weights(1, d, alpha, num_groups=b, generator=generator)  # [B, 1, D]
    # With m = 1 the max over candidates is the candidate itself, so the set reward is exactly mean_k w_k . s.
    return _znorm(_set_rewards(rewards, _check_weights(weights, b, d, rewards), mask), dim=1, eps=eps)  # [B, G]


def goal_conditioned_grpo(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None,
                          num_weights: int = 100, alpha: float = 1.0, eps: float = 1e-6,
                          generator: torch.Generator | None = None) -> Tensor:
    """Goal-conditioned GRPO: as :func:`random_weight_grpo`; only the prompt differs (it lists the weights)."""
    return random_weight_grpo(rewards, mask, weights=weights, num_weights=num_weights, alpha=alpha, eps=eps,
                              generator=generator)


def _log_comb(n: Tensor, k: Tensor | float) -> Tensor:
    """log C(n, k) for float64 tensors; -inf where C is 0 (k < 0 or k > n)."""
    valid = (k >= 0) & (n >= k)
    n_, k_ = n.clamp_min(0), torch.as_tensor(k, dtype=n.dtype).clamp_min(0)
    value = torch.lgamma(n_ + 1) - torch.lgamma(k_ + 1) - torch.lgamma((n_ - k_).clamp_min(0) + 1)
    return torch.where(valid, value, torch.full_like(value, -math.inf))


def max_at_k_contributions(scores: Tensor, k: int) -> Tensor:
    """Each rollout's contribution to the unbiased estimate of max@k = E[max of k samples], ``[B, n] -> [B, n]``.

    The unbiased estimate from n samples averages max(S) over all k-subsets S. Its policy gradient is
    ``sum_i s_i grad log p(y_i)`` with ``s_i = (1 / C(n, k)) * sum_{S containing i} max(S)``. With the scores
    sorted ascending (1-based rank i; ties in any fixed order give the same sums):
    ``s_(i) = [C(i-1, k-1) * r_(i) + sum_{j > i} C(j-2, k-2) * r_(j)] / C(n, k)``
    (subsets where i is the maximum, plus subsets whose maximum j > i also contain i). ``sum_i s_i = k * max@k``.
    """
    n = scores.shape[1]
    ordered, order = scores.double().sort(dim=1, stable=True)  # [B, n] ascending
    rank = torch.arange(1, n + 1, dtype=torch.float64, device=scores.device)  # [n]
    total = _log_comb(torch.tensor(float(n), dtype=torch.float64), float(k))
    own = (_log_comb(rank - 1, k - 1.0) - total).exp()  # [n] share of subsets where rank i is the max
    above = (_log_comb(rank - 2, k - 2.0) - total).exp()  # [n] share of subsets with max j that hold a given i<j
    v = ordered * above  # [B, n]
    later = v.flip(1).cumsum(1).flip(1) - v  # [B, n] sum over j > i
    contrib = ordered * own + later  # [B, n] in sorted order
    return torch.empty_like(contrib).scatter_(1, order, contrib).to(scores.dtype)  # [B, n] original order


def max_at_k(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None, num_weights: int = 100,
             alpha: float = 1.0, eps: float = 1e-6, generator: torch.Generator | None = None,
             k: int | None = None) -> Tensor:
    """Max@k (arXiv 2510.23393): per-rollout contribution to unbiased max@k of f, then mean-subtract / std + eps.

    Args:
        rewards: ``[B, G, 1, D]``; the scalar is f = mean over D (absent candidate = 0).
        mask: ``[B, G, 1]`` presence mask.
        k: subset size; default ``max(2, G // 2)``, capped at G.
        eps: see :func:`group_normalize` (the baseline is the group mean of the contributions).
        weights: unused (shared signature), like ``num_weights``, ``alpha`` and ``generator``.

    Returns:
        ``[B, G]`` advantages; see :func:`max_at_k_contributions` for the formula.
    """
    rewards, mask = _check_rewards(rewards, mask, single="max_at_k")
    scores = _masked(rewards, mask).mean(dim=-1).squeeze(2)  # [B, G]
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k must be None or a positive int, got {k!r}")
    k = min(max(2, scores.shape[1] // 2) if k is None else k, scores.shape[1])
    return group_normalize(max_at_k_contributions(scores, k), eps)  # [B, G]


def gdpo(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None, num_weights: int = 100,
         alpha: float = 1.0, eps: float = 1e-6, generator: torch.Generator | None = None) -> Tensor:
    """GDPO: z-normalise each dimension within the group, sum over D, then whiten over the whole batch (B * G).

    ``rewards [B, G, 1, D] -> [B, G]``; a dimension that is flat within a group contributes 0, and a batch whose
    summed scores are flat gets all zeros. The weight arguments are unused.
    """
    rewards, mask = _check_rewards(rewards, mask, single="gdpo")
    per_dim = _znorm(_masked(rewards, mask).squeeze(2), dim=1, eps=eps)  # [B, G, D]
    summed = per_dim.sum(dim=-1)  # [B, G]
    return _znorm(summed.reshape(1, -1), dim=1, eps=eps).view_as(summed)  # [B, G] batch-whitened


Estimator = Callable[..., Tensor]
ESTIMATORS: dict[str, Estimator] = {
    "vpo": vpo_advantages,
    "grpo": grpo,
    "multi_rlvr": multi_rlvr,
    "random_weight_grpo": random_weight_grpo,
    "goal_conditioned_grpo": goal_conditioned_grpo,
    "max_at_k": max_at_k,
    "gdpo": gdpo,
}
CHAIN_ESTIMATORS = frozenset({"vpo", "multi_rlvr"})  # m-answer chains; the others get m = 1
WEIGHTED_ESTIMATORS = frozenset({"random_weight_grpo", "goal_conditioned_grpo"})  # weights drawn before rollout
