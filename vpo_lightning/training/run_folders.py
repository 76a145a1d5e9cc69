"""Run folders that never clobber each other (`vpo fit`, `vpo sft`, `vpo validate`).

* Every output path comes from ``run_name`` when the config is loaded: ``checkpoints/<run_name>/``. A config that
  names another folder (``checkpoint.dirpath`` in an older ``config.yaml``) does not redirect the outputs.
* ``config.yaml`` keeps what defines the run and nothing about one invocation: no ``ckpt_path``, no
  ``checkpoint.dirpath``, no ``trainer.default_root_dir``, no ``overwrite``; the logger's folder is left to be derived.
* A non-empty run folder is refused unless the run resumes from it (``--ckpt_path last`` or a checkpoint inside it)
  or ``--overwrite`` is given; the replaced run is kept aside until the new one finishes its first step.
* A run that fails before its first optimizer step leaves nothing behind (the replaced run, if any, comes back).
* ``vpo validate`` / ``vpo test`` never write ``config.yaml``; each logs to its own ``<run>/<subcommand>/version_N``.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import SaveConfigCallback

log = logging.getLogger(__name__)

INVOCATION_KEYS = ("ckpt_path", "checkpoint.dirpath", "trainer.default_root_dir")


def tensorboard_loggers(cfg: Any) -> list[Any]:
    """The TensorBoardLogger entries of a parsed config's ``trainer.logger``."""
    logger = cfg["trainer"].get("logger")
    return [lg for lg in (logger if isinstance(logger, list) else [logger])
            if lg is not None and not isinstance(lg, bool) and "TensorBoardLogger" in str(lg.get("class_path", ""))]


def stored_config(config: Any, output_root: str) -> Any:
    """A copy of a parsed config without per-invocation state (what ``config.yaml`` holds)."""
    clean = config.clone()
    for key in INVOCATION_KEYS:
        if key in clean:
            clean[key] = None
    if "overwrite" in clean:
        clean["overwrite"] = False
    for lg in tensorboard_loggers(clean):
        lg["init_args"]["save_dir"], lg["init_args"]["name"], lg["init_args"]["version"] = output_root, "", ""
    return clean


class RunConfigSaver(SaveConfigCallback):
    """Writes ``config.yaml`` for training runs only, without per-invocation state (:func:`stored_config`)."""

    output_root = "checkpoints"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved or stage != "fit":  # validate/test read a run; they never rewrite its config
            return
        log_dir = Path(trainer.log_dir or ".")  # a collective under DDP: every rank asks
        if trainer.is_global_zero:
            log_dir.mkdir(parents=True, exist_ok=True)
            tmp = log_dir / f".{self.config_filename}.tmp"
            self.parser.save(stored_config(self.config, self.output_root), str(tmp), skip_none=False,
                             overwrite=True, multifile=False)
            os.replace(tmp, log_dir / self.config_filename)
        self.already_saved = trainer.strategy.broadcast(True)


def _inside(path: str, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


class RunFolder(Callback):
    """Owns ``checkpoints/<run_name>/`` for one training invocation; see :func:`claim`.

    Args:
        path: the run folder.
        created: the folder was empty or absent before this run (remove it if the run fails before step 1).
        aside: where a run replaced with ``--overwrite`` waits until this run's first step (then it is deleted).
    """

    def __init__(self, path: Path, created: bool, aside: Path | None = None) -> None:
        self.path, self.created, self.aside = path, created, aside
        self.root_created = not path.parent.exists()
        self.committed = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.committed and trainer.global_step > 0:
            self.commit()

    def commit(self) -> None:
        """The run made a step: it owns the folder, and a replaced run is gone for good."""
        self.committed = True
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
            self.aside = None

    def abandon(self) -> None:
        """The run failed before its first step: remove what it created, put a replaced run back."""
        if self.committed:
            return
        if self.created or self.aside is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if self.aside is not None:
            os.replace(self.aside, self.path)
            log.warning("the run failed before its first step: %s restored as it was", self.path)
        elif self.created:
            log.warning("the run failed before its first step: removed %s", self.path)
        if self.root_created and self.path.parent.is_dir() and not any(self.path.parent.iterdir()):
            self.path.parent.rmdir()


# what vpo_lightning.api.train writes before the run starts
API_INPUTS = frozenset({"api_config.yaml", "api_rewards.py", "data"})


def held_files(path: Path) -> list[str]:
    """What ``path`` holds that a new run would clobber (the notebook entry point's own inputs do not count)."""
    return sorted(p.name for p in path.iterdir() if p.name not in API_INPUTS) if path.is_dir() else []


def claim(path: Path, ckpt_path: str | None, overwrite: bool) -> RunFolder:
    """Check that a training run may write to ``path`` and take it; refuse, naming the fixes, when it may not.
    DDP worker processes (``LOCAL_RANK`` > 0, started once rank 0 is already writing there) take nothing."""
    if int(os.environ.get("LOCAL_RANK", "0") or 0) > 0 or int(os.environ.get("NODE_RANK", "0") or 0) > 0:
        folder = RunFolder(path, created=False)
        folder.committed = True
        return folder
    held = held_files(path)
    resuming = bool(ckpt_path) and (ckpt_path == "last" or _inside(ckpt_path, path))
    if not held or resuming:
        return RunFolder(path, created=not held)
    if not overwrite:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        resume = ("Resume it with --ckpt_path last, start" if "last.ckpt" in held else
                  "It has no last.ckpt to resume (killed before its first checkpoint?): start")
        raise ValueError(f"{path} already holds a run ({shown}). {resume} a separate run with --run_name NAME, or "
                         "replace it with --overwrite")
    aside = path.with_name(f".{path.name}.replaced")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    from vpo_lightning.training.progress import (
        action_needed,  # printed again after the run, so that it does not scroll away
    )

    action_needed(f"--overwrite: {path} is replaced by this run (kept aside as {aside} until its first step)")
    return RunFolder(path, created=True, aside=aside)
