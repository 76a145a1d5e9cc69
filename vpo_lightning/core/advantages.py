"""Advantage estimators: VPO's set reward (VPO-SPEC section 3) and the baselines of section 4. Pure torch.

Shapes: B prompts, G chains (rollouts) per prompt, m candidates per chain, D reward dimensions, K weight vectors.
Every estimator of the table (:mod:`~vpo_lightning.core.estimators`) takes ``rewards [B, G, m, D]`` in [0, 1] (+
an optional presence mask ``[B, G, m]``) and returns one advantage per rollout, ``[B, G]``, that the loss applies to
every generated token.
Single-answer methods receive m = 1. Nothing here loops in Python over B, G, m, K or D.

Per-row D. A batch may mix records with different numbers of real dimensions (code tasks: one per test, at most 16).
The tensor then has the widest D and every estimator takes ``dim_mask [B, D]`` (True = a real dimension of that
group's record): padding dimensions are zeroed, the scalar f is the mean over the real dimensions only, and Dirichlet
weights live on the real dimensions only (a Dirichlet draw restricted to a subset of coordinates and renormalised
is exactly Dirichlet over that subset). ``dim_mask=None`` means every dimension is real.

Normalisation follows the reference (``verl/verl/trainer/ppo/core_algos.py``): VPO's and the weighted baselines'
group z-norm use the population std (ddof 0, VPO-SPEC section 3); GRPO, Multi-RLVR, max@k and GDPO's per-dimension
step use the sample std (ddof 1); GDPO's batch whitening is token-weighted.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "gdpo",
    "goal_conditioned_grpo",
    "group_normalize",
    "grpo",
    "max_at_k",
    "max_at_k_contributions",
    "max_at_k_default",
    "multi_rlvr",
    "random_weight_grpo",
    "restrict_weights",
    "sample_weights",
    "set_rewards",
    "vpo",
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


def _znorm(x: Tensor, dim: int, eps: float, correction: int = 0) -> Tensor:
    """(x - mean) / (std + eps) along ``dim``; std with ``correction`` (0 = population, 1 = sample std).

    A slice whose std < eps is all zeros, and so is a slice too short for the correction (one rollout under ddof 1:
    no baseline, no signal; the reference's GRPO would give it r / (1 + eps))."""
    if x.numel() == 0 or x.shape[dim] <= correction:
        return torch.zeros_like(x)
    mean = x.mean(dim=dim, keepdim=True)
    std = x.std(dim=dim, correction=correction, keepdim=True)
    return torch.where(std < eps, torch.zeros_like(x), (x - mean) / (std + eps))


def _check_dim_mask(dim_mask: Tensor | None, rewards: Tensor) -> Tensor | None:
    """Validate ``dim_mask [B, D]`` (True = a real dimension of the group's record, at least one per group)."""
    if dim_mask is None:
        return None
    b, d = rewards.shape[0], rewards.shape[-1]
    if not isinstance(dim_mask, Tensor) or tuple(dim_mask.shape) != (b, d):
        got = tuple(dim_mask.shape) if isinstance(dim_mask, Tensor) else type(dim_mask).__name__
        raise ValueError(f"dim_mask must be a tensor of shape [B, D] = {(b, d)}, got {got}")
    if dim_mask.dtype != torch.bool and not ((dim_mask == 0) | (dim_mask == 1)).all():
        raise ValueError("dim_mask must be bool (True = a real dimension) or hold only 0 and 1")
    dim_mask = dim_mask.to(device=rewards.device, dtype=torch.bool)
    if b and not dim_mask.any(dim=1).all():
        raise ValueError("dim_mask must mark at least one real dimension in every group")
    return dim_mask


def _real_only(rewards: Tensor, dim_mask: Tensor | None) -> Tensor:
    """Padding dimensions set to 0 (whatever a reward wrote there), so they never count. ``[B, G, m, D]``."""
    return rewards if dim_mask is None else rewards * dim_mask[:, None, None, :].to(rewards.dtype)


def _f(rewards: Tensor, dim_mask: Tensor | None) -> Tensor:
    """The GRPO scalar f: the mean over the real dimensions, ``[B, G, m, D] -> [B, G, m]``."""
    if dim_mask is None:
        return rewards.mean(dim=-1)
    real = dim_mask[:, None, None, :].to(rewards.dtype)  # [B, 1, 1, D]
    return (rewards * real).sum(dim=-1) / real.sum(dim=-1)


def restrict_weights(weights: Tensor, dim_mask: Tensor) -> Tensor:
    """Weights ``[B or 1, K, D]`` restricted to each group's real dimensions ``dim_mask [B, D]`` and renormalised.

    For w ~ Dirichlet(alpha * 1_D) the restriction w_S / sum(w_S) is exactly Dirichlet(alpha * 1_S) (the Gamma
    construction), so padding never carries weight and the draw stays uniform over the real dimensions. A row with
    no mass on the real dimensions (possible only for hand-given weights) becomes uniform over them. ``[B, K, D]``.
    """
    real = dim_mask[:, None, :].to(weights.dtype)  # [B, 1, D]
    w = weights * real  # [B, K, D]
    total = w.sum(dim=-1, keepdim=True)  # [B, K, 1]
    uniform = (real / real.sum(dim=-1, keepdim=True)).expand_as(w)  # [B, K, D]
    return torch.where(total > 0, w / total.clamp_min(torch.finfo(w.dtype).tiny), uniform)


# ----------------------------------------------------------------------------------------------- VPO core
def _sample_log_gamma(shape: tuple[int, ...], alpha: float, generator: torch.Generator | None) -> Tensor:
    """log Gamma(alpha, 1) draws, float64 (Marsaglia-Tsang; vectorised rejection rounds, not a loop over items).

    torch's own Gamma/Dirichlet samplers take no ``generator``, so reproducibility needs this. For alpha < 1 it
    draws Gamma(alpha + 1) * U^(1/alpha), kept in log space so tiny alphas do not underflow to an all-zero row.
    """
    device = generator.device if generator is not None else torch.device("cpu")
    kw: dict[str, Any] = {"generator": generator, "dtype": torch.float64, "device": device}
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


# ----------------------------------------------------------------------------------------------- estimators
def vpo(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None, num_weights: int = 100,
        alpha: float = 1.0, eps: float = 1e-6, generator: torch.Generator | None = None,
        dim_mask: Tensor | None = None) -> Tensor:
    """:func:`vpo_advantages` as the estimator table (:mod:`~vpo_lightning.core.estimators`) calls it: with
    ``dim_mask [B, D]``, the weights (given, or drawn per group with ``generator`` exactly as :func:`vpo_advantages`
    draws them) are restricted to each group's real dimensions (:func:`restrict_weights`) and padding dimensions
    are zeroed. ``[B, G, m, D] -> [B, G]``."""
    checked, _ = _check_rewards(rewards, mask)
    dim_mask = _check_dim_mask(dim_mask, checked)
    if dim_mask is None:
        return vpo_advantages(rewards, mask, weights=weights, num_weights=num_weights, alpha=alpha, eps=eps,
                              generator=generator)
    b, d = checked.shape[0], checked.shape[-1]
    if weights is None:
        weights = sample_weights(num_weights, d, alpha, num_groups=b, generator=generator)  # [B, K, D]
    weights = restrict_weights(_check_weights(weights, b, d, checked), dim_mask)  # [B, K, D]
    return vpo_advantages(_real_only(checked, dim_mask), mask, weights=weights, eps=eps)


def grpo(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None, num_weights: int = 100,
         alpha: float = 1.0, eps: float = 1e-6, generator: torch.Generator | None = None,
         dim_mask: Tensor | None = None) -> Tensor:
    """GRPO: f(s) = mean of the real dimensions, z-normalised within the group with the sample std (ddof 1, as the
    reference's ``torch.std``). ``rewards [B, G, 1, D] -> [B, G]``.

    ``weights``, ``num_weights``, ``alpha`` and ``generator`` are accepted for the shared signature and unused.
    """
    rewards, mask = _check_rewards(rewards, mask, single=grpo.__name__)
    dim_mask = _check_dim_mask(dim_mask, rewards)
    return _znorm(_f(_masked(rewards, mask), dim_mask).squeeze(2), dim=1, eps=eps, correction=1)  # [B, G]


def multi_rlvr(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None,
               num_weights: int = 100, alpha: float = 1.0, eps: float = 1e-6,
               generator: torch.Generator | None = None, dim_mask: Tensor | None = None,
               vector_repeats: bool = False) -> Tensor:
    """Multi-RLVR as the reference scores it: per chain, the sum of the fixed scalar f over its distinct present
    answers, then GRPO's group z-norm with the sample std (ddof 1). ``rewards [B, G, m, D] -> [B, G]``.

    What makes two answers of a chain "the same" is the task's, as in the reference: the maze compares the answers
    themselves (``dedup_routes``: the rollout drops a candidate whose ``answer_key`` repeats an earlier one, so it
    arrives here absent), tool use and MuSiQue compare reward vectors (``dedup_by_vector``: ``vector_repeats=True``,
    set by the task's rewards, counts a present answer 0 when its vector over the real dimensions equals an earlier
    present answer's). Absent answers count 0 (the reference's zero padding to m). The weight arguments are unused.
    """
    rewards, mask = _check_rewards(rewards, mask)
    dim_mask = _check_dim_mask(dim_mask, rewards)
    rewards = _real_only(rewards, dim_mask)
    present = mask if mask is not None else torch.ones(rewards.shape[:3], dtype=torch.bool, device=rewards.device)
    if vector_repeats:
        m = rewards.shape[2]
        same = (rewards.unsqueeze(3) == rewards.unsqueeze(2)).all(dim=-1)  # [B, G, m, m]: row j equals row i
        earlier = torch.ones(m, m, dtype=torch.bool, device=rewards.device).tril(-1)  # [m, m]: i < j
        present = present & ~(same & earlier & present.unsqueeze(2)).any(dim=-1)  # [B, G, m]
    f = _f(rewards, dim_mask) * present.to(rewards.dtype)  # [B, G, m]; absent and repeated answers 0
    return _znorm(f.sum(dim=-1), dim=1, eps=eps, correction=1)  # [B, G]


def random_weight_grpo(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None,
                       num_weights: int = 100, alpha: float = 1.0, eps: float = 1e-6,
                       generator: torch.Generator | None = None, dim_mask: Tensor | None = None) -> Tensor:
    """Random-weight GRPO: score w.s with one w ~ Dir(alpha) per group, shared by its G rollouts; group z-norm.

    ``weights`` ``[B, 1, D]`` (or ``[B, K, D]``/``[K, D]``, scored as the mean over K) comes from the rollout,
    which keys it on the training row so the same row always gets the same w
    (:meth:`~vpo_lightning.core.protocol.ChainProtocol.step_weights`); ``None`` draws one vector per group with
    ``generator`` (``num_weights`` is then ignored: the method is defined with a single weight vector). With
    ``dim_mask`` the weights are restricted to the real dimensions. ``rewards [B, G, 1, D] -> [B, G]``.
    """
    rewards, mask = _check_rewards(rewards, mask, single=random_weight_grpo.__name__)
    dim_mask = _check_dim_mask(dim_mask, rewards)
    b, d = rewards.shape[0], rewards.shape[-1]
    if weights is None:
        weights = sample_weights(1, d, alpha, num_groups=b, generator=generator)  # [B, 1, D]
    weights = _check_weights(weights, b, d, rewards)  # [B or 1, K, D]
    if dim_mask is not None:
        weights, rewards = restrict_weights(weights, dim_mask), _real_only(rewards, dim_mask)
    # With m = 1 the max over candidates is the candidate itself, so the set reward is exactly mean_k w_k . s.
    return _znorm(_set_rewards(rewards, weights, mask), dim=1, eps=eps)  # [B, G]


def goal_conditioned_grpo(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None,
                          num_weights: int = 100, alpha: float = 1.0, eps: float = 1e-6,
                          generator: torch.Generator | None = None, dim_mask: Tensor | None = None) -> Tensor:
    """Goal-conditioned GRPO: as :func:`random_weight_grpo`; only the prompt differs (it lists the weights)."""
    return random_weight_grpo(rewards, mask, weights=weights, num_weights=num_weights, alpha=alpha, eps=eps,
                              generator=generator, dim_mask=dim_mask)


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


def max_at_k_default(group_size: int) -> int:
    """The reference's default subset size, ``max(2, G // 2)``."""
    return max(2, group_size // 2)


def max_at_k(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None, num_weights: int = 100,
             alpha: float = 1.0, eps: float = 1e-6, generator: torch.Generator | None = None,
             dim_mask: Tensor | None = None, k: int | None = None) -> Tensor:
    """Max@k (arXiv 2510.23393): per-rollout contribution to unbiased max@k of f, then mean-subtract / (std + eps)
    with the sample std (ddof 1), as the reference.

    Args:
        rewards: ``[B, G, 1, D]``; the scalar is f = mean over the real dimensions (absent candidate = 0).
        mask: ``[B, G, 1]`` presence mask.
        dim_mask: ``[B, D]`` real dimensions per group (None = all).
        k: subset size, 1 <= k < G; default ``max(2, G // 2)`` (:func:`max_at_k_default`). k >= G raises: at
            k = G every rollout's contribution is the group maximum, so all advantages would be 0.
        eps: added to the std; a group whose std < eps gets zeros.
        weights: unused (shared signature), like ``num_weights``, ``alpha`` and ``generator``.

    Returns:
        ``[B, G]`` advantages; see :func:`max_at_k_contributions` for the formula.
    """
    rewards, mask = _check_rewards(rewards, mask, single=max_at_k.__name__)
    dim_mask = _check_dim_mask(dim_mask, rewards)
    scores = _f(_masked(rewards, mask), dim_mask).squeeze(2)  # [B, G]
    g = scores.shape[1]
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k must be None or a positive int, got {k!r}")
    k = max_at_k_default(g) if k is None else k
    if k >= g:
        raise ValueError(f"max@k needs k < G (group size), got k={k}, G={g}: at k >= G every rollout's contribution "
                         "is the group maximum and all advantages are 0; raise rollout.group_size or lower "
                         "rollout.max_at_k_k (default max(2, G // 2))")
    return _znorm(max_at_k_contributions(scores, k), dim=1, eps=eps, correction=1)  # [B, G]


def _whiten(x: Tensor, counts: Tensor) -> Tensor:
    """Token-weighted whitening over the whole batch, as the reference's ``masked_whiten`` over response tokens:
    each rollout's value weighs by its token count; mean and Bessel-corrected variance over the T tokens;
    ``(x - mean) / sqrt(var + 1e-8)``. Fewer than 2 tokens in the batch: zeros (no spread to scale by)."""
    total = counts.sum()
    if not total > 1:
        return torch.zeros_like(x)
    mean = (counts * x).sum() / total
    var = (counts * (x - mean) ** 2).sum() / (total - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def gdpo(rewards: Tensor, mask: Tensor | None = None, *, weights: Tensor | None = None, num_weights: int = 100,
         alpha: float = 1.0, eps: float = 1e-6, generator: torch.Generator | None = None,
         dim_mask: Tensor | None = None, token_counts: Tensor | None = None) -> Tensor:
    """GDPO: z-normalise each real dimension within the group (sample std, ddof 1), sum over D, then whiten over the
    whole batch (B * G), token-weighted as the reference.

    ``token_counts [B, G]`` (generated tokens per rollout) weighs each rollout in the batch mean and variance, as the
    reference whitens per token; ``None`` weighs every rollout as 1. ``rewards [B, G, 1, D] -> [B, G]``; a dimension
    flat within a group (padding included) contributes 0, and a batch whose summed scores are flat gets zeros. The
    weight arguments are unused.
    """
    rewards, mask = _check_rewards(rewards, mask, single=gdpo.__name__)
    dim_mask = _check_dim_mask(dim_mask, rewards)
    per_dim = _znorm(_real_only(_masked(rewards, mask), dim_mask).squeeze(2), dim=1, eps=eps, correction=1)
    summed = per_dim.sum(dim=-1)  # [B, G]
    if token_counts is None:
        counts = torch.ones_like(summed)
    else:
        if not isinstance(token_counts, Tensor) or tuple(token_counts.shape) != tuple(summed.shape):
            got = tuple(token_counts.shape) if isinstance(token_counts, Tensor) else type(token_counts).__name__
            raise ValueError(f"token_counts must be a tensor of shape [B, G] = {tuple(summed.shape)}, got {got}")
        counts = token_counts.to(summed)
        if not counts.isfinite().all() or (counts < 0).any():
            raise ValueError("token_counts must be finite and non-negative")
    return _whiten(summed, counts)  # [B, G]

