"""``VPOModule``: the LoRA/QLoRA policy, its reference (adapters disabled) and the PPO-clip + KL training step.

The module only wires things up: rollouts arrive on the batch from ``RolloutCallback``; log-probs and the loss come
from the pure core (``losses.py``). Optimisation is manual so that the PPO mini-batch updates (``mini_batches``, the
reference's 2 per rollout), ``num_iterations > 1`` passes, gradient clipping and the non-finite guard live in one
readable place. ``trainer.global_step`` counts rollouts (one training batch), not optimizer updates: a rollout makes
``mini_batches * num_iterations`` updates, and only its last advances the step counter, so ``max_steps``, checkpoint
steps and the data position keep meaning "rollouts".
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer, do_nothing_closure
from torch import Tensor, nn

from vpo_lightning.core.dynamic_sampling import rows_to_train
from vpo_lightning.core.losses import masked_mean, per_token_logprobs, policy_loss
from vpo_lightning.core.packing import packed_micro_batches, packing_enabled
from vpo_lightning.core.types import Rollout
from vpo_lightning.generation.models import ModelSettings
from vpo_lightning.training.checkpointing import pause_point
from vpo_lightning.training.policy import (
    PolicyModule,
    PolicyOptimSettings,
    decoder_and_head,
    packed_logprobs,
    peak_rss_gb,
)
from vpo_lightning.training.progress import show_phase

log = logging.getLogger(__name__)


@dataclass
class LossSettings:
    """Policy loss settings (VPO-SPEC section 5).

    Args:
        beta: coefficient of the k3 KL to the reference (0 disables the reference pass).
        clip_low: PPO lower clip epsilon.
        clip_high: PPO upper clip epsilon (raise above clip_low for DAPO's clip-higher).
        dual_clip: dual-clip constant c > 1 for negative advantages (null = off); the reference's 3.0.
        aggregation: token_mean (default), sequence_mean, or constant (Dr. GRPO: sum / (N * max_new_tokens)).
    """

    beta: float = 1e-3
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"


@dataclass
class OptimSettings(PolicyOptimSettings):
    """Optimiser settings of ``vpo fit``: the policy's (:class:`~vpo_lightning.training.policy.PolicyOptimSettings`:
    AdamW, warm-up and schedule, clipping, the non-finite guard) and the RL step's updates and micro-batches.

    Args:
        num_iterations: passes over each rollout batch (PPO epochs); each pass makes ``mini_batches`` updates.
        mini_batches: optimizer updates per pass over a rollout, each on its own contiguous 1/mini_batches of the
            chains (whole prompt groups when B is a multiple). With 2, the default and the reference's (train batch
            128 x 8 chains, mini-batch 64 -> 2 updates), the second update's PPO ratio and clip act on log-probs the
            first update moved; with 1 (and num_iterations 1) the ratio is exactly 1. Old log-probs are computed once,
            before the first update, whenever a rollout makes more than one update.
        micro_batch_size: chains per forward/backward (gradients accumulate over a step's B * G chains).
        share_prompt: pack each prompt once with up to micro_batch_size of its chains (a 4D attention mask, no
            padding), so training runs the shared prompt once per micro-batch instead of once per chain; same
            log-probs and gradients. Ignored with flash_attention_2 (no custom masks there).
    """

    num_iterations: int = 1
    mini_batches: int = 2
    micro_batch_size: int = 8
    share_prompt: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("num_iterations", "mini_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"optim.{name} must be a positive int, got {value!r}")


def _select_rows(ro: Rollout, rows: Tensor) -> Rollout:
    """``ro`` restricted to the chains ``rows`` (``ro`` itself when that is all of them)."""
    if len(rows) == len(ro.advantages) and bool((rows == torch.arange(len(rows))).all()):
        return ro
    return replace(ro, input_ids=ro.input_ids[rows], attention_mask=ro.attention_mask[rows],
                   completion_mask=ro.completion_mask[rows], advantages=ro.advantages[rows],
                   rewards=ro.rewards[rows], candidate_mask=ro.candidate_mask[rows],
                   texts=[ro.texts[i] for i in rows.tolist()],
                   engine_logprobs=None if ro.engine_logprobs is None else ro.engine_logprobs[rows])


def padded_micro_batches(ro: Rollout, size: int) -> list[dict[str, Tensor]]:
    """Length-bucketed micro-batches, trimmed of all-padding columns (less padding, same result)."""
    lengths = ro.completion_mask.sum(1)  # [N]
    order = torch.argsort(lengths, descending=True, stable=True)
    out = []
    for start in range(0, len(order), size):
        idx = order[start : start + size]
        attn = ro.attention_mask[idx]  # [n, P + L]
        comp = ro.completion_mask[idx]  # [n, L]
        first = int(attn[:, : ro.prompt_length].any(0).float().argmax())  # leftmost real prompt column
        length = max(1, int(comp.sum(1).max()))
        cols = slice(first, ro.prompt_length + length)
        out.append({
            "index": idx, "input_ids": ro.input_ids[idx, cols], "attention_mask": attn[:, cols],
            "completion_mask": comp[:, :length], "prompt_length": ro.prompt_length - first,
        })
    return out


class VPOModule(PolicyModule):
    """Policy + reference + the VPO training step.

    Args:
        model: which model to load, precision, attention, LoRA / QLoRA, gradient checkpointing.
        loss: PPO-clip and KL settings.
        optim: optimiser, micro-batching and numerical-guard settings.
    """

    def __init__(
        self,
        model: ModelSettings = ModelSettings(),  # noqa: B008 - frozen-by-convention settings object
        loss: LossSettings = LossSettings(),  # noqa: B008
        optim: OptimSettings = OptimSettings(),  # noqa: B008
    ) -> None:
        super().__init__(model, optim)
        self.loss_settings = loss
        self.save_hyperparameters()
        self.reward_dim_names: list[str] = []

    # ---- models ---------------------------------------------------------------------------------------------
    def completion_logprobs(self, model: nn.Module, mb: dict[str, Tensor], temperature: float,
                            entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Per-token log-probs of the completion tokens, ``[n, L]``, from a chunked pass over hidden states."""
        chunk = self.optim_settings.logprob_chunk_size
        if "gather" in mb:  # a packed row: [prompt | completion_1 | ... | completion_n]
            return packed_logprobs(model, mb, chunk, temperature, entropy)
        decoder, head = decoder_and_head(model)
        attn = mb["attention_mask"]  # [n, P + L]
        position_ids = (attn.cumsum(1) - 1).clamp(min=0)  # [n, P + L] matches generate() with left padding
        hidden = decoder(input_ids=mb["input_ids"], attention_mask=attn, position_ids=position_ids,
                         use_cache=False).last_hidden_state  # [n, P + L, H]
        P = mb["prompt_length"]
        hidden = hidden[:, P - 1 : -1]  # [n, L, H] the state before each completion token predicts it
        targets = mb["input_ids"][:, P:]  # [n, L]
        return per_token_logprobs(hidden, head, targets, chunk_size=chunk, temperature=temperature,
                                  return_entropy=entropy)

    @torch.no_grad()
    def reference_logprobs(self, mb: dict[str, Tensor], temperature: float) -> Tensor:
        """The reference model's log-probs: the same weights with the LoRA adapter disabled (no second copy)."""
        if self.reference is not None:
            return self.completion_logprobs(self.reference, mb, temperature)
        with self.policy.disable_adapter():
            return self.completion_logprobs(self.policy, mb, temperature)

    # ---- training ---------------------------------------------------------------------------------------------
    def _counts(self, completion_mask: Tensor) -> float:
        """What the aggregation averages over: tokens (token_mean), sequences with tokens, or all sequences."""
        agg = self.loss_settings.aggregation
        if agg == "token_mean":
            return float(completion_mask.sum())
        if agg == "sequence_mean":
            return float((completion_mask.sum(1) > 0).sum())
        return float(completion_mask.shape[0])

    def _normaliser(self, ro: Rollout) -> float:
        """The whole step's count. Under DDP, which averages gradients over ranks, it is the global count divided
        by the world size, so the update equals one process seeing every rank's chains."""
        whole = self._counts(ro.completion_mask)
        world = self._trainer.world_size if self._trainer is not None else 1
        if world > 1:
            total = self.trainer.strategy.reduce(torch.tensor(whole, device=self.device), reduce_op="sum")
            whole = float(total) / world
        return max(whole, 1.0)

    def _prepare(self, ro: Rollout, keep_old: bool = False) -> list[dict[str, Tensor]]:
        mbs = self._micro_batches(ro)
        for mb in mbs:
            mb["advantages"] = ro.advantages[mb["index"]].to(self.device)  # [n]
            if self.loss_settings.beta > 0:
                mb["ref"] = self.reference_logprobs(mb, ro.temperature)
            if keep_old:
                with torch.no_grad():  # skipped for a single update per rollout: then old = logp.detach() exactly
                    mb["old"] = self.completion_logprobs(self.policy, mb, ro.temperature)
        return mbs

    def _rows_with_gradient(self, ro: Rollout) -> Rollout:
        """``ro`` without the chains whose loss is exactly zero (zero advantage when beta = 0; see
        :func:`~vpo_lightning.core.dynamic_sampling.rows_to_train`): their forward and backward passes are skipped."""
        return _select_rows(ro, rows_to_train(ro.advantages, self.loss_settings.beta))

    def _mini_batch_parts(self, ro: Rollout) -> list[tuple[Rollout, Rollout]]:
        """``(part, trained)`` per mini-batch update: the part's chains (a contiguous slice of the rollout) and
        those of them that carry a gradient. Parts with no chains are dropped."""
        rows = torch.arange(len(ro.advantages)).tensor_split(self.optim_settings.mini_batches)
        parts = [_select_rows(ro, r) for r in rows if len(r)]
        return [(part, self._rows_with_gradient(part)) for part in parts]

    def _micro_batches(self, ro: Rollout) -> list[dict[str, Tensor]]:
        size = self.optim_settings.micro_batch_size
        attn_impl = self.model_settings.attn_implementation
        if not packing_enabled(self.optim_settings.share_prompt, attn_impl):
            return padded_micro_batches(ro, size)
        # SDPA takes a boolean mask; eager attention adds the mask to scores in the model's compute dtype
        mask_dtype = torch.bool if attn_impl == "sdpa" else self.policy.get_input_embeddings().weight.dtype
        mbs = packed_micro_batches(ro.input_ids, ro.attention_mask, ro.completion_mask, ro.prompt_length, size,
                                   mask_dtype)
        return [{k: v.to(self.device) for k, v in mb.items()} for mb in mbs]

    @staticmethod
    def _engine_gap(engine_logprobs: Tensor, mb: dict[str, Tensor], logp: Tensor) -> tuple[float, float]:
        """Sum and count of |engine log-prob - trainer log-prob| over a micro-batch's generated tokens (the
        train/inference mismatch; ``logp`` is the trainer's [n, L] from the first pass, before any update)."""
        eng = engine_logprobs[mb["index"], : logp.shape[1]].to(logp)  # [n, L]
        return float(((eng - logp).abs() * mb["completion_mask"]).sum()), float(mb["completion_mask"].sum())

    def _backward_pass(self, ro: Rollout, mbs: list[dict[str, Tensor]],
                       engine_logprobs: Tensor | None = None) -> dict[str, float]:
        """One pass over the micro-batches; with ``engine_logprobs`` ([N, L] of the trained rows), also the mean
        engine/trainer log-prob gap as ``engine_logprob_gap`` (no extra forward: it reads this pass's log-probs)."""
        totals: dict[str, float] = {}
        max_len = ro.max_length or ro.completion_mask.shape[1]
        whole = self._normaliser(ro)
        gap_sum, gap_count = 0.0, 0.0
        for mb in mbs:
            logp, ent = self.completion_logprobs(self.policy, mb, ro.temperature, entropy=True)
            if engine_logprobs is not None:
                g_sum, g_count = self._engine_gap(engine_logprobs, mb, logp.detach())
                gap_sum, gap_count = gap_sum + g_sum, gap_count + g_count
            old = mb.get("old", logp.detach())
            loss, stats = policy_loss(
                logp, old, mb["advantages"], mb["completion_mask"], mb.get("ref"), beta=self.loss_settings.beta,
                clip_low=self.loss_settings.clip_low, clip_high=self.loss_settings.clip_high,
                dual_clip=self.loss_settings.dual_clip, aggregation=self.loss_settings.aggregation,
                max_length=max_len,
            )
            w = self._counts(mb["completion_mask"]) / whole  # this micro-batch's share of the step
            self.manual_backward(loss * w)
            stats = {**stats, "loss": loss, "entropy": masked_mean(ent.detach(), mb["completion_mask"])}
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + w * float(v.detach() if torch.is_tensor(v) else v)
        if not mbs:  # every chain skipped (beta = 0, no advantage): zero gradients, as the full pass would give
            for p in self.policy.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            totals["loss"] = 0.0
        if engine_logprobs is not None and mbs:
            totals["engine_logprob_gap"] = gap_sum / max(gap_count, 1.0)
        return totals

    def _optimizer_step(self, last: bool = True) -> tuple[bool, float]:
        """Clip and step (:meth:`_clipped_step`); only the rollout's ``last`` update advances
        ``trainer.global_step`` and the learning-rate schedule (the others step the same optimizer through the
        strategy, skipping the step counter)."""
        opt, sched = self.optimizers(), self.lr_schedulers()

        def step() -> None:
            if last or not isinstance(opt, LightningOptimizer):  # a bare torch optimizer (unit tests): no counter
                opt.step()
            else:
                self.trainer.strategy.optimizer_step(opt.optimizer, do_nothing_closure, self)
            pause_point("optimizer_step", lambda: self.global_step - 1)  # kill tests: weights updated, scheduler not
            if last:  # the schedule (warmup) counts rollouts, like max_steps and global_step, not updates
                sched.step()

        return self._clipped_step(step)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        ro: Rollout = batch["rollout"]
        t0 = time.perf_counter()
        parts = self._mini_batch_parts(ro)  # beta = 0: chains with zero advantage carry no gradient
        updates = self.optim_settings.num_iterations * len(parts)
        show_phase(self._trainer, self, "log-probs", force=True)
        # old log-probs of every part come from the policy before the rollout's first update
        prepared = [(part, trained, self._prepare(trained, keep_old=updates > 1)) for part, trained in parts]
        gap_sum, gap_tokens, done, all_stats, skipped, bad_stats = 0.0, 0.0, 0, [], 0, None
        for iteration in range(self.optim_settings.num_iterations):
            for part, trained, mbs in prepared:
                done += 1
                show_phase(self._trainer, self, f"update {done}/{updates}", force=True)
                stats = self._backward_pass(part, mbs, trained.engine_logprobs if iteration == 0 else None)
                if "engine_logprob_gap" in stats:
                    tokens = float(trained.completion_mask.sum())
                    gap_sum, gap_tokens = gap_sum + stats.pop("engine_logprob_gap") * tokens, gap_tokens + tokens
                if math.isfinite(stats["loss"]):
                    ok, grad_norm = self._optimizer_step(last=done == updates)
                else:  # drop the non-finite gradients: left in place they would poison the next update
                    self.optimizers().zero_grad(set_to_none=True)
                    ok, grad_norm = False, float("nan")
                if not ok:  # the update is dropped; the next one starts from clean gradients
                    skipped, bad_stats = skipped + 1, bad_stats or stats
                all_stats.append(stats)
        # counts rollouts: one with a dropped update is a bad step
        self._guard(skipped == 0, (bad_stats or {}).get("loss"))
        keys = dict.fromkeys(k for s in all_stats for k in s)  # an update with no chain to train logs only its loss
        stats = {k: sum(s[k] for s in all_stats if k in s) / sum(k in s for s in all_stats) for k in keys}
        gap = gap_sum / gap_tokens if gap_tokens else None
        trained = float(sum(t.completion_mask.sum() for _, t, _ in prepared))
        step_time = time.perf_counter() - t0
        logged = {f"train/{k}": v for k, v in stats.items()}
        logged.update({f"train/{k}": v for k, v in ro.metrics.items()})
        logged.update({
            "train/grad_norm": grad_norm, "train/train_time_s": step_time, "train/skipped_steps": float(skipped > 0),
            "train/skipped_updates": float(skipped), "train/updates": float(updates),
            "train/trained_tokens_per_s": trained / max(step_time, 1e-9), "train/peak_rss_gb": peak_rss_gb(),
            "train/lr": self.lr_schedulers().get_last_lr()[0],
            "train/skipped_chains": float(len(ro.advantages) - sum(len(t.advantages) for _, t, _ in prepared)),
        })
        if gap is not None:
            logged["train/engine_logprob_gap"] = gap
        if torch.cuda.is_available():
            logged["train/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2**30
            # what the caching allocator holds (allocated + cached blocks): what another process, vLLM, cannot use
            logged["train/peak_cuda_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        self.log_dict(logged, on_step=True, batch_size=1, sync_dist=self.trainer.world_size > 1)
        prog = {"reward": ro.metrics.get("reward/all/mean", 0.0),  # every candidate, unparsed ones count 0
                "parsed": ro.metrics.get("chains/candidate_parse_rate", 0.0),
                "tok/s": ro.metrics.get("rollout/tokens_per_s", 0.0)}
        self.log_dict(prog, prog_bar=True, logger=False, batch_size=1)

    def on_train_end(self) -> None:
        """Check that every rank ended with the same trainable weights (DDP keeps them in sync; say so if not)."""
        checksum = torch.tensor(sum(float(p.detach().double().abs().sum()) for p in self.policy.parameters()
                                    if p.requires_grad), dtype=torch.float64, device=self.device)
        if self.trainer.world_size > 1:
            every = self.trainer.strategy.all_gather(checksum).flatten().tolist()
            if self.trainer.is_global_zero:
                same = max(every) - min(every) <= 1e-9 * max(1.0, abs(every[0]))
                (log.info if same else log.warning)(
                    "trainable weights %s on all %d ranks (checksums %s)", "identical" if same else "DIFFER",
                    len(every), every)

    # ---- validation -------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        ro: Rollout = batch["rollout"]
        keys = [k for k in ro.metrics if k.startswith(("reward/", "diversity/", "chains/"))]
        self.log_dict({f"val/{k}": ro.metrics[k] for k in keys}, batch_size=len(batch["records"]),
                      sync_dist=self.trainer.world_size > 1)
