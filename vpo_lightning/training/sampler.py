"""The RL step's sampling half, without Lightning: a batch of records in, the scored chains and their advantages out.

One training step, top to bottom (:meth:`Sampler.sample`, then :meth:`Sampler.rollout`):

1. **weights**: the estimator's Dirichlet weights of each prompt group, keyed by the step or the record
   (:meth:`~vpo_lightning.core.protocol.ChainProtocol.step_weights`; None for estimators without weights);
2. **prompts**: each record's chat with the chain protocol's instruction appended (m answers for chain methods,
   the shown weights for goal-conditioned GRPO), through the model's chat template;
3. **sample**: G chains per prompt from the engine, each prompt seeded by (seed, step, record index);
4. **score**: each chain split into its m candidates (repeats of an earlier answer of the chain dropped) and scored
   by the reward vector: ``rewards [B, G, m, D]``, ``mask [B, G, m]``;
5. **advantages**: the estimator table's entry (:mod:`~vpo_lightning.core.estimators`) on those rewards, ``[B, G]``;
6. **dynamic sampling** (optional): flat groups replaced by groups of freshly drawn prompts
   (:mod:`~vpo_lightning.core.dynamic_sampling`);
7. **tensors for the loss**: prompt + completion ids, masks, one advantage per chain and the step's metrics, a
   :class:`~vpo_lightning.core.types.Rollout`. The loss itself is ``VPOModule.training_step``
   (``vpo_lightning/training/module.py``), which calls :func:`vpo_lightning.core.losses.policy_loss` on it.

``vpo eval`` and ``vpo search`` sample held-out records with the same class (:meth:`Sampler.generate_chains`):
the same prompts, parser and reward vector, at the evaluation temperature and top-p (:class:`EvalSettings`, the
run's ``eval:`` section), with no advantages. The rollout
callback (``vpo_lightning/training/rollout.py``) drives a Sampler inside Lightning and adds what a trainer needs:
when to sample, the progress bar, preemption, the token budget, logs and completion files.

Randomness is keyed, not carried: the sampling seed of a step is derived from (seed, step, rank), VPO's Dirichlet
weights of a prompt group from (seed, step, prompt index) and the weighted baselines' from (seed, record id), so a
resumed run and a run on more ranks draw the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from vpo_lightning.core import metrics
from vpo_lightning.core.advantages import max_at_k_default, set_rewards
from vpo_lightning.core.dynamic_sampling import DynamicSamplingSettings, fill_batch
from vpo_lightning.core.estimators import get_estimator
from vpo_lightning.core.protocol import (
    ChainProtocol,
    TagFamily,
    build_rollout_tensors,
    derive_seed,
    engine_logprob_tensor,
)
from vpo_lightning.core.types import Generation, Rollout, Round
from vpo_lightning.generation.engines import Engine, SamplingSettings
from vpo_lightning.generation.models import prompt_token_ids
from vpo_lightning.training.records import template_tools

__all__ = ["EvalSettings", "Sampler", "chain_protocol", "validate_settings"]


@dataclass(frozen=True)
class EvalSettings:
    """How ``vpo eval`` and ``vpo search`` sample held-out prompts (the ``eval:`` section); training and in-loop
    validation sample at ``rollout.sampling``, whose top-k and token budget evaluation keeps.

    Args:
        temperature: the evaluation temperature; the reference's held-out evaluation uses 0.7 in every domain.
        top_p: the evaluation top-p; the reference: 1.0 (maze, MuSiQue), 0.95 (tool use, EUREQA).
    """

    temperature: float = 0.7
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"eval.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"eval.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Sampler:
    """A chain protocol, an engine and sampling settings: what samples and scores chains.

    Args:
        protocol: prompts, candidate parser, reward vector and weights of the run.
        engine: the rollout engine (it generates with ``module.policy`` and ``module.tokenizer``).
        sampling: temperature, top-p, top-k and the token budget of a chain.
        group_size: G, chains per prompt in training.
        max_at_k_k: k of an estimator that takes it (max@k); None = its default.
        dynamic_sampling: DAPO filter groups on training steps.
    """

    protocol: ChainProtocol
    engine: Engine
    sampling: SamplingSettings
    group_size: int = 1
    max_at_k_k: int | None = None
    dynamic_sampling: DynamicSamplingSettings = field(default_factory=DynamicSamplingSettings)

    # ---- one training step ------------------------------------------------------------------------------------
    def sample(self, module: Any, records: list[dict], indices: list[int], step: int, rank: int = 0,
               pool: list[dict] | None = None) -> Round:
        """Sample, score and compute advantages for ``records``; with dynamic sampling on a training step
        (step >= 0), refill flat groups with prompts from ``pool`` (the training records). The Round holds the
        groups kept; ``extra["dynamic"]`` the refill's statistics when it ran."""
        rnd = self.sample_round(module, records, indices, step, rank)
        if not (self.dynamic_sampling.enabled and step >= 0 and pool):
            return rnd

        def draw(idx: list[int], r: int) -> Round:
            return self.sample_round(module, [pool[i] for i in idx], idx, step, rank, r)

        rnd, dyn = fill_batch(rnd, draw, len(pool), len(records), self.dynamic_sampling.max_extra_rounds,
                              derive_seed(self.protocol.seed, "refill", step, rank))
        if dyn["dynamic/extra_rounds"] or len(rnd.records) != len(records):  # recomputed: gdpo whitens the batch
            rnd.advantages = self.advantages(rnd.records, rnd.rewards, rnd.mask, rnd.weights, rnd.completion_ids)
        rnd.extra["dynamic"] = dyn
        return rnd

    def sample_round(self, module: Any, records: list[dict], indices: list[int], step: int, rank: int = 0,
                     round_: int = 0) -> Round:
        """One generation round: G chains for each of ``records``, scored, with their advantages."""
        B, G, protocol = len(records), self.group_size, self.protocol
        weights = protocol.step_weights(indices, step, records)  # 1. [B, K, D] or None
        prompts = [prompt_token_ids(module.tokenizer, protocol.messages(r, None if weights is None else weights[b, 0]),
                                    template_tools(r)) for b, r in enumerate(records)]  # 2.
        torch.manual_seed(derive_seed(protocol.seed, "sample", step, rank, *([round_] if round_ else [])))
        t0 = time.perf_counter()
        seeds = [derive_seed(protocol.seed, "sample", step, idx) for idx in indices]  # per prompt: rank-independent
        gen = self.engine.generate(module, prompts, G, self.sampling, seeds)  # 3.
        gen_time = time.perf_counter() - t0
        split = [protocol.training_candidates(t) for t in gen.texts]  # 4. repeated answers of a chain count once
        scores = protocol.score([c for c, _ in split], [r for r in records for _ in range(G)])
        rewards = scores.rewards.view(B, G, protocol.m, -1)  # [B, G, m, D]
        mask = scores.mask.view(B, G, protocol.m)  # [B, G, m]
        adv = self.advantages(records, rewards, mask, weights, gen.completion_ids)  # 5. [B, G]
        return Round(list(records), list(indices), prompts, gen.completion_ids, gen.texts, rewards, mask, adv,
                     weights, gen.num_tokens, gen.engine_logprobs,
                     {"gen_time": gen_time, "errors": scores.num_errors, "repeats": sum(n for _, n in split)})

    def advantages(self, records: list[dict], rewards: Tensor, mask: Tensor, weights: Tensor | None,
                   completion_ids: list[list[int]]) -> Tensor:
        """The estimator on ``rewards [B, G, m, D]``, with each record's real dimensions (per-row D) and the extra
        arguments its table entry names. ``[B, G]``."""
        method = self.protocol.method
        extra = method.extra_kwargs({
            "k": lambda: self.max_at_k_k,
            "vector_repeats": lambda: self.protocol.vector_repeats,
            "token_counts": lambda: torch.tensor([len(c) for c in completion_ids],
                                                 dtype=torch.float32).view(mask.shape[:2]),  # [B, G]
        })
        if self.protocol.reward_vector.variable_dims:
            extra["dim_mask"] = self.protocol.dim_mask(records)  # [B, D]
        return method(self.scalar_view(rewards), mask, weights=weights, num_weights=self.protocol.num_weights,
                      alpha=self.protocol.alpha, **extra)

    def scalar_view(self, rewards: Tensor) -> Tensor:
        """For the scalar baselines (``scalar_view`` in the estimator table) of a task whose f is a weighted mean
        (rewards registered with ``f_weights``, e.g. MuSiQue): ``[B, G, m, D] -> [B, G, m, 1]`` holding f, whose mean
        over the one dimension the estimator takes is f itself. Other estimators and plain-mean tasks get
        ``rewards`` unchanged."""
        w = torch.tensor(self.protocol.reward_vector.f_weights, dtype=rewards.dtype)  # [D]
        if not self.protocol.method.scalar_view or not bool((w != w[0]).any()):
            return rewards
        return (rewards @ (w / w.sum())).clamp(0.0, 1.0).unsqueeze(-1)  # [B, G, m, 1]

    def rollout(self, rnd: Round, pad_id: int) -> Rollout:
        """7. The Round as the loss reads it: ``[N, P + L]`` ids and attention mask, ``[N, L]`` completion mask, one
        advantage per chain, and the step's metrics."""
        B, G, m = len(rnd.records), self.group_size, self.protocol.m
        gen = Generation(rnd.completion_ids, rnd.texts, rnd.num_tokens, rnd.engine_logprobs)
        ids, attn, comp, P = build_rollout_tensors(rnd.prompts, gen, G, pad_id)
        engine_lp = engine_logprob_tensor(gen, comp)  # [N, L] or None
        rewards, mask = rnd.rewards.reshape(B * G, m, -1), rnd.mask.reshape(B * G, m)  # [N, m, D], [N, m]
        stats = self.metrics(rnd)
        return Rollout(ids, attn, comp, P, rnd.advantages.reshape(-1), rewards, mask, rnd.texts,
                       self.sampling.temperature, self.sampling.max_new_tokens, engine_lp, stats)

    def metrics(self, rnd: Round) -> dict[str, float]:
        """The step's logged metrics: rewards, advantages, parse rate, diversity, tokens and time."""
        rewards, mask, adv = rnd.rewards, rnd.mask, rnd.advantages
        B, G, m, D = rewards.shape
        gen_time, dyn = float(rnd.extra.get("gen_time", 0.0)), rnd.extra.get("dynamic")
        dim_mask = self.protocol.dim_mask(rnd.records) if self.protocol.reward_vector.variable_dims else None
        present = mask.float()  # [B, G, m]
        group_dims = None if dim_mask is None else dim_mask[:, None, :].expand(B, G, D)  # [B, G, D]
        out = metrics.reward_means(rewards, mask, self.protocol.dim_names, group_dims)  # all and parsed only
        real = torch.ones(B, 1, 1, D) if dim_mask is None else dim_mask[:, None, None, :].float()  # [B, 1, 1, D]
        f = (rewards * real).sum(-1) / real.sum(-1)  # [B, G, m] mean over the real dimensions
        out["reward/best_in_chain"] = float(f.max(-1).values.mean())
        if rnd.weights is not None and self.protocol.method.set_reward:
            out["reward/set"] = float(set_rewards(rewards, rnd.weights, mask).mean())
        out["adv/mean"], out["adv/std"] = float(adv.mean()), float(adv.std(correction=0))
        out["adv/abs_max"] = float(adv.abs().max())
        out["frac_zero_std_groups"] = float((adv.abs().amax(dim=1) == 0).float().mean())
        out["chains/parse_rate"] = float(mask.any(-1).float().mean())
        out["chains/valid_candidates"] = float(present.sum(-1).mean())
        pool = rewards.reshape(B, G * m, D)  # [B, G*m, D]
        out["diversity/within_group"] = metrics.pairwise_l1_diversity(pool, mask.reshape(B, G * m))
        if m > 1:
            out["diversity/within_chain"] = metrics.within_chain_diversity(rewards.reshape(B * G, m, D)[None],
                                                                           mask.reshape(1, B * G, m))
        out["rollout/tokens"] = float(rnd.num_tokens)
        out["rollout/tokens_per_s"] = rnd.num_tokens / max(gen_time, 1e-9)
        out["rollout/time_s"] = gen_time
        out["rollout/mean_length"] = rnd.num_tokens / max(1, B * G)
        out["reward/errors"] = float(rnd.extra.get("errors", 0))
        if m > 1:  # answers dropped as repeats of an earlier answer of their chain, per chain
            out["chains/repeated_candidates"] = float(rnd.extra.get("repeats", 0)) / max(1, B * G)
        if dyn:  # every round's tokens count toward the budget (rollout/tokens); the kept ones are trained on
            out.update(dyn)
            out["rollout/tokens"] = dyn["dynamic/total_tokens"]
            out["rollout/tokens_per_s"] = dyn["dynamic/total_tokens"] / max(out["rollout/time_s"], 1e-9)
        return out

    # ---- outside training: vpo eval, vpo search ------------------------------------------------------------------
    def generate_chains(self, module: Any, records: Sequence[dict], chains: int, seed: int,
                        *key: Any) -> Generation:
        """``chains`` completions of each of ``records`` in one engine call, in record order, seeded by (seed,
        *key)."""
        per_record = [self.prompt_rows(module.tokenizer, record, chains, seed) for record in records]  # [b][chains]
        torch.manual_seed(derive_seed(seed, *key))
        return self.generate_rows(module, per_record)

    def generate_rows(self, module: Any, per_record: list[list[list[int]]]) -> Generation:
        """One engine call for the prompt rows of several records (``per_record[i]``: record i's chains),
        completions in the same order. When every chain of a record has the same prompt (all estimators but one
        that shows its weights) the record is one group, so the engine prefills its prompt once, not per chain."""
        if all(row == rows[0] for rows in per_record for row in rows) and len({len(r) for r in per_record}) == 1:
            return self.engine.generate(module, [rows[0] for rows in per_record], len(per_record[0]), self.sampling)
        return self.engine.generate(module, [r for rows in per_record for r in rows], 1, self.sampling)

    def prompt_rows(self, tokenizer: Any, record: dict, chains: int, seed: int) -> list[list[int]]:
        """Token ids of the ``chains`` prompts of one record (a fresh shown weight per sample where the estimator
        shows its weights)."""
        tools = template_tools(record)
        return [prompt_token_ids(tokenizer, messages, tools)
                for messages in self.protocol.chain_messages(record, chains, seed)]


