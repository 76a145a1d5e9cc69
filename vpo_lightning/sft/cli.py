"""``vpo sft``: LightningCLI over SFTModule + SFTDataModule, with the same outputs and checkpoints as ``vpo fit``.

    vpo sft --config configs/tooluse_sft.yaml                    # train the cold-start adapter
    vpo sft --config configs/tooluse_sft.yaml --ckpt_path last   # resume checkpoints/<run_name>/last.ckpt
    vpo sft --help                                               # every argument, with its documentation

Outputs go to ``checkpoints/<run_name>/``: ``config.yaml``, TensorBoard logs, ``last.ckpt``/``step=N.ckpt`` and the
PEFT adapter beside each (``adapters/last``): give that to RL as ``model.model.adapter``.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser

from vpo_lightning.sft.data import SFTDataModule
from vpo_lightning.sft.module import SFTModule
from vpo_lightning.training.checkpointing import AdapterCheckpoint
from vpo_lightning.training.cli import SEED_DEFAULT, TRAINER_DEFAULTS, VPOCLI
from vpo_lightning.training.runtime import report_error


class SFTCLI(VPOCLI):
    """VPOCLI without the rollout section: ``run_name``, ``checkpoint:`` and the same trainer defaults."""

    PROGS = {"fit": "vpo sft", "validate": "vpo sft validate"}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        self.add_run_arguments(parser, "sft")
        parser.add_lightning_class_args(AdapterCheckpoint, "checkpoint")
        parser.link_arguments("model.model.name", "data.tokenizer")
        parser.set_defaults(TRAINER_DEFAULTS)


def make_cli(args: list[str], run: bool = True) -> SFTCLI:
    """The SFT CLI on ``args`` (``fit`` is implied: ``vpo sft --config X`` = ``fit --config X``)."""
    argv = list(args)
    if run and (not argv or argv[0] != "fit"):
        argv = ["fit", *argv]
    return SFTCLI(SFTModule, SFTDataModule, args=argv, run=run,
                  parser_kwargs={"parser_mode": "omegaconf", "default_env": False, "prog": "vpo"},
                  save_config_kwargs={"overwrite": True}, subclass_mode_model=False, subclass_mode_data=False,
                  auto_configure_optimizers=False, seed_everything_default=SEED_DEFAULT)


def main(args: list[str]) -> Any:
    """``vpo sft ...`` (called by :func:`vpo_lightning.launcher.main`)."""
    warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
    try:
        make_cli(args)
    except (ValueError, FileNotFoundError, ImportError, OSError, FloatingPointError, MisconfigurationException) as err:
        raise SystemExit(report_error("vpo sft", err)) from None
    return None
