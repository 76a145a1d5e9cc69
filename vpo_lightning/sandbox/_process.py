"""One sandboxed child process: its launch under the isolation, its pipes (:class:`_Pump`) and its end."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from functools import lru_cache
from typing import Any

from ._types import (
    _BOX,
    _CHILD_FILES,
    _HERE,
    _LAUNCHER_TASKS,
    _LIB,
    SandboxLimits,
    SandboxUnavailable,
    _boot,
    _Isolation,
    refusal_message,
)
from ._uids import _uid_pool

log = logging.getLogger(__name__)


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


_LIVE: weakref.WeakSet[_Child] = weakref.WeakSet()  # every child started and not yet closed, for :func:`end_all`
_LIVE_LOCK = threading.Lock()
_SIGTERM_LOCK = threading.Lock()
_SIGTERM_CHAINED: list[Any] = []  # the handler :func:`end_all_on_sigterm` replaced (empty: not installed yet)


def end_all() -> int:
    """SIGKILL every sandbox this process started and has not closed (async-signal safe enough for a Python signal
    handler: no waiting, no lock held by the interrupted code). Returns how many were running.

    Killing a run's launcher (bubblewrap's outer process, the leader of its own process group) ends its namespace's
    init, which the kernel ends with every process in the namespace."""
    ended, children = 0, []
    for _ in range(3):  # another thread may add a child while the set is copied
        try:
            children = list(_LIVE)
            break
        except RuntimeError:
            continue
    for child in children:
        proc = getattr(child, "proc", None)
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
                ended += 1
            except OSError:
                pass
    return ended


def end_all_on_sigterm() -> bool:
    """Make SIGTERM end every sandbox of this process first, then do what the handler it replaces did (the default
    ends the process; a handler that only takes note, as Lightning's does, keeps it running). Installed once; only
    the main thread can install signal handlers, so from another thread this does nothing and returns False."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with _SIGTERM_LOCK:
        if _SIGTERM_CHAINED:
            return True
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            end_all()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:  # the default (or a handler not set from Python): end the process
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)
        _SIGTERM_CHAINED.append(previous)
        return True


class _Child:
    """One sandboxed interpreter: its process, uid and pipes, and how to kill and clean it."""

    def __init__(self, program: str, limits: SandboxLimits, mode: str, merge_stderr: bool = False,
                 *, iso: _Isolation, uid: int | None = None) -> None:
        self.iso = iso  # the caller probed it (._modes._isolation; its probe starts a child with the one it tests)
        if self.iso.kind == "unavailable":
            raise SandboxUnavailable(refusal_message(self.iso))
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
            with _LIVE_LOCK:
                _LIVE.add(self)
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
        # No --as-pid-1: bubblewrap's own init is PID 1 of the namespace (the candidate is PID 2 and cannot clear
        # the init's parent-death signal), --die-with-parent ties that init to the launcher and the launcher to
        # the trainer, and when PID 1 ends the kernel kills everything in the namespace.
        return [
            *prefix, iso.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", *seccomp,
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
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

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
        with _LIVE_LOCK:
            _LIVE.discard(self)
        for stream in (proc.stdin, proc.stdout, proc.stderr) if proc else ():
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
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
        with contextlib.suppress(OSError):
            self.child.proc.stdin.close()
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
