"""Which isolation this machine gives (root, userns, weak or none), probed once (a layer it lacks is refused unless
accepted by name). The private uid pool is :mod:`._uids`; the isolation's record and refusal are :mod:`._types`."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from functools import lru_cache
from typing import Any

from . import _cgroup, _seccomp
from ._types import (
    ALLOW_MISSING_FLAG,
    LAYERS,
    STRICT_FLAG,
    WEAK_FLAG,
    SandboxLimits,
    SandboxUnavailable,
    _Isolation,
    refusal_message,
)

log = logging.getLogger(__name__)


_ISO: _Isolation | None = None
_ISO_LOCK = threading.Lock()


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


def _accepted_missing() -> set[str]:
    """The layers the user accepts to run without (``VPO_SANDBOX_ALLOW_MISSING``; none with ``VPO_SANDBOX_STRICT=1``).

    Raises:
        SandboxUnavailable: the variable names something that is not a layer.
    """
    names = {n.strip().lower() for n in os.environ.get(ALLOW_MISSING_FLAG, "").split(",") if n.strip()}
    unknown = names - set(LAYERS)
    if unknown:
        raise SandboxUnavailable(f"{ALLOW_MISSING_FLAG}={os.environ[ALLOW_MISSING_FLAG]}: {', '.join(sorted(unknown))} "
                                 f"is not a sandbox layer; name some of: {', '.join(LAYERS)}")
    return set() if _flag(STRICT_FLAG) else names


def _refusal(missing: tuple[str, ...]) -> str:
    """'' if every missing layer is accepted by name, else why the sandbox refuses and how to go on."""
    layers, accepted = [m.split(":", 1)[0] for m in missing], _accepted_missing()
    refused = [m for m, layer in zip(missing, layers) if layer not in accepted]
    if not refused:
        return ""
    return ("this machine's isolation lacks " + "; ".join(refused) + ". Fix that, or accept the weaker isolation by "
            f"name: {ALLOW_MISSING_FLAG}={','.join(dict.fromkeys(layers))}"
            + (f" (and unset {STRICT_FLAG})" if _flag(STRICT_FLAG) else ""))


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
            for layer in ("cgroups", "seccomp"):  # a layer the kernel refuses is dropped (then refused below)
                if error and getattr(iso, layer) is not None and not _probe(replace(iso, **{layer: None})):
                    iso = replace(iso, **{layer: None}, missing=(*iso.missing, f"{layer}: refused here "
                                                                 f"({error.strip()[-200:]})"))
                    error = ""
            if error:
                why.append(f"{kind} with {python}: {error}")
                continue
            refusal = _refusal(iso.missing)
            if refusal:
                return _Isolation("unavailable", "", reason=f"{kind}: {refusal}", missing=iso.missing)
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
        missing.append(f"cgroups: {why}; memory, tasks and CPU are then limited per process (RLIMIT_AS, "
                       "RLIMIT_NPROC, RLIMIT_CPU), so one run can hold max_procs x memory_mb (and socket buffers) and "
                       "several cores")
    return replace(iso, seccomp=program, cgroups=cgroups, missing=tuple(missing))


def _probe(iso: _Isolation) -> str:
    """'' if ``iso`` can run the bootstrap in the sandbox, else why not."""
    from ._process import _Child  # a probe is a child process; _process needs this module to launch one

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
    """The isolation here (probed at the first call). From the main thread, it also makes sure that SIGTERM ends
    this process's sandboxes (:func:`._process.end_all_on_sigterm`)."""
    global _ISO
    from ._process import end_all_on_sigterm  # _process imports this module

    end_all_on_sigterm()
    with _ISO_LOCK:
        if _ISO is None:
            _ISO = _detect()
            if _ISO.kind in ("root", "userns"):
                log.info("sandbox isolation: %s (bubblewrap: own mount/PID/network/IPC namespaces, %s, seccomp %s, "
                         "python %s)", _ISO.kind, "private uid per run" if _ISO.kind == "root" else "the caller's uid",
                         "allow-list" if _ISO.seccomp else "OFF", _ISO.python)
                for gap in _ISO.missing:
                    log.warning("sandbox isolation is weaker than it should be, accepted by %s: %s", ALLOW_MISSING_FLAG,
                                gap)
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
            "missing": list(iso.missing), "reason": iso.reason, "refusal": refusal_message(iso)}
