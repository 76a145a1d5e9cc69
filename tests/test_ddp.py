"""More than one process: Lightning DDP on CPU (gloo) with two ranks, on the tiny model (slow tier)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_reliability import HELPERS, _scalars

REPO = Path(__file__).resolve().parents[1]
DATA = str(REPO / "data/tooluse/val.jsonl")


def _command(cwd: Path, run: str, *extra: str) -> list[str]:
    # The random tiny model never writes tagged answers, so real rewards would all be 0 (no update to compare): the
    # tagging engine and text rewards of tests/test_reliability.py give non-zero advantages from its own samples.
    (cwd / "ddp_helpers.py").write_text(HELPERS)
    return [sys.executable, "-m", "vpo_lightning", "fit", "--config", str(REPO / "configs/debug.yaml"),
            f"--run_name={run}", f"--data.train_files=[{DATA}]", "--data.val_files=null",
            "--trainer.limit_val_batches=0", "--rollout.engine=ddp_helpers.TaggingEngine",
            "--rollout.rewards=[ddp_helpers.length,ddp_helpers.letters]", "--model.optim.lr=1e-3",
            "--rollout.save_completions=true", "--rollout.engine.init_args.per_prompt_seed=true",
            "--rollout.log_samples_every=0", "--trainer.accelerator=cpu", *extra]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def _fit(cwd: Path, run: str, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_command(cwd, run, *extra), cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _seen(run_dir: Path, rank: int) -> list[tuple[int, int]]:
    rows = [json.loads(x) for x in (run_dir / "completions" / f"rank{rank}.jsonl").read_text().splitlines()]
    return sorted({(r["step"], r["index"]) for r in rows})


@pytest.mark.slow
def test_two_ranks_see_disjoint_prompts_and_stay_in_sync(tmp_path):
    proc = _fit(tmp_path, "ddp2", "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_steps=2",
                "--data.batch_size=1")
    run = tmp_path / "checkpoints" / "ddp2"
    r0, r1 = _seen(run, 0), _seen(run, 1)
    assert r0 and r1 and not {i for _, i in r0} & {i for _, i in r1}, (r0, r1)
    assert "trainable weights identical on all 2 ranks" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_one_rank_batch_2b_equals_two_ranks_batch_b(tmp_path):
    """The first update of 1 rank x 2 prompts equals that of 2 ranks x 1 prompt (tolerance: 1e-5 absolute).

    With one update per rollout: with ``mini_batches`` = 2 each rank splits its own prompts, so one rank's first
    update sees prompt 1 while two ranks' sees half of each prompt's group, a different (equally valid) update."""
    common = ("--trainer.max_steps=1", "--checkpoint.every_n_train_steps=1", "--model.optim.mini_batches=1")
    _fit(tmp_path, "one", "--trainer.devices=1", "--data.batch_size=2", *common)
    _fit(tmp_path, "two", "--trainer.devices=2", "--trainer.strategy=ddp", "--data.batch_size=1", *common)
    one = tmp_path / "checkpoints" / "one"
    two = tmp_path / "checkpoints" / "two"
    assert sorted(i for _, i in _seen(one, 0)) == sorted(i for _, i in _seen(two, 0) + _seen(two, 1))
    a = load_file(one / "adapters" / "last" / "adapter_model.safetensors")
    b = load_file(two / "adapters" / "last" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)
    # LoRA B starts at zero: non-zero B weights mean the update really happened in both runs
    assert any("lora_B" in k and a[k].abs().sum() > 0 for k in a)


@pytest.mark.slow
def test_token_budget_counts_all_ranks_and_stops_them_together(tmp_path):
    """rollout.max_generated_tokens counts the tokens of all ranks. The random tiny model (almost) never samples EOS, so
    each rank generates 1 prompt x G=4 x 24 = 96 tokens a step: a budget of 150 is crossed after step 1 only when both
    ranks' tokens count (per rank it would take 2 steps), and both ranks must stop together (a rank that stopped alone
    would leave the other blocked in its next all-reduce until the timeout)."""
    _fit(tmp_path, "budget", "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_steps=6",
         "--data.batch_size=1", "--checkpoint.every_n_train_steps=6", "--rollout.max_generated_tokens=150")
    ckpt = torch.load(tmp_path / "checkpoints" / "budget" / "last.ckpt", weights_only=False)
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("RolloutCallback")]
    assert ckpt["global_step"] == 1 and 150 <= state["generated_tokens"] <= 192, (ckpt["global_step"], state)
    assert [len(_seen(tmp_path / "checkpoints" / "budget", r)) for r in (0, 1)] == [1, 1]


# Two ranks, 6 steps of one prompt each, no periodic checkpoint: only SIGTERM's last.ckpt.
SIGTERM_ARGS = ("--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_steps=6", "--data.batch_size=1",
                "--checkpoint.every_n_train_steps=50")
SIGTERM_WAIT_S = 120  # from the signal to the exit of every process; more is a hang (the bug this guards against)


def _sigterm_at(cwd: Path, pause: str, group: bool, *extra: str) -> str:
    """Run 2 ranks until they park at ``pause`` (``VPO_TEST_PAUSE_AT``, for 1 s), then SIGTERM the main process or,
    with ``group``, every process of the job (systemd's KillMode=control-group, ``kill -TERM -<pgid>``, a shell's job
    control). Expect exit code 143 and no process of the job left within ``SIGTERM_WAIT_S``; the run's output."""
    marker, log_path = cwd / "paused", cwd / "vpo.log"
    marker.unlink(missing_ok=True)
    env = _env(VPO_TEST_PAUSE_AT=pause, VPO_TEST_PAUSE_FILE=str(marker), VPO_TEST_PAUSE_S="1")
    with log_path.open("a") as log:
        log.write(f"\n===== SIGTERM to the {'process group' if group else 'main process'} at {pause}\n")
        log.flush()
        proc = subprocess.Popen(_command(cwd, "ddp", *SIGTERM_ARGS, *extra), cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # its own process group
        try:
            deadline = time.monotonic() + 600
            while not marker.exists():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(0.05)
            if group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                os.kill(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + SIGTERM_WAIT_S
            try:
                code = proc.wait(timeout=SIGTERM_WAIT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"no exit {SIGTERM_WAIT_S} s after SIGTERM at {pause}:\n{log_path.read_text()[-4000:]}")
            assert code == 143, log_path.read_text()[-4000:]
            while _group_alive(proc.pid):  # rank 1 must not be left behind, blocked in a collective
                assert time.monotonic() < deadline, f"rank 1 still running after SIGTERM at {pause}"
                time.sleep(0.1)
        finally:
            if _group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return log_path.read_text()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _step(run: Path) -> int:
    return torch.load(run / "last.ckpt", weights_only=False, map_location="cpu")["global_step"]


@pytest.mark.slow
def test_sigterm_to_every_rank_saves_last_exits_143_and_resumes(tmp_path):
    """SIGTERM to the whole process group (each rank gets it, rank 1 twice: from the kill and from rank 0): during
    step 2's rollout the ranks stop together and last.ckpt holds step 2 (as of the end of step 1); during step 3's
    update the step finishes on both and last.ckpt holds step 4; then --ckpt_path last trains to max_steps, each
    step logged once."""
    run = tmp_path / "checkpoints" / "ddp"
    out = _sigterm_at(tmp_path, "generate@2", True)
    assert _step(run) == 2 and "writing last.ckpt as of the end of step 1" in out
    assert not list(run.glob("*.tmp")) and (run / "adapters" / "last").is_dir()
    _sigterm_at(tmp_path, "optimizer_step@3", True, "--ckpt_path=last")
    assert _step(run) == 4
    _fit(tmp_path, "ddp", *SIGTERM_ARGS, "--ckpt_path=last")
    assert _step(run) == 6
    assert {s: len(v) for s, v in _scalars(run, "train/loss").items()} == dict.fromkeys(range(6), 1)


@pytest.mark.slow
def test_sigterm_to_the_main_process_stops_both_ranks_and_resumes(tmp_path):
    """SIGTERM to the main process only (rank 0 forwards it to rank 1) during step 2's rollout: last.ckpt holds step
    2, and --ckpt_path last trains to max_steps."""
    run = tmp_path / "checkpoints" / "ddp"
    _sigterm_at(tmp_path, "generate@2", False)
    assert _step(run) == 2
    _fit(tmp_path, "ddp", *SIGTERM_ARGS, "--ckpt_path=last")
    assert _step(run) == 6


@pytest.mark.slow
def test_sigterm_to_every_rank_during_validation_saves_the_step_before(tmp_path):
    """SIGTERM to the process group during the first in-loop validation rollout (after steps 0 and 1): the ranks
    finish that validation batch, agree after it, write last.ckpt of step 2 together and exit 143; resumed, the run
    trains to max_steps. (4 validation prompts, 1 per batch: each rank has its own.)"""
    run = tmp_path / "checkpoints" / "ddp"
    val = (f"--data.val_files=[{DATA}]", "--data.max_val_prompts=4", "--data.val_batch_size=1",
           "--trainer.limit_val_batches=2", "--trainer.val_check_interval=2", "--trainer.num_sanity_val_steps=0")
    out = _sigterm_at(tmp_path, "generate@-1", True, *val)
    assert _step(run) == 2 and "SIGTERM received during validation: writing last.ckpt as of step 2" in out
    _fit(tmp_path, "ddp", *SIGTERM_ARGS, *val, "--ckpt_path=last")
    assert _step(run) == 6
    assert {s: len(v) for s, v in _scalars(run, "train/loss").items()} == dict.fromkeys(range(6), 1)
