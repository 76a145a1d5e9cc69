"""benchmarks/gpu_check.py: its dry run (what needs no CUDA runs, the rest is skipped with a reason) and its parsers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

CUDA_CHECKS = {"fit_tiny_bf16_lora", "fit_tiny_qlora", "fit_tiny_fsdp_1gpu", "fit_tiny_ddp_2gpu", "fit_tiny_fsdp_2gpu",
               "generation_tiny", "scale_qwen2.5-1.5b", "scale_qwen2.5-7b"}


def _check_report(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True and report["dry_run_reason"]
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) >= CUDA_CHECKS, set(checks)
    for name in CUDA_CHECKS:  # every CUDA step is reported as skipped, with the reason
        assert checks[name]["status"] == "skipped" and "needs CUDA" in checks[name]["reason"], checks[name]
    assert checks["vllm_engine"]["status"] == "skipped" and "vLLM" in checks["vllm_engine"]["reason"]
    # issue 55's steps come first: the driver, the dtypes after setup, the shipped 24 GB recipes' plans
    names = [c["name"] for c in report["checks"]]
    assert names[0] == "driver" and checks["driver"]["status"] == "skipped"
    dtypes = [n for n in names if n.startswith("dtypes_")]
    assert "dtypes_32-true_bf16" in dtypes and "dtypes_32-true_bf16_qlora" in dtypes
    assert all(checks[n]["status"] == "skipped" and "needs CUDA" in checks[n]["reason"] for n in dtypes)
    for stem in ("tooluse_qwen7b_qlora", "musique", "eureqa", "livecodebench"):
        recipe = checks[f"recipe_{stem}"]
        assert recipe["status"] == "pass", recipe
        assert recipe["numbers"]["kv_tokens"] >= recipe["numbers"]["sequence_tokens"]
        assert names.index(f"recipe_{stem}") < names.index("fit_tiny_bf16_lora")
    assert names.index("vllm_engine") < names.index("fit_tiny_bf16_lora")
    for name in ("tests_default", "tests_slow"):
        assert checks[name]["status"] == "skipped" and checks[name]["reason"]
    assert checks["environment"]["status"] == "pass", checks["environment"]
    assert checks["environment"]["numbers"]["packages"]["torch"]
    # the plan of the 24 GB recipe on the real 7B shape: 7.6B parameters, under 24 GiB as the recipe claims
    plan7 = checks["plan_qwen2.5-7b"]
    assert plan7["status"] == "pass" and 7500 < plan7["numbers"]["params_m"] < 7700, plan7
    assert 0 < plan7["numbers"]["peak_gib"] < 24
    assert checks["plan_qwen2.5-1.5b"]["numbers"]["peak_gib"] < plan7["numbers"]["peak_gib"]
    statuses = [c["status"] for c in report["checks"]]
    assert report["summary"] == {s: statuses.count(s) for s in ("pass", "fail", "skipped")}
    md = (out / "report.md").read_text()
    assert "| fit_tiny_qlora | skipped |" in md and "## Not covered" in md
    return checks


def _time_box(signum, frame):
    raise TimeoutError(f"the --quick dry run took over {TIME_BOX} s")


TIME_BOX = 240  # seconds; measured 94 s alone on the shared 2-core machine at load ~14 (imports), far less in a run


def test_dry_run_reports_cuda_steps_skipped(tmp_path):
    """--quick dry run in-process (imports shared with the other tests): environment and plans run, CUDA is skipped."""
    out = tmp_path / "out"
    old = signal.signal(signal.SIGALRM, _time_box)
    signal.alarm(TIME_BOX)
    try:
        rc = gpu_check.main([str(out), "--dry-run", "--quick", "--work", str(tmp_path / "work")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert rc == 0
    checks = _check_report(out)
    assert checks["fit_tiny_cpu_harness"]["status"] == "skipped"
    # the config fed to both `vpo plan` and `vpo fit` is the recipe with the engine the lent machine can run
    config = Path(checks["plan_qwen2.5-7b"]["numbers"]["config"]).read_text()
    assert "TransformersEngine" in config and "load_in_4bit: true" in config
    assert (tmp_path / "work" / "models" / "qwen2.5-7b" / "config.json").is_file()
    assert not list((tmp_path / "work").rglob("*.safetensors"))  # no weights written without CUDA


@pytest.mark.slow
def test_dry_run_script_end_to_end(tmp_path):
    """benchmarks/gpu_check.sh as the lent machine runs it, here without CUDA: the CPU fit proves the harness."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "VPO_CACHE_DIR": str(tmp_path / "cache"),
           "GPU_WHEELS": "/nonexistent"}
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), str(out), "--dry-run", "--work",
                           str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = _check_report(out)
    harness = checks["fit_tiny_cpu_harness"]
    assert harness["status"] == "pass" and harness["numbers"]["steps_logged"] == 1, harness
    assert "fit_tiny_cpu_harness" in (out / "logs.txt").read_text()


def test_pytest_counts_reads_the_last_summary_line():
    text = "tests/test_a.py ..F\n===== 2 passed, 1 failed, 3 skipped, 4 deselected in 1.2s =====\n"
    assert gpu_check.pytest_counts(text) == {"passed": 2, "failed": 1, "skipped": 3, "deselected": 4}
    assert gpu_check.pytest_counts("!!! KeyboardInterrupt !!!\n1 error, 7 passed in 9s") == {"error": 1, "passed": 7}
    assert gpu_check.pytest_counts("no summary") == {}


def test_usage_error_without_outdir():
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_run_time_box_interrupts_and_logs(tmp_path):
    """A step past its time box gets SIGINT (pytest then prints its summary), returns 124 and says so in logs.txt."""
    import argparse
    import time

    args = argparse.Namespace(dry_run=True, budget=60)
    check = gpu_check.Check(tmp_path, tmp_path, args)
    t = time.monotonic()
    code = "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('interrupted cleanly')\n"
    rc, text, secs = check.run("sleeper", [sys.executable, "-c", code], timeout=2)
    assert rc == 124 and "interrupted cleanly" in text and "time box of 2s reached" in text
    assert time.monotonic() - t < 30
    assert "===== sleeper" in (tmp_path / "logs.txt").read_text()
