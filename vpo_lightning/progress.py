"""A progress bar that counts optimizer steps toward ``trainer.max_steps`` (RL runs have no meaningful epochs)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """Rich progress bar over the whole run: step / max_steps, reward, tokens/s, elapsed and ETA."""

    @property
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        return max_steps if max_steps and max_steps > 0 else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return "Training"

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.train_progress_bar_id is None:  # one bar for the whole run, not one per epoch
            super().on_train_epoch_start(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
