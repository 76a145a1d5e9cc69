"""glibc malloc tuning: applied on Linux/glibc, skipped when the user opts out or set MALLOC_* themselves."""

import sys

import pytest

from vpo_lightning.training.runtime import tune_malloc


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
