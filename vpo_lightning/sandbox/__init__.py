"""Run model-written Python where it can neither read the answers nor reach the trainer.

Threat model. In RL the code under test is written by a policy that is rewarded for passing: anything a candidate
can read (reference solutions, hidden tests, the project's data), write (files a later candidate or the trainer
reads), reach (sockets, other processes) or forge (the verdict, the trainer's time) becomes a reward it learns to
take. So the candidate is isolated by the kernel, not by Python, and nothing it sends back is trusted.

Entry points (one launcher):

* :func:`run_python` (and :func:`run_many`) runs a whole program once and returns its exit status and capped
  output, like ``python main.py``.
* :class:`FunctionSession` loads a program once and serves calls to its functions over a private pipe: plain-data
  arguments in, a plain-data answer out (tagged JSON, never pickle; see :mod:`._codec`). :meth:`~FunctionSession.
  call_raw` / :meth:`~FunctionSession.call_frame` return or relay answers undecoded, so the code reward computes
  verdicts in a second sandbox (the checker) and the trainer decodes nothing a candidate wrote.

Modes (probed once, logged at the first use: ``INFO`` for kernel isolation, ``WARNING`` for weak or for a missing
layer, ``ERROR`` when code will be refused; see :func:`isolation_info`; ``VPO_SANDBOX_ISOLATION=root|userns|weak``
forces one):

* ``root`` (the trainer runs as root; ``bwrap`` from bubblewrap and util-linux ``setpriv`` installed): each run
  drops to a private unprivileged uid from a per-process pool (a candidate and its checker take theirs in one step:
  :func:`function_sessions`), then bubblewrap gives it new user, mount, PID, network, IPC, UTS and cgroup namespaces
  and forbids nested user namespaces. Nothing a candidate does is done as root or with a capability over anything
  real.
* ``userns`` (not root, unprivileged user namespaces allowed, ``bwrap`` installed): the same namespaces, as the
  caller's uid. Refused for a root trainer: there the candidate would be uid 0 with every capability in its
  namespace, and files owned by real root (``/proc/sys``) would be writable. As root, the choice is ``root`` mode
  or a refusal whose message names what is missing (``setpriv``, bubblewrap, a readable interpreter).
* ``weak`` (no bubblewrap or no namespaces): only with ``VPO_SANDBOX_ALLOW_WEAK_ISOLATION=1``. A plain subprocess in
  a new session with the rlimits and the audit hook below: the candidate can read everything the trainer's user
  can read (reference solutions, data) and write wherever that user can. Without the flag the sandbox refuses
  (:class:`SandboxUnavailable`, whose message says how to install bubblewrap or opt in).

Layers in ``root``/``userns``, none of which depends on the candidate's cooperation:

* Filesystem: a root that is an empty read-only tmpfs holding only the interpreter (read-only: the executable, its
  standard library with ``site-packages`` hidden, the shared libraries ``ldd`` reports for it and its extension
  modules, and ``libgcc_s``, which glibc loads when a thread exits), a fresh ``/proc`` of its own PID namespace
  mounted read-only (no ``/proc/sys`` file, ``sysrq-trigger`` or other kernel interface can be opened for writing),
  a minimal read-only ``/dev``, its run directory ``/sandbox`` (a tmpfs of ``max_disk_mb``, default 32 MiB, the
  only writable place; ``/tmp`` and ``/var/tmp`` point to it; it vanishes with the run), and the bootstrap's two
  modules. Nothing of the project, its data, its virtual environment, other packages, ``/etc``, ``/root`` or the
  host's ``/tmp``/``/dev/shm``. No third-party package is available to candidates (none of the built-in tasks needs
  one). When the trainer's interpreter is not readable by the private uid (a pyenv under ``/root``), the first of
  ``/usr/bin/python3`` or ``python3`` on PATH that works is used.
* Network: the namespace has only its own loopback interface; with no host path mounted and abstract sockets scoped
  to the namespace, no Unix socket outside is reachable either; and seccomp allows no socket family but
  ``AF_UNIX`` (``AF_VSOCK`` is not confined by network namespaces).
* System calls: a seccomp filter (:mod:`._seccomp`, classic BPF built here, loaded by bubblewrap before the
  interpreter starts) refuses what candidates never need: ``ptrace``/``process_vm_*``, the mount family, new
  namespaces, keyrings, ``bpf``, ``perf_event_open``, ``memfd_create``, ``userfaultfd``, ``io_uring``, module and
  ``kexec`` loading, clock and host settings, NUMA page moves; calls of another architecture kill the process.
* Resources: a cgroup per run (:mod:`._cgroup`, under the trainer's own; v1, or v2 where the trainer's cgroup
  delegates the controllers) caps all its processes together: memory (``memory_mb`` + ``max_disk_mb``, tmpfs files
  and the kernel memory the run causes included), tasks (``max_procs`` + 2, threads included) and CPU (one core's
  worth, and an equal share against other runs), so that forked processes and setsid spinners neither multiply the
  budget nor starve a neighbour.

In every mode the child is ``python -I -S -B -c "import _child; _child.main()"`` (the bootstrap in
:mod:`._child` and :mod:`._codec`, copied into the sandbox; no site, no user environment, nothing of the parent's
state) with a scrubbed environment (``PATH``, ``HOME`` = ``TMPDIR`` = the run directory, ``LANG``), stdin/out/err
pipes read by the parent up to a byte cap (then the run is killed), a wall-clock deadline (then its PID namespace,
or in weak mode its process group, is killed), and limits set by the bootstrap before any candidate code runs
(``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` = 0). The
bootstrap then installs a ``sys.addaudithook`` guard, a second layer only: it refuses sockets, ``ctypes``, process
creation, signals to other processes, writes outside the run directory and other processes' ``/proc``, and binds
its state in closures so that rebinding globals does not switch it off. A candidate can still switch it off (find
the hook through ``gc`` and rewrite its closure cells); the attack tests do exactly that and then check that the
kernel layers above still hold.

A machine that lacks a layer (no filter for its architecture, bubblewrap refusing ``--seccomp``, no writable
cgroups) still runs candidates, with a WARNING at the first use that names the layer and why;
``VPO_SANDBOX_STRICT=1`` makes that a refusal (:class:`SandboxUnavailable`). :func:`isolation_info` lists the
missing layers.

What comes back is bounded: output by ``max_output_bytes``, answer frames by ``max_message_bytes``. The built-in
tasks compare answers in a checker sandbox and the trainer only compares verdict bytes; answers the trainer does
decode (:meth:`FunctionSession.call`) are refused when they carry hash-collision floods (which would make building a
set or dict quadratic).

Known gaps: a kernel bug in a system call the filter allows is the remaining way out (the filter is a deny list: new
kernels' new calls are allowed until listed); the filter exists for x86_64 only; without writable cgroups (as a
normal user on most machines) memory is bounded per process (``RLIMIT_AS`` times ``max_procs``), CPU per process
(``RLIMIT_CPU``) and by the deadline, and spinners can crowd a neighbour; the run directory's tmpfs has a size cap but
no inode cap (bubblewrap cannot set one): empty files cost kernel memory, which the run's memory cgroup counts, but
which nothing else bounds before the deadline; the v2 cgroup path is untested on the development machine (v1).

Design tradeoff (code reward): one candidate process per candidate, not per test (starting a sandbox dominates the
cost), plus one checker process. Tests share the candidate's process state (as in HumanEval's own ``check``),
which cannot forge a verdict since verdicts are computed in the checker. A test that kills, exits, hangs or floods
its process fails alone and the next test gets a fresh process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from . import _cgroup, _codec, _seccomp

log = logging.getLogger(__name__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_CHILD_FILES = ("_child.py", "_codec.py")
_BOX = "/sandbox"  # the run directory inside the sandbox (a size-capped tmpfs)
_LIB = "/opt/vpo-sandbox"  # where the child's bootstrap modules are copied inside the sandbox
WEAK_FLAG = "VPO_SANDBOX_ALLOW_WEAK_ISOLATION"
_LAUNCHER_TASKS = 2  # tasks of a run that are not the candidate's: bubblewrap's outer process and a spare
STRICT_FLAG = "VPO_SANDBOX_STRICT"  # a layer missing here (seccomp, cgroup limits) is an error, not a WARNING


def _boot(lib: str) -> str:
    """The ``-c`` program: import the bootstrap module from ``lib`` and run it (nothing else of the parent)."""
    return f"import sys; sys.path.insert(0, {lib!r}); import _child; _child.main()"


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``cpu_s`` defaults to the wall-clock timeout rounded up, plus one second."""

    timeout_s: float = 5.0
    cpu_s: int | None = None
    memory_mb: int = 512
    max_output_bytes: int = 64_000
    max_procs: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    guard: bool = True
    max_disk_mb: int = 32

    def argv(self, mode: str, res_fd: int) -> list[str]:
        cpu = self.cpu_s if self.cpu_s is not None else int(self.timeout_s) + 2
        return [mode, str(res_fd), str(max(1, cpu)), str(self.memory_mb), str(self.max_procs),
                str(self.max_file_mb), str(self.max_open_files), "1" if self.guard else "0"]


