"""The sandboxed child's trusted bootstrap: resource limits, the audit-hook guard, then the candidate.

Never imported by the trainer to run anything: the parent copies this file and :mod:`._codec` into the sandbox
(or, in weak mode, points ``sys.path`` at this directory) and starts ``python -I -S -B -c "...; _child.main()"``,
so nothing of the parent's state reaches the child. Arguments (``sys.argv[1:]``): mode (``run`` | ``serve``),
result fd, cpu_s, mem_mb, nproc, fsize_mb, nofile, guard (``1`` | ``0``).

The guard is a second layer only (the kernel isolation and seccomp filter set up by the parent are what hold):
everything it uses is bound in closures when it is installed, so rebinding module globals or builtins does not
switch it off, and it sees the path strings the operation will use; a candidate can still rewrite its closure cells
(found through ``gc``), which the attack tests do before checking the kernel layers.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from typing import Any

try:
    from ._codec import dumps, encode, loads
except ImportError:  # in the sandbox: a top-level module next to this one
    from _codec import dumps, encode, loads  # type: ignore[no-redef]

DENY = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.system",
        "os.forkpty", "pty.", "os.startfile", "os.symlink", "os.link", "os.chflags", "os.lchflags", "os.setxattr",
        "os.removexattr", "sqlite3.", "resource.setrlimit", "resource.prlimit", "os.chroot", "winreg.")
NO_IMPORT = frozenset({"_ctypes", "ctypes", "_posixsubprocess", "_socket", "_multiprocessing", "_posixshmem"})
# event -> (indices of path arguments, indices of dir_fd arguments)
PATH_EVENTS = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.rename": ((0, 1), (2, 3)),
               "os.mkdir": ((0,), (2,)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
               "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()), "shutil.rmtree": ((0,), (1,)),
               "shutil.move": ((0, 1), ()), "shutil.copyfile": ((1,), ()), "os.mkfifo": ((0,), (2,)),
               "os.mknod": ((0,), (3,))}


def set_limits(cpu_s: int, mem_mb: int, nproc: int, fsize_mb: int, nofile: int) -> None:
    """RLIMIT_CORE/CPU/AS/FSIZE/NOFILE/NPROC for this process and its children."""
    r = resource
    for res, soft, hard in ((r.RLIMIT_CORE, 0, 0), (r.RLIMIT_CPU, cpu_s, cpu_s + 1),
                            (r.RLIMIT_AS, mem_mb << 20, mem_mb << 20), (r.RLIMIT_FSIZE, fsize_mb << 20, fsize_mb << 20),
                            (r.RLIMIT_NOFILE, nofile, nofile), (r.RLIMIT_NPROC, nproc, nproc)):
        with contextlib.suppress(ValueError, OSError):
            r.setrlimit(res, (soft, hard))


def install_guard(root: str) -> None:
    """An audit hook refusing sockets, ctypes, processes, signals to others, writes outside ``root`` and other
    processes' /proc entries. All state is captured here: later rebinding of globals does not reach it."""
    realpath, fsdecode, getpid, isinstance_ = os.path.realpath, os.fsdecode, os.getpid, isinstance
    str_, bytes_, int_, any_, all_, len_, exc = str, bytes, int, any, all, len, PermissionError
    deny_prefixes, no_import, path_events = tuple(DENY), frozenset(NO_IMPORT), dict(PATH_EVENTS)
    root = realpath(root)
    wflags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def text_of(path: Any) -> str | None:
        if isinstance_(path, (str_, bytes_)):
            return str_.__str__(fsdecode(path)) if isinstance_(path, str_) else bytes_.decode(path, "utf-8", "replace")
        return None  # anything else (a path-like object) is refused: it could answer differently each time

    def inside(path: Any) -> bool:
        if isinstance_(path, int_):
            return True
        text = text_of(path)
        if text is None:
            return False
        full = realpath(text)
        return full == root or str_.startswith(full, root + "/")

    def deny(event: str) -> None:
        raise exc(f"sandbox: {event} is not allowed")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if isinstance_(path, int_):
                return
            text = text_of(path)
            if text is None:
                deny("opening a path-like object")
            full = realpath(text)
            if str_.startswith(full, "/proc/") and not str_.startswith(full, f"/proc/{getpid()}/"):
                deny("reading other processes' /proc")
            writing = any_(c in mode for c in "wax+") if isinstance_(mode, str_) else bool((flags or 0) & wflags)
            if writing and not inside(path):
                deny("writing outside the sandbox directory")
        elif str_.startswith(event, deny_prefixes):
            deny(event)
        elif event == "import" and args[0] in no_import:
            deny("importing " + args[0])
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            if event != "signal.pthread_kill" and args[0] != getpid():
                deny("signalling another process")
        elif event in path_events:
            paths, fds = path_events[event]
            if any_(i < len_(args) and args[i] not in (None, -1, -100) for i in fds):
                deny(event + " with dir_fd")
            if not all_(i >= len_(args) or inside(args[i]) for i in paths):
                deny(event + " outside the sandbox directory")

    sys.addaudithook(hook)


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def serve(program: str, res_fd: int) -> None:
    """Load ``program`` once, then answer framed requests ``[name, args, kwargs]`` on stdin with framed
    ``["ok", value]`` / ``["err", text]`` on ``res_fd``. ``__vpo_call__(args, kwargs)`` in the program asks the
    parent to run a call elsewhere (the checker's ``candidate``) and returns its answer."""
    write, read_exact = os.write, _read_exact

    def send(msg: Any) -> None:
        data = dumps(msg)
        data = len(data).to_bytes(4, "big") + data
        while data:
            data = data[write(res_fd, data):]

    def receive() -> Any:
        head = read_exact(0, 4)
        body = head and read_exact(0, int.from_bytes(head, "big"))
        if body is None:
            raise SystemExit(0)
        return body

    def call_out(args: list, kwargs: dict) -> Any:
        send(["cb", encode(list(args)), encode(dict(kwargs))])
        status, value = loads(receive())
        if status != "ok":
            raise RuntimeError(f"call failed: {value}")
        return value

    ns = {"__name__": "__sandbox__", "__builtins__": __builtins__, "__vpo_call__": call_out}
    try:
        exec(compile(program, "<candidate>", "exec"), ns)
    except BaseException as e:  # noqa: BLE001 - anything the program does at load is reported, never raised
        send(["load_error", f"{type(e).__name__}: {str(e)[:500]}"])
        return
    send(["ready"])
    while True:
        body = receive()
        try:
            name, args, kwargs = loads(body)
            out = ["ok", encode(ns[name](*args, **kwargs))]
        except BaseException as e:  # noqa: BLE001
            out = ["err", f"{type(e).__name__}: {str(e)[:500]}"]
        send(out)


def main(argv: list[str] | None = None) -> None:
    """Entry point in the child: limits, then the guard, then run or serve ``main.py`` from the cwd."""
    mode, res_fd, cpu_s, mem_mb, nproc, fsize_mb, nofile, guard = (argv if argv is not None else sys.argv[1:])[:8]
    set_limits(int(cpu_s), int(mem_mb), int(nproc), int(fsize_mb), int(nofile))
    with open("main.py", encoding="utf-8") as f:
        program = f.read()
    if guard == "1":
        install_guard(os.getcwd())
    if mode == "serve":
        serve(program, int(res_fd))
    else:
        exec(compile(program, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
