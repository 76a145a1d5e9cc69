"""Checkpoints that are never half-written, each with the adapter exported in the standard PEFT format.

A checkpoint is written to a temporary name and renamed into place (``os.replace`` is atomic on POSIX), so a kill at any
moment leaves either the previous complete file or the new complete file. The adapter directory beside it is written the
same way (temporary directory, then rename) by :func:`vpo_lightning.generation.adapters.write_adapter_folder`: it loads
with plain ``PeftModel.from_pretrained`` and vLLM and gives the trained policy, also after a two-stage run (the starting
adapter is stacked in), and it carries the tokenizer and a model card.

Preemption: SIGTERM (a cluster or a spot machine taking the job back) stops the run at the next safe point and writes
``last.ckpt`` there (atomically, as any checkpoint): during a rollout, at once, as of the end of the step before (the
rollout's samples are dropped: nothing of the step has touched the weights, the data position or the token count);
during the update, at the end of the step; during in-loop validation, after the validation rollout in progress, as of
the step before it. ``vpo fit`` then exits with code 143 (128 + SIGTERM) instead of 0, so a
scheduler sees an interrupted job; ``--ckpt_path last`` resumes it in the same folder, as if never stopped.

With several processes (DDP) the ranks decide together: the signal handler only notes the signal (Lightning 2.6's
broadcasts inside the handler, which deadlocks when every rank gets the SIGTERM, as from ``kill -TERM -<pgid>``), and
the run stops where every rank passes (:func:`agree_on_sigterm`): after the rollout (a rank that got it stops
generating at the next token, then waits there for the others), at a step's end and at a validation batch's end.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors import signal_connector
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

log = logging.getLogger(__name__)


def pause_point(point: str, step: int | Callable[[], int]) -> None:
    """Test hook for the kill-and-resume tests; a no-op unless ``VPO_TEST_PAUSE_AT`` is ``"<point>@<step>"``.

    Then the process writes that string to ``$VPO_TEST_PAUSE_FILE`` and sleeps (``$VPO_TEST_PAUSE_S`` seconds, default
    600) so that a test can SIGKILL it at a known point: ``generate``, ``optimizer_step`` (after ``opt.step()``,
    before the scheduler step) and ``checkpoint:<file name>`` (temp file written, not yet renamed into place).
    """
    spec = os.environ.get("VPO_TEST_PAUSE_AT")
    if not spec or spec != f"{point}@{step() if callable(step) else step}":
        return
    Path(os.environ.get("VPO_TEST_PAUSE_FILE", "vpo_paused")).write_text(spec + "\n")
    time.sleep(float(os.environ.get("VPO_TEST_PAUSE_S", "600")))


class _SignalNotes(signal_connector._SignalConnector):
    """Lightning's signal connector with a SIGTERM handler that does no collective (Lightning 2.6's broadcasts from
    inside the handler: with the signal on every rank, rank 1 gets it twice, from the kill and from rank 0, and its
    second broadcast has no partner). One process: as Lightning's, it sets ``received_sigterm``. Several: it sets
    ``pending`` only; ``received_sigterm``, which Lightning's loops read on each rank, changes at
    :func:`agree_on_sigterm` alone, so the ranks always read the same value."""

    pending = False

    def register_signal_handlers(self) -> None:
        self.pending = False
        super().register_signal_handlers()

    def _sigterm_notifier_fn(self, signum: Any, _: Any) -> None:
        signal_connector.log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        if not (self.received_sigterm or self.pending):
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # rank 0 passes it on to the ranks it started, once
        if self.trainer.world_size > 1:
            self.pending = True
        else:
            self.received_sigterm = True


def use_collective_sigterm(trainer: L.Trainer) -> None:
    """Give ``trainer`` the connector of :class:`_SignalNotes`; from a callback's ``setup``, before Lightning registers
    its handlers (it restores the previous ones at teardown, as always)."""
    connector = getattr(trainer, "_signal_connector", None)  # absent on a stand-in trainer (tests)
    if connector is not None and not isinstance(connector, _SignalNotes):
        trainer._signal_connector = _SignalNotes(trainer)


def sigterm_pending(trainer: L.Trainer) -> bool:
    """Whether this rank got a SIGTERM (agreed on or not yet): a rank's reason to cut its rollout short."""
    connector = getattr(trainer, "_signal_connector", None)
    return bool(getattr(trainer, "received_sigterm", False) or getattr(connector, "pending", False))