def validate_settings(estimator: str, m: int, group_size: int, num_weights: int, alpha: float,
                      k: int | None = None) -> None:
    """Refuse rollout settings no estimator can use, naming the ``rollout.`` key."""
    method = get_estimator(estimator)  # raises, naming the known ones, for an unknown name
    if m < 1:
        raise ValueError(f"rollout.num_candidates (m) must be >= 1, got {m}")
    if group_size < 2:
        raise ValueError(
            f"rollout.group_size (G) must be >= 2: every estimator normalises within a group of chains, "
            f"got {group_size}"
        )
    if num_weights < 1:
        raise ValueError(f"rollout.num_weights (K) must be >= 1, got {num_weights}")
    if not alpha > 0:
        raise ValueError(f"rollout.alpha (Dirichlet concentration) must be > 0, got {alpha}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"rollout.max_at_k_k must be null or a positive int, got {k!r}")
    if "k" in method.extras and (k or max_at_k_default(group_size)) >= group_size:
        shown = f"rollout.max_at_k_k={k}" if k else f"the default k = max(2, G // 2) = {max_at_k_default(group_size)}"
        raise ValueError(f"max_at_k needs k < rollout.group_size, got {shown} with group_size={group_size}: at "
                         "k >= G every rollout's contribution is the group maximum and all advantages are 0. Raise "
                         "rollout.group_size (>= 3 for the default k) or set rollout.max_at_k_k below it")


def chain_protocol(rewards: Sequence[str], estimator: str, num_candidates: int, group_size: int, num_weights: int,
                   alpha: float, tag_family: TagFamily, seed: int, reward_workers: int | None = None,
                   max_at_k_k: int | None = None) -> ChainProtocol:
    """The run's chain protocol from the ``rollout:`` settings of the same names, after
    :func:`validate_settings`: what the rollout callback builds and ``vpo eval``/``vpo search`` build without it."""
    validate_settings(estimator, num_candidates, group_size, num_weights, alpha, max_at_k_k)
    # the reward names are looked up here: a bad one fails fast
    return ChainProtocol(rewards, estimator, num_candidates, num_weights, alpha, tag_family, seed, reward_workers)
