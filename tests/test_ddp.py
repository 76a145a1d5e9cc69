"""More than one process: Lightning DDP on CPU (gloo) with two ranks, on the tiny model (slow tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_reliability import HELPERS

REPO = Path(__file__).resolve().parents[1]
DATA = str(REPO / "data/tooluse/val.jsonl")


def _fit(cwd: Path, run: str, *extra: str) -> subprocess.CompletedProcess:
    # The random tiny model never writes tagged answers, so real rewards would all be 0 (no update to compare): the
    # tagging engine and text rewards of tests/test_reliability.py give non-zero advantages from its own samples.
    (cwd / "ddp_helpers.py").write_text(HELPERS)
    cmd = [sys.executable, "-m", "vpo_lightning", "fit", "--config", str(REPO / "configs/debug.yaml"),
           f"--run_name={run}", f"--data.train_files=[{DATA}]", "--data.val_files=null",
           "--trainer.limit_val_batches=0", "--rollout.engine=ddp_helpers.TaggingEngine",
           "--rollout.rewards=[ddp_helpers.length,ddp_helpers.letters]", "--model.optim.lr=1e-3",
           "--rollout.save_completions=true", "--rollout.engine.init_args.per_prompt_seed=true",
           "--rollout.log_samples_every=0", "--trainer.accelerator=cpu", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
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
