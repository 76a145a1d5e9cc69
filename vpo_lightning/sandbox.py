"""Run model-written Python in a limited subprocess.

Two entry points share one launcher:

* :func:`run_python` (and the batch helper :func:`run_many`) runs a whole program once and returns its exit
  status and (capped) output, like ``python main.py``.
* :class:`FunctionSession` loads a program once and serves calls to its functions over a private pipe: the
  parent sends plain-data arguments, the child answers with a plain-data value (``None``/bool/int/float/str,
  lists, tuples, dicts, sets, bytes; tagged JSON, never pickle). The code reward evaluates every test assertion
  *in the parent* on the returned values, so a candidate cannot forge a verdict: nothing it prints, patches or
  writes inside its own process can reach the checker, and objects with a rigged ``__eq__`` cannot cross the
  boundary. A call that crashes, exits, hangs or floods the output kills only that process; the next call
  starts a fresh one.

Isolation, strongest first (probed once, see :func:`isolation_info`; ``VPO_SANDBOX_ISOLATION`` = ``root``,
``userns`` or ``none`` forces a level):

* ``root`` (running as root with util-linux ``unshare``): each run gets its own network namespace (no network
  at all), its own PID namespace (killing its init kills and reaps every process it forked, even ones that
  called ``setsid``), and a private unprivileged uid from a per-process pool (so ``RLIMIT_NPROC`` applies, the
  project tree, ``/root`` and other processes' ``/proc/<pid>/environ`` are out of reach, and concurrent runs
  cannot signal or ptrace each other). The interpreter must be readable by that uid: when ``sys.executable``
  is not (a pyenv under ``/root``), the first of ``/usr/bin/python3`` or ``python3`` on PATH that works is used.
* ``userns`` (not root, unprivileged user namespaces allowed): same namespaces, the caller's own uid.
* ``none``: a plain subprocess in a new session (process-group kill); the audit hook below is the only guard
  against the network, writes and signals.

In every mode the child is ``python -I -S -B`` (no site, no user env) with a scrubbed environment (``PATH``,
``HOME`` and ``TMPDIR`` = a fresh temporary directory removed afterwards, ``LANG``), stdin/out/err pipes read
by the parent up to a byte cap (then the run is killed), a wall-clock deadline (then the whole namespace or
process group is killed), and resource limits set by a trusted bootstrap before any candidate code runs
(``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` = 0).
The limits are set in the child rather than in a ``preexec_fn`` because rewards run in a thread pool and
``preexec_fn`` is not thread-safe. The bootstrap then installs a ``sys.addaudithook`` guard (it cannot be
removed by later code) that refuses sockets, ``ctypes``, process creation, signals to other processes,
resource-limit changes, links, writes/renames/removals outside the run directory, and reads of other
processes' ``/proc`` entries. The audit hook is a second layer: C extensions could bypass it, which is why
``ctypes`` and ``_posixsubprocess`` are refused and why the OS-level layer above matters. Without a
``preexec_fn`` or ``user=``, CPython can also start the child with ``vfork``, which stays cheap when the parent
is a trainer holding gigabytes of memory.

Design tradeoff (code reward): one process per candidate, not per test. Starting an interpreter (~20-40 ms)
dominates the cost, so serving all tests of a candidate from one process is several times faster than one
process per test. The price is that tests share the candidate's process state (as in HumanEval's own
``check``): a candidate could, say, memoize across tests, which cannot forge a verdict since the verdicts are
computed in the parent. Per-test isolation where it matters is kept: a test that kills, exits, hangs or floods
its process fails alone and the next test gets a fresh process.
"""

from __future__ import annotations

import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

# Plain-data codec, shared verbatim by the parent and the child bootstrap (which cannot import this package).
_CODEC_SRC = r'''
import json as _json


def encode(value, _depth=0):
    if _depth > 200:
        raise ValueError("value nested too deeply")
    t = type(value)
    if value is None or t is bool or t is int or t is float or t is str:
        return value
    if t is list:
        return [encode(v, _depth + 1) for v in value]
    if t is tuple:
        return {"t": [encode(v, _depth + 1) for v in value]}
    if t is dict:
        return {"d": [[encode(k, _depth + 1), encode(v, _depth + 1)] for k, v in value.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [encode(v, _depth + 1) for v in value]}
    if t is bytes:
        return {"b": value.hex()}
    if t is complex:
        return {"c": [value.real, value.imag]}
    raise TypeError("cannot pass a %s value across the sandbox boundary" % t.__name__)


def _tagged(obj):
    if len(obj) != 1:
        raise ValueError("malformed tagged value")
    ((tag, v),) = obj.items()
    if tag == "t":
        return tuple(v)
    if tag == "d":
        return {k: x for k, x in v}
    if tag == "s":
        return set(v)
    if tag == "f":
        return frozenset(v)
    if tag == "b":
        return bytes.fromhex(v)
    if tag == "c":
        return complex(*v)
    raise ValueError("unknown tag %r" % tag)


def dumps(msg):
    return _json.dumps(msg, separators=(",", ":")).encode()


def loads(data):
    return _json.loads(data, object_hook=_tagged)
'''

