"""``PolicyModule``: what the two LightningModules share, ``VPOModule`` (``vpo fit``) and ``SFTModule`` (``vpo sft``).

One trainable policy (LoRA by default) loaded in ``configure_model`` (idempotent), manual optimisation with AdamW
over its trainable weights and a per-step learning-rate schedule (linear warm-up, then :meth:`lr_factor`), the guard
that drops non-finite updates and stops after ``optim.max_bad_steps`` bad steps in a row, and checkpoints that hold
only the trainable weights (the adapter) with the guard's count.
"""

from __future__ import annotations

import logging
import math
import resource
from typing import Any

import lightning as L
import torch
from torch import nn

from vpo_lightning.generation.models import ModelSettings, count_parameters, load_policy, load_tokenizer

log = logging.getLogger(__name__)


def peak_rss_gb() -> float:
    """Peak resident memory of this process, GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def lr_factor(step: int, warmup: int, total: int, min_ratio: float = 1.0, shape: str = "linear") -> float:
    """Linear warm-up over ``warmup`` steps to 1, then a decay to ``min_ratio`` at step ``total`` (1.0: none), linear
    or (``shape="cosine"``) along half a cosine, as TRL's ``lr_scheduler_type="cosine"``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    done = min(1.0, (step - warmup) / max(1, total - warmup))  # fraction of the decay behind
    if shape == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))
    return max(min_ratio, 1.0 - (1.0 - min_ratio) * done)


def lr_shape(optim: Any) -> tuple[str, float]:
    """``(shape, min_ratio)`` of an optimiser settings object's schedule: ``schedule`` constant (the default of
    `vpo fit`), linear or cosine, decaying to ``min_lr_ratio``."""
    schedule = getattr(optim, "schedule", "constant")
    if schedule == "constant":
        return "linear", 1.0
    return schedule, float(getattr(optim, "min_lr_ratio", 0.0))


class PolicyModule(L.LightningModule):
    """The trainable policy, its optimiser, the non-finite guard and adapter-only checkpoints.

    Subclasses call ``self.save_hyperparameters()`` in their own ``__init__`` (it records the caller's arguments).
    ``optim`` is a settings object with ``lr``, ``weight_decay``, ``warmup_steps`` and ``max_bad_steps``.
    """

    needs_reference = True  # full fine-tuning keeps a frozen copy of the base (the KL's reference)

    def __init__(self, model: ModelSettings, optim: Any) -> None:
        super().__init__()
        self.model_settings, self.optim_settings = model, optim
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold only trainable weights (the adapter)
        self.policy: nn.Module | None = None
        self.reference: nn.Module | None = None
        self.tokenizer: Any = None
        self._bad_steps = 0

    # ---- models ---------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.policy is not None:  # idempotent
            return
        self.tokenizer = load_tokenizer(self.model_settings.name)
        device = self.device if self.device.type == "cuda" else None
        self.policy, self.reference = load_policy(self.model_settings, device, reference=self.needs_reference)
        trainable, total = count_parameters(self.policy)
        log.info("policy %s: %s trainable of %s parameters", self.model_settings.name, f"{trainable:,}", f"{total:,}")

    def on_fit_start(self) -> None:
        """Warn when the trained weights or the rotary frequencies are not fp32 after Lightning's precision plugin
        ran: ``trainer.precision: bf16-true`` casts the whole module, so the LoRA weights and AdamW state become bf16
        (a 2e-5 update is below half the bf16 spacing of typical LoRA values) and RoPE's ``inv_freq`` is rounded
        (the trained policy's positions drift from vLLM's fp32 RoPE)."""
        if self.policy is None:
            return
        off = sorted({f"trainable {p.dtype}" for p in self.trainable_parameters() if p.dtype != torch.float32}
                     | {f"{n} {b.dtype}" for n, b in self.policy.named_buffers()
                        if n.endswith("inv_freq") and b.dtype != torch.float32})
        if off:
            log.warning("trainer.precision=%s leaves %s: train with trainer.precision=32-true and the base in "
                        "model.model.dtype=bf16 (fp32 LoRA weights and optimizer state over a bf16 base)",
                        self.trainer.precision if self._trainer is not None else "?", ", ".join(off[:4]))

    @property
    def uses_lora(self) -> bool:
        return self.model_settings.lora.enabled

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    # ---- the non-finite guard -------------------------------------------------------------------------------
    def _guard(self, ok: bool, loss: Any = None) -> None:
        """Count steps with a non-finite update (each such update was dropped, never applied); stop after
        ``max_bad_steps`` in a row (the last good checkpoint stays)."""
        if ok:
            self._bad_steps = 0
            return
        self._bad_steps += 1
        log.warning("non-finite loss or gradient (loss=%s): update dropped, a bad step (%d in a row)",
                    loss, self._bad_steps)
        if self._bad_steps >= self.optim_settings.max_bad_steps:
            raise FloatingPointError(
                f"{self._bad_steps} non-finite steps in a row (optim.max_bad_steps). The last checkpoint holds the "
                "last good state; lower optim.lr, set model.dtype=fp32, or raise optim.max_bad_steps."
            )

    # ---- optimiser and checkpoints --------------------------------------------------------------------------------
    def _schedule_total(self) -> int:
        return max(1, int(self.trainer.max_steps or 1)) if self._trainer is not None else 1

    def configure_optimizers(self) -> Any:
        o = self.optim_settings
        opt = torch.optim.AdamW(self.trainable_parameters(), lr=o.lr, weight_decay=o.weight_decay)
        total, (shape, min_ratio) = self._schedule_total(), lr_shape(o)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, o.warmup_steps, total, min_ratio, shape))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep only trainable weights (the adapter, or all policy weights for full fine-tuning)."""
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["vpo_bad_steps"] = self._bad_steps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._bad_steps = checkpoint.get("vpo_bad_steps", 0)
