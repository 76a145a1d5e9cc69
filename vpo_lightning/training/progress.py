"""What a run prints: a progress bar over optimizer steps, and Lightning's messages that tell the user nothing.

:class:`StepProgressBar` counts optimizer steps toward ``trainer.max_steps`` (RL runs have no meaningful epochs) and
shows ``reward`` (the mean over every candidate, unparsed ones scoring 0), ``parsed`` (the fraction of candidates
that parsed) and ``tok/s``. :func:`quiet_lightning_logs` drops Lightning's info lines that describe hardware the run
does not use, advertise products or echo the config back. (A run folder that holds an earlier run is refused before
anything starts: run_folders.py.)
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """Rich progress bar over the whole run: step / max_steps, reward, tokens/s, elapsed and ETA, and inside a step
    what it is doing (``now: rollout 12/16 chains, 840 tok``, then ``now: update 1/2``; :meth:`show_phase`)."""

    PHASE_EVERY_S = 0.2  # the decode loop reports every token: redraw the phase at most this often

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        console = dict(kwargs.pop("console_kwargs", None) or {})
        if not sys.stdout.isatty():  # a file or a pipe: Rich would cut the line at 80 columns, metrics first
            console.setdefault("width", 120)
        super().__init__(*args, console_kwargs=console, **kwargs)
        self.phase: str | None = None
        self._phase_shown_at = 0.0

    def show_phase(self, trainer: L.Trainer, pl_module: L.LightningModule, text: str | None,
                   force: bool = False) -> None:
        """Show ``text`` as the bar's ``now`` field until the step ends (None clears it); redrawn at most every
        :data:`PHASE_EVERY_S` seconds unless ``force``."""
        self.phase = text
        now = time.monotonic()
        if force or now - self._phase_shown_at >= self.PHASE_EVERY_S:
            self._phase_shown_at = now
            self._update_metrics(trainer, pl_module)
            self.refresh()  # Lightning's refresh thread redraws only when asked to

    @property
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        return max_steps if max_steps and max_steps > 0 else super().total_train_batches

    def configure_columns(self, trainer: L.Trainer) -> list:
        """Lightning's columns with a shorter bar and no it/s (the ETA says it), leaving room for the metrics."""
        from lightning.pytorch.callbacks.progress.rich_progress import (
            BatchesProcessedColumn,
            CustomBarColumn,
            CustomTimeColumn,
        )
        from rich.progress import TextColumn

        return [
            TextColumn("[progress.description]{task.description}"),
            CustomBarColumn(bar_width=16, complete_style=self.theme.progress_bar,
                            finished_style=self.theme.progress_bar_finished, pulse_style=self.theme.progress_bar_pulse),
            BatchesProcessedColumn(style=self.theme.batch_progress),
            CustomTimeColumn(style=self.theme.time),
        ]

    def _get_train_description(self, current_epoch: int) -> str:
        return "Training"

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.train_progress_bar_id is None:  # one bar for the whole run, not one per epoch
            super().on_train_epoch_start(trainer, pl_module)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float | dict]:
        """The logged bar metrics, then ``check``: a callback's ``progress_note`` while the run has no signal (the
        rollout's format check: no answer parsed, no reward spread)."""
        items = super().get_metrics(trainer, pl_module)
        if self.phase:
            items["now"] = self.phase
        notes = [n for cb in trainer.callbacks if (n := getattr(cb, "progress_note", None))]
        if notes:
            items["check"] = "; ".join(notes)
        return items

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self.phase = None  # the step is over
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)


# Lightning info lines with nothing for the user to act on (a GPU that exists but is unused is kept: that one is).
NOISE = (
    r"^GPU available: False, used: False",
    r"^(TPU|HPU|IPU) available: False",
    r"Tip: For seamless",  # advertisements for Lightning's cloud products
    r"^`Trainer\(\w+=1(\.0)?\)` was configured so",  # echoes the config the user wrote
)


class NoiseFilter(logging.Filter):
    """Drops log records whose message matches one of ``patterns`` (regular expressions)."""

    def __init__(self, patterns: tuple[str, ...] = NOISE) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def show_phase(trainer: L.Trainer | None, pl_module: L.LightningModule, text: str | None, force: bool = False) -> None:
    """:meth:`StepProgressBar.show_phase` on ``trainer``'s bar; nothing when it has another bar, or none."""
    bar = getattr(trainer, "progress_bar_callback", None) if trainer is not None else None
    if isinstance(bar, StepProgressBar):
        bar.show_phase(trainer, pl_module, text, force)


def quiet_lightning_logs() -> None:
    """Install :class:`NoiseFilter` on the handlers that print Lightning's messages (its own, and the root's)."""
    noise = NoiseFilter()
    for name in ("", "lightning.pytorch", "lightning.fabric", "lightning"):
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            if not any(isinstance(f, NoiseFilter) for f in handler.filters):
                handler.addFilter(noise)
        if name and not any(isinstance(f, NoiseFilter) for f in logger.filters):
            logger.addFilter(noise)


_ACTION_NEEDED: list[str] = []  # warnings that need the user to act, printed again after the run
# library messages that need no action: bitsandbytes falls back to its own CPU kernel when the kernel hub is not used
_LIBRARY_NOISE = {"bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",)}


class _Drop(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_libraries() -> None:
    """Drop library log lines that need no action (:data:`_LIBRARY_NOISE`); before the library is imported."""
    for name, prefixes in _LIBRARY_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(prefixes))


def action_needed(message: str) -> None:
    """Log a warning the user has to act on now, and keep it for :func:`print_action_needed` after the run."""
    logging.getLogger("vpo_lightning").warning(message)
    if message not in _ACTION_NEEDED:
        _ACTION_NEEDED.append(message)


def print_action_needed() -> None:
    """Print the warnings of :func:`action_needed` again, last, so that they do not scroll away; then forget them."""
    if _ACTION_NEEDED:
        lines = "\n".join(f"  - {m}" for m in _ACTION_NEEDED)
        print(f"\nwarnings that need action (also printed above):\n{lines}", file=sys.stderr, flush=True)
        _ACTION_NEEDED.clear()

