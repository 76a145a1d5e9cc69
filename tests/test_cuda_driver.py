"""requirements/check_cuda_driver.sh: refuses an NVIDIA driver too old for the CUDA lock, with what to do (issue 55).
A fake nvidia-smi on PATH stands in for the driver."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "requirements" / "check_cuda_driver.sh"


def _run(tmp_path: Path, driver: str | None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if driver is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{driver}'\n")
        smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)


def test_the_lock_is_cuda_13():  # the threshold below follows the lock's CUDA runtime
    assert "nvidia-cuda-runtime==13." in (REPO / "requirements" / "cuda.txt").read_text()


@pytest.mark.parametrize(("driver", "ok"), [("535.183.01", False), ("575.57.08", False), ("580.65.06", True),
                                            ("590.10", True)])
def test_driver_version_against_the_cuda_lock(tmp_path, driver, ok):
    proc = _run(tmp_path, driver)
    assert (proc.returncode == 0) == ok, proc
    if not ok:
        assert f"driver {driver} is too old" in proc.stderr and ">= 580" in proc.stderr
        assert "requirements/cpu.txt" in proc.stderr  # what to do instead


def test_no_driver_is_not_an_error(tmp_path):
    proc = _run(tmp_path, None)
    assert proc.returncode == 0 and "nothing to check" in proc.stdout


def test_vllm_extra_is_pinned_to_the_locked_torch():
    """vLLM pins an exact torch per release: a floating extra would replace the lock's hashed torch 2.13.0."""
    lines = (REPO / "pyproject.toml").read_text().splitlines()
    assert 'vllm = ["vllm==0.32.0"]' in lines  # the newest vLLM whose wheel requires torch==2.13.0
    assert "torch==2.13.0" in (REPO / "requirements" / "constraints-cuda.txt").read_text()
