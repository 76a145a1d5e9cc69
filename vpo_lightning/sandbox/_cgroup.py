"""Per-sandbox cgroups: one memory, pids and cpu limit for all of a run's processes together.

RLIMITs are per process: 16 processes under a 512 MiB ``RLIMIT_AS`` hold 8 GiB, and CPU spinners in their own
sessions each get a core. A cgroup made for each run (under the trainer's own cgroup, in a ``vpo-sandbox-<pid>``
folder removed at exit, or at the next start-up when the trainer was killed first: :func:`reap_stale`) caps the run
as a whole: memory (its processes, its tmpfs files and the kernel memory it
causes, such as inodes), tasks (processes and threads) and CPU (one core's worth, and the weight of the trainer's
own nice level, which the run's processes would otherwise inherit: a run does not outrank a niced trainer that
relays its calls). The run's first process (a
``sh`` that then execs the launcher) joins the cgroup before anything else starts, so no candidate code ever runs
outside it.

cgroup v1 (separate ``memory``, ``pids`` and ``cpu`` hierarchies) and v2 (one unified hierarchy, where the trainer's
cgroup must already delegate ``memory pids cpu`` to its children) are supported; writing there needs root (or a
delegated subtree). :func:`detect` says why not otherwise, and the sandbox logs that as a WARNING.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shlex
import shutil
import signal
import time
from dataclasses import dataclass

_CONTROLLERS = ("memory", "pids", "cpu")
_PERIOD_US = 100_000
_REAP_WAIT_S = 5.0  # how long start-up waits for a dead trainer's killed candidates to finish exiting


@dataclass(frozen=True)
class Cgroups:
    """Where per-run cgroups are made: one folder per v1 hierarchy (or the one v2 folder)."""

    version: int
    parents: tuple[str, ...]  # v1: memory, pids, cpu folders; v2: one folder
    shell: str

    def create(self, memory_bytes: int, tasks: int, cpus: float = 1.0) -> list[str]:
        """New cgroup folders for one run with its limits set (raises OSError if the kernel refuses)."""
        name = f"run-{os.getpid()}-{next(_COUNTER)}"  # a forked trainer process shares the base folder
        dirs = [os.path.join(parent, name) for parent in self.parents]
        try:
            for d in dirs:
                os.mkdir(d, 0o755)
            if self.version == 1:
                memory, pids, cpu = dirs
                _write(memory, "memory.limit_in_bytes", memory_bytes)
                if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
                    _write(memory, "memory.memsw.limit_in_bytes", memory_bytes)  # no swapping past the limit
                _write(pids, "pids.max", tasks)
                _write(cpu, "cpu.shares", max(2, round(1024 / 1.25 ** os.nice(0))))  # the kernel's nice weights
                _write(cpu, "cpu.cfs_period_us", _PERIOD_US)
                _write(cpu, "cpu.cfs_quota_us", int(_PERIOD_US * cpus))
            else:
                (folder,) = dirs
                _write(folder, "memory.max", memory_bytes)
                if os.path.exists(os.path.join(folder, "memory.swap.max")):
                    _write(folder, "memory.swap.max", 0)
                _write(folder, "pids.max", tasks)
                _write(folder, "cpu.weight.nice", os.nice(0))
                _write(folder, "cpu.max", f"{int(_PERIOD_US * cpus)} {_PERIOD_US}")
        except OSError:
            self.remove(dirs)
            raise
        return dirs

    def join_command(self, dirs: list[str]) -> list[str]:
        """A command prefix that moves itself into ``dirs`` and then execs the rest of the command line."""
        joins = " && ".join(f"echo $$ > {shlex.quote(os.path.join(d, 'cgroup.procs'))}" for d in dirs)
        return [self.shell, "-c", f'{joins} && exec "$@"', "vpo-sandbox"]

    def remove(self, dirs: list[str]) -> None:
        """Kill whatever is left in ``dirs`` and remove them (retried later if the kernel still holds them)."""
        for d in dirs:
            _kill_all(d)
        for d in dirs:
            if not _rmdir(d):
                _STALE.append(d)
        for d in list(_STALE):
            if d not in dirs and _rmdir(d, tries=1):
                _STALE.remove(d)


_COUNTER = itertools.count()
_STALE: list[str] = []


def _write(folder: str, name: str, value: object) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(str(value))


def _kill_all(folder: str) -> None:
    try:
        with open(os.path.join(folder, "cgroup.procs")) as f:
            pids = [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _rmdir(folder: str, tries: int = 20) -> bool:
    for i in range(tries):
        try:
            os.rmdir(folder)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if i + 1 < tries:
                time.sleep(0.01 * (i + 1))  # the kernel frees a cgroup once its last task is reaped
    return False


def _mounts() -> dict[str, tuple[str, str]]:
    """controller (or ``"unified"``) -> (mount point, mount root) from /proc/self/mountinfo."""
    found: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            root, point = fields[3], fields[4]
            if tail[0] == "cgroup2":
                found.setdefault("unified", (point, root))
            elif tail[0] == "cgroup":
                for option in tail[2].split(","):
                    if option in _CONTROLLERS:
                        found.setdefault(option, (point, root))
    return found


def _own_paths() -> dict[str, str]:
    """controller (or ``"unified"``) -> this process's cgroup path, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else ["unified"]:
                paths[c] = path
    return paths


