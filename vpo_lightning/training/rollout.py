"""The rollout callback: generate G chains per prompt, score them into a [B, G, m, D] reward tensor, compute advantages.

Why a callback and not an IterableDataset of rollouts (Lightning's PPO example): generation needs the *current*
policy, which the callback reaches through ``pl_module`` after every optimizer step, and the data position stays a
plain integer that checkpoints can save. ``on_train_batch_start`` attaches a ``Rollout`` to the batch; Lightning
passes that same dict to ``training_step``.

Randomness is keyed, not carried: the sampling seed of a step is derived from (seed, step, rank), VPO's Dirichlet
weights of a prompt group from (seed, step, prompt index) and the weighted baselines' from (seed, record id), so a
resumed run and a run on more ranks draw the same.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vpo_lightning.core.dynamic_sampling import DynamicSamplingSettings
from vpo_lightning.core.estimators import DEFAULT_ESTIMATOR, EstimatorName
from vpo_lightning.core.format_check import FormatCheck
from vpo_lightning.core.types import Rollout
from vpo_lightning.generation.engines import Engine, RolloutShape, SamplingSettings, TransformersEngine
from vpo_lightning.training.checkpointing import AdapterCheckpoint, note_sigterm, pause_point, sigterm_pending
from vpo_lightning.training.progress import action_needed, show_phase
from vpo_lightning.training.runtime import trim_malloc
from vpo_lightning.training.sampler import Sampler, chain_protocol

__all__ = ["RolloutCallback"]

log = logging.getLogger(__name__)


class RolloutInterrupted(Exception):
    """Raised inside the engine's generation when a SIGTERM arrives: the rollout stops at the next token."""


def _protocol_field(name: str) -> property:
    """A read-only attribute of the callback that is its chain protocol's ``name``."""
    return property(lambda self: getattr(self.protocol, name), doc=f"``self.protocol.{name}``")


def _sampler_field(name: str) -> property:
    """An attribute of the callback that is its sampler's ``name`` (settable: tests swap the engine)."""
    return property(lambda self: getattr(self.sampler, name), lambda self, value: setattr(self.sampler, name, value),
                    doc=f"``self.sampler.{name}``")


