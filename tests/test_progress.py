"""What a run prints: Lightning's noise dropped, actionable lines kept, the earlier-run warning."""

from __future__ import annotations

import logging

import pytest

from vpo_lightning.progress import NoiseFilter, earlier_run_warning


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


def test_earlier_run_warning(tmp_path):
    assert earlier_run_warning(tmp_path, resuming=False) is None  # config.yaml alone is not an earlier run
    (tmp_path / "config.yaml").write_text("x")
    assert earlier_run_warning(tmp_path, resuming=False) is None
    for name in ("last.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt"):
        (tmp_path / name).write_text("x")
    msg = earlier_run_warning(tmp_path, resuming=False)
    assert msg == (f"{tmp_path} already holds checkpoints of an earlier run (last.ckpt, step=1.ckpt, step=2.ckpt and "
                   "1 more); this run overwrites them. Resume with --ckpt_path last, or start a separate run with "
                   "--run_name NAME.")
    assert earlier_run_warning(tmp_path, resuming=True) is None
