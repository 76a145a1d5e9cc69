"""benchmarks/run_summary.py: first/last-N means of a run's logged scalars, exact on hand-written event files."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import run_summary


def _write(run: Path, values: dict[str, list[tuple[int, float]]], mtime: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run))
    for tag, points in values.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    newest = max(run.glob("events.out.tfevents.*"), key=lambda f: f.stat().st_mtime_ns)
    os.utime(newest, (mtime, mtime))


def test_first_and_last_means_and_resumed_steps(tmp_path):
    now = time.time()
    _write(tmp_path, {"train/kl": [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)], "train/reward/exit": [(0, 0.5)],
                      "val/kl": [(0, 9.0)], "train/grad_norm": [(0, 7.0)]}, now - 100)
    time.sleep(0.01)
    _write(tmp_path, {"train/kl": [(3, 10.0), (4, 20.0)]}, now)  # a resumed run re-logs step 3
    rows = run_summary.summarise(run_summary.read_scalars(tmp_path), ("kl", "reward/"), first=2, last=2)
    assert rows == [("train/kl", 5, pytest.approx(1.5), pytest.approx(15.0)),
                    ("train/reward/exit", 1, pytest.approx(0.5), pytest.approx(0.5))]


def test_missing_event_files_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no TensorBoard event files"):
        run_summary.read_scalars(tmp_path)


# The other readers of the same files go through vpo_lightning.commands.runs.read_scalars too.
def test_training_tokens_counts_steps_before_the_checkpoint(tmp_path):
    from vpo_lightning.commands.evaluate import training_tokens

    run = tmp_path / "run"
    _write(run, {"train/rollout/tokens": [(0, 10.0), (1, 20.0), (2, 30.0), (3, 40.0)]}, time.time())
    (run / "adapters" / "last").mkdir(parents=True)
    assert training_tokens(str(run / "adapters" / "last"), None) == {
        "log_dir": str(run), "optimizer_steps": 4, "logged_steps": 4, "generated_tokens": 100}
    assert training_tokens(str(run / "step=2.ckpt"), None) == {
        "log_dir": str(run), "optimizer_steps": 2, "logged_steps": 2, "generated_tokens": 30}
    assert training_tokens(str(tmp_path / "elsewhere" / "x.ckpt"), None) is None


def test_gpu_check_reads_nested_event_files_in_step_order(tmp_path):
    import gpu_check

    now = time.time()
    _write(tmp_path / "a", {"train/loss": [(1, 2.0), (0, 1.0)]}, now - 100)
    _write(tmp_path / "b", {"train/loss": [(1, 5.0), (2, 3.0)]}, now)  # resumed: step 1 again, the later file wins
    assert gpu_check.tb_scalars(tmp_path) == {"train/loss": [1.0, 5.0, 3.0]}