# The child's trusted bootstrap: limits, guard, then the candidate. argv: mode cwd result_fd cpu_s mem_mb nproc
# fsize_mb nofile guard.
_BOOT_SRC = (
    _CODEC_SRC
    + r'''
import os
import resource
import sys


def _limits(cpu_s, mem_mb, nproc, fsize_mb, nofile):
    R = resource
    for res, soft, hard in ((R.RLIMIT_CORE, 0, 0), (R.RLIMIT_CPU, cpu_s, cpu_s + 1),
                            (R.RLIMIT_AS, mem_mb << 20, mem_mb << 20), (R.RLIMIT_FSIZE, fsize_mb << 20, fsize_mb << 20),
                            (R.RLIMIT_NOFILE, nofile, nofile), (R.RLIMIT_NPROC, nproc, nproc)):
        try:
            R.setrlimit(res, (soft, hard))
        except (ValueError, OSError):
            pass


_DENY = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.system",
         "os.forkpty", "pty.", "os.startfile", "os.symlink", "os.link", "os.chflags", "os.lchflags", "os.setxattr",
         "os.removexattr", "sqlite3.", "resource.setrlimit", "resource.prlimit", "os.chroot", "winreg.")
_NO_IMPORT = frozenset({"_ctypes", "ctypes", "_posixsubprocess", "_socket", "_multiprocessing", "_posixshmem"})
# event -> (indices of path arguments, indices of dir_fd arguments)
_PATH_EVENTS = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.rename": ((0, 1), (2, 3)),
                "os.mkdir": ((0,), (2,)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
                "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()), "shutil.rmtree": ((0,), (1,)),
                "shutil.move": ((0, 1), ()), "shutil.copyfile": ((1,), ()), "os.mkfifo": ((0,), (2,)),
                "os.mknod": ((0,), (3,))}


def _guard(root):
    realpath, abspath, fsdecode, getpid = os.path.realpath, os.path.abspath, os.fsdecode, os.getpid
    root = realpath(root)
    wflags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path):
        if isinstance(path, int):
            return True
        try:
            full = realpath(fsdecode(path))
        except Exception:
            return False
        return full == root or full.startswith(root + "/")

    def deny(event):
        raise PermissionError("sandbox: %s is not allowed" % event)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            text = fsdecode(path) if isinstance(path, (str, bytes)) else str(path)
            full = abspath(text)
            if full.startswith("/proc/") and not full.startswith(("/proc/self/", "/proc/thread-self/")):
                deny("reading other processes' /proc")
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & wflags)
            if writing and (not inside(path) or (mode is None and not text.startswith("/"))):
                deny("writing outside the sandbox directory")
        elif event.startswith(_DENY):
            deny(event)
        elif event == "import" and args[0] in _NO_IMPORT:
            deny("importing " + args[0])
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            if event != "signal.pthread_kill" and args[0] != getpid():
                deny("signalling another process")
        elif event in _PATH_EVENTS:
            paths, fds = _PATH_EVENTS[event]
            if any(i < len(args) and args[i] not in (None, -1, -100) for i in fds):
                deny(event + " with dir_fd")
            if not all(i >= len(args) or inside(args[i]) for i in paths):
                deny(event + " outside the sandbox directory")

    sys.addaudithook(hook)


def _read_exact(fd, n, read=os.read):
    buf = b""
    while len(buf) < n:
        chunk = read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _serve(program, res_fd):
    write, read_exact = os.write, _read_exact

    def send(msg):
        data = dumps(msg)
        data = len(data).to_bytes(4, "big") + data
        while data:
            data = data[write(res_fd, data):]

    ns = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    try:
        exec(compile(program, "<candidate>", "exec"), ns)
    except BaseException as e:
        send(["load_error", "%s: %s" % (type(e).__name__, str(e)[:500])])
        return
    send(["ready"])
    while True:
        head = read_exact(0, 4)
        body = head and read_exact(0, int.from_bytes(head, "big"))
        if body is None:
            return
        try:
            name, args, kwargs = loads(body)
            out = ["ok", encode(ns[name](*args, **kwargs))]
        except BaseException as e:
            out = ["err", "%s: %s" % (type(e).__name__, str(e)[:500])]
        send(out)


def _main(mode, cwd, res_fd, cpu_s, mem_mb, nproc, fsize_mb, nofile, guard):
    _limits(int(cpu_s), int(mem_mb), int(nproc), int(fsize_mb), int(nofile))
    os.chdir(cwd)
    with open("main.py", encoding="utf-8") as f:
        program = f.read()
    if guard == "1":
        _guard(cwd)
    if mode == "serve":
        _serve(program, int(res_fd))
    else:
        exec(compile(program, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


_main(*sys.argv[1:])
'''
)

