"""benchmarks/vs_trl_sft.py gives TRL's SFTTrainer the job `vpo sft` runs: the config's LoRA, optimiser and batch,
the demonstrations `vpo sft` streams, loss on the same tokens (the completions, EOS included) and the same learning
rate at every step. The last test asks TRL itself (in benchmarks/.venv-trl) what it would train on."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import vs_trl
import vs_trl_sft

from vpo_lightning.sft.data import SFTDataModule, pack_examples


def _demo_file(path: Path, count: int = 16) -> Path:
    """Ready-made demonstrations (ours: messages + completion) of varied lengths."""
    with path.open("w") as fh:
        for i in range(count):
            row = {"id": f"d{i}", "messages": [{"role": "user", "content": f"question {i}: " + "why " * (i % 5)}],
                   "completion": f"<think> {'because ' * (1 + i % 7)}</think> answer {i}"}
            fh.write(json.dumps(row) + "\n")
    return path


def _spec(tmp_path: Path, steps: int = 2) -> dict:
    """The tooluse recipe on the tiny model over a small demonstration file; rows of 64 tokens, so that packing
    spreads a batch over several rows."""
    data = {"train_files": [str(_demo_file(tmp_path / "demos.jsonl"))], "builder": "none", "formats": [1],
            "val_fraction": 0.0, "max_prompt_tokens": 0, "max_completion_tokens": 0, "max_tokens_per_row": 64}
    return vs_trl_sft.make_spec(vs_trl_sft.DEFAULT_CONFIG, model="tiny-llama", steps=steps, data=data)


def test_trl_gets_the_configs_job(in_repo):
    job = vs_trl_sft.recipe(vs_trl_sft.DEFAULT_CONFIG)
    model, optim, data = job["model"], job["optim"], job["data"]
    assert (model["name"], model["gradient_checkpointing"], model["attn_implementation"]) == ("smollm2-135m", True,
                                                                                           "sdpa")
    assert (model["lora"]["r"], model["lora"]["alpha"], model["lora"]["target_modules"]) == (16, 32, "all-linear")
    assert (optim["lr"], optim["warmup_steps"], optim["schedule"], optim["min_lr_ratio"]) == (5e-4, 5, "linear", 0.1)
    assert (job["schedule_steps"], data["batch_size"], data["max_tokens_per_row"]) == (60, 8, 1024)
    assert data["tokenizer"] == "smollm2-135m"  # the CLI's link, set by hand

    trl = vs_trl_sft.trl_config_args({**job, "steps": 5, "trl_mode": "padding_free", "batches": [[{}] * 8]})
    assert (trl["per_device_train_batch_size"], trl["gradient_accumulation_steps"], trl["max_steps"]) == (8, 1, 5)
    assert (trl["learning_rate"], trl["weight_decay"], trl["max_grad_norm"]) == (
        optim["lr"], optim["weight_decay"], optim["max_grad_norm"])
    assert trl["gradient_checkpointing"] and trl["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert trl["padding_free"] and not trl["packing"] and trl["completion_only_loss"] and trl["max_length"] is None
    assert trl["train_sampling_strategy"] == "sequential" and not trl["shuffle_dataset"]  # our order
    adamw = inspect.signature(torch.optim.AdamW).parameters  # ours: torch.optim.AdamW(lr, weight_decay)
    assert trl["optim"] == "adamw_torch" and (trl["adam_beta1"], trl["adam_beta2"]) == adamw["betas"].default
    assert trl["adam_epsilon"] == adamw["eps"].default


def test_trl_rows_put_the_loss_on_the_tokens_vpo_sft_learns(tiny_model_dir, in_repo, tmp_path):
    spec = _spec(tmp_path)
    rows = vs_trl_sft.trl_rows(spec["batches"])
    dm = SFTDataModule(**spec["data"])
    dm.setup("fit")
    stream = iter(dm.train_stream)
    assert [[e["id"] for e in b] for b in spec["batches"]] == [[e["id"] for e in next(stream)["records"]]
                                                               for _ in range(2)]  # vpo sft's order
    assert len(rows) == 2 * 8
    for batch, start in zip(spec["batches"], (0, 8)):
        ours = pack_examples(batch, spec["data"]["max_tokens_per_row"])
        assert len(ours) > 1  # several packed rows
        # TRL's rule: labels = input_ids where completion_mask, else -100; position t predicts label t + 1
        trl_targets = []
        for row in rows[start : start + len(batch)]:
            labels = [t if m else -100 for t, m in zip(row["input_ids"], row["completion_mask"])]
            trl_targets += [t for t in labels[1:] if t != -100]
        assert trl_targets == [t for e in batch for t in e["completion_ids"]]  # every completion token, EOS too
        assert sorted(trl_targets) == sorted(t for r in ours for t in r["targets"].tolist())
        assert sum(r["input_ids"].shape[1] for r in ours) == sum(len(r["input_ids"]) for r in rows[start:start + 8])


def test_seed_lora_gives_one_start_whatever_came_before(tiny_model_dir):
    from vpo_lightning.generation.models import LoraSettings, ModelSettings, load_policy

    settings = ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(r=4, alpha=8))
    sums = []
    for draws in (0, 7):
        torch.manual_seed(draws)
        torch.rand(draws)  # a different RNG history on each side
        policy, _ = load_policy(settings, reference=False)
        sums.append(vs_trl_sft.seed_lora(policy, seed=0))
        weights = {n: p for n, p in policy.named_parameters() if "lora_" in n}
        assert all(float(p.detach().abs().sum()) == 0 for n, p in weights.items() if ".lora_B." in n)
        assert all(float(p.detach().abs().sum()) > 0 for n, p in weights.items() if ".lora_A." in n)
    assert sums[0] == sums[1] > 0


def _our_lrs(spec: dict) -> list[float]:
    """The learning rate of each step under SFTModule's own optimiser and scheduler."""
    from vpo_lightning.sft.module import SFTModule, SFTOptimSettings

    module = SFTModule(optim=SFTOptimSettings(**spec["optim"]))
    module.policy = torch.nn.Linear(2, 2)
    module._trainer = SimpleNamespace(max_steps=spec["schedule_steps"])  # what the schedule's length is read from
    setup = module.configure_optimizers()
    opt, sched = setup["optimizer"], setup["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(spec["schedule_steps"]):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.slow
@pytest.mark.skipif(not vs_trl.TRL_PYTHON.exists(), reason="needs benchmarks/.venv-trl (benchmarks/setup_trl.sh)")
def test_trl_trains_on_our_tokens_with_our_schedule_and_start(tiny_model_dir, in_repo, tmp_path):
    from vpo_lightning.generation.models import ModelSettings, load_policy

    spec = _spec(tmp_path)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(vs_trl.TRL_PYTHON), "benchmarks/vs_trl_sft.py", "--worker", "trl-check", "--spec",
                           str(tmp_path / "spec.json"), "--result", str(tmp_path / "trl.json")],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trl = json.loads((tmp_path / "trl.json").read_text())
    first = spec["batches"][0]
    assert trl["targets"] == [t for e in first for t in e["completion_ids"]]  # TRL's first batch: our first batch
    ours = pack_examples(first, spec["data"]["max_tokens_per_row"])
    assert len(trl["targets"]) == sum(r["targets"].numel() for r in ours)
    assert trl["lrs"] == pytest.approx(_our_lrs(spec), rel=1e-12)
    assert trl["lrs"][0] < trl["lrs"][5] and trl["lrs"][-1] < trl["lrs"][5]  # warm-up, then the decay
    policy, _ = load_policy(ModelSettings(**spec["model"]), reference=False)
    assert vs_trl_sft.seed_lora(policy, spec["seed"]) == pytest.approx(trl["lora_checksum"], rel=1e-12)
    assert sum(p.numel() for p in policy.parameters() if p.requires_grad) == trl["trainable_params"]
