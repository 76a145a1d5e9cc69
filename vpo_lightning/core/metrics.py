"""Evaluation metrics of VPO-SPEC section 6: best@k, pass@k, reward-space diversity, E_w[max w.v], Pareto fraction.

Shapes: P prompts, n solutions in a prompt's pool (for chain methods: chains x m flattened), D reward dimensions.
A pool is a tensor ``[P, n, D]`` (with an optional ``[P, n]`` presence mask where the metric can skip absent
candidates), or a list of ``[n_p, D]`` tensors when prompts have pools of different sizes. k counts individual
solutions, except in :func:`chain_pass_at_k_curve`. Pure torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from vpo_lightning.core.advantages import sample_weights

__all__ = [
    "best_at_k_curve",
    "best_pick_correct_at_k",
    "chain_pass_at_k_curve",
    "expected_best_weighted",
    "pairwise_l1_diversity",
    "pareto_fraction",
    "pass_at_k",
    "pass_at_k_curve",
    "reward_means",
    "solved",
    "within_chain_diversity",
]

Pool = Tensor | Sequence[Tensor]


def _as_padded(pool: Pool, mask: Tensor | None = None, name: str = "pool") -> tuple[Tensor, Tensor]:
    """``(values [P, n, D] float64, present [P, n] bool)`` from a tensor (+ mask) or a list of ``[n_p, D]``."""
    if isinstance(pool, Tensor):
        if pool.dim() != 3 or pool.shape[0] < 1:
            raise ValueError(f"{name} must have shape [P, n, D] with P >= 1, got {tuple(pool.shape)}")
        values = pool.double()
        present = torch.ones(pool.shape[:2], dtype=torch.bool, device=pool.device)
        if mask is not None:
            if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(pool.shape[:2]):
                raise ValueError(f"mask must have shape [P, n] = {tuple(pool.shape[:2])}, "
                                 f"got {getattr(mask, 'shape', mask)!r}")
            present = mask.to(device=pool.device, dtype=torch.bool)
    else:
        if mask is not None:
            raise ValueError("mask must be None when pool is a list (list pools hold only present candidates)")
        rows = [torch.as_tensor(p, dtype=torch.float64) for p in pool]
        dims = {r.shape[-1] for r in rows if r.dim() == 2}
        if not rows or any(r.dim() != 2 for r in rows) or len(dims) != 1:
            raise ValueError(f"{name} must be a non-empty list of [n_p, D] tensors with one D, got shapes "
                             f"{[tuple(r.shape) for r in rows]}")
        values = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [P, n_max, D]
        sizes = torch.tensor([r.shape[0] for r in rows])  # [P]
        present = torch.arange(values.shape[1]).unsqueeze(0) < sizes.unsqueeze(1)  # [P, n_max]
    if not values.isfinite().all():
        raise ValueError(f"{name} must hold finite values (no NaN or inf)")
    return values, present


def best_at_k_curve(pool: Pool, *, seed: int = 0, num_seeds: int = 1,
                    f_weights: Sequence[float] | None = None) -> Tensor:
    """best@k for k = 1..n: per prompt a seeded random order of its pool; curve[k-1] = max f over the first k.

    f = mean over D, or the weighted mean with ``f_weights`` (one non-negative weight per dimension, e.g. MuSiQue's
    (1, 1, 1, 1, 3)). The curve is averaged over prompts and ``num_seeds`` orders (drawn from one generator seeded
    with ``seed``). For a list of pools of different sizes the curve stops at the smallest pool (beyond it some
    prompt would have no k-th sample).

    Returns:
        ``[n]`` float32 curve (non-decreasing).
    """
    values, present = _as_padded(pool)
    if isinstance(num_seeds, bool) or not isinstance(num_seeds, int) or num_seeds < 1:
        raise ValueError(f"num_seeds must be a positive int, got {num_seeds!r}")
    n_min = int(present.sum(dim=1).min())
    if n_min < 1:
        raise ValueError("pool must hold at least one solution for every prompt")
    f = values.mean(dim=-1)  # [P, n]
    if f_weights is not None:
        w = torch.as_tensor(f_weights, dtype=values.dtype, device=values.device)  # [D]
        if w.shape != values.shape[-1:] or bool((w < 0).any()) or not float(w.sum()) > 0:
            raise ValueError(f"f_weights must be {values.shape[-1]} non-negative weights with a positive sum, "
                             f"got {list(f_weights)}")
        if bool((w != w[0]).any()):  # equal weights: the plain mean above, bit for bit
            f = values @ (w / w.sum())  # [P, n]
    generator = torch.Generator().manual_seed(seed)
    keys = torch.rand((num_seeds, *f.shape), generator=generator, dtype=torch.float64).to(f.device)  # [S, P, n]
    keys = torch.where(present, keys, torch.full_like(keys, 2.0))  # padding sorts after every real sample
    shuffled = f.expand_as(keys).gather(-1, keys.argsort(dim=-1))  # [S, P, n]
    return shuffled.cummax(dim=-1).values[..., :n_min].mean(dim=(0, 1)).float()  # [n_min]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n solutions of which c solve: ``1 - prod_{i=n-c+1..n} (1 - k/i)``.

    Equals ``1 - C(n-c, k) / C(n, k)``, the chance that a random k-subset holds a solver.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def best_pick_correct_at_k(scores: Sequence[float], correct: Sequence[bool], k: int) -> float:
    """The chance that the highest-scoring of k answers drawn without replacement is correct (ties broken uniformly).

    What a user who samples k answers and keeps the one their reward scores highest reads, when another judge (BFCL's
    checker) decides correctness. Exact: with ``n_v`` answers scoring v, ``c_v`` of them correct, the k-subset's
    maximum is v with probability ``[C(n_<=v, k) - C(n_<v, k)] / C(n, k)``, and a tied answer is as likely to be kept
    as any other at v, so the kept one is correct with probability ``c_v / n_v``.
    """
    n = len(scores)
    if len(correct) != n:
        raise ValueError(f"scores and correct differ in length: {n} and {len(correct)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"need an int 1 <= k <= n, got k={k!r}, n={n}")
    by_value: dict[float, list[int]] = {}
    for s, ok in zip(scores, correct):
        tally = by_value.setdefault(float(s), [0, 0])
        tally[0] += 1
        tally[1] += bool(ok)
    total, below, out = math.comb(n, k), 0, 0.0
    for v in sorted(by_value):
        n_v, c_v = by_value[v]
        out += (math.comb(below + n_v, k) - math.comb(below, k)) / total * c_v / n_v
        below += n_v
    return out


def _log_comb(n: Tensor, k: Tensor) -> Tensor:
    """log C(n, k) for float64 tensors (broadcast); -inf where k > n."""
    ok = n >= k
    n_k = (n - k).clamp_min(0)
    value = torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n_k + 1)
    return torch.where(ok, value, torch.full_like(value, -math.inf))


def pass_at_k_curve(solved: Tensor | Sequence[Tensor]) -> Tensor:
    """pass@k for k = 1..n averaged over prompts, from ``solved [P, n]`` bool (or a list of ``[n_p]``).

    For lists of different sizes the curve stops at the smallest n_p. Returns ``[n]`` float32.
    """
    if isinstance(solved, Tensor):
        if solved.dim() != 2 or solved.shape[0] < 1 or solved.shape[1] < 1:
            raise ValueError(f"solved must have shape [P, n] with P, n >= 1, got {tuple(solved.shape)}")
        counts, sizes = solved.bool().sum(dim=1).double(), torch.full((solved.shape[0],), float(solved.shape[1]))
    else:
        rows = [torch.as_tensor(s).bool() for s in solved]
        if not rows or any(r.dim() != 1 or r.numel() < 1 for r in rows):
            raise ValueError("solved must be a non-empty list of non-empty 1-d bool tensors")
        counts = torch.tensor([float(r.sum()) for r in rows], dtype=torch.float64)
        sizes = torch.tensor([float(r.numel()) for r in rows], dtype=torch.float64)
    counts, sizes = counts.cpu(), sizes.cpu().double()
    k = torch.arange(1, int(sizes.min()) + 1, dtype=torch.float64)  # [n]
    fail = (_log_comb((sizes - counts)[:, None], k) - _log_comb(sizes[:, None], k)).exp()  # [P, n] no solver in k
    return (1.0 - fail).mean(dim=0).float()  # [n]


def chain_pass_at_k_curve(solved: Tensor) -> Tensor:
    """pass@k over chains: ``solved [P, C, m]`` bool; a chain solves if any of its m solutions does; k counts chains.

    Returns ``[C]`` float32.
    """
    if not isinstance(solved, Tensor) or solved.dim() != 3:
        raise ValueError(f"solved must have shape [P, chains, m], got {getattr(solved, 'shape', solved)!r}")
    return pass_at_k_curve(solved.bool().any(dim=-1))  # [P, C] -> [C]


def solved(pool: Tensor, mask: Tensor | None = None) -> Tensor:
    """A solution solves iff every reward component is >= 1. ``[..., D] -> [...]`` bool; absent (mask) = False."""
    if not isinstance(pool, Tensor) or pool.dim() < 1:
        raise ValueError(f"pool must be a tensor of shape [..., D], got {getattr(pool, 'shape', pool)!r}")
    out = (pool >= 1).all(dim=-1)
    if mask is not None:
        if tuple(mask.shape) != tuple(out.shape):
            raise ValueError(f"mask must have shape {tuple(out.shape)}, got {tuple(mask.shape)}")
        out = out & mask.bool()
    return out


def pairwise_l1_diversity(pool: Pool, mask: Tensor | None = None) -> float:
    """Mean L1 distance over distinct pairs of present solutions per prompt (not divided by D), averaged.

    Prompts with fewer than two present solutions are skipped; 0.0 when no prompt has a pair.
    """
    values, present = _as_padded(pool, mask)
    n = values.shape[1]
    dist = (values.unsqueeze(2) - values.unsqueeze(1)).abs().sum(dim=-1)  # [P, n, n]
    upper = torch.ones(n, n, dtype=torch.bool, device=values.device).triu(1)  # [n, n] pairs i < j
    pairs = present.unsqueeze(2) & present.unsqueeze(1) & upper  # [P, n, n]
    count = pairs.sum(dim=(1, 2))  # [P]
    per_prompt = (dist * pairs).sum(dim=(1, 2)) / count.clamp_min(1)  # [P]
    return float(per_prompt[count > 0].mean()) if bool((count > 0).any()) else 0.0


def within_chain_diversity(rewards: Tensor, mask: Tensor | None = None) -> float:
    """Mean pairwise L1 between the m candidates of each chain, averaged over chains with >= 2 present candidates.

    Args:
        rewards: ``[P, C, m, D]``.
        mask: ``[P, C, m]`` bool presence mask.
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 4:
        raise ValueError(f"rewards must have shape [P, C, m, D], got {getattr(rewards, 'shape', rewards)!r}")
    if mask is not None and (not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(rewards.shape[:3])):
        raise ValueError(f"mask must have shape [P, C, m] = {tuple(rewards.shape[:3])}, "
                         f"got {getattr(mask, 'shape', mask)!r}")
    p, c, m, d = rewards.shape
    flat_mask = None if mask is None else mask.reshape(p * c, m)
    return pairwise_l1_diversity(rewards.reshape(p * c, m, d), flat_mask)  # each chain as its own pool


