"""MuSiQue, EUREQA and LiveCodeBench end to end (slow tier): build the splits from the hand-made public-shape records,
train 2 steps on the tiny model with each shipped VPO config (GPU settings swapped for CPU ones), then `vpo eval` the
checkpoint and find each task's primary number in eval.json."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch

from vpo_lightning.launcher import main as vpo

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "public"
DIMS = {"musique": ["hop_1", "hop_2", "hop_3", "hop_4", "answer_f1"],
        "eureqa": [f"entity_{x}" for x in "ABCDE"],
        "livecodebench": [f"test_{i}" for i in range(16)]}
CPU = ["--model.model.name=tiny-llama", "--model.model.dtype=fp32", "--model.model.load_in_4bit=false",
       "--model.model.lora.r=4", "--model.model.lora.alpha=8", "--trainer.accelerator=cpu",
       "--trainer.precision=32-true", "--rollout.engine=vpo_lightning.generation.engines.TransformersEngine",
       "--rollout.group_size=4", "--rollout.sampling.max_new_tokens=24", "--data.batch_size=2",
       "--model.optim.micro_batch_size=8", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
       "--data.val_files=null", "--checkpoint.every_n_train_steps=1", "--run_name=e2e"]


def _build(task: str, out: Path) -> None:
    import importlib

    build = importlib.import_module(f"vpo_lightning.tasks.{task}.build")
    extra = ["--per_hop", "1", "--val_per_hop", "1"] if task == "musique" else []
    assert build.main(["--source", str(FIXTURES / task), "--out", str(out), *extra]) == 0


def _scalars(run: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[float]] = {}
    for f in sorted(glob.glob(str(run / "events.out.tfevents.*"))):
        acc = EventAccumulator(f)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", ["musique", "musique_grpo", "eureqa", "livecodebench"])
def test_task_trains_two_steps_and_evaluates(config, tmp_path, monkeypatch, tiny_model_dir):
    task = config.removesuffix("_grpo")
    monkeypatch.chdir(tmp_path)
    _build(task, tmp_path / "data")
    vpo(["fit", "--config", str(REPO / "configs" / f"{config}.yaml"),
         f"--data.train_files=[{tmp_path / 'data' / 'train.jsonl'}]", *CPU])
    run = tmp_path / "checkpoints" / "e2e"
    assert torch.load(run / "last.ckpt", weights_only=False)["global_step"] == 2
    scalars = _scalars(run)
    for dim in DIMS[task]:
        assert f"train/reward/{dim}" in scalars, sorted(scalars)
    assert len(scalars["train/loss"]) == 2 and all(map(torch.isfinite, map(torch.tensor, scalars["train/loss"])))

    out = tmp_path / "eval"
    vpo(["eval", "--ckpt", str(run / "last.ckpt"), "--data_file", str(tmp_path / "data" / "test.jsonl"), "--n", "6",
         "--max_prompts", "2", "--max_prompt_tokens", "0", "--out", str(out),
         "--set", "rollout.sampling.max_new_tokens=16"])
    report = json.loads((out / "eval.json").read_text())
    agg = report["aggregate"]
    assert report["dim_names"] == DIMS[task] and report["num_prompts"] == 2
    assert (report["estimator"], report["m"]) == (("grpo", 1) if config.endswith("_grpo") else ("vpo", 3))
    assert report["f_weights"] == ([1.0, 1.0, 1.0, 1.0, 3.0] if task == "musique" else [1.0] * len(DIMS[task]))
    primary = {"musique": agg["expected_best_weighted"], "eureqa": agg["best_at_k"][-1],
               "livecodebench": agg["pass_at_k"][-1]}[task]
    assert 0.0 <= primary <= 1.0 and len(agg["best_at_k"]) == 6
    assert agg["reward_errors"] == 0
