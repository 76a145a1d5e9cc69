"""The private uid pool of root-mode sandboxes: ``_POOL_STRIDE`` uids per trainer process, derived from its pid, and
the reaping of the processes a dead trainer's sandboxes left running (when the pool is first made)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from . import _cgroup

_POOL_BASE, _POOL_STRIDE = 1_000_000, 256  # trainer pid p owns uids _POOL_BASE + (p % 10**6) * _POOL_STRIDE + [0, 256)


def _pool_owner_alive(uid: int) -> bool:
    """Whether another process that could own ``uid``'s pool (a pid equal to its owner modulo 10**6) is running."""
    owner, me = (uid - _POOL_BASE) // _POOL_STRIDE, os.getpid()
    return any(_cgroup._alive(pid) for pid in range(owner, 1 << 22, 1_000_000) if pid > 0 and pid != me)


def reap_stale_uids(before_first_run: bool = False) -> list[int]:
    """SIGKILL the processes a dead trainer's root-mode sandboxes left running: a uid from the pool range whose
    owning trainer is gone (no running pid equal to its owner modulo 10**6 but this process, whose own range is
    reaped only ``before_first_run``), inside a user namespace that maps exactly that one uid (as bubblewrap's does;
    a container's namespace maps a range, so its processes are never touched). Returns the pids killed."""
    me, killed = os.getpid() % 1_000_000, []
    own = range(_POOL_BASE + me * _POOL_STRIDE, _POOL_BASE + (me + 1) * _POOL_STRIDE)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            if not _POOL_BASE <= uid < _POOL_BASE + 1_000_000 * _POOL_STRIDE:
                continue
            with open(f"/proc/{name}/uid_map") as f:
                if f.read().split() != [str(uid), str(uid), "1"]:
                    continue
            if (before_first_run or uid not in own) and not _pool_owner_alive(uid):
                os.kill(int(name), 9)
                killed.append(int(name))
        except (OSError, StopIteration, ValueError):
            continue
    return killed


class _UidPool:
    """Private uids for concurrent runs in root mode: ``size`` per parent process, derived from its pid.

    A caller that needs several uids at once (a candidate and its checker) takes them in one :meth:`acquire`, so
    threads never hold some while waiting for more (with as many scoring threads as uids, one uid at a time
    deadlocked every thread)."""

    def __init__(self, size: int = _POOL_STRIDE) -> None:
        if not 1 <= size <= _POOL_STRIDE:
            raise ValueError(f"a uid pool holds 1 to {_POOL_STRIDE} uids, not {size}")
        self.size = size
        base = _POOL_BASE + (os.getpid() % 1_000_000) * _POOL_STRIDE  # the owner is found back from a uid
        self._free = list(range(base, base + size))
        self._cond = threading.Condition()

    def acquire(self, n: int = 1) -> list[int]:
        """``n`` distinct uids, all at once (waits until ``n`` are free)."""
        if not 1 <= n <= self.size:
            raise ValueError(f"cannot take {n} uids from a pool of {self.size}")
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, uids: Sequence[int]) -> None:
        with self._cond:
            self._free.extend(uids)
            self._cond.notify_all()


_UIDS: _UidPool | None = None
_UIDS_LOCK = threading.Lock()
def _uid_pool() -> _UidPool:
    global _UIDS
    with _UIDS_LOCK:
        if _UIDS is None:
            if os.geteuid() == 0:
                reap_stale_uids(before_first_run=True)
            _UIDS = _UidPool()
        return _UIDS