class RolloutCallback(L.Callback):
    """Runs the step's :class:`~vpo_lightning.training.sampler.Sampler` before each batch: samples chains with an
    engine, scores them with the reward vector and computes advantages.

    Args:
        rewards: reward names (or dotted paths) forming the D-dimensional reward vector, in order.
        estimator: advantage estimator: VPO (the default) or a baseline, a name of the estimator table
            (:data:`~vpo_lightning.core.estimators.ESTIMATORS`). Chain methods ask for m answers per chain.
        num_candidates: m, answers per chain for chain methods (single-answer methods use 1).
        group_size: G, chains sampled per prompt.
        num_weights: K, Dirichlet weight vectors per prompt group for the VPO set reward.
        alpha: Dirichlet concentration (1.0 = uniform on the simplex).
        tag_family: how candidates are delimited: response (<response_i>), route (<route_i>), fence (code blocks).
        sampling: temperature, top-p, top-k and the token budget of a chain.
        engine: the rollout engine (TransformersEngine by default; VLLMEngine on a GPU).
        seed: seed from which per-step sampling seeds and per-group weight seeds are derived.
        log_samples_every: write a table of sample completions to TensorBoard every this many steps (0 = never).
        reward_workers: threads for rewards that run subprocesses (code); default: the CPU count.
        save_completions: append every sampled chain (step, prompt id, text, reward vectors, advantage) to
            ``<run dir>/completions/rank<r>.jsonl`` for later analysis.
        max_generated_tokens: stop training after the optimizer step at which the run (all ranks) has generated
            this many tokens; ``trainer.max_steps`` stays a cap. For baselines matched on compute, not on steps
            (a VPO chain and a GRPO answer differ in length). None = no token budget. Tokens of dynamic sampling's
            extra rounds count.
        dynamic_sampling: DAPO filter groups: draw more prompts when groups have zero reward spread and train only
            on groups with signal, at most ``max_extra_rounds`` extra generation rounds per step (one process only).
        max_at_k_k: k of the max_at_k estimator, 1 <= k < group_size; null = the reference's max(2, G // 2).
            Ignored by the other estimators.
        trim_memory: after every optimizer step, hand the free pages of the process's heaps back to the kernel
            (glibc ``malloc_trim``; a no-op elsewhere). Without it resident memory grows over a long run as the
            step's buffers, sized by each step's lengths, fragment the heap (issue 56, docs/SPEED.md).
    """

    def __init__(
        self,
        rewards: list[str],
        estimator: EstimatorName = DEFAULT_ESTIMATOR,
        num_candidates: int = 3,
        group_size: int = 8,
        num_weights: int = 100,
        alpha: float = 1.0,
        tag_family: Literal["response", "route", "fence"] = "response",
        sampling: SamplingSettings = SamplingSettings(),  # noqa: B008 - settings object, never mutated
        engine: Engine = lazy_instance(TransformersEngine),
        seed: int = 0,
        log_samples_every: int = 10,
        reward_workers: int | None = None,
        save_completions: bool = False,
        max_generated_tokens: int | None = None,
        dynamic_sampling: DynamicSamplingSettings = DynamicSamplingSettings(),  # noqa: B008 - never mutated
        max_at_k_k: int | None = None,
        trim_memory: bool = True,
    ) -> None:
        self.protocol = chain_protocol(rewards, estimator, num_candidates, group_size, num_weights, alpha, tag_family,
                                       seed, reward_workers, max_at_k_k)
        if max_generated_tokens is not None and max_generated_tokens < 1:
            raise ValueError(f"rollout.max_generated_tokens must be >= 1 or null, got {max_generated_tokens}")
        self.log_samples_every, self.save_completions = log_samples_every, save_completions
        self.trim_memory = trim_memory
        self.max_generated_tokens = max_generated_tokens
        if dynamic_sampling.max_extra_rounds < 0:
            raise ValueError("rollout.dynamic_sampling.max_extra_rounds must be >= 0, got "
                             f"{dynamic_sampling.max_extra_rounds}")
        self.sampler = Sampler(self.protocol, engine, sampling, group_size, max_at_k_k, dynamic_sampling)
        self.generated_tokens = 0  # training tokens generated so far, all ranks; saved in checkpoints
        self._engine_ready = False
        self.format_check = FormatCheck(estimator, self.m, tag_family)  # a run that cannot learn is told so

    # the chain protocol's settings, read from it (one copy): m is num_candidates for chain methods, else 1
    estimator = _protocol_field("estimator")
    m = _protocol_field("m")
    num_weights = _protocol_field("num_weights")
    alpha = _protocol_field("alpha")
    tag_family = _protocol_field("tag_family")
    seed = _protocol_field("seed")
    reward_names = _protocol_field("reward_names")
    reward_vector = _protocol_field("reward_vector")
    # the sampler's settings (one copy)
    engine = _sampler_field("engine")
    sampling = _sampler_field("sampling")
    group_size = _sampler_field("group_size")
    max_at_k_k = _sampler_field("max_at_k_k")
    dynamic_sampling = _sampler_field("dynamic_sampling")

    def state_dict(self) -> dict[str, Any]:
        return {"generated_tokens": self.generated_tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.generated_tokens = int(state_dict.get("generated_tokens", 0))

    # ---- Lightning hooks ---------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.reward_dim_names = self.reward_vector.dim_names
        if self.dynamic_sampling.enabled and trainer.world_size > 1:
            raise ValueError("rollout.dynamic_sampling.enabled is not supported with several processes yet (ranks "
                             "would keep different numbers of groups); run on one device or turn it off")

    def _ensure_engine(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._engine_ready:  # after configure_model, so the engine sees the loaded policy
            self.engine.prepare(self.rollout_shape(trainer))
            self.engine.setup(pl_module)
            self._engine_ready = True

    def rollout_shape(self, trainer: L.Trainer) -> RolloutShape:
        """B, G, the prompt budget and the generation budget of this run's largest rollout step."""
        data = getattr(trainer, "datamodule", None)
        return RolloutShape(batch_size=int(getattr(data, "batch_size", 1) or 1), group_size=self.group_size,
                            max_prompt_tokens=int(getattr(data, "max_prompt_tokens", 0) or 0),
                            max_new_tokens=self.sampling.max_new_tokens)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: dict, batch_idx: int) -> None:
        self._ensure_engine(trainer, pl_module)
        stream = getattr(trainer.datamodule, "train_stream", None) if trainer.datamodule is not None else None

        def report(finished: int, total: int, tokens: int) -> None:  # the bar's `now` field during the rollout
            if sigterm_pending(trainer):  # preempted: stop generating, save, exit
                raise RolloutInterrupted
            show_phase(trainer, pl_module, f"rollout {finished}/{total} chains, {tokens:,} tok",
                       force=finished == total)

        self.engine.progress = report
        interrupted = False
        try:
            batch["rollout"] = self.rollout(pl_module, batch, step=trainer.global_step, rank=trainer.global_rank,
                                            pool=getattr(stream, "records", None))
        except RolloutInterrupted:
            interrupted = True
        finally:
            self.engine.progress = None
        tokens = 0.0 if interrupted else batch["rollout"].metrics["rollout/tokens"]
        if trainer.world_size > 1:  # every rank must agree on when the budget runs out, and on a SIGTERM
            both = trainer.strategy.reduce(torch.tensor([tokens, float(interrupted or sigterm_pending(trainer))],
                                                        device=pl_module.device), reduce_op="sum")
            tokens, interrupted = float(both[0]), bool(both[1] > 0)
        if interrupted:  # any rank's SIGTERM stops them all: last.ckpt as of the step before (together), then stop
            note_sigterm(trainer)
            if isinstance(trainer.checkpoint_callback, AdapterCheckpoint):
                trainer.checkpoint_callback.save_before_step(trainer)
            raise SIGTERMException  # what Lightning raises after a step when SIGTERM came
        self.generated_tokens += int(tokens)
        if trainer.datamodule is not None and hasattr(trainer.datamodule, "mark_consumed"):
            trainer.datamodule.mark_consumed(batch["position"])
        if trainer.global_rank == 0:  # the format check reads this rank's chains; one rank prints
            self._check_format(batch["rollout"])
        if self.log_samples_every and trainer.global_step % self.log_samples_every == 0:
            self._log_samples(trainer, batch)
        if self.save_completions:
            self._save_completions(trainer, batch)

    def card_facts(self) -> dict[str, Any]:
        """What the adapter's model card reports of this run's rollouts
        (:func:`vpo_lightning.generation.adapters.run_facts`)."""
        return {"method": "RL (vpo fit)", "estimator": self.estimator, "reward_dims": list(self.protocol.dim_names),
                "m": self.m, "G": self.group_size, "tokens_trained": f"{self.generated_tokens} generated"}

    @property
    def progress_note(self) -> str | None:
        """What the progress bar shows while the run has no signal (no parsed answer, no reward spread)."""
        return self.format_check.note

    def _check_format(self, ro: Rollout) -> None:
        """Report the first rollout's parse rate per position; warn once when the run has no signal (format_check)."""
        first = self.format_check.first_rollout(ro.candidate_mask)  # [N, m]
        if first:
            log.info(first)
        warning = self.format_check.update(ro.metrics["chains/candidate_parse_rate"],
                                           ro.metrics["frac_zero_std_groups"], ro.metrics["reward/all/mean"])
        if warning:
            action_needed(warning)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: dict, batch_idx: int) -> None:
        self.engine.sync(pl_module)
        if self.trim_memory:
            trim_malloc()
        if self.max_generated_tokens is not None and self.generated_tokens >= self.max_generated_tokens:
            if not trainer.should_stop:
                log.info("token budget reached: %d generated tokens >= rollout.max_generated_tokens=%d; stopping "
                         "after step %d", self.generated_tokens, self.max_generated_tokens, trainer.global_step)
            trainer.should_stop = True

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: dict, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._ensure_engine(trainer, pl_module)

        def interrupt(*_: int) -> None:  # preempted during validation: training's state is whole, stop here
            if getattr(trainer, "received_sigterm", False):
                raise RolloutInterrupted

        self.engine.progress = interrupt
        try:
            batch["rollout"] = self.rollout(pl_module, batch, step=-1 - batch_idx, rank=trainer.global_rank)
        except RolloutInterrupted:
            raise SIGTERMException from None  # AdapterCheckpoint.on_exception writes last.ckpt
        finally:
            self.engine.progress = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.engine.teardown()

    # ---- the rollout itself: the sampler's ----------------------------------------------------------------------
    def rollout(self, pl_module: Any, batch: dict, step: int, rank: int = 0,
                pool: list[dict] | None = None) -> Rollout:
        """Sample, score and compute advantages for ``batch`` (:meth:`Sampler.sample`); with dynamic sampling on a
        training step, ``batch["records"]``/``["indices"]`` become the groups kept."""
        records: list[dict] = batch["records"]
        pause_point("generate", step)  # a no-op outside the kill-and-resume tests
        rnd = self.sampler.sample(pl_module, records, batch.get("indices", list(range(len(records)))), step, rank,
                                  pool)
        if "dynamic" in rnd.extra:
            batch["records"], batch["indices"] = rnd.records, rnd.indices
        return self.sampler.rollout(rnd, pl_module.tokenizer.pad_token_id)

    def _save_completions(self, trainer: L.Trainer, batch: dict) -> None:
        ro: Rollout = batch["rollout"]
        out = Path(trainer.default_root_dir) / "completions" / f"rank{trainer.global_rank}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as fh:
            for i, text in enumerate(ro.texts):
                b = i // self.group_size
                row = {"step": trainer.global_step, "position": batch["position"], "index": batch["indices"][b],
                       "id": batch["records"][b].get("id"), "text": text, "advantage": float(ro.advantages[i]),
                       "rewards": [r if ok else None for r, ok in zip(ro.rewards[i].tolist(),
                                                                       ro.candidate_mask[i].tolist())]}
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")

    def _log_samples(self, trainer: L.Trainer, batch: dict) -> None:
        ro: Rollout = batch["rollout"]
        writer = getattr(trainer.logger, "experiment", None)
        if writer is None or not hasattr(writer, "add_text"):
            return
        names = self.reward_vector.dim_names
        lines = ["| chain | id | completion | rewards (" + ", ".join(names) + ") |", "|---|---|---|---|"]
        for i, text in enumerate(ro.texts[: 2 * self.group_size]):
            rid = batch["records"][i // self.group_size].get("id", "")
            vecs = "; ".join(
                "[" + ", ".join(f"{v:.2f}" for v in ro.rewards[i, j].tolist()) + "]" if ro.candidate_mask[i, j] else "-"
                for j in range(ro.rewards.shape[1])
            )
            snippet = text[:600].replace("|", "\\|").replace("\n", "<br>")
            lines.append(f"| {i} | {rid} | {snippet} | {vecs} |")
        writer.add_text("samples", "\n".join(lines), global_step=trainer.global_step)

