"""``PolicyModule``: what the two LightningModules share, ``VPOModule`` (``vpo fit``) and ``SFTModule`` (``vpo sft``).

One trainable policy (LoRA by default) loaded in ``configure_model`` (idempotent), manual optimisation with AdamW
over its trainable weights and a per-step learning-rate schedule (linear warm-up, then :meth:`lr_factor`), the clipped
step and the guard that drops non-finite updates and stops after ``optim.max_bad_steps`` bad steps in a row, the
log-probs of packed rows (:func:`packed_logprobs`), and checkpoints that hold only the trainable weights (the
adapter) with the guard's count.
"""

from __future__ import annotations

import logging
import math
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor, nn

from vpo_lightning.core.losses import per_token_logprobs
from vpo_lightning.generation.attention import uses_vpo_attention
from vpo_lightning.generation.models import ModelSettings, count_parameters, load_policy, load_tokenizer

log = logging.getLogger(__name__)


def peak_rss_gb() -> float:
    """Peak resident memory of this process, GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


@dataclass
class PolicyOptimSettings:
    """The optimiser settings every policy module has: AdamW, a linear warm-up, then a constant learning rate or a
    linear or cosine decay; gradient clipping and the non-finite guard. ``vpo fit``'s :class:`OptimSettings` and
    ``vpo sft``'s ``SFTOptimSettings`` extend it (and set their own defaults).

    Args:
        lr: learning rate; LoRA wants ~1e-5..1e-4 (full fine-tuning ~1e-6).
        weight_decay: AdamW weight decay (the reference's 0.01).
        warmup_steps: linear warm-up steps.
        schedule: after the warm-up: constant (the reference's), or a linear or cosine decay to ``min_lr_ratio`` x lr
            at trainer.max_steps (TRL's lr_scheduler_type).
        min_lr_ratio: the learning rate at the last step, as a fraction of lr, for the linear and cosine schedules.
        max_grad_norm: gradient clipping norm (0 = off).
        logprob_chunk_size: positions per chunk of the log-softmax over the vocabulary (memory knob).
        max_bad_steps: stop with an error after this many non-finite steps in a row.
    """

    lr: float = 5e-5
    weight_decay: float = 0.01
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    logprob_chunk_size: int = 1024
    max_bad_steps: int = 3


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


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder stack and the output head of a causal LM (through a PEFT wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def packed_logprobs(model: nn.Module, row: dict[str, Tensor], chunk_size: int = 1024, temperature: float = 1.0,
                    entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probs of the completion tokens of one packed row, ``[prompt | c_1 | ... | c_n]``, from a
    chunked pass over the hidden states: ``gather`` ``[n, L]`` holds the positions whose state predicts each
    completion token, ``targets`` ``[n, L]`` the tokens. The RL step's micro-batches (``core/packing.py``) and the
    SFT rows (``sft/data.py``) both take this path."""
    decoder, head = decoder_and_head(model)
    # under SDPA, attention runs per segment (vpo_lightning.generation.attention): the prompt once, then each
    # completion against [prompt | itself], instead of every pair of the row under the block mask
    segments = row["segments"].tolist() if "segments" in row and uses_vpo_attention(decoder) else None
    extra = {"vpo_segments": (segments[0], segments[1:])} if segments else {}
    hidden = decoder(input_ids=row["input_ids"], attention_mask=row["attention_mask"],
                     position_ids=row["position_ids"], use_cache=False, **extra).last_hidden_state  # [1, T, H]
    hidden = hidden[0, row["gather"]]  # [n, L, H] the state that predicts each completion token
    return per_token_logprobs(hidden, head, row["targets"], chunk_size=chunk_size, temperature=temperature,
                              return_entropy=entropy)


class PolicyModule(L.LightningModule):
    """The trainable policy, its optimiser, the non-finite guard and adapter-only checkpoints.

    Subclasses call ``self.save_hyperparameters()`` in their own ``__init__`` (it records the caller's arguments).
    ``optim`` is a :class:`PolicyOptimSettings` (a subclass of it: ``vpo fit``'s and ``vpo sft``'s).
    """

    needs_reference = True  # full fine-tuning keeps a frozen copy of the base (the KL's reference)

    def __init__(self, model: ModelSettings, optim: PolicyOptimSettings) -> None:
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

    def _clipped_step(self, step: Callable[[], Any], allowed: bool = True) -> tuple[bool, float]:
        """Clip the gradients to ``optim.max_grad_norm`` (0 = off), call ``step()`` only when ``allowed`` and their
        norm is finite (a non-finite update is dropped, never applied), then clear them. Returns (stepped, norm)."""
        norm = float(torch.nn.utils.clip_grad_norm_(self.trainable_parameters(),
                                                    self.optim_settings.max_grad_norm or float("inf")))
        ok = allowed and math.isfinite(norm)
        if ok:
            step()
        self.optimizers().zero_grad(set_to_none=True)
        return ok, norm

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
