"""The sandbox's limits, results, isolation record and constants, shared by its isolation, process and API modules."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._cgroup import Cgroups

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHILD_FILES = ("_child.py", "_codec.py")
_BOX = "/sandbox"  # the run directory inside the sandbox (a size-capped tmpfs)
_LIB = "/opt/vpo-sandbox"  # where the child's bootstrap modules are copied inside the sandbox
WEAK_FLAG = "VPO_SANDBOX_ALLOW_WEAK_ISOLATION"
_LAUNCHER_TASKS = 3  # tasks of a run that are not the candidate's: bubblewrap's outer process, its init (PID 1 of the
# namespace) and a spare
# A layer missing here (seccomp, cgroups) is an error unless this names it: VPO_SANDBOX_ALLOW_MISSING=cgroups,seccomp
ALLOW_MISSING_FLAG = "VPO_SANDBOX_ALLOW_MISSING"
LAYERS = ("seccomp", "cgroups")
STRICT_FLAG = "VPO_SANDBOX_STRICT"  # =1: refuse a missing layer even when VPO_SANDBOX_ALLOW_MISSING names it


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


@dataclass(frozen=True)
class _Isolation:
    kind: str  # "root" | "userns" | "weak" | "unavailable"
    python: str
    bwrap: str | None = None
    setpriv: str | None = None
    binds: tuple[str, ...] = ()  # bubblewrap arguments that lay out the interpreter read-only
    reason: str = ""
    seccomp: bytes | None = None  # the filter bubblewrap loads (None: not available here)
    cgroups: Cgroups | None = None  # where per-run cgroups are made (None: per-process rlimits only)
    missing: tuple[str, ...] = ()  # layers this machine lacks, each "<layer>: why" (an error unless accepted)


def refusal_message(iso: _Isolation) -> str:
    """Why the sandbox refuses to run code with ``iso`` and how to go on ('' when it runs code)."""
    if iso.kind != "unavailable":
        return ""
    if iso.missing:  # kernel isolation, but a layer is missing and not accepted by name
        return f"the sandbox refuses to run untrusted code: {iso.reason}"
    return ("the sandbox has no kernel isolation here, so it refuses to run untrusted code. Install bubblewrap "
            f"(apt-get install -y bubblewrap) and allow user namespaces, or set {WEAK_FLAG}=1 to accept weak "
            f"isolation (the candidate can then read this machine's files). Why: {iso.reason}")