@dataclass
class SandboxResult:
    """What a :func:`run_python` run did.

    Attributes:
        returncode: exit status (negative: killed by that signal); None if it never started.
        stdout: decoded standard output, at most ``max_output_bytes`` bytes.
        stderr: decoded standard error, at most ``max_output_bytes`` bytes.
        timed_out: the wall-clock deadline passed and the run was killed.
        killed_reason: ``"timeout"``, ``"output_limit"`` or None.
        duration_s: wall-clock seconds.
        isolation: the isolation mode used (see :func:`isolation_info`).
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    duration_s: float
    isolation: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


class SandboxUnavailable(RuntimeError):
    """No kernel isolation here and weak mode was not opted into: untrusted code is refused."""


# ----------------------------------------------------------------------------------------------- isolation


@dataclass(frozen=True)
class _Isolation:
    kind: str  # "root" | "userns" | "weak" | "unavailable"
    python: str
    bwrap: str | None = None
    setpriv: str | None = None
    binds: tuple[str, ...] = ()  # bubblewrap arguments that lay out the interpreter read-only
    reason: str = ""
    seccomp: bytes | None = None  # the filter bubblewrap loads (None: not available here)
    cgroups: _cgroup.Cgroups | None = None  # where per-run cgroups are made (None: per-process rlimits only)
    missing: tuple[str, ...] = ()  # layers this machine lacks, each with why (logged as a WARNING)


class _UidPool:
    """Private uids for concurrent runs in root mode: ``size`` per parent process, derived from its pid.

    A caller that needs several uids at once (a candidate and its checker) takes them in one :meth:`acquire`, so
    threads never hold some while waiting for more (with as many scoring threads as uids, one uid at a time
    deadlocked every thread)."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        base = 1_000_000 + (os.getpid() % 1_000_000) * size
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


