"""``vpo fit`` and ``vpo validate``: LightningCLI over VPOModule + PromptDataModule, the rollout its own section.

    vpo fit --config configs/tooluse.yaml                   # train
    vpo fit --config configs/tooluse.yaml --rollout.group_size 4 --model.optim.lr 1e-4   # dotted overrides
    vpo fit --config configs/tooluse.yaml --ckpt_path last  # resume checkpoints/<run_name>/last.ckpt
    vpo fit --config configs/tooluse.yaml --overwrite       # replace an earlier run of the same name
    vpo fit --help                                          # every argument, with its documentation
    vpo sft --config configs/tooluse_sft.yaml               # supervised cold start (vpo_lightning/sft/)

Outputs go to ``checkpoints/<run_name>/``: ``config.yaml``, TensorBoard logs, ``last.ckpt``/``step=N.ckpt`` and the
PEFT adapter exported beside each checkpoint (``adapters/last``, ``adapters/step=N``). A run prints one line naming
its ``config.yaml`` (``--print_config`` prints the configuration and exits); warnings that need action are printed
again after the run. The ``vpo`` console script is :mod:`vpo_lightning.launcher`, which lists the commands without
importing this module and runs :func:`fit` / :func:`validate` here.
A non-empty run folder is refused unless resuming or ``--overwrite``; ``vpo validate`` logs to
``<run>/validate/version_N`` (rules in run_folders.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vpo_lightning.app import report_error, underscored
from vpo_lightning.rewards import BrokenRewardError, add_config_dir
from vpo_lightning.training import config_check, run_folders
from vpo_lightning.training.config import get
from vpo_lightning.training.config_keys import rename_old_flags
from vpo_lightning.training.schema import FIT, OUTPUT_ROOT, SUBCOMMANDS, Schema

_SUBCOMMANDS_WITH_RUN = ("fit", "validate")
log = logging.getLogger("vpo_lightning.training.cli")


def sandboxed_rewards(names: list[str]) -> list[str]:
    """The rewards among ``names`` that run model-written code (their function's module uses
    :mod:`vpo_lightning.sandbox`); unknown names are left to the reward lookup's own error."""
    from vpo_lightning.rewards import get_reward

    found = []
    for name in names:
        try:
            fn = get_reward(name).fn
        except (ValueError, ImportError, AttributeError):
            continue
        module = sys.modules.get(getattr(fn, "__module__", ""))
        if module is not None and any(str(getattr(v, "__module__", "")).startswith("vpo_lightning.sandbox")
                                      for v in vars(module).values()):
            found.append(name)
    return found


def sandbox_summary(names: list[str]) -> dict[str, Any] | None:
    """The sandbox isolation a run with rewards ``names`` uses (None when no reward runs model-written code).

    Raises:
        ValueError: the sandbox refuses to run code here; the message says why and how to go on.
    """
    rewards = sandboxed_rewards(names)
    if not rewards:
        return None
    from vpo_lightning import sandbox

    try:
        info = sandbox.isolation_info()
    except sandbox.SandboxUnavailable as err:  # a setting that names no layer
        raise ValueError(str(err)) from None
    if info["kind"] == "unavailable":
        raise ValueError(f"rewards {', '.join(rewards)} run model-written code; {info['refusal']}")
    return {"rewards": rewards, **info}


