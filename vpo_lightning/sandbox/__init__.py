"""Run model-written Python where it can neither read the answers nor reach the trainer.

Threat model. In RL the code under test is written by a policy that is rewarded for passing: anything a candidate
can read (reference solutions, hidden tests, the project's data), write (files a later candidate or the trainer
reads), reach (sockets, other processes) or forge (the verdict, the trainer's time) becomes a reward it learns to
take; and what it can hold (a core, memory outside its limits, a machine-wide kernel pool such as AIO events, a
process that outlives its trainer) harms the machine. So the candidate is isolated by the kernel, not by Python,
and nothing it sends back is trusted.

This module is the API; :mod:`._modes` finds the isolation this machine gives (probed once) and holds the private
uid pool, :mod:`._process` runs one child under it (launch, pipes, end), :mod:`._types` has the limits and results.

Entry points (one launcher):

* :func:`run_python` (and :func:`run_many`) runs a whole program once and returns its exit status and capped
  output, like ``python main.py``.
* :class:`FunctionSession` loads a program once and serves calls to its functions over a private pipe: plain-data
  arguments in, a plain-data answer out (tagged JSON, never pickle; see :mod:`._codec`). :meth:`~FunctionSession.
  call_raw` / :meth:`~FunctionSession.call_frame` return or relay answers undecoded, so the code reward computes
  verdicts in a second sandbox (the checker) and the trainer decodes nothing a candidate wrote.

Modes (probed once, logged at the first use: ``INFO`` for kernel isolation, ``WARNING`` for weak or for a missing
layer accepted by name, ``ERROR`` when code will be refused; see :func:`isolation_info`;
``VPO_SANDBOX_ISOLATION=root|userns|weak`` forces one):

* ``root`` (the trainer runs as root; ``bwrap`` from bubblewrap and util-linux ``setpriv`` installed): each run
  drops to a private unprivileged uid from a per-process pool (a candidate and its checker take theirs in one step:
  :func:`function_sessions`), then bubblewrap gives it new user, mount, PID, network, IPC, UTS and cgroup namespaces
  and forbids nested user namespaces. Nothing a candidate does is done as root or with a capability over anything
  real.
* ``userns`` (not root, unprivileged user namespaces allowed, ``bwrap`` installed): the same namespaces, as the
  caller's uid; a cgroup per run only where the caller's cgroup delegates the controllers (else refused unless
  ``VPO_SANDBOX_ALLOW_MISSING=cgroups``). Refused for a root trainer: there the candidate would be uid 0 with every
  capability in its namespace, and files owned by real root (``/proc/sys``) would be writable. As root, the choice
  is ``root`` mode or a refusal whose message names what is missing (``setpriv``, bubblewrap, a readable
  interpreter).
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
  interpreter starts) that is an allow-list (issue 54): the calls the interpreter, its standard library and
  bubblewrap's init need, some only with certain arguments; everything else is refused, named or not (the AIO
  family, System V IPC, POSIX message queues, inotify, ``ptrace``, the mount family, new namespaces, keyrings,
  ``bpf``, ``perf_event_open``, ``memfd_create``, ``userfaultfd``, ``io_uring``, ``sync``, ``mlock``...). Socket
  buffers cannot be raised past ``net.core.wmem_default`` (``SO_SNDBUF``/``SO_RCVBUF`` refused), and calls of
  another architecture kill the process.
* Lifetime: nothing a candidate starts outlives the trainer. The candidate is never PID 1 of its namespace:
  bubblewrap's init is, and dies with bubblewrap's launcher, which dies with the trainer (parent-death signals;
  the candidate cannot reach the init's, and the filter refuses clearing or weakening its own); when PID 1 ends,
  the kernel kills every process of the namespace, forked, ``setsid`` or re-execed alike. SIGTERM first kills
  every sandbox of the trainer, then runs the handler it replaced (installed from the main thread at the first
  use). At start-up the trainer reaps what a trainer killed before its exit handlers left: ``vpo-sandbox-<pid>``
  cgroups of a dead pid (killing what runs in them) and processes on a dead trainer's private uids.
* Resources: a cgroup per run (:mod:`._cgroup`, under the trainer's own; v1, or v2 where the trainer's cgroup
  delegates the controllers) caps all its processes together: memory (``memory_mb`` + ``max_disk_mb``, tmpfs files
  and the kernel memory the run causes included: socket buffers too, measured with cgroup v1 on kernel 6.18), tasks
  (``max_procs`` + 3, threads included: bubblewrap's launcher and init count) and CPU (one core's worth, and an
  equal share against other runs), so that forked processes and setsid spinners neither multiply the budget nor
  starve a neighbour.

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

Strict by default (issue 54): a machine that lacks a layer of its mode (no filter for its architecture,
bubblewrap refusing ``--seccomp``, no writable cgroups), or whose first probe fails because of one, refuses to run
candidates (:class:`SandboxUnavailable`, naming the layer and the fix) unless the user accepts that layer by name,
``VPO_SANDBOX_ALLOW_MISSING=cgroups`` (or ``seccomp``, comma-separated): then it runs, with a WARNING at the first
use. ``VPO_SANDBOX_STRICT=1`` refuses even an accepted layer. :func:`isolation_info` lists the missing layers, and
``vpo fit``/``vpo validate`` print the isolation a run with a code reward uses and record it in its
``sandbox.json``.

What comes back is bounded: output by ``max_output_bytes``, answer frames by ``max_message_bytes``. The built-in
tasks compare answers in a checker sandbox and the trainer only compares verdict bytes; answers the trainer does
decode (:meth:`FunctionSession.call`) are refused when they carry hash-collision floods (which would make building a
set or dict quadratic).

Guarantees per mode: ``docs/SANDBOX.md`` has the table. Known gaps: a kernel bug in a system call the filter allows
is the remaining way out; the filter exists for x86_64 only; without cgroups (accepted by name; an unprivileged user
on most machines) memory is bounded per process (``RLIMIT_AS`` times ``max_procs``) plus what its sockets queue in
the kernel (at most ``net.core.wmem_default`` per socket, times 64 descriptors per process and the descriptors in
flight: about 200 MiB for 16 processes) and pipe buffers (the user's ``fs.pipe-user-pages-soft``), CPU per process
(``RLIMIT_CPU``) and by the deadline, and spinners can crowd a neighbour; the run directory's tmpfs has a size cap but
no inode cap (bubblewrap cannot set one): empty files cost kernel memory, which the run's memory cgroup counts, but
which nothing else bounds before the deadline; the v2 cgroup path is untested on the development machine (v1); the
start-up reaping only looks beside this trainer's own cgroups (a trainer killed in another cgroup leaves its empty
cgroups there, though none of its processes: they die with it); the SIGTERM handler needs the sandbox's first use,
or :func:`isolation_info`, in the main thread (``vpo fit`` does that).

Design tradeoff (code reward): one candidate process per candidate, not per test (starting a sandbox dominates the
cost), plus one checker process. Tests share the candidate's process state (as in HumanEval's own ``check``),
which cannot forge a verdict since verdicts are computed in the checker. A test that kills, exits, hangs or floods
its process fails alone and the next test gets a fresh process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import _codec
from ._modes import _isolation, isolation_info
from ._process import _Child, _Pump
from ._types import ALLOW_MISSING_FLAG, STRICT_FLAG, WEAK_FLAG, SandboxLimits, SandboxResult, SandboxUnavailable
from ._uids import _uid_pool

log = logging.getLogger(__name__)
__all__ = ["ALLOW_MISSING_FLAG", "STRICT_FLAG", "WEAK_FLAG", "FunctionSession", "SandboxCallError", "SandboxLimits",
           "SandboxResult", "SandboxUnavailable", "encode", "function_sessions", "isolation_info", "run_many",
           "run_python"]


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
    iso = _isolation()  # probe once, before the deadline runs
    start = time.monotonic()
    child = _Child(code, limits, "run", iso=iso)
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
            self._child = _Child(self.program, self.limits, "serve", merge_stderr=True, iso=_isolation(),
                                 uid=self._uid)
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
