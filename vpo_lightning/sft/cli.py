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

from vpo_lightning.sft.data import SFTDataModule
from vpo_lightning.sft.module import SFTModule
from vpo_lightning.training import cli
from vpo_lightning.training.checkpointing import AdapterCheckpoint
from vpo_lightning.training.schema import Schema

# `vpo sft`: `vpo fit`'s schema without the rollout section
SFT = Schema(SFTModule, SFTDataModule, "sft", (("checkpoint", AdapterCheckpoint),),
             {"fit": "vpo sft", "validate": "vpo sft validate"})


class SFTCLI(cli.VPOCLI):
    """VPOCLI over the SFT schema: ``run_name``, ``checkpoint:`` and the same trainer defaults."""

    schema = SFT


def _fit_args(args: list[str]) -> list[str]:
    """``fit`` is implied: ``vpo sft --config X`` = ``fit --config X``."""
    return list(args) if args and args[0] == "fit" else ["fit", *args]


def make_cli(args: list[str], run: bool = True) -> SFTCLI:
    """The SFT CLI on ``args``; with ``run`` False, only parsed and instantiated."""
    return cli.run_lightning(_fit_args(args) if run else list(args), SFTCLI, run=run)  # type: ignore[return-value]


def main(args: list[str]) -> Any:
    """``vpo sft ...`` (called by :func:`vpo_lightning.launcher.main`): bad input gets a one-line error, exit 2."""
    warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
    cli.main(_fit_args(list(args)), SFTCLI, "vpo sft")
    return None
