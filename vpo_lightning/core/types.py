"""The data types that cross layers: what an engine returns, what rewards score, what the loss reads.

Plain dataclasses over torch tensors (no Lightning, transformers or vLLM), so every layer can name them: the
generation engines return a :class:`Generation`, the reward registry a :class:`RewardScores`, dynamic sampling
keeps one :class:`Round` per generation round, and the rollout callback hands the module a :class:`Rollout`.
Shape letters as in docs/ARCHITECTURE.md: B prompts, G chains per prompt, N = B * G, m candidates, D reward
dimensions, K weight vectors, P prompt length, L completion length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

DERIVED = "_derived"  # record key: the fields vpo added to a record (TRL prompt's messages, id), not data columns


@dataclass
class Generation:
    """What an engine returns for N = B * G chains (chain n belongs to prompt n // G)."""

    completion_ids: list[list[int]]  # N lists of generated token ids (EOS included when it was produced)
    texts: list[str]  # N decoded completions, special tokens removed
    num_tokens: int  # generated tokens in total
    engine_logprobs: list[list[float]] | None = None  # per-token log-probs reported by the engine, if any
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rollout:
    """One step's sampled chains, ready for the loss. N = B * G rows, group-contiguous."""

    input_ids: Tensor  # [N, P + L] left-padded prompt, right-padded completion
    attention_mask: Tensor  # [N, P + L]
    completion_mask: Tensor  # [N, L] 1 on generated tokens that count in the loss
    prompt_length: int  # P
    advantages: Tensor  # [N] one scalar per chain, broadcast to every generated token
    rewards: Tensor  # [N, m, D]
    candidate_mask: Tensor  # [N, m]
    texts: list[str]
    temperature: float = 1.0
    max_length: int = 0  # the generation budget (Dr. GRPO's constant normaliser); 0 = the batch's L
    engine_logprobs: Tensor | None = None  # [N, L] from the engine (its decode loop, vLLM): the train/inference gap
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Round:
    """One generation round of a step: B prompt groups of G chains, scored. N = B * G rows, group-contiguous."""

    records: list[dict[str, Any]]  # [B]
    indices: list[int]  # [B] record indices in the training set
    prompts: list[list[int]]  # [B] prompt token ids
    completion_ids: list[list[int]]  # [N]
    texts: list[str]  # [N]
    rewards: Tensor  # [B, G, m, D]
    mask: Tensor  # [B, G, m]
    advantages: Tensor  # [B, G]
    weights: Tensor | None  # [B, K, D] or None
    num_tokens: int  # tokens generated in this round
    engine_logprobs: list[list[float]] | None = None  # [N] per-token engine log-probs
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. reward errors, generation time


@dataclass
class RewardScores:
    """Scores of one rollout batch. N chains, m candidates, D dimensions."""

    rewards: Tensor  # [N, m, D] float32 in [0, 1]; zero rows where absent or where a reward failed
    mask: Tensor  # [N, m] bool, True where the candidate is present
    num_errors: int = 0  # reward calls that raised or returned an invalid value (their candidate scored 0)
    errors: list[str] = field(default_factory=list)  # the first few error reports
    dim_mask: Tensor | None = None  # [N, D] bool, True on each chain's record's real dimensions; None = all real
