"""benchmarks/run_summary.py: first/last-N means of a run's logged scalars, exact on hand-written event files."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import run_summary  # noqa: E402


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
