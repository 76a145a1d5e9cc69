"""What a run prints: Lightning's noise dropped, actionable lines kept (earlier runs: tests/test_artifacts.py)."""

from __future__ import annotations

import logging

import pytest

from vpo_lightning.training.progress import NoiseFilter


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("lightning.pytorch.utilities.rank_zero", logging.INFO, __file__, 1, message, None, None)


@pytest.mark.parametrize(("message", "kept"), [
    ("GPU available: False, used: False", False),
    ("TPU available: False, using: 0 TPU cores", False),
    ("HPU available: False, using: 0 HPUs", False),
    ("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](...)", False),
    ("`Trainer(limit_val_batches=1)` was configured so 1 batch will be used.", False),
    ("`Trainer(val_check_interval=1.0)` was configured so validation will run at the end of the training epoch..",
     False),
    ("GPU available: True (cuda), used: False", True),  # the user can act on this one
    ("`Trainer.fit` stopped: `max_steps=2` reached.", True),
    ("Seed set to 0", True),
])
def test_noise_filter_drops_only_lines_without_an_action(message, kept):
    assert NoiseFilter().filter(_record(message)) is kept

