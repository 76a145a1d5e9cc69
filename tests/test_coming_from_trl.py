"""docs/COMING_FROM_TRL.md runs as written: its Python example (the notebook entry point) and its command-line example
(TRL reward functions by dotted path from the working directory) on the tiny model, the latter over every TRL data
form at once: standard Parquet, conversational JSONL and a ``save_to_disk`` folder."""

from __future__ import annotations

import glob
import json
import linecache
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "COMING_FROM_TRL.md"


def _blocks() -> dict[str, str]:
    """The code blocks after ``<!-- runs in tests/test_coming_from_trl.py[: NAME] -->`` markers, by NAME."""
    found = re.findall(r"<!-- runs in tests/test_coming_from_trl\.py(?::\s*(\S+))?\s*-->\n```\w*\n(.*?)```",
                       DOC.read_text(encoding="utf-8"), flags=re.S)
    return {name or "python-api": code for name, code in found}


def _scalars(run: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[float]] = {}
    for f in sorted(glob.glob(str(run / "events.out.tfevents.*"))):
        ea = EventAccumulator(f)
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            out.setdefault(tag, []).extend(e.value for e in ea.Scalars(tag))
    return out


def test_doc_has_the_runnable_examples_and_the_settings_table():
    blocks = _blocks()
    assert set(blocks) == {"python-api", "my_rewards.py", "trl_style.yaml", "command"}
    text = DOC.read_text(encoding="utf-8")
    for trl, ours in (("learning_rate", "model.optim.lr"), ("num_generations", "rollout.group_size"),
                      ("per_device_train_batch_size", "data.batch_size"), ("beta", "model.loss.beta"),
                      ("max_completion_length", "rollout.sampling.max_new_tokens")):
        assert re.search(rf"`{trl}`.*\| `{re.escape(ours)}`", text), trl


def _notebook_cell(code: str, namespace: dict) -> None:
    """Run ``code`` as a Jupyter cell runs: in ``__main__``, its source kept in ``linecache`` under a cell name."""
    name = f"<ipython-input-{abs(hash(code))}>"
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    exec(compile(code, name, "exec"), namespace)  # noqa: S102 - test code


