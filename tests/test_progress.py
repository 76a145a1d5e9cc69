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



def test_the_bar_shows_what_a_step_is_doing(tmp_path, monkeypatch):
    """Issue 53: inside a step the bar's ``now`` field shows the rollout's chains and tokens, then the log-prob pass
    and each update; the step's end clears it."""
    from pathlib import Path

    from vpo_lightning.launcher import main
    from vpo_lightning.training.progress import StepProgressBar

    shown: list[dict] = []
    original = StepProgressBar.get_metrics

    def recording(self, trainer, pl_module):  # what the bar is given to draw, each time it is redrawn
        items = original(self, trainer, pl_module)
        shown.append(dict(items))
        return items

    monkeypatch.setattr(StepProgressBar, "get_metrics", recording)
    monkeypatch.chdir(tmp_path)
    data = Path(__file__).resolve().parents[1] / "data/tooluse/val.jsonl"
    main(["fit", "--config", str(Path(__file__).resolve().parents[1] / "configs/debug.yaml"),
          f"--data.train_files=[{data}]", "--data.val_files=null", "--trainer.max_steps=1"])
    phases = [m["now"] for m in shown if "now" in m]
    assert phases[0] == "rollout 0/8 chains, 8 tok", phases  # after the first decoded token of 2 x 4 chains
    assert phases[-3:] == ["log-probs", "update 1/2", "update 2/2"], phases
    last_rollout = [p for p in phases if p.startswith("rollout")][-1]
    assert last_rollout.startswith("rollout 8/8 chains, "), phases
    assert "now" not in shown[-1]  # the finished step's bar: reward, parsed, tok/s only
