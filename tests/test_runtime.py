"""glibc malloc tuning: applied on Linux/glibc, skipped when the user opts out or set MALLOC_* themselves; malloc_trim
hands freed heap pages back (resident memory, no timing); the intra-op thread policy for a shared machine (issue 43):
pure decisions with exact values, no timing."""

import ctypes
import ctypes.util
import os
import sys

import pytest
import torch

from vpo_lightning.generation.threads import ThreadPolicy, busy_jiffies, parse_threads, threads_for_load
from vpo_lightning.training.runtime import trim_malloc, tune_malloc


def test_opt_out_env_var_disables_tuning(monkeypatch):
    monkeypatch.setenv("VPO_MALLOC_TUNING", "0")
    assert tune_malloc() is False


def test_user_malloc_env_wins(monkeypatch):
    monkeypatch.delenv("VPO_MALLOC_TUNING", raising=False)
    monkeypatch.setenv("MALLOC_TOP_PAD_", "1024")
    assert tune_malloc() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc-only")
def test_applied_on_linux(monkeypatch):
    for key in ("VPO_MALLOC_TUNING", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        monkeypatch.delenv(key, raising=False)
    import ctypes.util

    if ctypes.util.find_library("c") is None:
        pytest.skip("no libc found")
    # values far beyond int range are clamped rather than overflowing the C int argument
    assert tune_malloc(trim_threshold=1 << 40, top_pad=1 << 40) is True


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                    reason="malloc_trim is glibc-only")
def test_trim_malloc_returns_freed_heap_pages_to_the_kernel():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 10  # below every mmap threshold: the blocks come from the heap, as a training step's small buffers do
    blocks = [libc.malloc(size) for _ in range(2048)]  # 128 MiB
    for b in blocks:
        ctypes.memset(b, 1, size)  # touched: resident
    keep = libc.malloc(size)  # a live block above them: free() alone cannot shrink the heap past it
    for b in blocks:
        libc.free(b)
    before = _rss()
    assert trim_malloc() is True
    released = before - _rss()
    libc.free(keep)
    assert released > 64 << 20  # most of the 128 MiB freed below the live block went back


STAT = """cpu  100 1 50 1000 10 2 3 4 0 0
cpu0 60 1 30 500 5 2 3 4 0 0
cpu1 40 0 20 500 5 0 0 0 7 0
intr 12345 0 0
ctxt 999
"""


def test_busy_jiffies_sums_busy_columns_of_the_chosen_cpus():
    # cpu0: user 60 + nice 1 + system 30 + irq 2 + softirq 3 + steal 4 = 100 (idle 500 and iowait 5 are not busy)
    assert busy_jiffies(STAT, {0}) == 100
    # cpu1: 40 + 20 = 60; its guest column (7) is already inside user and is not added again
    assert busy_jiffies(STAT, {1}) == 60
    assert busy_jiffies(STAT, {0, 1}) == 160
    assert busy_jiffies(STAT, set()) == 0  # the aggregate "cpu" line never counts


@pytest.mark.parametrize(("allowed", "others", "threads"), [
    (2, 0.0, 2),    # quiet: one thread per core
    (2, 0.05, 2),   # daemons' crumbs do not take a core
    (2, 0.29, 2),   # below the 0.3 threshold
    (2, 0.3, 1),    # at the threshold the core counts as taken
    (2, 0.5, 1),    # one busy process sharing a core with our second thread: it gets ~half the core
    (2, 1.0, 1),    # one core fully busy
    (2, 1.9, 1),    # both cores busy: still one thread (never zero)
    (8, 2.6, 5),    # floor(2.6 + 0.7) = 3 cores taken
    (1, 0.9, 1),
])
def test_threads_for_load_leaves_busy_cores_out(allowed, others, threads):
    assert threads_for_load(allowed, others) == threads


def test_parse_threads_accepts_auto_and_positive_integers():
    assert parse_threads("auto") == "auto"
    assert parse_threads(3) == 3
    assert parse_threads("2") == 2  # as a YAML string
    for bad in (0, -1, "two", 2.5, None):
        with pytest.raises(ValueError, match="threads: .* is not 'auto' or a positive integer"):
            parse_threads(bad)


def test_auto_policy_follows_the_measured_load_under_the_ceiling(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        policy = ThreadPolicy("auto")
        policy.cpus = {0, 1}  # decide for two usable cores whatever this machine has
        assert policy.ceiling == 2
        loads = iter([1.0, 0.0, 0.4])  # one core busy, then quiet, then a busy process sharing our second core
        monkeypatch.setattr(policy, "others_busy_cores", lambda: next(loads))
        assert policy.update() == 1 and torch.get_num_threads() == 1
        assert policy.update() == 2 and torch.get_num_threads() == 2
        assert policy.update() == 1 and torch.get_num_threads() == 1
        assert [h["threads"] for h in policy.history] == [1, 2, 1]
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert ThreadPolicy("auto").ceiling == 1  # the user's OMP_NUM_THREADS stays a ceiling
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert ThreadPolicy("auto").ceiling == len(os.sched_getaffinity(0))  # else every usable core
    finally:
        torch.set_num_threads(before)


def test_fixed_policy_sets_the_count():
    before = torch.get_num_threads()
    try:
        assert ThreadPolicy(2).update() == 2 and torch.get_num_threads() == 2
        assert ThreadPolicy("1").update() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_engine_rejects_a_bad_threads_setting():
    from vpo_lightning.generation.engines import TransformersEngine

    with pytest.raises(ValueError, match="threads: 'many'"):
        TransformersEngine(threads="many")
    assert TransformersEngine(threads="3").threads == 3
