"""How a ``vpo`` process starts: library noise quieted, the log format, malloc tuning.

:func:`prepare_process` and :func:`tune_malloc` run once at the start of every ``vpo`` command
(:func:`vpo_lightning.launcher.main`); how each command answers bad input is :func:`vpo_lightning.app.report_error`.

Malloc tuning.
glibc's malloc returns every large block (>= 32 MiB-ish, dynamic threshold) to the kernel with ``munmap`` and trims
the heap top eagerly. A training step allocates and frees logits-sized buffers (hundreds of MB) many times, so with
the defaults the kernel re-faults the same pages on every micro-batch. Keeping freed memory in the heap removes that
cost (measured in ``benchmarks/vs_trl.py``). The same effect is available to any program through the environment
variables ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=... MALLOC_TOP_PAD_=...``; ``mallopt`` sets them in-process.
The price is that freed memory is never handed back: shapes change from step to step (prompt and completion
lengths), so the freed blocks fragment the heap and resident memory grows over a long run (issue 56). The rollout
callback therefore calls :func:`trim_malloc` once after every optimizer step (``rollout.trim_memory``): within a step
the buffers are reused, between steps the free pages go back to the kernel (``benchmarks/rss_long_run.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import warnings

log = logging.getLogger(__name__)
_QUIET = (  # Lightning warnings that do not apply to this app's design
    ".*ModelCheckpoint with manual optimization.*",  # checkpoints after the step are what we want
    ".*module\\(s\\) in eval mode.*",  # dropout-free frozen base modules
    ".*IterableDataset. has .__len__. defined.*",  # one process, position-aware stream
    ".*litlogger.*",
    ".*is_gradient_checkpointing.*",
    ".*Checkpoint directory .* exists and is not empty.*",  # config.yaml is written there first; run_folders.py
    ".*LeafSpec.* is deprecated.*",  # inside Lightning's pytree helper, nothing the user can change
    ".*resuming from a checkpoint that ended before the epoch ended.*",  # the datamodule resumes at its position
    ".*args parameter is intended to run from within Python.*",  # main() passes sys.argv on as args, on purpose
)

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4


@functools.cache  # find_library runs ldconfig in a subprocess: once per process, not once per step
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def tune_malloc(mmap_max: int = 0, trim_threshold: int = 4 << 30, top_pad: int = 256 << 20) -> bool:
    """Keep freed memory in the glibc heap instead of returning it to the kernel after every large free.

    Returns True when the settings were applied. A no-op (False) outside Linux/glibc, when the user already set any
    ``MALLOC_*_`` variable (their choice wins), or when ``VPO_MALLOC_TUNING=0``.
    """
    if os.environ.get("VPO_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if any(key in os.environ for key in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")):
        return False
    mallopt = getattr(_libc(), "mallopt", None)  # musl and other libcs have none
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    top_pad = min(top_pad, 2**31 - 1)
    trim_threshold = min(trim_threshold, 2**31 - 1)
    applied = all(
        mallopt(param, value) == 1
        for param, value in ((_M_MMAP_MAX, mmap_max), (_M_TRIM_THRESHOLD, trim_threshold), (_M_TOP_PAD, top_pad))
    )
    if applied:
        log.debug("malloc tuned: mmap_max=%d trim_threshold=%d top_pad=%d", mmap_max, trim_threshold, top_pad)
    return applied


def trim_malloc() -> bool:
    """Hand the free pages of every glibc heap back to the kernel (``malloc_trim(0)``); True when glibc did it.

    Memory still in use stays where it is; only whole free pages are released (``madvise``), so the next allocation
    of that memory faults its pages in again. A no-op (False) outside Linux/glibc.
    """
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)  # musl and other libcs have none
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)  # returns 1 if memory was released, 0 if there was none to release: both are success
    return True


def prepare_process() -> None:
    """What every ``vpo`` command sets up first: quiet library noise that needs no action, and the log format."""
    from vpo_lightning.training import progress

    for pattern in _QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    progress.quiet_lightning_logs()
    progress.quiet_libraries()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