@pytest.mark.slow
def test_python_example_trains(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    _notebook_cell(_blocks()["python-api"], {"__name__": "__main__"})  # the doc's code, as a notebook cell
    run = tmp_path / "checkpoints" / "trl-style"
    assert (run / "last.ckpt").is_file() and (run / "adapters" / "last" / "adapter_config.json").is_file()
    # functions of the notebook are written beside the config, which names them by an importable path
    assert "rewards:\n  - api_rewards.mentions_answer\n  - api_rewards.brevity" in (run / "config.yaml").read_text()
    scalars = _scalars(run)
    assert "train/reward/all/mentions_answer" in scalars and "train/reward/all/brevity" in scalars, sorted(scalars)
    out = capfd.readouterr().out
    assert f"configuration: {Path('checkpoints') / 'trl-style' / 'config.yaml'}" in out
    assert "Effective configuration" not in out and "seed_everything:" not in out  # no config dump


STANDARD = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
CONVERSATIONAL = [{"prompt": [{"role": "system", "content": "Answer with a number."},
                              {"role": "user", "content": f"What is {i} times 2?"}], "answer": str(2 * i)}
                  for i in range(4)]


@pytest.mark.slow
def test_command_line_example_on_every_trl_data_form(tmp_path):
    import datasets

    blocks = _blocks()
    (tmp_path / "my_rewards.py").write_text(blocks["my_rewards.py"])
    (tmp_path / "trl_style.yaml").write_text(blocks["trl_style.yaml"])
    datasets.Dataset.from_list(STANDARD).to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "conversational.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL))
    datasets.Dataset.from_list(STANDARD).save_to_disk(str(tmp_path / "saved"))
    run = tmp_path / "checkpoints" / "trl-style-cli"
    run.mkdir(parents=True)
    (run / "step=9.ckpt").write_text("an earlier run's checkpoint")  # refused, then replaced with --overwrite
    command = blocks["command"].split()
    assert command[:2] == ["vpo", "fit"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # -P: the working directory is not on sys.path, as for the installed `vpo` script; the rewards import anyway
    args = [sys.executable, "-P", "-m", "vpo_lightning", *command[1:],
            "--data.train_files=[train.parquet,conversational.jsonl,saved]",
            "--rollout.estimator=grpo"]  # one answer per chain: the tiny model's text is scored
    refused = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "already holds a run (step=9.ckpt)" in refused.stderr
    assert (run / "step=9.ckpt").read_text() == "an earlier run's checkpoint"
    proc = subprocess.run([*args, "--overwrite"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scalars = _scalars(run)
    assert scalars["train/reward/all/brevity"] and all(v > 0 for v in scalars["train/reward/all/brevity"])
    assert "train/reward/all/mentions_answer" in scalars
    assert "train/reward/errors" in scalars and max(scalars["train/reward/errors"]) == 0  # every call fitted
    # quiet: one line names the saved configuration; the overwrite warning is repeated after the run
    assert "configuration: checkpoints/trl-style-cli/config.yaml" in proc.stdout
    assert "seed_everything:" not in proc.stdout
    # issue 53: the example sets no seed_everything; Lightning warned "No seed found", transformers drew its bar
    assert "No seed found" not in proc.stderr and "Loading weights" not in proc.stderr, proc.stderr[-3000:]
    tail = proc.stderr[proc.stderr.rindex("warnings that need action"):]
    assert "--overwrite: checkpoints/trl-style-cli is replaced by this run" in tail


@pytest.mark.parametrize("rows", [STANDARD, CONVERSATIONAL])
def test_api_refuses_bad_records_before_loading_a_model(rows, tmp_path, monkeypatch):
    from vpo_lightning.api import train

    monkeypatch.chdir(tmp_path)
    bad = [*rows, {"prompt": ""}]
    with pytest.raises(ValueError, match=r"train.jsonl: row 5|train.jsonl:5: 'prompt' is empty"):
        train("tiny-llama", reward_funcs=["format"], train_dataset=bad)


# A notebook cell: TRL reward functions using a module import, a helper of the cell and a constant.
CELL = """
import re as regex

BONUS = 0.5


def count_digits(text):
    return len(regex.findall(r"[0-9]", text))


def digits(prompts, completions, **kwargs):
    return [min(1.0, count_digits(c) * BONUS) for c in completions]
"""


def test_api_saved_config_reruns_from_the_command_line(tmp_path, monkeypatch):
    """Issue 53: rewards defined in a notebook are written to the run folder and named by an importable path, so
    ``vpo fit --config checkpoints/<run>/config.yaml`` runs in a fresh process (here: with them unregistered)."""
    from vpo_lightning import rewards
    from vpo_lightning.api import train
    from vpo_lightning.launcher import main

    monkeypatch.chdir(tmp_path)
    cell: dict = {"__name__": "__main__"}
    _notebook_cell(CELL, cell)
    tiny = {"trainer.max_steps": 1, "trainer.accelerator": "cpu", "data.batch_size": 2, "rollout.group_size": 2,
            "rollout.estimator": "grpo", "rollout.sampling.max_new_tokens": 8, "model.model.dtype": "fp32"}
    run = train("tiny-llama", reward_funcs=[cell["digits"]], train_dataset=STANDARD, run_name="nb", overrides=tiny)
    assert "- api_rewards.digits" in (run / "config.yaml").read_text()
    assert "def count_digits" in (run / "api_rewards.py").read_text()
    monkeypatch.delitem(rewards.REWARDS, "api_rewards.digits")  # as in a fresh process: imported from the file
    monkeypatch.delitem(sys.modules, "api_rewards", raising=False)
    main(["fit", "--config", str(run / "config.yaml"), "--run_name", "again"])
    assert Path(sys.modules["api_rewards"].__file__) == (run / "api_rewards.py").resolve()  # imported from the file
    assert "train/reward/all/digits" in _scalars(tmp_path / "checkpoints" / "again")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"learning_rate": 1e-4}, r"unknown key 'learning_rate' in overrides\. Did you mean 'model\.optim\.lr'\? "
                              r"\(learning_rate is TRL's name"),
    ({"rollout.group_sise": 4}, r"unknown key 'rollout\.group_sise' in overrides\. Did you mean 'rollout\.group_size'"),
])
def test_api_bad_override_key_is_a_value_error_naming_it(overrides, message, tmp_path, monkeypatch):
    from vpo_lightning.api import train

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        train("tiny-llama", reward_funcs=["format"], train_dataset=STANDARD, overrides=overrides)
    assert not (tmp_path / "checkpoints").exists()  # refused before anything is written


def test_api_bad_override_value_is_a_value_error_not_an_exit(tmp_path, monkeypatch):
    from vpo_lightning.api import train

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"rollout\.group_size") as err:
        train("tiny-llama", reward_funcs=["format"], train_dataset=STANDARD, overrides={"rollout.group_size": "four"})
    assert "api_config" not in str(err.value)  # the user's key, not an internal file


def test_api_reads_a_renamed_override_key_as_its_new_one(tmp_path, monkeypatch, caplog):
    """`rollout.eval_temperature` (now `eval.temperature`) given to `train`: read as the new key, with a notice, and
    checked as it (an evaluation temperature of 0 is refused by name)."""
    from vpo_lightning.api import train

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"eval\.temperature must be > 0, got 0"):
        train("tiny-llama", reward_funcs=["format"], train_dataset=STANDARD,
              overrides={"rollout.eval_temperature": 0, "trainer.accelerator": "cpu"})
    assert "overrides: rollout.eval_temperature is now eval.temperature; read as such" in caplog.messages
