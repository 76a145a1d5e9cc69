"""Dynamic sampling (DAPO's "filter groups", also in verl) and the zero-advantage skip: pure logic, no Lightning.

A prompt group whose G chains all score the same set reward has zero advantage everywhere: with ``loss.beta = 0``
it adds nothing to the gradient, and with ``beta > 0`` only the KL term. When many groups come back flat (a policy
that fails, or solves, every prompt) a step learns from few prompts. With ``rollout.dynamic_sampling.enabled``, the
rollout draws more prompts, ``batch_size`` at a time and at most ``max_extra_rounds`` times per step, until the
step holds ``batch_size`` groups with signal; it then trains on the first ``batch_size`` such groups in draw order.
If no group of any round has signal, the first round is kept as it is (a step without signal, as without the
option). Every generated token, in every round, counts toward ``rollout.max_generated_tokens``, so runs with and
without the option stay matched on generation compute.

Extra prompts are a keyed draw (seed, step, round) from the training records, excluding the prompts already drawn
in the step; the data stream's position is not moved, so checkpoints and resume are unchanged.

The zero-advantage skip (:func:`rows_to_train`): with ``beta = 0`` the loss of a chain with zero advantage is
exactly zero (PPO-clip times 0, no KL term), so its forward and backward passes are skipped; the loss normaliser
still counts its tokens, so the update is the same as without the skip (up to float summation order).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from vpo_lightning.core.types import Round


@dataclass
class DynamicSamplingSettings:
    """Dynamic sampling (DAPO filter groups).

    Args:
        enabled: draw more prompts when groups come back with zero reward spread and train only on groups with
            signal (training steps only; validation is never filtered).
        max_extra_rounds: at most this many extra generation rounds of ``data.batch_size`` prompts per step.
    """

    enabled: bool = False
    max_extra_rounds: int = 2


def groups_with_signal(advantages: Tensor) -> Tensor:
    """``[B, G] -> [B]`` bool: True where some chain of the group has a non-zero advantage (reward spread)."""
    return (advantages != 0).any(dim=1)


def refill_indices(num_records: int, exclude: Sequence[int], count: int, seed: int) -> list[int]:
    """``count`` distinct record indices in ``[0, num_records)`` not in ``exclude``, a seeded draw (fewer when not
    enough records are left)."""
    banned = set(exclude)
    pool = [i for i in range(num_records) if i not in banned]
    return random.Random(seed).sample(pool, min(count, len(pool)))


def select_groups(signals: Sequence[Tensor], batch_size: int) -> list[tuple[int, int]]:
    """``(round, group)`` pairs to train on: the first ``batch_size`` groups with signal in draw order, or every
    group of round 0 when no group has signal. ``signals[r]`` is round r's ``[B_r]`` bool mask."""
    kept = [(r, b) for r, sig in enumerate(signals) for b in range(len(sig)) if bool(sig[b])]
    if not kept:
        return [(0, b) for b in range(len(signals[0]))]
    return kept[:batch_size]


def concat_groups(rounds: Sequence[Round], keep: Sequence[tuple[int, int]], group_size: int) -> Round:
    """The kept groups of several rounds as one round (``num_tokens`` is the kept chains' tokens)."""
    G = group_size
    rows = [(rounds[r], b) for r, b in keep]
    completion = [c for rd, b in rows for c in rd.completion_ids[b * G : (b + 1) * G]]
    weights = None
    if rounds[0].weights is not None:
        weights = torch.stack([cast(Tensor, rd.weights)[b] for rd, b in rows])  # [B', K, D]; all rounds have them
    engine_lp = None
    if rounds[0].engine_logprobs is not None:
        engine_lp = [lp for rd, b in rows for lp in cast(list[list[float]], rd.engine_logprobs)[b * G : (b + 1) * G]]
    return Round(
        records=[rd.records[b] for rd, b in rows], indices=[rd.indices[b] for rd, b in rows],
        prompts=[rd.prompts[b] for rd, b in rows], completion_ids=completion,
        texts=[t for rd, b in rows for t in rd.texts[b * G : (b + 1) * G]],
        rewards=torch.stack([rd.rewards[b] for rd, b in rows]),  # [B', G, m, D]
        mask=torch.stack([rd.mask[b] for rd, b in rows]),  # [B', G, m]
        advantages=torch.stack([rd.advantages[b] for rd, b in rows]),  # [B', G]
        weights=weights, num_tokens=sum(map(len, completion)), engine_logprobs=engine_lp,
    )


def fill_batch(first: Round, draw: Callable[[list[int], int], Round], num_records: int, batch_size: int,
               max_extra_rounds: int, seed: int) -> tuple[Round, dict[str, float]]:
    """Run dynamic sampling for one step.

    Args:
        first: the step's first round (the data stream's batch).
        draw: ``draw(indices, round) -> Round`` generates and scores the records at ``indices``.
        num_records: size of the training set the extra prompts are drawn from.
        batch_size: groups with signal wanted (``data.batch_size``).
        max_extra_rounds: at most this many calls to ``draw``.
        seed: key of the extra draws (mixed with the round number).

    Returns:
        The kept groups as one round (its ``num_tokens`` is the kept chains' tokens) and the step's statistics:
        ``dynamic/extra_rounds``, ``dynamic/groups_drawn``, ``dynamic/frac_zero_spread`` (of the groups drawn),
        ``dynamic/frac_dropped`` (groups drawn but not trained on), ``dynamic/extra_tokens`` (tokens generated in
        the extra rounds) and ``dynamic/total_tokens`` (every round's tokens: what the token budget counts).
    """
    if max_extra_rounds < 0:
        raise ValueError(f"rollout.dynamic_sampling.max_extra_rounds must be >= 0, got {max_extra_rounds}")
    rounds, signals = [first], [groups_with_signal(first.advantages)]
    used = list(first.indices)
    for r in range(1, max_extra_rounds + 1):
        if sum(int(s.sum()) for s in signals) >= batch_size:
            break
        indices = refill_indices(num_records, used, batch_size, seed * 1_000_003 + r)
        if not indices:
            break
        used += indices
        rounds.append(draw(indices, r))
        signals.append(groups_with_signal(rounds[-1].advantages))
    keep = select_groups(signals, batch_size)
    drawn = sum(len(s) for s in signals)
    extra_tokens = sum(rd.num_tokens for rd in rounds[1:])
    stats = {
        "dynamic/extra_rounds": float(len(rounds) - 1),
        "dynamic/groups_drawn": float(drawn),
        "dynamic/frac_zero_spread": 1.0 - sum(int(s.sum()) for s in signals) / drawn,
        "dynamic/frac_dropped": 1.0 - len(keep) / drawn,
        "dynamic/extra_tokens": float(extra_tokens),
        "dynamic/total_tokens": float(first.num_tokens + extra_tokens),
    }
    out = concat_groups(rounds, keep, len(first.texts) // max(1, len(first.records)))
    out.extra = {k: sum(rd.extra.get(k, 0) for rd in rounds) for k, v in first.extra.items()
                 if isinstance(v, int | float)}  # generation time, reward errors: summed over rounds
    return out, stats


def rows_to_train(advantages: Tensor, beta: float) -> Tensor:
    """``[N] -> [n]`` indices of the chains whose forward and backward passes are needed: all of them when
    ``beta > 0`` (the KL term has a gradient everywhere), only non-zero advantages when ``beta == 0``."""
    if beta != 0:
        return torch.arange(advantages.shape[0])
    return (advantages != 0).nonzero().flatten()
