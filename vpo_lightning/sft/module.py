"""``SFTModule``: supervised fine-tuning of the policy on demonstrations (the cold start before RL).

The same model loading as ``vpo fit`` (:func:`vpo_lightning.generation.models.load_base_model`: alias, GGUF, directory,
hub; dtype; LoRA/QLoRA; a starting ``model.adapter``), the same chunked log-prob core (:func:`per_token_logprobs`), the
same checkpoints (``AdapterCheckpoint``: atomic, PEFT adapter exported beside each). The loss is the mean negative
log-likelihood of the completion tokens of a batch (prompt tokens carry none), over packed rows
(:func:`vpo_lightning.sft.data.pack_examples`); each row is backpropagated on its own, weighted by its share of the
batch's completion tokens, so memory holds one row's activations.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from vpo_lightning.generation.models import ModelSettings
from vpo_lightning.sft.data import pack_examples
from vpo_lightning.training.policy import (
    PolicyModule,
    PolicyOptimSettings,
    lr_factor,
    lr_shape,
    packed_logprobs,
    peak_rss_gb,
)

__all__ = ["SFTModule", "SFTOptimSettings", "row_nll"]

log = logging.getLogger(__name__)


@dataclass
class SFTOptimSettings(PolicyOptimSettings):
    """SFT optimiser settings: the policy's (:class:`~vpo_lightning.training.policy.PolicyOptimSettings`), with a
    higher learning rate, a short warm-up and a decay by default.

    Args:
        lr: peak learning rate (LoRA: ~1e-4..5e-4).
        weight_decay: AdamW weight decay.
        min_lr_ratio: the learning rate at the last step, as a fraction of ``lr`` (1.0 = constant).
        schedule: the decay after the warm-up: linear or cosine (TRL's lr_scheduler_type).
    """

    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 5
    schedule: Literal["linear", "cosine"] = "linear"  # type: ignore[assignment]
    min_lr_ratio: float = 0.1


def row_nll(model: nn.Module, row: dict[str, Tensor], chunk_size: int = 1024) -> tuple[Tensor, int]:
    """(sum of -log p over the row's completion tokens, their count) for one packed row."""
    one = {**row, "gather": row["gather"][None], "targets": row["targets"][None]}  # one sequence: [1, K]
    logp = packed_logprobs(model, one, chunk_size)  # [1, K]
    return -logp.sum(), int(row["targets"].numel())


class SFTModule(PolicyModule):
    """The policy (LoRA by default) trained on demonstrations with a completion-only NLL loss.

    Args:
        model: which model to load, precision, attention, LoRA / QLoRA, gradient checkpointing, starting adapter.
        optim: optimiser and numerical-guard settings.
    """

    needs_reference = False  # no KL term: full fine-tuning loads no second copy
    card_method = "supervised (vpo sft)"  # what the adapter's model card says trained it

    def __init__(
        self,
        model: ModelSettings = ModelSettings(),  # noqa: B008 - frozen-by-convention settings object
        optim: SFTOptimSettings = SFTOptimSettings(),  # noqa: B008
    ) -> None:
        super().__init__(model, optim)
        self.save_hyperparameters()
        self._val_sum, self._val_count = 0.0, 0

    def rows(self, examples: list[dict[str, Any]]) -> list[dict[str, Tensor]]:
        """Packed rows of a batch, on the module's device, with the mask type the attention wants."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        max_tokens = getattr(dm, "max_tokens_per_row", 2048)
        pack = getattr(dm, "pack", True)
        impl = self.model_settings.attn_implementation
        if impl == "flash_attention_2":
            pack = False  # no custom 4D masks there
        dtype = torch.bool if impl == "sdpa" else self.policy.get_input_embeddings().weight.dtype
        return [{k: v.to(self.device) for k, v in r.items()} for r in pack_examples(examples, max_tokens, pack, dtype)]

    def batch_loss(self, examples: list[dict[str, Any]], backward: bool = False) -> tuple[float, int]:
        """Mean completion NLL of a batch (and its token count); with ``backward``, accumulates its gradients."""
        rows = self.rows(examples)
        total = sum(int(r["targets"].numel()) for r in rows)
        loss_sum = 0.0
        for row in rows:
            nll, n = row_nll(self.policy, row, self.optim_settings.logprob_chunk_size)
            if backward:
                self.manual_backward(nll / max(total, 1))
            loss_sum += float(nll.detach())
        return loss_sum / max(total, 1), total

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        t0 = time.perf_counter()
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss, tokens = self.batch_loss(batch["records"], backward=True)
        ok, norm = self._clipped_step(lambda: (opt.step(), sched.step()), allowed=math.isfinite(loss))
        self._guard(ok, loss)
        elapsed = time.perf_counter() - t0
        self.log_dict({
            "train/loss": loss, "train/completion_tokens": float(tokens), "train/grad_norm": norm,
            "train/tokens_per_s": tokens / max(elapsed, 1e-9), "train/step_time_s": elapsed,
            "train/skipped_steps": float(not ok), "train/peak_rss_gb": peak_rss_gb(),
            "train/lr": sched.get_last_lr()[0],
        }, on_step=True, batch_size=1)
        self.log("loss", loss, prog_bar=True, logger=False, batch_size=1)
        # here, not in on_train_batch_end: checkpoint callbacks run before the module's batch-end hook, and the
        # position they save must already count this batch
        dm = self.trainer.datamodule
        if dm is not None and hasattr(dm, "mark_consumed"):
            dm.mark_consumed(batch["position"])

    # ---- validation -------------------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sum, self._val_count = 0.0, 0

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss, tokens = self.batch_loss(batch["records"])
        self._val_sum += loss * tokens
        self._val_count += tokens

    def on_validation_epoch_end(self) -> None:
        if self._val_count:
            self.log("val/loss", self._val_sum / self._val_count, prog_bar=True, batch_size=1)

    # ---- optimiser --------------------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        """Set the learning rate from the schedule at the current step: a run resumed with another
        ``trainer.max_steps`` follows the new schedule instead of the learning rate saved with the optimizer."""
        o, sched = self.optim_settings, self.lr_schedulers()
        shape, min_ratio = lr_shape(o)
        factor = lr_factor(sched.last_epoch, o.warmup_steps, max(1, int(self.trainer.max_steps or 1)), min_ratio, shape)
        for group, base in zip(self.optimizers().optimizer.param_groups, sched.base_lrs):
            group["lr"] = base * factor