_ISO: _Isolation | None = None
_ISO_LOCK = threading.Lock()
_UIDS: _UidPool | None = None
_UIDS_LOCK = threading.Lock()


def _uid_pool() -> _UidPool:
    global _UIDS
    with _UIDS_LOCK:
        if _UIDS is None:
            _UIDS = _UidPool()
        return _UIDS


def _python_binds(python: str) -> tuple[str, ...] | None:
    """Read-only bubblewrap binds for ``python``: the executable, its standard library (its ``site-packages``
    hidden) and the shared libraries it and its extension modules load (from ``ldd``). None if unknown."""
    query = ("import json, sys, sysconfig; p = sysconfig.get_paths(); d = sysconfig.get_config_var('DESTSHARED'); "
             "print(json.dumps([sys.executable, p['stdlib'], p['platstdlib'], d]))")
    try:
        out = subprocess.run([python, "-I", "-S", "-c", query], capture_output=True, text=True, timeout=30)
        exe, stdlib, platstdlib, dynload = json.loads(out.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    exe = os.path.realpath(exe)
    dirs = [d for d in dict.fromkeys((stdlib, platstdlib, dynload)) if d and os.path.isdir(d)]
    objects = [exe] + [os.path.join(dynload, f) for f in os.listdir(dynload) if f.endswith(".so")] if dynload and \
        os.path.isdir(dynload) else [exe]
    ldd = shutil.which("ldd")
    libs: dict[str, str] = {}
    if ldd:
        try:
            out = subprocess.run([ldd, *objects], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        for line in out.stdout.splitlines():
            parts = line.split()
            path = parts[2] if len(parts) >= 3 and parts[1] == "=>" else parts[0] if parts else ""
            if path.startswith("/") and os.path.exists(path):
                libs[path] = os.path.realpath(path)
    # glibc dlopens libgcc_s when a thread exits or is cancelled (pthread_exit unwinds through it); no ldd lists it,
    # and without it a program that leaves a running daemon thread at exit dies with SIGSEGV.
    for folder in {os.path.dirname(p) for p in libs if os.path.basename(p).startswith("libc.so")}:
        gcc = os.path.join(folder, "libgcc_s.so.1")
        if os.path.exists(gcc):
            libs[gcc] = os.path.realpath(gcc)
    binds = ["--ro-bind", exe, exe]
    for d in dirs:
        binds += ["--ro-bind", d, d]
        site = os.path.join(d, "site-packages")
        if os.path.isdir(site):
            binds += ["--tmpfs", site]
    for path, real in sorted(libs.items()):
        binds += ["--ro-bind", real, path]
    return tuple(binds)


def _candidate_pythons() -> list[str]:
    found = [os.path.realpath(sys.executable), getattr(sys, "_base_executable", ""), "/usr/bin/python3",
             shutil.which("python3") or ""]
    return list(dict.fromkeys(os.path.realpath(p) for p in found if p and os.path.exists(p)))


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def _weak_allowed() -> bool:
    return _flag(WEAK_FLAG)


def _detect() -> _Isolation:
    forced = os.environ.get("VPO_SANDBOX_ISOLATION", "auto").strip().lower() or "auto"
    bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
    as_root = os.geteuid() == 0
    kinds = ["root", "userns"] if forced == "auto" else [forced]
    why = []
    for kind in kinds:
        if kind not in ("root", "userns"):
            continue
        if kind == "userns" and as_root:  # the candidate would be uid 0 with every capability in its namespace
            why.append("userns: refused for a root trainer (the candidate would run as uid 0 with capabilities in "
                       "its namespace); root mode drops to a private uid and needs util-linux setpriv "
                       f"({'found' if setpriv else 'not found: apt-get install -y util-linux'})")
            continue
        if bwrap is None or (kind == "root" and (not as_root or setpriv is None)):
            why.append(f"{kind}: needs {'root, setpriv (util-linux) and ' if kind == 'root' else ''}bubblewrap (bwrap)")
            continue
        for python in _candidate_pythons():
            binds = _python_binds(python)
            if binds is None:
                continue
            iso = _with_layers(_Isolation(kind, python, bwrap, setpriv if kind == "root" else None, binds))
            error = _probe(iso)
            for layer in ("cgroups", "seccomp"):  # a layer the kernel refuses is dropped, with a WARNING
                if error and getattr(iso, layer) is not None and not _probe(replace(iso, **{layer: None})):
                    iso = replace(iso, **{layer: None}, missing=(*iso.missing, f"{layer}: refused here "
                                                                 f"({error.strip()[-200:]})"))
                    error = ""
            if error:
                why.append(f"{kind} with {python}: {error}")
                continue
            if iso.missing and _flag(STRICT_FLAG):
                return _Isolation("unavailable", "", reason=f"{STRICT_FLAG}=1 and this machine lacks: "
                                  + "; ".join(iso.missing))
            return iso
    reason = "; ".join(why) or f"VPO_SANDBOX_ISOLATION={forced}"
    if _weak_allowed() and forced in ("auto", "weak"):
        return _Isolation("weak", os.path.realpath(sys.executable), reason=reason)
    return _Isolation("unavailable", "", reason=reason)


@lru_cache(maxsize=1)
def _cgroups() -> tuple[_cgroup.Cgroups | None, str]:
    return _cgroup.detect()


def _with_layers(iso: _Isolation) -> _Isolation:
    """``iso`` with the seccomp filter and per-run cgroups, and the layers this machine lacks listed in ``missing``."""
    program = _seccomp.program()
    missing = [] if program else [f"seccomp: no filter for this machine ({platform.machine()}), so candidates can "
                                  "make any system call their namespaces allow"]
    cgroups, why = _cgroups()
    if cgroups is None:
        missing.append(f"cgroup limits: {why}; memory, tasks and CPU are then limited per process (RLIMIT_AS, "
                       "RLIMIT_NPROC, RLIMIT_CPU), so one run can hold max_procs x memory_mb and several cores")
    return replace(iso, seccomp=program, cgroups=cgroups, missing=tuple(missing))


def _probe(iso: _Isolation) -> str:
    """'' if ``iso`` can run the bootstrap in the sandbox, else why not."""
    try:
        child = _Child("print('ok')", SandboxLimits(timeout_s=30), "run", iso=iso)
    except (OSError, SandboxUnavailable) as e:
        return str(e)
    try:
        out, err = child.proc.communicate(timeout=30)
        return "" if child.proc.returncode == 0 and out == b"ok\n" else (err or out).decode(errors="replace")[-300:]
    except subprocess.TimeoutExpired:
        return "timed out"
    finally:
        child.close()


def _isolation() -> _Isolation:
    global _ISO
    with _ISO_LOCK:
        if _ISO is None:
            _ISO = _detect()
            if _ISO.kind in ("root", "userns"):
                log.info("sandbox isolation: %s (bubblewrap: own mount/PID/network/IPC namespaces, %s, seccomp %s, "
                         "python %s)", _ISO.kind, "private uid per run" if _ISO.kind == "root" else "the caller's uid",
                         "on" if _ISO.seccomp else "OFF", _ISO.python)
                for gap in _ISO.missing:
                    log.warning("sandbox isolation is weaker than it should be: %s (set %s=1 to refuse to run "
                                "instead)", gap, STRICT_FLAG)
            elif _ISO.kind == "weak":
                log.warning("sandbox isolation: WEAK (%s=1): model-written code runs with no kernel isolation, only "
                            "rlimits and an audit hook; it can read the filesystem. Why no isolation: %s",
                            WEAK_FLAG, _ISO.reason)
            else:
                log.error("sandbox isolation: none available, untrusted code will be refused (%s)", _ISO.reason)
        return _ISO


def isolation_info() -> dict[str, Any]:
    """The sandbox mode here: ``{"kind": "root"|"userns"|"weak"|"unavailable", "python": path, ...}``."""
    iso = _isolation()
    strong = iso.kind in ("root", "userns")
    return {"kind": iso.kind, "python": iso.python, "kernel_isolation": strong, "network_namespace": strong,
            "pid_namespace": strong, "mount_namespace": strong, "private_uid": iso.kind == "root",
            "seccomp": iso.seccomp is not None, "cgroup": iso.cgroups.version if iso.cgroups else None,
            "missing": list(iso.missing), "reason": iso.reason}


# ------------------------------------------------------------------------------------------------ processes


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@lru_cache(maxsize=1)
def _child_sources() -> tuple[bytes, ...]:
    return tuple(open(os.path.join(_HERE, name), "rb").read() for name in _CHILD_FILES)


def _remove_dir(path: str) -> None:
    def retry(func: Any, target: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


class _Child:
    """One sandboxed interpreter: its process, uid and pipes, and how to kill and clean it."""

    def __init__(self, program: str, limits: SandboxLimits, mode: str, merge_stderr: bool = False,
                 iso: _Isolation | None = None, uid: int | None = None) -> None:
        self.iso = iso or _isolation()
        if self.iso.kind == "unavailable":
            raise SandboxUnavailable(
                "the sandbox has no kernel isolation here, so it refuses to run untrusted code. Install bubblewrap "
                f"(apt-get install -y bubblewrap) and allow user namespaces, or set {WEAK_FLAG}=1 to accept weak "
                f"isolation (the candidate can then read this machine's files). Why: {self.iso.reason}")
        # a uid handed in belongs to the caller (a session keeps one across restarts); otherwise take one
        self.own_uid = uid is None and self.iso.kind == "root"
        self.uid = _uid_pool().acquire()[0] if self.own_uid else uid if self.iso.kind == "root" else None
        self.dir, self.res_r, self.cgroup_dirs = "", None, []
        fds: list[int] = []
        try:
            res_w = -1
            if mode == "serve":
                self.res_r, res_w = os.pipe()
                fds.append(res_w)
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
            if self.iso.kind == "weak":
                self.dir = tempfile.mkdtemp(prefix="vpo-sandbox-")
                with open(os.path.join(self.dir, "main.py"), "w", encoding="utf-8") as f:
                    f.write(program)
                cmd, cwd = [self.iso.python, "-I", "-S", "-B", "-c", _boot(_HERE)], self.dir
                env.update(HOME=self.dir, TMPDIR=self.dir)
            else:
                files = [_memfd("main", program.encode()), *(_memfd(n, src) for n, src in
                                                             zip(_CHILD_FILES, _child_sources()))]
                if self.iso.seccomp is not None:
                    files.append(_memfd("seccomp", self.iso.seccomp))
                fds += files
                cmd, cwd = self._bwrap_cmd(limits, files), "/"
                if self.iso.cgroups is not None:  # all its processes together: tmpfs files count as memory
                    self.cgroup_dirs = self.iso.cgroups.create((limits.memory_mb + limits.max_disk_mb) << 20,
                                                               limits.max_procs + _LAUNCHER_TASKS)
                    cmd = self.iso.cgroups.join_command(self.cgroup_dirs) + cmd
                env.update(HOME=_BOX, TMPDIR=_BOX)
            self.proc = subprocess.Popen(
                cmd + limits.argv(mode, res_w), cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, pass_fds=tuple(fds),
                start_new_session=True,
            )
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def _bwrap_cmd(self, limits: SandboxLimits, files: list[int]) -> list[str]:
        iso = self.iso
        prefix = [] if self.uid is None else [iso.setpriv, "--reuid", str(self.uid), "--regid", str(self.uid),
                                              "--clear-groups", "--"]
        main_fd, child_fd, codec_fd = files[:3]
        seccomp = ["--seccomp", str(files[3])] if len(files) > 3 else []
        return [
            *prefix, iso.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--as-pid-1", "--new-session", *seccomp,
            "--proc", "/proc", "--dev", "/dev", *iso.binds,
            "--size", str(limits.max_disk_mb << 20), "--perms", "0700", "--tmpfs", _BOX,
            "--symlink", _BOX, "/tmp", "--symlink", _BOX, "/var/tmp",
            "--file", str(main_fd), f"{_BOX}/main.py",
            "--file", str(child_fd), f"{_LIB}/_child.py", "--file", str(codec_fd), f"{_LIB}/_codec.py",
            "--remount-ro", "/", "--remount-ro", "/dev", "--remount-ro", "/proc", "--chdir", _BOX,
            iso.python, "-I", "-S", "-B", "-c", _boot(_LIB),
        ]

    def kill(self) -> None:
        """Kill the run: the namespace init first (so the kernel reaps everything), then the process group."""
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            return
        if self.iso.kind != "weak":
            try:
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    for pid in f.read().split():
                        os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
            try:
                proc.wait(timeout=2)
                return
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def close(self, grace_s: float = 0.0) -> None:
        """Close stdin and give it ``grace_s`` to exit, kill it if still running, close the pipes, remove the
        directory and give the uid back."""
        proc = getattr(self, "proc", None)
        if grace_s > 0 and proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=grace_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for stream in (proc.stdin, proc.stdout, proc.stderr) if proc else ():
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        if self.res_r is not None:
            os.close(self.res_r)
            self.res_r = None
        if self.dir:
            _remove_dir(self.dir)
            self.dir = ""
        if self.cgroup_dirs and self.iso.cgroups is not None:
            self.iso.cgroups.remove(self.cgroup_dirs)
            self.cgroup_dirs = []
        if self.uid is not None and self.own_uid:
            _uid_pool().release([self.uid])
        self.uid = None


class _Pump:
    """Moves bytes between the parent and a child's pipes until a condition, a deadline or a byte cap."""

    def __init__(self, child: _Child, max_output_bytes: int) -> None:
        self.child, self.cap = child, max_output_bytes
        self.out: dict[int, bytearray] = {}
        self.sel = selectors.DefaultSelector()
        for stream in (child.proc.stdout, child.proc.stderr):
            if stream is not None:
                os.set_blocking(stream.fileno(), False)
                self.out[stream.fileno()] = bytearray()
                self.sel.register(stream.fileno(), selectors.EVENT_READ)
        if child.res_r is not None:
            os.set_blocking(child.res_r, False)
            self.sel.register(child.res_r, selectors.EVENT_READ)
        self.frames = bytearray()
        self.total: dict[int, int] = dict.fromkeys(self.out, 0)
        self.stdin_fd = child.proc.stdin.fileno() if child.proc.stdin else -1
        if self.stdin_fd >= 0:
            os.set_blocking(self.stdin_fd, False)
        self.pending = b""
        self.close_when_sent = False

    def send(self, data: bytes, close: bool = False) -> None:
        """Queue ``data`` for the child's stdin (closed afterwards if ``close``)."""
        self.pending += data
        self.close_when_sent = close
        if self.stdin_fd >= 0:
            self._toggle_stdin(True) if self.pending else self._close_stdin() if close else None

    def _toggle_stdin(self, on: bool) -> None:
        registered = self.stdin_fd in self.sel.get_map()
        if on and not registered:
            self.sel.register(self.stdin_fd, selectors.EVENT_WRITE)
        elif not on and registered:
            self.sel.unregister(self.stdin_fd)

    def _write(self) -> None:
        try:
            n = os.write(self.stdin_fd, self.pending[:65536])
            self.pending = self.pending[n:]
        except (BrokenPipeError, OSError):
            self.pending = b""
        if not self.pending:
            self._toggle_stdin(False)
            if self.close_when_sent:
                self._close_stdin()

    def _close_stdin(self) -> None:
        self._toggle_stdin(False)
        try:
            self.child.proc.stdin.close()
        except OSError:
            pass
        self.stdin_fd = -1

    def _read(self, fd: int) -> str | None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        if not chunk:
            self.sel.unregister(fd)
            return "eof_result" if fd == self.child.res_r else None
        if fd == self.child.res_r:
            self.frames += chunk
            return None
        buf = self.out[fd]
        buf += chunk[: max(0, self.cap - len(buf))]
        self.total[fd] += len(chunk)
        return "output_limit" if self.total[fd] > self.cap else None

    def frame(self, max_bytes: int) -> bytes | str | None:
        """A complete result frame if one is buffered, ``"bad_frame"`` if the header is absurd, else None."""
        if len(self.frames) < 4:
            return None
        n = int.from_bytes(self.frames[:4], "big")
        if n > max_bytes:
            return "bad_frame"
        if len(self.frames) < 4 + n:
            return None
        data = bytes(self.frames[4 : 4 + n])
        del self.frames[: 4 + n]
        return data

    def run(self, deadline: float, want_frame: int = 0) -> bytes | str:
        """Pump until: a result frame (``want_frame`` = max frame bytes), all output closed (run mode), the
        deadline (``"timeout"``), the output cap (``"output_limit"``) or a dead result pipe (``"died"``)."""
        while True:
            if want_frame:
                got = self.frame(want_frame)
                if got is not None:
                    return got
            elif not any(fd in self.sel.get_map() for fd in self.out):
                return "eof"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            for key, _ in self.sel.select(min(left, 1.0)):
                if key.fd == self.stdin_fd:
                    self._write()
                    continue
                status = self._read(key.fd)
                if status == "output_limit" or (status == "eof_result" and want_frame and self.frame(want_frame)
                                                is None):
                    return "output_limit" if status == "output_limit" else "died"

    def text(self, fd_index: int) -> str:
        streams = [s for s in (self.child.proc.stdout, self.child.proc.stderr) if s is not None]
        if fd_index >= len(streams):
            return ""
        return bytes(self.out.get(streams[fd_index].fileno(), b"")).decode("utf-8", "replace")

    def close(self) -> None:
        self.sel.close()


# ----------------------------------------------------------------------------------------------- public API


def run_python(
    code: str,
    *,
    stdin: str | bytes | None = None,
    timeout_s: float = 5.0,
    cpu_s: int | None = None,
    memory_mb: int = 512,
    max_output_bytes: int = 64_000,
    max_procs: int = 16,
    max_file_mb: int = 16,
    max_disk_mb: int = 32,
    guard: bool = True,
) -> SandboxResult:
    """Run ``code`` as a program in the sandbox (see the module docstring for what it may and may not do).

    Args:
        code: the program source (run as ``__main__`` from a fresh directory, its only writable place).
        stdin: data fed to its standard input (then closed).
        timeout_s: wall-clock limit; the run is killed (all its processes) when it passes.
        cpu_s: ``RLIMIT_CPU`` seconds (default: ``timeout_s`` rounded down + 2).
        memory_mb: ``RLIMIT_AS`` in MiB per process; with a cgroup per run, all its processes together (plus its
            run directory's files) get ``memory_mb + max_disk_mb``.
        max_output_bytes: per stream; the run is killed once either stream reaches it.
        max_procs: ``RLIMIT_NPROC`` (effective with a private uid, i.e. in ``root`` isolation); with a cgroup per
            run, also its tasks (processes and threads) together.
        max_file_mb: ``RLIMIT_FSIZE`` in MiB.
        max_disk_mb: size of the run directory's tmpfs (all files together; kernel isolation modes only).
        guard: install the audit-hook guard (disable only to test the OS-level layer).

    Returns:
        A :class:`SandboxResult`; never raises because of what the code does.

    Raises:
        SandboxUnavailable: no kernel isolation here and weak mode was not opted into.
    """
    limits = SandboxLimits(timeout_s, cpu_s, memory_mb, max_output_bytes, max_procs, max_file_mb, guard=guard,
                           max_disk_mb=max_disk_mb)
    _isolation()  # probe once, before the deadline runs
    start = time.monotonic()
    child = _Child(code, limits, "run")
    pump = _Pump(child, max_output_bytes)
    try:
        pump.send(stdin.encode() if isinstance(stdin, str) else (stdin or b""), close=True)
        status = pump.run(start + timeout_s)
        if status == "eof":
            try:
                child.proc.wait(timeout=max(0.01, start + timeout_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                status = "timeout"
        reason = status if status in ("timeout", "output_limit") else None
        child.kill()
        return SandboxResult(child.proc.returncode, pump.text(0), pump.text(1), reason == "timeout", reason,
                             time.monotonic() - start, child.iso.kind)
    finally:
        pump.close()
        child.close()


def run_many(codes: Sequence[str], *, max_workers: int | None = None, **kwargs: Any) -> list[SandboxResult]:
    """Run many programs with :func:`run_python` in parallel, ``max_workers`` (default: CPU count) at a time.

    Args:
        codes: program sources.
        max_workers: concurrent runs.
        **kwargs: passed to :func:`run_python` for every run.

    Returns:
        One :class:`SandboxResult` per program, in order.
    """
    with ThreadPoolExecutor(max_workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda code: run_python(code, **kwargs), codes))


class SandboxCallError(RuntimeError):
    """A sandboxed call failed: the candidate raised (``reason="raised"``), or its process timed out, died,
    flooded the output, failed to load, or sent an unreadable answer."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


_READY = _codec.dumps(["ready"])


class FunctionSession:
    """A program loaded once in the sandbox, whose top-level functions the parent calls with plain data.

    Only plain data crosses the boundary (see :func:`encode`); the candidate cannot run code in the parent.
    If a call kills, hangs or floods its process, that call raises and the next call starts a fresh process
    (unless the program itself failed to load or to become ready in time: then every call raises at once).

    Args:
        program: the source to load (its top level runs once per process).
        memory_mb, max_output_bytes, max_procs, guard: as in :func:`run_python` (output is capped per process).
        cpu_s: ``RLIMIT_CPU`` per process.
        max_message_bytes: largest answer accepted.
    """

    def __init__(self, program: str, *, cpu_s: int = 10, memory_mb: int = 512, max_output_bytes: int = 64_000,
                 max_procs: int = 16, guard: bool = True, max_message_bytes: int = 1 << 20) -> None:
        _isolation()  # probe once, before any deadline runs
        self.program = program
        self.limits = SandboxLimits(0.0, cpu_s, memory_mb, max_output_bytes, max_procs, guard=guard)
        self.max_message_bytes = max_message_bytes
        self.load_error: str | None = None
        self.starts = 0
        self._uid: int | None = None  # root mode: this session's uid, kept across restarts
        self._owns_uid = True  # False when :func:`function_sessions` took it (and gives it back)
        self._child: _Child | None = None
        self._pump: _Pump | None = None
        self._ready = False

    def _stop(self, grace_s: float = 0.0) -> None:
        if self._pump is not None:
            self._pump.close()
        if self._child is not None:
            self._child.close(grace_s)
        self._child = self._pump = None
        self._ready = False

    def prestart(self) -> None:
        """Start the process now without waiting for it to load (so several sessions start concurrently)."""
        if self._child is None and self.load_error is None:
            self.starts += 1
            if self._uid is None and _isolation().kind == "root":
                self._uid = _uid_pool().acquire()[0]
            self._child = _Child(self.program, self.limits, "serve", merge_stderr=True, uid=self._uid)
            self._pump = _Pump(self._child, self.limits.max_output_bytes)
            self._ready = False

    def _start(self, deadline: float) -> None:
        self.prestart()
        assert self._pump is not None
        got = self._pump.run(deadline, self.max_message_bytes)
        if got == _READY:
            self._ready = True
            return
        self._stop()
        msg = _decode(got) if isinstance(got, bytes) and len(got) <= 4096 else None
        if isinstance(msg, list) and msg[:1] == ["load_error"]:
            self.load_error = str(msg[1:2])
        else:
            self.load_error = f"not ready ({got if isinstance(got, str) else 'bad message'})"
        raise SandboxCallError("load", self.load_error)

    def call_raw(self, name: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
                 deadline: float, on_callback: Callable[[bytes], bytes] | None = None) -> bytes:
        """Like :meth:`call`, but return the answer frame undecoded (``["ok", value]`` or ``["err", text]`` as
        JSON bytes, at most ``max_message_bytes``), so that decoding can happen elsewhere (in another sandbox).

        Args:
            on_callback: handles the program's ``__vpo_call__(args, kwargs)`` requests: given the raw
                ``["cb", args, kwargs]`` frame, it returns the raw reply frame (``["ok", value]`` /
                ``["err", text]``). Without it such a request fails the call.

        Raises:
            SandboxCallError: the process timed out, died, flooded its output or did not load (it is stopped).
        """
        request = _codec.dumps([name, _codec.encode(list(args)), _codec.encode(dict(kwargs or {}))])
        return self.call_frame(request, deadline=deadline, on_callback=on_callback)

    def call_frame(self, request: bytes, *, deadline: float,
                   on_callback: Callable[[bytes], bytes] | None = None) -> bytes:
        """:meth:`call_raw` with the request already encoded (``[name, args, kwargs]`` as JSON bytes): relays
        a request from one sandbox to another without decoding it here."""
        if self.load_error is not None:
            raise SandboxCallError("load", self.load_error)
        if not self._ready:
            self._start(deadline)
        assert self._pump is not None
        self._pump.send(len(request).to_bytes(4, "big") + request)
        while True:
            got = self._pump.run(deadline, self.max_message_bytes)
            if isinstance(got, bytes) and got.startswith(b'["cb",') and on_callback is not None:
                reply = on_callback(got)
                self._pump.send(len(reply).to_bytes(4, "big") + reply)
                continue
            if isinstance(got, bytes) and got.startswith((b'["ok",', b'["err",')):
                return got
            self._stop()  # timed out, died, flooded, or spoke garbage: this process is done
            raise SandboxCallError(got if isinstance(got, str) else "bad_answer")

    def call(self, name: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
             deadline: float) -> Any:
        """Call ``name(*args, **kwargs)`` in the sandbox and return its (plain-data) result.

        Args:
            name: a top-level callable of the program.
            args: positional arguments (plain data).
            kwargs: keyword arguments (plain data).
            deadline: ``time.monotonic()`` value by which the answer must arrive (the process is killed after).

        Raises:
            SandboxCallError: the candidate raised, timed out, died, flooded its output, did not load, or sent
                something that is not plain data. ``TypeError`` if the arguments are not plain data.
        """
        msg = _decode(self.call_raw(name, args, kwargs, deadline=deadline))
        if isinstance(msg, list) and len(msg) == 2 and msg[0] == "ok":
            return msg[1]
        if isinstance(msg, list) and len(msg) == 2 and msg[0] == "err":
            raise SandboxCallError("raised", str(msg[1])[:1000])
        self._stop()
        raise SandboxCallError("bad_answer")

    def close(self) -> None:
        """End the process (EOF on its requests, then a kill if it lingers) and clean up."""
        self._stop(grace_s=0.2)
        if self._uid is not None and self._owns_uid:
            _uid_pool().release([self._uid])
            self._uid = None

    def __enter__(self) -> FunctionSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def function_sessions(programs: Sequence[str], **kwargs: Any) -> Iterator[list[FunctionSession]]:
    """:class:`FunctionSession` s for ``programs`` (a candidate and its checker) whose private uids (root mode) are
    taken in one step and kept until the block ends, so that any number of scoring threads can share the uid pool
    without deadlock. ``kwargs`` go to every session.

    Yields:
        One session per program, in order; all are closed when the block ends.
    """
    iso = _isolation()
    uids: list[int | None] = list(_uid_pool().acquire(len(programs))) if iso.kind == "root" and programs else \
        [None] * len(programs)
    sessions = [FunctionSession(program, **kwargs) for program in programs]
    for session, uid in zip(sessions, uids):
        session._uid, session._owns_uid = uid, False
    try:
        yield sessions
    finally:
        for session in sessions:
            session.close()
        if iso.kind == "root" and programs:
            _uid_pool().release([u for u in uids if u is not None])


def _decode(data: bytes) -> Any:
    try:
        return _codec.loads(data)
    except Exception:  # noqa: BLE001 - any garbage from the child is just an unreadable answer
        return None


def encode(value: Any) -> Any:
    """The tagged-JSON form of a plain-data value (raises ``TypeError`` on anything else)."""
    return _codec.encode(value)