def _folder(point: str, root: str, path: str) -> str:
    rel = path[len(root):] if root != "/" and path.startswith(root) else path
    return os.path.join(point, rel.lstrip("/"))


def detect() -> tuple[Cgroups | None, str]:
    """The per-run cgroups this process can make, or None and why not."""
    shell = shutil.which("sh") or "/bin/sh"
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as err:
        return None, f"cannot read this process's cgroups ({err})"
    if all(c in mounts and c in own for c in _CONTROLLERS):  # v1 hierarchies
        parents = tuple(_folder(*mounts[c], own[c]) for c in _CONTROLLERS)
        return _make_base(Cgroups(1, parents, shell))
    if "unified" in mounts and "unified" in own:
        folder = _folder(*mounts["unified"], own["unified"])
        try:
            with open(os.path.join(folder, "cgroup.subtree_control")) as f:
                enabled = set(f.read().split())
        except OSError as err:
            return None, f"cgroup v2 at {folder} is not readable ({err})"
        if not set(_CONTROLLERS) <= enabled:
            return None, (f"cgroup v2: {folder} does not delegate {' '.join(_CONTROLLERS)} to its children (its "
                          f"cgroup.subtree_control has {' '.join(sorted(enabled)) or 'nothing'}); run the trainer in "
                          "a cgroup whose parent enables them, e.g. systemd-run --scope -p Delegate=yes")
        return _make_base(Cgroups(2, (folder,), shell))
    return None, "no cgroup v1 memory/pids/cpu hierarchies and no cgroup v2 mounted"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: a process of another user
        return True
    return True


def _stale_bases(parents: tuple[str, ...]) -> list[str]:
    """The ``vpo-sandbox-<pid>`` folders under ``parents`` whose trainer is gone."""
    found = []
    for parent in parents:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            owner = name.removeprefix("vpo-sandbox-")
            if name.startswith("vpo-sandbox-") and owner.isdigit() and not _alive(int(owner)):
                found.append(os.path.join(parent, name))
    return found


def _runs(base: str) -> list[str]:
    try:
        return [os.path.join(base, d) for d in os.listdir(base) if d.startswith("run-")]
    except OSError:
        return []


def reap_stale(parents: tuple[str, ...], within: float = _REAP_WAIT_S) -> list[str]:
    """Remove the ``vpo-sandbox-<pid>`` folders under ``parents`` whose trainer is gone (killed before its exit
    handler ran), killing whatever still runs in their run cgroups. Returns the folders removed.

    Every pass kills what is left in all of them (all hierarchies first), then tries each folder once; passes repeat
    for up to ``within`` seconds. Measured on cgroup v1 under load: a memory folder whose tasks were just killed can
    answer EBUSY (with an empty ``cgroup.procs``) for as long as one pass keeps retrying it, and is removed at once
    by the next pass. What is still held at the end is retried at the next run's removal and at exit."""
    removed: list[str] = []
    end = time.monotonic() + within
    for i in itertools.count():
        stale = _stale_bases(parents)
        for run in (run for base in stale for run in _runs(base)):
            _kill_all(run)
        for base in stale:
            runs_gone = [_rmdir(run, tries=1) for run in _runs(base)]  # every run is tried, none short-circuits
            if all(runs_gone) and _rmdir(base, tries=1):
                removed.append(base)
        left = [base for base in stale if os.path.isdir(base)]
        if not left or time.monotonic() >= end:
            _STALE.extend(d for base in left for d in (*_runs(base), base) if d not in _STALE)
            return removed
        time.sleep(min(0.02 * (i + 1), 0.25))
    return removed  # unreachable: itertools.count() does not end


def _make_base(cgroups: Cgroups) -> tuple[Cgroups | None, str]:
    """``cgroups`` moved into a ``vpo-sandbox-<pid>`` folder of its own (removed at exit), or None and why. Folders
    that a dead trainer left beside it are removed first (:func:`reap_stale`)."""
    reap_stale(cgroups.parents)
    made: list[str] = []
    try:
        for parent in cgroups.parents:
            base = os.path.join(parent, f"vpo-sandbox-{os.getpid()}")
            if not os.path.isdir(base):
                os.mkdir(base, 0o755)
                made.append(base)
            if cgroups.version == 2:
                _write(base, "cgroup.subtree_control", "+memory +pids +cpu")
    except OSError as err:
        for d in made:
            _rmdir(d, tries=1)
        return None, f"cannot create a cgroup under {', '.join(cgroups.parents)} ({err.strerror or err})"
    bases = tuple(os.path.join(p, f"vpo-sandbox-{os.getpid()}") for p in cgroups.parents)
    owner = os.getpid()
    atexit.register(lambda: [_rmdir(d, tries=1) for d in (*_STALE, *bases)] if os.getpid() == owner else None)
    return Cgroups(cgroups.version, bases, cgroups.shell), ""
