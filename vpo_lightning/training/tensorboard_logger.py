"""The TensorBoard logger of ``vpo fit`` and ``vpo sft``: Lightning's, without the tags that say nothing.

Lightning adds ``epoch`` to every dict logged, training and validation alike. Here it is the number of whole passes
over the training prompts, a function of the step (``step * data.batch_size // prompts``), so the tag
repeats the x axis in a coarser unit. ``hp_metric`` (a constant -1 unless a metric is named) is off by default.
The tags a run logs are listed in docs/TRAINING.md ("Logged metrics").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger


class TensorBoardLogger(LightningTensorBoardLogger):
    """``lightning.pytorch.loggers.TensorBoardLogger`` without the ``epoch`` tag and, by default, ``hp_metric``."""

    def __init__(self, save_dir: str, *args: Any, default_hp_metric: bool = False, **kwargs: Any) -> None:
        super().__init__(save_dir, *args, default_hp_metric=default_hp_metric, **kwargs)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics({k: v for k, v in metrics.items() if k != "epoch"}, step)