def expected_best_weighted(pool: Pool, num_weights: int = 100, alpha: float = 1.0,
                           generator: torch.Generator | None = None, mask: Tensor | None = None) -> float:
    """E_w[max_{v in pool} w.v] with w ~ Dirichlet(alpha), ``num_weights`` draws per prompt, averaged over prompts.

    Absent solutions never win; a prompt with none scores 0.
    """
    values, present = _as_padded(pool, mask)
    weights = sample_weights(num_weights, values.shape[-1], alpha, num_groups=values.shape[0], generator=generator)
    scores = torch.einsum("pnd,pkd->pnk", values, weights.to(values))  # [P, n, K]
    scores = scores.masked_fill(~present.unsqueeze(-1), -math.inf)
    best = scores.amax(dim=1).mean(dim=-1)  # [P]
    return float(torch.where(present.any(dim=1), best, torch.zeros_like(best)).mean())


def pareto_fraction(pool: Pool, mask: Tensor | None = None) -> float:
    """Fraction of each prompt's present pool that is Pareto non-dominated, averaged over prompts.

    u dominates v iff u >= v in every component and u > v in at least one; equal vectors do not dominate each
    other, so duplicates on the front all count. Prompts with no present solution are skipped.
    """
    values, present = _as_padded(pool, mask)
    u, v = values.unsqueeze(2), values.unsqueeze(1)  # [P, n, 1, D], [P, 1, n, D]
    dominates = (u >= v).all(dim=-1) & (u > v).any(dim=-1) & present.unsqueeze(2)  # [P, n, n]: i dominates j
    front = present & ~dominates.any(dim=1)  # [P, n]
    size = present.sum(dim=1)  # [P]
    per_prompt = front.sum(dim=1) / size.clamp_min(1)  # [P]
    return float(per_prompt[size > 0].mean()) if bool((size > 0).any()) else 0.0