class VPOCLI(LightningCLI):
    """LightningCLI over a :class:`~vpo_lightning.training.schema.Schema` (``vpo fit``'s by default): its parsers
    are built by the schema's steps, so the config resolver's ``fit`` parser (``Schema.parser``) is the same."""

    schema: Schema = FIT
    run_folder: run_folders.RunFolder | None = None
    sandbox: dict[str, Any] | None = None  # the isolation of a run whose rewards run model-written code
    raise_parse_errors = False  # True: a bad value raises ValueError instead of printing and exiting 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_callback", run_folders.RunConfigSaver)
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: {str(k) for k in skip} for name, skip in SUBCOMMANDS.items()}

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        return self.schema.new_parser(**kwargs)

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        self.schema.add_seed(parser)

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        self.schema.add_core(parser)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        self.schema.add_sections(parser)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse; on failure print a short message (unknown keys with the closest known ones) instead of the usage."""
        for name, sub in getattr(self, "_subcommand_parsers", {}).items():
            sub.prog = self.schema.progs.get(name, sub.prog)
        if isinstance(args, list):  # one style everywhere: --run-name is --run_name, --trainer.max-steps ...
            args = rename_old_flags([underscored(a) for a in args])  # and a renamed key is read as its new one
        parsers = [parser, *getattr(self, "_subcommand_parsers", {}).values()]
        saved = [p.exit_on_error for p in parsers]
        for p in parsers:
            p.exit_on_error = False
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            if os.environ.get("VPO_DEBUG") or isinstance(args, dict):
                raise
            if self.raise_parse_errors:  # the notebook entry point: an exception, not an exit
                raise ValueError(" ".join(str(err).split())) from None
            argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
            subcommands = sorted(getattr(self, "_subcommand_parsers", {}))
            sub = getattr(self, "_subcommand_parsers", {}).get(argv[0]) if argv else None
            print(config_check.explain_parse_error(str(err), sub, argv, "vpo", subcommands), file=sys.stderr)
            raise SystemExit(2) from None
        finally:
            for p, value in zip(parsers, saved):
                p.exit_on_error = value

    def before_instantiate_classes(self) -> None:
        """Check options that need a GPU or an optional package; route every output under checkpoints/<run_name>/."""
        cfg = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if self.subcommand in _SUBCOMMANDS_WITH_RUN:
            problems = config_check.preflight(cfg)
            if problems:
                raise ValueError("\n  ".join(problems))
            self.sandbox = sandbox_summary(list(get(cfg, "rollout.rewards") or []))
        for path in cfg.get("config") or []:  # dotted reward paths also resolve beside the config (my_rewards.py)
            add_config_dir(Path(getattr(path, "absolute", str(path))).parent)
        run_dir = Path(OUTPUT_ROOT) / cfg["run_name"]
        training = self.subcommand == "fit"
        log_dir = run_dir if training else run_dir / str(self.subcommand)  # validate/test: <run>/validate/version_N
        cfg["trainer"]["default_root_dir"] = str(log_dir)
        for lg in run_folders.tensorboard_loggers(cfg):
            lg["init_args"]["save_dir"], lg["init_args"]["name"] = str(log_dir.parent), log_dir.name
            lg["init_args"]["version"] = "" if training else None
        if cfg["checkpoint"].get("dirpath") not in (None, str(run_dir)):
            log.info("checkpoint.dirpath=%s is ignored: outputs go to %s (from run_name)",
                     cfg["checkpoint"]["dirpath"], run_dir)
        cfg["checkpoint"]["dirpath"] = str(run_dir)
        if self.subcommand in _SUBCOMMANDS_WITH_RUN and cfg.get("ckpt_path") == "last":
            cfg["ckpt_path"] = _last_checkpoint(str(run_dir))
        if training:
            if "val_files" in (cfg.get("data") or {}) and not get(cfg, "data.val_files"):
                log.info("data.val_files is empty: no validation in this run")
            self.run_folder = run_folders.claim(run_dir, cfg.get("ckpt_path"), bool(cfg.get("overwrite")))

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer, with the run folder's guard; validation off when there are no validation files."""
        trainer = super().instantiate_trainer(**kwargs)
        if self.run_folder is not None:
            trainer.callbacks.append(self.run_folder)
        if self.subcommand == "fit" and getattr(self.datamodule, "val_files", True) == []:
            trainer.limit_val_batches = 0
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except BaseException as err:
            if self.run_folder is not None:
                self.run_folder.abandon()
            if isinstance(err, SIGTERMException):  # Lightning's is a SystemExit with code 0: a preempted job
                raise SystemExit(_preempted(self.trainer)) from None  # must not look like a finished one
            raise
        if self.run_folder is not None:
            self.run_folder.commit()

    def before_fit(self) -> None:
        """Name the file the effective configuration is saved to (``--print_config`` prints it instead)."""
        if self.trainer.is_global_zero:
            name = (self.save_config_kwargs or {}).get("config_filename", "config.yaml")
            path = Path(self.trainer.log_dir or self.trainer.default_root_dir) / name
            prog = self.schema.progs.get("fit", "vpo fit")  # vpo sft's says vpo sft
            print(f"configuration: {path} ({prog} ... --print_config prints it)", flush=True)
            self._report_sandbox(path.parent)

    def before_validate(self) -> None:
        """Print and record the sandbox isolation, as :meth:`before_fit` does."""
        if self.trainer.is_global_zero:
            self._report_sandbox(Path(self.trainer.log_dir or self.trainer.default_root_dir))

    def _report_sandbox(self, folder: Path) -> None:
        """Print the isolation of a run whose rewards run model-written code and write it to ``sandbox.json``."""
        if self.sandbox is None:
            return
        info = self.sandbox
        missing = f", accepted missing: {'; '.join(info['missing'])}" if info["missing"] else ""
        print(f"sandbox isolation: {info['kind']} (seccomp {'on' if info['seccomp'] else 'OFF'}, cgroup "
              f"{info['cgroup'] or 'none'}{missing}) for {', '.join(info['rewards'])}; recorded in "
              f"{folder / 'sandbox.json'}", flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sandbox.json").write_text(json.dumps(info, indent=1) + "\n")


SIGTERM_EXIT = 143  # 128 + SIGTERM, what a shell reports for a process that SIGTERM ended


def _preempted(trainer: Any) -> int:
    """Say where a run stopped by SIGTERM can be resumed from; the exit code."""
    last = Path(trainer.default_root_dir) / "last.ckpt"
    if last.is_file():
        print(f"vpo: stopped by SIGTERM after step {trainer.global_step}; {last} is saved: resume with the same "
              "command and --ckpt_path last", file=sys.stderr, flush=True)
    else:
        print("vpo: stopped by SIGTERM before the first step finished; nothing was saved", file=sys.stderr, flush=True)
    return SIGTERM_EXIT


def _last_checkpoint(run_dir: str) -> str:
    path = Path(run_dir) / "last.ckpt"
    if not path.is_file():
        raise SystemExit(f"--ckpt_path last: no {path} yet (nothing to resume); drop --ckpt_path to start fresh")
    return str(path)


def run_lightning(args: list[str], cli_class: type[VPOCLI] = VPOCLI, run: bool = True) -> VPOCLI:
    """Run ``vpo fit|validate ...`` (errors propagate: the notebook entry point raises them as they are) with
    ``cli_class`` (VPOCLI or a subclass: its ``schema`` says which classes; ``vpo sft``'s is SFTCLI); with ``run``
    False, only parse and instantiate (no subcommand)."""
    return cli_class(args=args, run=run, **cli_class.schema.cli_kwargs())


BAD_INPUT = (ValueError, FileNotFoundError, ImportError, OSError, FloatingPointError, BrokenRewardError,
             MisconfigurationException)  # what a run reports in one line (exit code 2) instead of a traceback


def main(argv: list[str], cli_class: type[VPOCLI] = VPOCLI, command: str = "vpo") -> None:
    """``vpo fit|validate ...`` as a command: bad input gets a one-line error and exit code 2."""
    try:
        run_lightning(list(argv), cli_class)
    except BAD_INPUT as err:
        raise SystemExit(report_error(command, err)) from None


def fit(argv: list[str]) -> None:
    """``vpo fit ...``: train."""
    main(["fit", *argv])


def validate(argv: list[str]) -> None:
    """``vpo validate ...``: score the validation prompts without training."""
    main(["validate", *argv])
