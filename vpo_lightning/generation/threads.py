"""The intra-op thread count of a rollout on a shared machine: the engine re-decides it before each rollout
(:func:`adapt_threads`, ``TransformersEngine(threads=...)``). Plain Python over /proc/stat; torch only to set
the count.
"""

from __future__ import annotations

import logging
import math
import os
import time

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- intra-op threads on a shared machine
# torch runs its intra-op work on an OpenMP team (libgomp, bundled with the CPU wheel) of one thread per usable core.
# Every parallel region ends at a barrier, and a decode step has hundreds of them. When another process keeps one
# of the cores busy, the team's thread on that core runs only in its time slices, and every region waits for it:
# the step collapses (docs/SPEED.md, "Threads under load"). ``threads="auto"`` sizes the team to the cores that
# other processes leave free, measured from /proc/stat at the first rollout and re-measured over each step.

# /proc/stat columns after "cpuN": user nice system idle iowait irq softirq steal (guest time is inside user)
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
_FIRST_WINDOW_S = 0.3  # the first measurement: how busy the cores are before the first rollout


def busy_jiffies(stat_text: str, cpus: set[int]) -> int:
    """Busy time (user, nice, system, irq, softirq, steal; in clock ticks) of ``cpus``, from /proc/stat's text."""
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            total += sum(int(fields[i]) for i in _BUSY_COLUMNS if i < len(fields))
    return total


def threads_for_load(allowed: int, others_busy_cores: float, threshold: float = 0.3) -> int:
    """Intra-op threads for ``allowed`` usable cores when other processes keep ``others_busy_cores`` cores' worth of
    time busy: one thread per core they leave free, at least one. A core counts as taken once others use
    ``threshold`` of it (a thread that shares a core with a busy process gets about half of it, so our own threads'
    share must not hide the other process: with 2 threads and one busy process, others measure ~0.5 core)."""
    taken = min(allowed, max(0, math.floor(others_busy_cores + 1 - threshold)))
    return max(1, allowed - taken)


def parse_threads(value: int | float | str) -> int | str:
    """``"auto"`` or a positive thread count (a YAML value may be a string); ValueError naming the fix otherwise."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"threads: {value!r} is not 'auto' or a positive integer (e.g. threads: auto, threads: 2)")
    return count


class ThreadPolicy:
    """The process's intra-op thread count, re-decided at every :meth:`update` (before each rollout).

    ``"auto"``: one thread per usable core (``os.sched_getaffinity``) that other processes leave free, never more than
    ``OMP_NUM_THREADS`` when it is set (the user's ceiling). Others' use is the cores' busy time in /proc/stat minus
    this process's own CPU time (its threads and waited-for children), over the window since the previous update
    (the first window is 0.3 s). An integer fixes the count.
    """

    def __init__(self, setting: int | str = "auto") -> None:
        self.setting = parse_threads(setting)
        self.cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        omp = os.environ.get("OMP_NUM_THREADS", "")
        self.ceiling = int(omp) if omp.isdigit() and int(omp) > 0 else max(len(self.cpus), 1)
        self.history: list[dict] = []  # one entry per update: what was measured and decided
        self._last: tuple[float, int, float] | None = None

    def _sample(self) -> tuple[float, int, float] | None:
        try:
            with open("/proc/stat") as fh:
                busy = busy_jiffies(fh.read(), self.cpus)
        except OSError:
            return None
        t = os.times()
        return time.monotonic(), busy, t.user + t.system + t.children_user + t.children_system

    def others_busy_cores(self) -> float | None:
        """Cores' worth of CPU time other processes used since the previous call (None without /proc/stat)."""
        if self._last is None:
            self._last = self._sample()
            if self._last is None:
                return None
            time.sleep(_FIRST_WINDOW_S)
        now = self._sample()
        if now is None:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        window = max(t1 - t0, 1e-3)
        return max(0.0, (busy1 - busy0) / os.sysconf("SC_CLK_TCK") - (own1 - own0)) / window

    def update(self) -> int:
        """Set and return the intra-op thread count for the next rollout and training step."""
        import torch

        if isinstance(self.setting, int):  # parse_threads gave a count, or "auto"
            threads, others = self.setting, None
        else:
            others = self.others_busy_cores()
            if others is None or not self.cpus:
                return torch.get_num_threads()
            threads = min(self.ceiling, threads_for_load(len(self.cpus), others))
        previous = torch.get_num_threads()
        if threads != previous:
            torch.set_num_threads(threads)
            log.info("intra-op threads %d -> %d (other processes busy on %s of %d cores)", previous, threads,
                     "?" if others is None else f"{others:.2f}", len(self.cpus))
        self.history = [*self.history[-99:], {"others_busy_cores": others, "threads": threads}]
        return threads


_POLICIES: dict[int | str, ThreadPolicy] = {}


def adapt_threads(setting: int | str = "auto") -> int:
    """Apply the process-wide :class:`ThreadPolicy` for ``setting`` (one per setting, kept across calls so that each
    update measures the window since the previous one) and return the thread count it chose."""
    setting = parse_threads(setting)
    if setting not in _POLICIES:
        _POLICIES[setting] = ThreadPolicy(setting)
    return _POLICIES[setting].update()