_codec: dict[str, Any] = {}
exec(_CODEC_SRC, _codec)  # the parent's copy of the codec (encode/decode plain data)


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

    def argv(self, mode: str, cwd: str, res_fd: int) -> list[str]:
        cpu = self.cpu_s if self.cpu_s is not None else int(self.timeout_s) + 2
        return [mode, cwd, str(res_fd), str(max(1, cpu)), str(self.memory_mb), str(self.max_procs),
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
        isolation: the isolation level used (see :func:`isolation_info`).
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


# ----------------------------------------------------------------------------------------------- isolation


@dataclass(frozen=True)
class _Isolation:
    kind: str  # "root" | "userns" | "none"
    python: str
    unshare: str | None


class _UidPool:
    """Private uids for concurrent runs in root mode: 64 per parent process, derived from its pid."""

    def __init__(self, size: int = 64) -> None:
        base = 1_000_000 + (os.getpid() % 1_000_000) * size
        self._free: queue.Queue[int] = queue.Queue()
        for uid in range(base, base + size):
            self._free.put(uid)

    def acquire(self) -> int:
        return self._free.get()

    def release(self, uid: int) -> None:
        self._free.put(uid)


_ISO: _Isolation | None = None
_ISO_LOCK = threading.Lock()
_UIDS: _UidPool | None = None
_UIDS_LOCK = threading.Lock()


def _wrapper(iso: _Isolation, uid: int | None) -> list[str]:
    if iso.kind == "root":
        ids = ["--setuid", str(uid), "--setgid", str(uid)]
        return [iso.unshare, "--net", "--pid", "--fork", "--kill-child", *ids, "--"]
    if iso.kind == "userns":
        return [iso.unshare, "--map-current-user", "--net", "--pid", "--fork", "--kill-child", "--"]
    return []


def _probe(iso: _Isolation) -> bool:
    """Whether ``iso`` can start its interpreter and import the stdlib (as the sandbox uid)."""
    uid = _uid_pool().acquire() if iso.kind == "root" else None
    tmp = _make_dir(uid)
    try:
        cmd = [*_wrapper(iso, uid), iso.python, "-I", "-S", "-B", "-c", "import math, json, resource, os"]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8"}
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, timeout=30, start_new_session=True)
        return done.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        _remove_dir(tmp)
        if uid is not None:
            _uid_pool().release(uid)


def _uid_pool() -> _UidPool:
    global _UIDS
    with _UIDS_LOCK:
        if _UIDS is None:
            _UIDS = _UidPool()
        return _UIDS