def reward_means(rewards: Tensor, mask: Tensor, dim_names: Sequence[str],
                 dim_mask: Tensor | None = None) -> dict[str, float]:
    """Training-time reward averages under names that say what they average.

    ``reward/all/mean`` and ``reward/all/<dim>`` average every candidate slot of every chain, a candidate that did
    not parse counting 0 (what the model earns); ``reward/parsed/mean`` and ``reward/<dim>`` average only the parsed
    candidates (how good an answer is once it parses); ``chains/candidate_parse_rate`` is the fraction of candidate
    slots that parsed, so ``all = parsed x candidate_parse_rate``.

    Args:
        rewards: ``[..., m, D]`` reward vectors (any value where ``mask`` is False: it is ignored).
        mask: ``[..., m]`` True where the candidate parsed.
        dim_names: the D dimension names.
        dim_mask: ``[..., D]`` (the leading shape of ``mask`` without m) True on each chain's real dimensions
            (per-record D); a dimension averages over the chains where it is real, and a candidate's mean over its
            real dimensions. None = every dimension real.
    """
    if rewards.shape[:-1] != mask.shape or rewards.shape[-1] != len(dim_names):
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [..., m, D] with mask {tuple(mask.shape)} = "
                         f"[..., m] and D = {len(dim_names)} dim_names")
    present = mask.to(rewards.dtype)  # [..., m]
    kept = rewards * present[..., None]  # [..., m, D] absent candidates -> 0
    slots = max(present.numel(), 1)
    n_parsed = float(present.sum().clamp(min=1))
    if dim_mask is None:
        per_dim = kept.reshape(-1, rewards.shape[-1]).sum(0)  # [D]
        out: dict[str, float] = {}
        for d, name in enumerate(dim_names):
            out[f"reward/{name}"] = float(per_dim[d]) / n_parsed
            out[f"reward/all/{name}"] = float(per_dim[d]) / slots
        total = float(kept.mean(-1).sum())
    else:
        real = dim_mask.to(rewards.dtype).unsqueeze(-2).expand_as(rewards)  # [..., m, D]
        per_dim = (kept * real).reshape(-1, rewards.shape[-1]).sum(0)  # [D]
        slots_d = real.reshape(-1, rewards.shape[-1]).sum(0)  # [D] candidate slots where the dimension is real
        parsed_d = (real * present[..., None]).reshape(-1, rewards.shape[-1]).sum(0)  # [D]
        out = {}
        for d, name in enumerate(dim_names):
            out[f"reward/{name}"] = float(per_dim[d]) / max(float(parsed_d[d]), 1.0)
            out[f"reward/all/{name}"] = float(per_dim[d]) / max(float(slots_d[d]), 1.0)
        total = float(((kept * real).sum(-1) / real.sum(-1).clamp(min=1)).sum())
    out["reward/parsed/mean"] = total / n_parsed
    out["reward/all/mean"] = total / slots
    out["chains/candidate_parse_rate"] = float(present.sum()) / slots
    return out
