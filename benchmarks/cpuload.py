"""A controlled background load for the speed benchmarks (issue 43), and the names their results carry.

``--load busy:N`` starts N processes that spin on one core each (pinned with ``sched_setaffinity``; by default the
last N cores this benchmark may run on), at normal priority like a user's other job, for the duration of the
benchmark, and stops them at the end; ``busy:N@C1,C2`` names the cores. ``none`` (the default) starts nothing. The
results record the load's pids and cores, the CPU seconds each busy process spun (from ``os.wait4``: proof that it
ran) and the 1-minute load average, next to the CPU kind and dtype (:func:`results_label`).

    with BusyLoad.from_spec("busy:1") as load:     # one core busy while the benchmark runs
        ...
    record = load.record()                          # {"spec": "busy:1", "processes": [{"pid":..., "core": 1, ...}]}
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

# a tight loop that never allocates: it takes its core's time without touching memory bandwidth
_SPIN = "while True:\n    pass\n"


def parse_load(spec: str, allowed: list[int]) -> list[int]:
    """The cores to keep busy for ``spec`` (``none``, ``busy:N`` or ``busy:N@C1,C2``), given the cores this process
    may use (sorted). ``busy:N`` takes the last N of them. Raises ``ValueError`` naming the fix on a bad spec."""
    if spec in ("", "none"):
        return []
    kind, _, rest = spec.partition(":")
    count, _, cores = rest.partition("@")
    if kind != "busy" or not count.isdigit() or int(count) < 1:
        raise ValueError(f"--load {spec!r}: expected 'none', 'busy:N' or 'busy:N@CORE,CORE' (e.g. busy:1)")
    n = int(count)
    if cores:
        chosen = [int(c) for c in cores.split(",") if c.strip().isdigit()]
        if len(chosen) != n or len(set(chosen)) != n:
            raise ValueError(f"--load {spec!r}: name exactly {n} distinct core number(s) after '@'")
        missing = [c for c in chosen if c not in allowed]
        if missing:
            raise ValueError(f"--load {spec!r}: core(s) {missing} are not in this process's CPU set {allowed}")
        return chosen
    if n > len(allowed):
        raise ValueError(f"--load {spec!r}: only {len(allowed)} core(s) available ({allowed})")
    return sorted(allowed)[-n:]


@dataclass
class BusyLoad:
    """N spinning processes, one per core, started on ``__enter__`` and stopped on ``__exit__``."""

    spec: str
    cores: list[int]
    processes: list[dict] = field(default_factory=list)
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @classmethod
    def from_spec(cls, spec: str) -> BusyLoad:
        return cls(spec or "none", parse_load(spec, sorted(os.sched_getaffinity(0))))

    def __enter__(self) -> BusyLoad:
        for core in self.cores:
            proc = subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL)
            os.sched_setaffinity(proc.pid, {core})
            self._procs.append(proc)
            self.processes.append({"pid": proc.pid, "core": core, "nice": os.getpriority(os.PRIO_PROCESS, proc.pid),
                                   "started": time.time()})
        if self._procs:
            time.sleep(0.5)  # let the load settle before the benchmark starts
            where = ", ".join(f"pid {p['pid']} on core {p['core']}" for p in self.processes)
            print(f"[load] {self.spec}: busy process(es) {where}", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc) -> None:
        for proc, info in zip(self._procs, self.processes):
            if proc.poll() is None:
                proc.terminate()
            _, _, usage = os.wait4(proc.pid, 0)
            info["stopped"] = time.time()
            info["cpu_s"] = usage.ru_utime + usage.ru_stime  # how much it spun: ~ its wall time on a free core
            info["wall_s"] = info["stopped"] - info["started"]
        self._procs.clear()

    def record(self) -> dict:
        """What the results JSON says about the load."""
        return {"spec": self.spec, "busy_cores": self.cores, "processes": self.processes,
                "loadavg_1m_at_record": os.getloadavg()[0]}


def results_label(cpu: dict, dtype: str, load: str) -> str:
    """``<cpu kind>_<dtype>`` plus ``_busy1``-style suffix under a load: the results file names' middle part."""
    from roofline import cpu_kind

    suffix = "" if load in ("", "none") else "_" + load.replace(":", "").replace("@", "at").replace(",", "-")
    return f"{cpu_kind(cpu)}_{dtype}{suffix}"
