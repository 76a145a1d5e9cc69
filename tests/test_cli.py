"""The `vpo` CLI: --help documents every argument; every shipped config parses and instantiates without a run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from vpo_lightning.cli import VPOCLI
from vpo_lightning.datamodule import PromptDataModule
from vpo_lightning.module import VPOModule

CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")
                 if not p.name.endswith("_sft.yaml"))  # `vpo sft` configs: tests/test_sft.py


def _cli(args: list[str]) -> VPOCLI:
    return VPOCLI(VPOModule, PromptDataModule, args=args, run=False,
                  parser_kwargs={"parser_mode": "omegaconf", "default_env": False})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_instantiates(path, in_repo):
    t0 = time.perf_counter()
    cli = _cli(["--config", str(path), "--trainer.accelerator=cpu", "--trainer.devices=1"])
    elapsed = time.perf_counter() - t0
    assert isinstance(cli.model, VPOModule) and cli.model.policy is None  # models load in configure_model
    assert isinstance(cli.datamodule, PromptDataModule)
    assert elapsed < 5.0, f"parsing {path.name} took {elapsed:.1f}s"


def test_dotted_overrides(in_repo):
    cli = _cli(["--config", "configs/debug.yaml", "--rollout.group_size", "6", "--model.optim.lr", "3e-4",
                "--model.model.lora.r", "2"])
    rollout = next(c for c in cli.trainer.callbacks if type(c).__name__ == "RolloutCallback")
    assert rollout.group_size == 6
    assert cli.model.optim_settings.lr == 3e-4 and cli.model.model_settings.lora.r == 2


def test_fit_help_documents_every_argument():
    out = subprocess.run([sys.executable, "-m", "vpo_lightning.cli", "fit", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    for expected in ("--rollout.estimator", "advantage estimator", "--rollout.group_size", "chains sampled per prompt",
                     "--model.model.name", "built-in alias", "--model.model.lora.r", "adapter rank",
                     "--model.loss.beta", "k3 KL", "--data.batch_size", "prompts per step",
                     "--rollout.sampling.max_new_tokens", "--checkpoint.every_n_train_steps", "--run_name"):
        assert expected in out, f"{expected!r} missing from vpo fit --help"


def test_unknown_key_is_rejected_with_a_suggestion(in_repo, capsys):
    with pytest.raises(SystemExit):
        _cli(["--config", "configs/debug.yaml", "--rollout.group_sise", "4"])
    err = capsys.readouterr().err
    assert "group_sise" in err


def test_bad_values_are_rejected(in_repo):
    for args, match in (
        (["--rollout.group_size", "1"], "group_size"),
        (["--rollout.num_candidates", "0"], "num_candidates"),
        (["--rollout.num_weights", "0"], "num_weights"),
        (["--rollout.alpha", "0"], "alpha"),
    ):
        with pytest.raises((ValueError, SystemExit), match=match if args[0] != "--rollout.alpha" else None):
            _cli(["--config", "configs/debug.yaml", *args])
