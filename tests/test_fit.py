"""`vpo fit` end to end: the debug config (default tier), resume from last, and the embedded model (slow)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch

from vpo_lightning.launcher import main

REPO = Path(__file__).resolve().parents[1]


def _fit(tmp_path: Path, monkeypatch, *extra: str) -> Path:
    monkeypatch.chdir(tmp_path)
    data = str(REPO / "data/tooluse/val.jsonl")
    main(["fit", "--config", str(REPO / "configs/debug.yaml"), f"--data.train_files=[{data}]",
          f"--data.val_files=[{data}]", *extra])
    return tmp_path / "checkpoints" / "debug"


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(glob.glob(str(run / "events.out.tfevents.*"))):
        ea = EventAccumulator(f)
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in ea.Scalars(tag))
    return out


# What a normal run must not print: Lightning lines with nothing to act on (issue: a user's first hour).
NOISE = ("Tip:", "litlogger", "TPU available", "GPU available: False", "was configured so",
         "exists and is not empty", "LeafSpec", "Warning", "warn(", "Loading weights")


def test_debug_fit_logs_checkpoints_and_resumes(tmp_path, monkeypatch, capfd):
    run = _fit(tmp_path, monkeypatch)
    printed = "".join(capfd.readouterr())
    assert "reward: " in printed and "parsed: " in printed and "tok/s: " in printed  # the bar, not cut at 80
    assert not [n for n in NOISE if n in printed], [line for line in printed.splitlines() if any(n in line
                                                                                                for n in NOISE)]
    assert (run / "config.yaml").is_file() and (run / "last.ckpt").is_file()
    scalars = _scalars(run)
    for tag in ("train/reward/format", "train/reward/arg_value", "train/reward/set", "train/kl", "train/clip_frac",
                "train/entropy", "train/frac_zero_std_groups", "train/chains/parse_rate", "train/rollout/tokens_per_s",
                "train/peak_rss_gb", "train/diversity/within_group", "val/reward/format", "train/reward/all/mean",
                "train/reward/parsed/mean", "train/reward/all/format", "train/chains/candidate_parse_rate"):
        assert tag in scalars, f"{tag} not logged; have {sorted(scalars)}"
    assert "train/reward/mean" not in scalars  # renamed: its name did not say it skipped unparsed candidates
    assert "train/lr" in scalars and not {"lr-AdamW", "hp_metric"} & set(scalars)  # issue 53: no duplicate tags
    # the transformers engine's decode loop reports its log-probs: the train/inference gap is logged, and small
    assert scalars.get("train/engine_logprob_gap"), f"no engine gap logged; have {sorted(scalars)}"
    assert all(0.0 <= gap < 0.5 for _, gap in scalars["train/engine_logprob_gap"])
    for (_, every), (_, parsed), (_, rate) in zip(scalars["train/reward/all/mean"], scalars["train/reward/parsed/mean"],
                                                  scalars["train/chains/candidate_parse_rate"]):
        assert every == pytest.approx(parsed * rate, abs=1e-6)
    ckpt = torch.load(run / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 2
    assert all("lora_" in k for k in ckpt["state_dict"])  # only the adapter is stored
    assert ckpt["PromptDataModule"]["position"] == 2

    from peft import PeftModel

    from vpo_lightning.generation.models import ModelSettings, load_base_model

    base = load_base_model(ModelSettings(name="tiny-llama", dtype="fp32"))
    PeftModel.from_pretrained(base, str(run / "adapters" / "last"))  # standard PEFT format

    _fit(tmp_path, monkeypatch, "--trainer.max_steps=3", "--ckpt_path=last")
    ckpt = torch.load(run / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 3 and ckpt["PromptDataModule"]["position"] == 3
    steps = [s for s, _ in _scalars(run)["train/loss"]]
    assert sorted(steps) == [0, 1, 2], steps  # the resumed run logged only the new step


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="nothing to resume"):
        _fit(tmp_path, monkeypatch, "--ckpt_path=last")


@pytest.mark.slow
def test_embedded_model_fit_few_steps(tmp_path, monkeypatch):
    """The embedded SmolLM2-135M, G = 8, m = 3, a few steps: logs, saves a reloadable adapter, resumes."""
    embedded = ("--model.model.name=smollm2-135m", "--model.model.dtype=auto",
                "--model.model.gradient_checkpointing=true", "--rollout.group_size=8", "--data.batch_size=1",
                "--rollout.sampling.max_new_tokens=64", "--data.max_prompt_tokens=300",
                "--model.optim.micro_batch_size=8")
    run = _fit(tmp_path, monkeypatch, *embedded, "--trainer.max_steps=2")
    scalars = _scalars(run)
    assert scalars["train/rollout/tokens_per_s"][-1][1] > 0
    print({k: v[-1][1] for k, v in scalars.items() if k.startswith("train/")})
    _fit(tmp_path, monkeypatch, *embedded, "--trainer.max_steps=3", "--ckpt_path=last")
    assert torch.load(run / "last.ckpt", weights_only=False)["global_step"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("config", ["maze.yaml", "maze_grpo.yaml", "code.yaml"])
def test_task_configs_train_end_to_end(config, tmp_path, monkeypatch):
    """Maze and code train for a few steps (tiny model, small budget): rewards flow, checkpoints are written."""
    monkeypatch.chdir(tmp_path)
    task = "maze" if config.startswith("maze") else "code"
    data = str(REPO / f"data/{task}/val.jsonl")
    main(["fit", "--config", str(REPO / "configs" / config), "--run_name=task", "--model.model.name=tiny-llama",
          "--model.model.lora.r=4", f"--data.train_files=[{data}]", "--data.val_files=null",
          "--data.max_prompt_tokens=0", "--trainer.limit_val_batches=0", "--trainer.max_steps=2",
          "--trainer.accelerator=cpu", "--rollout.group_size=4", "--rollout.sampling.max_new_tokens=32",
          "--checkpoint.every_n_train_steps=1"])
    run = tmp_path / "checkpoints" / "task"
    scalars = _scalars(run)
    dims = ["exit", "gold", "diamond", "safety"] if task == "maze" else [f"test_{i}" for i in range(16)]
    for d in dims:
        assert f"train/reward/{d}" in scalars, sorted(scalars)
    assert torch.load(run / "last.ckpt", weights_only=False)["global_step"] == 2
    if task == "code":  # the isolation the run used is recorded beside its configuration (issue 54)
        assert json.loads((run / "sandbox.json").read_text())["rewards"] == ["code_tests"]
    else:
        assert not (run / "sandbox.json").exists()


def test_token_budget_stops_training_and_checkpoints_the_stop(tmp_path, monkeypatch):
    """rollout.max_generated_tokens ends the run after the step that crosses it (max_steps stays a cap); the count
    and the stop step are in last.ckpt, and a resumed run with a larger budget continues from the saved count."""
    run = _fit(tmp_path, monkeypatch, "--trainer.max_steps=20", "--checkpoint.every_n_train_steps=7",
               "--trainer.limit_val_batches=0", "--rollout.max_generated_tokens=200")
    per_step = [v for _, v in sorted(_scalars(run)["train/rollout/tokens"])]
    # debug: 2 prompts x G=4 chains x <= 24 tokens = at most 192 tokens a step, so 200 needs at least 2 steps
    crossed = next(i + 1 for i in range(len(per_step)) if sum(per_step[: i + 1]) >= 200)
    assert len(per_step) == crossed >= 2, per_step
    ckpt = torch.load(run / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == crossed  # the stop step is saved even though it is not a multiple of 7
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("RolloutCallback")]
    assert state == {"generated_tokens": int(sum(per_step))}

    _fit(tmp_path, monkeypatch, "--trainer.max_steps=20", "--checkpoint.every_n_train_steps=7",
         "--trainer.limit_val_batches=0", f"--rollout.max_generated_tokens={int(sum(per_step)) + 1}",
         "--ckpt_path=last")
    ckpt = torch.load(run / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == crossed + 1  # one more step crosses the raised budget


def test_keep_last_keeps_the_newest_step_checkpoints_and_their_adapters(tmp_path, monkeypatch):
    """Issue 53 (TRL's save_total_limit): checkpoint.keep_last=2 with a checkpoint every step keeps step=2, step=3
    and their adapters, and last."""
    run = _fit(tmp_path, monkeypatch, "--trainer.max_steps=3", "--checkpoint.keep_last=2", "--data.val_files=null",
               "--rollout.log_samples_every=0")
    assert sorted(p.name for p in run.glob("*.ckpt")) == ["last.ckpt", "step=2.ckpt", "step=3.ckpt"]
    assert sorted(p.name for p in (run / "adapters").iterdir()) == ["last", "step=2", "step=3"]
    assert torch.load(run / "step=3.ckpt", weights_only=False)["global_step"] == 3


def test_options_take_dashes_as_vpo_help_promises_one_style(tmp_path, monkeypatch):
    """Issue 53: `vpo fit --run-name X` was refused (only --run_name parsed); keys with dashes now parse as the same
    keys with underscores."""
    run = _fit(tmp_path, monkeypatch, "--run-name", "dashed", "--trainer.max-steps=1", "--data.val-files=null",
               "--rollout.log-samples-every", "0")
    assert run.name == "debug" and not run.exists()  # the default name was not used
    ckpt = torch.load(tmp_path / "checkpoints" / "dashed" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 1


def test_a_config_without_a_seed_runs_seeded_0_without_a_warning(tmp_path, monkeypatch, capfd, caplog, recwarn):
    """Issue 53: configs without seed_everything (COMING_FROM_TRL.md's example) warned "No seed found" (Lightning
    then seeds 0); now 0 is the default, as in the notebook entry point, and nothing warns."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs/debug.yaml").read_text())
    del cfg["seed_everything"]
    (tmp_path / "no_seed.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    data = str(REPO / "data/tooluse/val.jsonl")
    main(["fit", "--config", "no_seed.yaml", f"--data.train_files=[{data}]", "--data.val_files=null",
          "--trainer.max_steps=1"])
    printed = "".join(capfd.readouterr()) + caplog.text + "".join(str(w.message) for w in recwarn)
    assert "No seed found" not in printed and "Seed set to 0" in printed
    assert yaml.safe_load((tmp_path / "checkpoints/debug/config.yaml").read_text())["seed_everything"] == 0


def _documented_tags(conditions: set[str]) -> set[str]:
    """The tags of TRAINING.md's "Logged metrics" table whose "logged when" is empty or in ``conditions``, with
    ``{a,b}`` expanded and ``val/`` copies of the rows marked so; ``<reward>`` is left for the caller."""
    import re

    text = (REPO / "docs/TRAINING.md").read_text().split("## Logged metrics\n")[1].split("\n## ")[0]
    tags: set[str] = set()
    for row in (line for line in text.splitlines() if line.startswith("| `train/")):
        names, val, when, _ = (c.strip() for c in re.split(r"(?<!\\)\|", row)[1:5])  # \| is a pipe in a cell
        if when and when not in conditions:
            continue
        todo = re.findall(r"`([^`]+)`", names)
        while todo:
            name = todo.pop()
            brace = re.search(r"\{([^}]*)\}", name)
            if brace:
                todo += [name[:brace.start()] + part + name[brace.end():] for part in brace[1].split(",")]
            else:
                tags |= {name, name.replace("train/", "val/", 1)} if val == "yes" else {name}
    return tags


def test_the_debug_run_logs_exactly_the_documented_tags(tmp_path, monkeypatch):
    """Issue 53: ~70 TensorBoard scalars, some duplicates (epoch, hp_metric = -1, lr-AdamW beside train/lr). A run
    logs the list in docs/TRAINING.md, no more and no fewer."""
    run = _fit(tmp_path, monkeypatch, "--trainer.max_steps=1", "--trainer.val_check_interval=1")
    conditions = {"`estimator: vpo`", "`num_candidates > 1`", "the engine reports log-probs"}
    if torch.cuda.is_available():
        conditions.add("on CUDA")
    documented = set()
    for tag in _documented_tags(conditions):
        documented |= ({tag.replace("<reward>", r) for r in ("format", "tool_name", "arg_key", "arg_value")}
                       if "<reward>" in tag else {tag})
    logged = set(_scalars(run))
    assert logged == documented, f"logged, not documented: {sorted(logged - documented)}; " \
                                 f"documented, not logged: {sorted(documented - logged)}"
