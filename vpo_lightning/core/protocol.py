"""A task's chain protocol, and the rollout's tensors: what training, ``vpo eval`` and ``vpo search`` share.

:class:`ChainProtocol` is the Lightning-free part of a rollout (VPO-SPEC sections 2 and 3): the prompt with the
m-answer instruction appended (chain methods) or the shown objective weights (goal-conditioned GRPO), the split of
a completion into its m candidates, the D-dimensional reward vector that scores them, and the Dirichlet weights:
VPO's keyed by (seed, step, prompt index), fresh every step; the weighted single-answer baselines' keyed by (seed,
record id), fixed per training row as in the reference (``vpo/augment.py``: the same prompt sees the same weights
every epoch). The rollout callback drives it with an engine inside
Lightning; ``vpo eval`` and ``vpo search`` drive it with an engine outside. :func:`build_rollout_tensors` stacks
prompts and completions into the tensors of a :class:`~vpo_lightning.core.types.Rollout`, the step's sampled chains
as the loss reads them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from vpo_lightning.core.advantages import restrict_weights, sample_weights
from vpo_lightning.core.chains import build_instruction, distinct, parse_chain
from vpo_lightning.core.estimators import DEFAULT_ESTIMATOR, get_estimator
from vpo_lightning.core.types import Generation, RewardScores
from vpo_lightning.rewards import RewardVector

TagFamily = Literal["response", "route", "fence"]
# Goal-conditioned GRPO's prompt suffix, worded as the reference's (vpo/augment.py): one line per real dimension,
# "- <description>: <weight to 2 decimals>".
WEIGHT_SUFFIX = ("\n\nYour objective weights (higher = more important to optimize):\n{lines}\n\n"
                 "Maximize your weighted score.")


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any tuple of values (independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ChainProtocol:
    """How one run asks for, splits and scores answers.

    Args:
        rewards: reward names (or dotted paths) forming the D-dimensional reward vector, in order.
        estimator: the advantage estimator's name in :data:`~vpo_lightning.core.estimators.ESTIMATORS`; chain
            methods ask for m answers per chain.
        num_candidates: m for chain methods (single-answer methods use 1).
        num_weights: K, Dirichlet weight vectors per prompt group (VPO set reward).
        alpha: Dirichlet concentration.
        tag_family: how candidates are delimited: response (<response_i>), route (<route_i>), fence (code blocks).
        seed: the seed from which the per-step weights are derived.
        reward_workers: threads for rewards registered ``parallel=True``.
    """

    def __init__(self, rewards: Sequence[str], estimator: str = DEFAULT_ESTIMATOR, num_candidates: int = 3,
                 num_weights: int = 100, alpha: float = 1.0, tag_family: TagFamily = "response", seed: int = 0,
                 reward_workers: int | None = None) -> None:
        self.reward_names, self.estimator = list(rewards), estimator
        self.method = get_estimator(estimator)  # the table's entry: its function and traits
        self.chained = self.method.chained
        self.m = num_candidates if self.chained else 1
        self.num_weights, self.alpha, self.tag_family, self.seed = num_weights, alpha, tag_family, seed
        self.reward_vector = RewardVector(self.reward_names, max_workers=reward_workers)  # fails fast on a bad name
        # what makes two answers of one chain the same (the first reward that says so), looked up once
        self.answer_key = next((e.answer_key for e in self.reward_vector.entries if e.answer_key is not None), None)
        # Multi-RLVR's repeats by reward vector (the reference's dedup_by_vector: tool use, MuSiQue)
        self.vector_repeats = any(e.vector_repeats for e in self.reward_vector.entries)

    @property
    def dim_names(self) -> list[str]:
        return self.reward_vector.dim_names

    @property
    def dim(self) -> int:
        return self.reward_vector.dim

    def messages(self, record: Mapping[str, Any], weights: Tensor | None = None) -> list[dict[str, str]]:
        """The chat messages of ``record`` with the protocol's instruction appended to the last message.

        ``weights`` (``[1, D]`` or ``[D]``) is shown to the model by goal-conditioned GRPO only, one line per real
        dimension of the record (:data:`WEIGHT_SUFFIX`).
        """
        messages = [dict(m) for m in record["messages"]]
        suffix = build_instruction(self.m, self.tag_family) if self.chained else ""
        if self.method.shows_weights and weights is not None:
            real = self.dim_mask([record])[0].tolist()  # [D]
            lines = [f"- {desc}: {w:.2f}" for desc, w, ok in
                     zip(self.reward_vector.descriptions, weights.reshape(-1).tolist(), real) if ok]
            suffix += WEIGHT_SUFFIX.format(lines="\n".join(lines))
        messages[-1]["content"] += suffix
        return messages

    def dim_mask(self, records: Sequence[Mapping[str, Any]]) -> Tensor:
        """``[B, D]`` bool: the real dimensions of each record (all True unless a reward registered ``real_dims``)."""
        if not self.reward_vector.variable_dims:
            return torch.ones(len(records), self.dim, dtype=torch.bool)
        return self.reward_vector.dim_mask(records)

    def row_key(self, record: Mapping[str, Any], index: int) -> Any:
        """What identifies a training row: its record id (stable when the file is reordered), else its index."""
        rid = record.get("id")
        return ("id", rid) if rid is not None else ("index", index)

    def step_weights(self, indices: Sequence[int], step: int,
                     records: Sequence[Mapping[str, Any]] | None = None) -> Tensor | None:
        """``[B, K, D]`` weights, restricted to each record's real dimensions; None for estimators without weights.

        Weights keyed per step (VPO): K = ``num_weights`` fresh draws per step, keyed by (seed, step, prompt
        index). Keyed per row (the weighted single-answer baselines): K = 1, keyed by (seed, record id) only, so a
        training row gets the same w at every step and epoch, as the reference keys it on (seed, row)
        (``vpo/augment.py``).
        """
        if self.method.weights is None:
            return None
        per_step = self.method.weights == "step"
        given = records is not None
        records = list(records) if records is not None else [{} for _ in indices]
        if len(records) != len(indices):
            raise ValueError(f"step_weights got {len(indices)} indices but {len(records)} records")
        if per_step:
            keys: list[tuple[Any, ...]] = [(self.seed, step, idx) for idx in indices]
        else:
            keys = [(self.seed, "row-weights", self.row_key(r, idx)) for r, idx in zip(records, indices)]
        k = self.num_weights if per_step else 1
        draws = [sample_weights(k, self.dim, self.alpha, generator=torch.Generator().manual_seed(derive_seed(*key)))
                 for key in keys]
        weights = torch.stack(draws)  # [B, K, D]
        if self.reward_vector.variable_dims and given:
            weights = restrict_weights(weights, self.dim_mask(records))  # Dirichlet over the real dims only
        return weights

    def chain_messages(self, record: Mapping[str, Any], chains: int, seed: int) -> list[list[dict[str, str]]]:
        """The messages of ``chains`` samples of one record outside training (``vpo eval``, ``vpo search``): an
        estimator that shows its weights (goal-conditioned GRPO) shows a fresh one per sample, keyed by (seed,
        record id)."""
        if not self.method.shows_weights:
            return [self.messages(record)] * chains
        gen = torch.Generator().manual_seed(derive_seed(seed, "eval-weights", record.get("id")))
        weights = sample_weights(chains, self.dim, self.alpha, generator=gen)  # [C, D]
        if self.reward_vector.variable_dims:
            weights = restrict_weights(weights[None], self.dim_mask([record]))[0]  # [C, D]
        return [self.messages(record, w) for w in weights]

    def candidates(self, text: str) -> list[str | None]:
        """Split a chain into m candidates (single-answer methods: the whole text, None when empty)."""
        if not self.chained:
            return [text if text.strip() else None]
        return parse_chain(text, self.m, self.tag_family)

    def training_candidates(self, text: str) -> tuple[list[str | None], int]:
        """:meth:`candidates` as training scores them: answers of one chain that repeat an earlier one (by the
        first reward's ``answer_key``, e.g. the maze's move list) are dropped, so they count once (the reference's
        ``dedup_routes``). Evaluation scores every answer, as the reference's evaluation does. Returns the
        candidates and the number dropped."""
        cands = self.candidates(text)
        if self.answer_key is None or len(cands) < 2:
            return cands, 0
        return distinct(cands, self.answer_key)

    def score(self, candidates: Sequence[Sequence[str | None]], samples: Sequence[Mapping[str, Any]]) -> RewardScores:
        """Score ``candidates[n][j]`` against ``samples[n]`` with the reward vector: ``[N, m, D]`` and ``[N, m]``."""
        return self.reward_vector.score(candidates, samples)


def engine_logprob_tensor(gen: Generation, completion_mask: Tensor) -> Tensor | None:
    """The engine's per-token log-probs as a float tensor shaped like ``completion_mask`` [N, L] (zeros past each
    chain's end), or None when the engine reported none."""
    if gen.engine_logprobs is None:
        return None
    out = torch.zeros(completion_mask.shape, dtype=torch.float32)  # [N, L]
    for i, lp in enumerate(gen.engine_logprobs):
        out[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out


def build_rollout_tensors(
    prompt_ids: list[list[int]], gen: Generation, group_size: int, pad_id: int
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Stack prompts (left-padded) and completions (right-padded): ``input_ids``, ``attention_mask`` ``[N, P+L]``,
    ``completion_mask`` ``[N, L]`` and P."""
    rows = [p for p in prompt_ids for _ in range(group_size)]
    P, L_ = max(len(p) for p in rows), max(1, max(len(c) for c in gen.completion_ids))
    N = len(rows)
    ids = torch.full((N, P + L_), pad_id, dtype=torch.long)  # [N, P + L]
    attn = torch.zeros(N, P + L_, dtype=torch.long)  # [N, P + L]
    comp = torch.zeros(N, L_, dtype=torch.float32)  # [N, L]
    for i, (p, c) in enumerate(zip(rows, gen.completion_ids)):
        ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p) : P + len(c)] = 1
        if c:
            ids[i, P : P + len(c)] = torch.tensor(c, dtype=torch.long)
            comp[i, : len(c)] = 1.0
    return ids, attn, comp, P
