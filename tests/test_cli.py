"""The `vpo` CLI: --help documents every argument; every shipped config parses and instantiates without a run."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vpo_lightning.training.cli import VPOCLI
from vpo_lightning.training.datamodule import PromptDataModule
from vpo_lightning.training.module import VPOModule

CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")
                 if not p.name.endswith("_sft.yaml"))  # `vpo sft` configs: tests/test_sft.py


def _cli(args: list[str]) -> VPOCLI:
    return VPOCLI(VPOModule, PromptDataModule, args=args, run=False,
                  parser_kwargs={"parser_mode": "omegaconf", "default_env": False})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_instantiates(path, in_repo):
    cli = _cli(["--config", str(path), "--trainer.accelerator=cpu", "--trainer.devices=1"])
    assert isinstance(cli.model, VPOModule) and cli.model.policy is None  # models load in configure_model
    assert isinstance(cli.datamodule, PromptDataModule)


@pytest.mark.slow
def test_parsing_a_config_loads_no_model(in_repo):
    """The timing half (slow tier): parsing and instantiating takes seconds, as nothing heavy is loaded."""
    t0 = time.perf_counter()
    _cli(["--config", "configs/tooluse.yaml", "--trainer.accelerator=cpu", "--trainer.devices=1"])
    assert time.perf_counter() - t0 < 5.0


def test_dotted_overrides(in_repo):
    cli = _cli(["--config", "configs/debug.yaml", "--rollout.group_size", "6", "--model.optim.lr", "3e-4",
                "--model.model.lora.r", "2"])
    rollout = next(c for c in cli.trainer.callbacks if type(c).__name__ == "RolloutCallback")
    assert rollout.group_size == 6
    assert cli.model.optim_settings.lr == 3e-4 and cli.model.model_settings.lora.r == 2


def _help_blocks(text: str) -> dict[str, str]:
    """``{"--option": its help text}`` from an argparse help page (an option's text may span lines)."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        found = re.match(r"^  (--[\w.]+)(.*)$", line)
        if found:
            current = found.group(1)
            blocks[current] = found.group(2)
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def _our_arguments() -> list[str]:
    """Every option that this app's classes add to `vpo fit`, read from their signatures and dataclass fields."""
    import dataclasses
    import inspect

    from vpo_lightning.generation.engines import SamplingSettings
    from vpo_lightning.generation.models import LoraSettings, ModelSettings
    from vpo_lightning.training.module import LossSettings, OptimSettings
    from vpo_lightning.training.rollout import RolloutCallback
    from vpo_lightning.training.sampler import EvalSettings

    def params(fn) -> list[str]:
        return [n for n in inspect.signature(fn).parameters if n != "self"]

    opts = [f"--model.model.{f.name}" for f in dataclasses.fields(ModelSettings) if f.name != "lora"]
    opts += [f"--model.model.lora.{f.name}" for f in dataclasses.fields(LoraSettings)]
    opts += [f"--model.loss.{f.name}" for f in dataclasses.fields(LossSettings)]
    opts += [f"--model.optim.{f.name}" for f in dataclasses.fields(OptimSettings)]
    opts += [f"--rollout.sampling.{f.name}" for f in dataclasses.fields(SamplingSettings)]
    opts += [f"--rollout.{n}" for n in params(RolloutCallback) if n != "sampling"]
    opts += [f"--eval.{f.name}" for f in dataclasses.fields(EvalSettings)]  # what vpo eval / vpo search sample at
    opts += [f"--data.{n}" for n in params(PromptDataModule) if n != "tokenizer"]  # linked to model.model.name
    return opts + ["--run_name"]


def test_fit_help_documents_every_argument():
    """Every option of this app's classes is in `vpo fit --help` with a description, not only its type/default."""
    out = subprocess.run([sys.executable, "-m", "vpo_lightning", "fit", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    blocks = _help_blocks(out)
    expected = _our_arguments()
    assert len(expected) > 40
    for option in expected:
        assert option in blocks, f"{option} missing from vpo fit --help"
        described = re.sub(r"\(type:.*?\)|\(required.*?\)|^\s*[A-Z_,.\[\]{}]+", "", blocks[option].strip())
        assert re.search(r"[a-z]{3}", described), f"{option} has no description: {blocks[option]!r}"
    for expected in ("--rollout.estimator", "advantage estimator", "--rollout.group_size", "chains sampled per prompt",
                     "--model.model.name", "built-in alias", "--model.model.lora.r", "adapter rank",
                     "--model.loss.beta", "k3 KL", "--data.batch_size", "prompts per step",
                     "--rollout.sampling.max_new_tokens", "--checkpoint.every_n_train_steps", "--run_name",
                     "--eval.temperature", "the evaluation temperature"):
        assert expected in out, f"{expected!r} missing from vpo fit --help"


def test_unknown_key_is_rejected_with_a_suggestion(in_repo, capsys):
    """Through `vpo fit` (the path users take): a one-line error naming the key and the closest known one."""
    from vpo_lightning.launcher import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/debug.yaml", "--rollout.group_sise", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown key 'rollout.group_sise'" in err and "Did you mean 'rollout.group_size'?" in err


def test_bad_values_are_rejected(in_repo):
    for args, match in (
        (["--rollout.group_size", "1"], "group_size"),
        (["--rollout.num_candidates", "0"], "num_candidates"),
        (["--rollout.num_weights", "0"], "num_weights"),
        (["--rollout.alpha", "0"], "alpha"),
    ):
        with pytest.raises((ValueError, SystemExit), match=match if args[0] != "--rollout.alpha" else None):
            _cli(["--config", "configs/debug.yaml", *args])