def _candidate_pythons() -> list[str]:
    found = [sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", shutil.which("python3") or ""]
    return list(dict.fromkeys(p for p in found if p and os.path.exists(p)))


def _detect() -> _Isolation:
    forced = os.environ.get("VPO_SANDBOX_ISOLATION", "auto")
    unshare = shutil.which("unshare") or ("/usr/bin/unshare" if os.path.exists("/usr/bin/unshare") else None)
    kinds = ["root", "userns"] if forced == "auto" else [forced]
    for kind in kinds:
        if kind == "none" or unshare is None or (kind == "root" and os.geteuid() != 0):
            continue
        for python in _candidate_pythons():
            iso = _Isolation(kind, python, unshare)
            if _probe(iso):
                return iso
    return _Isolation("none", sys.executable, None)


def _isolation() -> _Isolation:
    global _ISO
    with _ISO_LOCK:
        if _ISO is None:
            _ISO = _detect()
        return _ISO


def isolation_info() -> dict[str, Any]:
    """Which isolation the sandbox uses here: ``{"kind": "root"|"userns"|"none", "python": path}``."""
    iso = _isolation()
    return {"kind": iso.kind, "python": iso.python, "network_namespace": iso.kind != "none",
            "pid_namespace": iso.kind != "none", "private_uid": iso.kind == "root"}


# ------------------------------------------------------------------------------------------------ processes


def _make_dir(uid: int | None) -> str:
    path = tempfile.mkdtemp(prefix="vpo-sandbox-")
    if uid is not None:
        os.chown(path, uid, uid)
    os.chmod(path, 0o700)
    return path


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
    """One sandboxed interpreter: its process, directory, uid and pipes, and how to kill and clean it."""

    def __init__(self, program: str, limits: SandboxLimits, mode: str, merge_stderr: bool = False) -> None:
        self.iso = _isolation()
        self.uid = _uid_pool().acquire() if self.iso.kind == "root" else None
        self.dir = _make_dir(self.uid)
        self.res_r: int | None = None
        try:
            main = os.path.join(self.dir, "main.py")
            with open(main, "w", encoding="utf-8") as f:
                f.write(program)
            if self.uid is not None:
                os.chown(main, self.uid, self.uid)
            res_w = -1
            if mode == "serve":
                self.res_r, res_w = os.pipe()
            cmd = [*_wrapper(self.iso, self.uid), self.iso.python, "-I", "-S", "-B", "-c", _BOOT_SRC]
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": self.dir, "TMPDIR": self.dir, "LANG": "C.UTF-8"}
            self.proc = subprocess.Popen(
                cmd + limits.argv(mode, self.dir, res_w), cwd=self.dir, env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                pass_fds=(res_w,) if res_w >= 0 else (), start_new_session=True,
            )
            if res_w >= 0:
                os.close(res_w)
        except BaseException:
            self.close()
            raise

    def kill(self) -> None:
        """Kill the run: the namespace init first (so the kernel reaps everything), then the process group."""
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            return
        if self.iso.kind != "none":
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
        if self.uid is not None:
            _uid_pool().release(self.uid)
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
    guard: bool = True,
) -> SandboxResult:
    """Run ``code`` as a program in the sandbox (see the module docstring for what it may and may not do).

    Args:
        code: the program source (run as ``__main__`` from a fresh directory, its only writable place).
        stdin: data fed to its standard input (then closed).
        timeout_s: wall-clock limit; the run is killed (all its processes) when it passes.
        cpu_s: ``RLIMIT_CPU`` seconds (default: ``timeout_s`` rounded down + 2).
        memory_mb: ``RLIMIT_AS`` in MiB.
        max_output_bytes: per stream; the run is killed once either stream reaches it.
        max_procs: ``RLIMIT_NPROC`` (effective with a private uid, i.e. in ``root`` isolation).
        max_file_mb: ``RLIMIT_FSIZE`` in MiB.
        guard: install the audit-hook guard (disable only to test the OS-level layer).

    Returns:
        A :class:`SandboxResult`; never raises because of what the code does.
    """
    limits = SandboxLimits(timeout_s, cpu_s, memory_mb, max_output_bytes, max_procs, max_file_mb, guard=guard)
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
        self.program = program
        self.limits = SandboxLimits(0.0, cpu_s, memory_mb, max_output_bytes, max_procs, guard=guard)
        self.max_message_bytes = max_message_bytes
        self.load_error: str | None = None
        self.starts = 0
        self._child: _Child | None = None
        self._pump: _Pump | None = None

    def _stop(self, grace_s: float = 0.0) -> None:
        if self._pump is not None:
            self._pump.close()
        if self._child is not None:
            self._child.close(grace_s)
        self._child = self._pump = None

    def _start(self, deadline: float) -> None:
        self.starts += 1
        self._child = _Child(self.program, self.limits, "serve", merge_stderr=True)
        self._pump = _Pump(self._child, self.limits.max_output_bytes)
        got = self._pump.run(deadline, self.max_message_bytes)
        msg = self._decode(got) if isinstance(got, bytes) else None
        if msg == ["ready"]:
            return
        self._stop()
        if isinstance(msg, list) and msg[:1] == ["load_error"]:
            self.load_error = str(msg[1:2])
        else:
            self.load_error = f"not ready ({got if isinstance(got, str) else 'bad message'})"
        raise SandboxCallError("load", self.load_error)

    def _decode(self, data: bytes) -> Any:
        try:
            return _codec["loads"](data)
        except Exception:  # noqa: BLE001 - any garbage from the child is just an unreadable answer
            return None

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
        if self.load_error is not None:
            raise SandboxCallError("load", self.load_error)
        request = _codec["dumps"]([name, _codec["encode"](list(args)), _codec["encode"](dict(kwargs or {}))])
        if self._child is None:
            self._start(deadline)
        assert self._pump is not None
        self._pump.send(len(request).to_bytes(4, "big") + request)
        got = self._pump.run(deadline, self.max_message_bytes)
        msg = self._decode(got) if isinstance(got, bytes) else None
        if isinstance(msg, list) and len(msg) == 2 and msg[0] == "ok":
            return msg[1]
        if isinstance(msg, list) and len(msg) == 2 and msg[0] == "err":
            raise SandboxCallError("raised", str(msg[1]))
        self._stop()  # timed out, died, flooded, or spoke garbage: this process is done
        raise SandboxCallError(got if isinstance(got, str) else "bad_answer")

    def close(self) -> None:
        """End the process (EOF on its requests, then a kill if it lingers) and clean up."""
        self._stop(grace_s=0.2)

    def __enter__(self) -> FunctionSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode(value: Any) -> Any:
    """The tagged-JSON form of a plain-data value (raises ``TypeError`` on anything else)."""
    return _codec["encode"](value)