def agree_on_sigterm(trainer: L.Trainer, got_it: bool = False) -> bool:
    """``trainer.received_sigterm`` on every rank if any rank got a SIGTERM (or passes ``got_it``); a collective that
    every rank must call at the same point. One process: ``received_sigterm`` (or ``got_it``) as it is."""
    got_it = got_it or sigterm_pending(trainer)
    if trainer.world_size > 1:
        flag = torch.tensor(float(got_it), device=trainer.strategy.root_device)
        got_it = float(trainer.strategy.reduce(flag, reduce_op="sum")) > 0
        if got_it:
            note_sigterm(trainer)
    return got_it


def note_sigterm(trainer: L.Trainer) -> None:
    """Set ``trainer.received_sigterm`` (Lightning's loops then stop the run); under DDP, only where every rank does."""
    trainer._signal_connector.received_sigterm = True


class AdapterCheckpoint(ModelCheckpoint):
    """Lightning checkpoints (last, and every N steps) written atomically, plus the PEFT adapter beside each.

    Args:
        dirpath: ignored by `vpo fit` and `vpo sft`, which always write to checkpoints/<run_name>/ (and never store
            this in config.yaml); accepted so that the config.yaml of older runs still loads.
        every_n_train_steps: save ``step=N.ckpt`` every this many optimizer steps.
        save_last: keep ``last.ckpt`` up to date (needed for ``--ckpt_path last``).
        save_top_k: Lightning's: -1 keeps every ``step=N.ckpt`` (there is no metric to rank checkpoints by; to keep
            fewer, use ``keep_last``).
        keep_last: keep only the newest this many ``step=N.ckpt`` files and their ``adapters/step=N`` (TRL's
            ``save_total_limit``); ``last.ckpt`` and ``adapters/last`` are always kept. None = keep all.
        export_adapter: also export the adapter in PEFT format to ``adapters/<checkpoint name>/``.
        push_to_hub: at the end of training, upload ``adapters/last`` to the Hugging Face hub (needs network and a
            token: ``huggingface-cli login`` or ``HF_TOKEN``).
        hub_model_id: the hub repo for ``push_to_hub``, ``<user or org>/<name>``.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int = 50,
        save_last: bool = True,
        save_top_k: int = -1,
        keep_last: int | None = None,
        export_adapter: bool = True,
        push_to_hub: bool = False,
        hub_model_id: str | None = None,
    ) -> None:
        super().__init__(
            dirpath=dirpath, filename="step={step}", auto_insert_metric_name=False,
            every_n_train_steps=every_n_train_steps, save_last=save_last, save_top_k=save_top_k,
            enable_version_counter=False,
        )
        self.export = export_adapter
        if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
            raise ValueError(f"checkpoint.keep_last must be a positive number of checkpoints or null, got "
                             f"{keep_last!r}")
        self.keep_last = keep_last
        if push_to_hub and (not hub_model_id or hub_model_id.count("/") != 1):
            raise ValueError(f"checkpoint.push_to_hub=true needs checkpoint.hub_model_id=<user or org>/<name>, "
                             f"got {hub_model_id!r}")
        if push_to_hub and not (export_adapter and save_last):
            raise ValueError("checkpoint.push_to_hub=true uploads adapters/last: it needs checkpoint.export_adapter "
                             "and checkpoint.save_last")
        self.push_to_hub, self.hub_model_id = push_to_hub, hub_model_id

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Clean up after a run killed while writing: stray temp files, and an adapter caught mid-swap."""
        super().setup(trainer, pl_module, stage)
        use_collective_sigterm(trainer)
        if not trainer.is_global_zero or not self.dirpath or not Path(self.dirpath).is_dir():
            return
        root = Path(self.dirpath)
        for stray in [*root.glob("*.ckpt.tmp"), *root.glob("adapters/*.tmp")]:
            log.warning("removing %s, left by an interrupted checkpoint write", stray)
            if stray.is_dir():
                shutil.rmtree(stray, ignore_errors=True)
            else:
                stray.unlink(missing_ok=True)
        for old in root.glob("adapters/*.old"):  # killed between the two renames of export_adapter
            current = old.with_name(old.name[: -len(".old")])
            if current.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, current)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        tmp = f"{filepath}.tmp"
        trainer.save_checkpoint(tmp, self.save_weights_only)
        pause_point(f"checkpoint:{Path(filepath).name}", trainer.global_step)
        if trainer.is_global_zero:
            os.replace(tmp, filepath)
            module = trainer.lightning_module
            if self.export and getattr(module, "uses_lora", False):
                from vpo_lightning.generation.adapters import run_facts, write_adapter_folder

                run_dir = Path(filepath).parent
                write_adapter_folder(module.policy, run_dir / "adapters" / Path(filepath).stem, module.model_settings,
                                     run_facts(trainer, module, run_dir.name))
        trainer.strategy.barrier("adapter_checkpoint")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if self.keep_last is not None and Path(filepath).name.startswith("step="):
            self._drop_old_steps(trainer, Path(filepath).parent)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _drop_old_steps(self, trainer: L.Trainer, run_dir: Path) -> None:
        """Remove ``step=N.ckpt`` files (and their adapters) beyond the newest ``keep_last``."""
        def step(path: Path) -> int:
            number = path.stem.removeprefix("step=")
            return int(number) if number.isdigit() else -1

        steps = sorted((p for p in run_dir.glob("step=*.ckpt") if step(p) >= 0), key=step)
        for old in steps[: max(0, len(steps) - int(self.keep_last or 0))]:
            self._remove_checkpoint(trainer, str(old))

    def save_before_step(self, trainer: L.Trainer) -> None:
        """``last.ckpt`` as of the end of the previous step, from inside the rollout of step ``global_step`` (a
        SIGTERM stopped it): Lightning's loop counters are put back to where that step's end left them (the
        rollout's batch was fetched, not processed), so the checkpoint resumes as one written at that step's end."""
        if not self.save_last or trainer.global_step == 0 or self._last_global_step_saved == trainer.global_step:
            return  # nothing trained yet, or that checkpoint exists
        loop = trainer.fit_loop.epoch_loop
        progress = loop.batch_progress
        if progress.current.processed < 1:  # the first batch of an epoch: its counters cannot be put back
            log.warning("SIGTERM during the first rollout of an epoch: last.ckpt is not rewritten")
            return
        for tracker in (progress.total, progress.current):  # [ready, started, processed, completed] = [k, k, k, k-1]
            tracker.ready, tracker.started, tracker.completed = tracker.processed, tracker.processed, \
                tracker.processed - 1
        loop._batches_that_stepped -= 1  # counted when step k - 1 ended, after its checkpoint hook
        log.warning("SIGTERM received during the rollout of step %d: writing last.ckpt as of the end of step %d",
                    trainer.global_step, trainer.global_step - 1)
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """After a SIGTERM during in-loop validation (between two training steps, where Lightning itself saves on
        validation end), ``last.ckpt`` of the step that preceded it."""
        super().on_exception(trainer, pl_module, exception)
        if isinstance(exception, SIGTERMException) and trainer.validating:
            self._save_during_validation(trainer)

    def _save_during_validation(self, trainer: L.Trainer) -> None:
        if self.save_last and trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            log.warning("SIGTERM received during validation: writing last.ckpt as of step %d", trainer.global_step)
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Lightning's every-N-steps checkpoint; after a SIGTERM, also ``last.ckpt`` of this step (Lightning stops
        the run right after this hook, with :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException`)."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if agree_on_sigterm(trainer) and self.save_last and self._last_global_step_saved != trainer.global_step:
            log.warning("SIGTERM received: step %d finished, writing last.ckpt before stopping", trainer.global_step)
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        """Several processes: the ranks agree on a SIGTERM after each validation batch (Lightning then stops them all,
        unless the batch was the last) and write ``last.ckpt`` of the step that preceded it, together."""
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        if trainer.world_size > 1 and agree_on_sigterm(trainer) and not trainer.sanity_checking:
            self._save_during_validation(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        adapter = Path(self.dirpath or "") / "adapters" / "last"
        if self.push_to_hub and trainer.is_global_zero and adapter.is_dir():
            from vpo_lightning.generation.adapters import push_folder

            push_folder(adapter, str(self.hub_model_id))

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            shutil.rmtree(Path(filepath).parent / "adapters" / Path(filepath).stem, ignore_errors=True)
