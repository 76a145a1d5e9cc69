"""Attacks a policy rewarded for getting around the sandbox would find (issue 20), each as a test.

Every attack runs in each kernel isolation mode this machine supports (``root``: bubblewrap namespaces and a
private uid; ``userns``: bubblewrap in a user namespace), mostly with the audit-hook guard switched off
(``guard=False``) so that what is tested is the kernel layer alone: nothing may depend on the hook. A test passes
when the attack gets nothing: no forged reward, no file outside the run directory, no connection, no stall.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from vpo_lightning import sandbox
from vpo_lightning.sandbox import _modes, _uids
from vpo_lightning.tasks.code import code_tests_reward, run_tests

REPO = Path(__file__).resolve().parents[1]
SECRET = "vpo-attack-secret-7d2e"
TOY = {
    "task_id": "Toy/add", "entry_point": "add", "preamble": "",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "tests": ["assert candidate(1, 2) == 3", "assert candidate(0, 0) == 0", "assert candidate(-1, 1) == 0"],
}


@pytest.fixture(params=["root", "userns"])
def mode(request, monkeypatch):
    """Force one isolation mode (skipped where this machine cannot provide it)."""
    monkeypatch.setenv("VPO_SANDBOX_ISOLATION", request.param)
    monkeypatch.setenv("VPO_TEST_SECRET", SECRET)
    monkeypatch.setattr(_modes, "_ISO", None)
    if request.param == "root" and os.geteuid() != 0:
        pytest.skip("root mode needs root")
    kind = sandbox.isolation_info()["kind"]
    if kind != request.param:
        pytest.skip(f"{request.param} isolation is not available here (got {kind})")
    return request.param


def _run_unprivileged(code: str, **kwargs) -> dict:
    """``sandbox.run_python(code, **kwargs)`` driven by an unprivileged user (uid 65534, the system python), so a
    root machine also tests ``userns`` mode: the result as a dict, plus ``kind`` (the isolation it got)."""
    script = (
        "import json, sys\nfrom vpo_lightning import sandbox\n"
        "code, kwargs = json.loads(sys.stdin.read())\n"
        "info = sandbox.isolation_info()\n"
        "r = sandbox.run_python(code, **kwargs) if info['kind'] == 'userns' else None\n"
        "print(json.dumps({'kind': info['kind'], 'reason': info['reason'], **(r.__dict__ if r else {})}))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/tmp", "LANG": "C.UTF-8",
           "VPO_SANDBOX_ISOLATION": "userns", sandbox.ALLOW_MISSING_FLAG: "cgroups"}  # no cgroups for uid 65534
    done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3",
                           "-c", script], input=json.dumps([code, kwargs]), env=env, capture_output=True, text=True,
                          cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(params=["root", "userns"])
def run(request, monkeypatch):
    """``run(code, **kwargs) -> dict`` of a :class:`~vpo_lightning.sandbox.SandboxResult`, in one kernel mode. As
    root, ``userns`` runs through an unprivileged user (a root trainer is refused ``userns`` mode)."""
    monkeypatch.setenv("VPO_SANDBOX_ISOLATION", request.param)
    monkeypatch.setattr(_modes, "_ISO", None)
    if request.param == "root":
        if os.geteuid() != 0:
            pytest.skip("root mode needs root")
        if sandbox.isolation_info()["kind"] != "root":
            pytest.skip(f"root isolation is not available here: {sandbox.isolation_info()['reason']}")
        return lambda code, **kwargs: sandbox.run_python(code, **kwargs).__dict__
    if os.geteuid() != 0:
        if sandbox.isolation_info()["kind"] != "userns":
            pytest.skip(f"userns isolation is not available here: {sandbox.isolation_info()['reason']}")
        return lambda code, **kwargs: sandbox.run_python(code, **kwargs).__dict__
    if not os.path.exists("/usr/bin/python3") or shutil.which("setpriv") is None:
        pytest.skip("userns from root needs /usr/bin/python3 and setpriv to drop to an unprivileged user")
    probe = _run_unprivileged("print(1)")
    if probe["kind"] != "userns":
        pytest.skip(f"userns isolation is not available to an unprivileged user here: {probe['reason']}")
    return _run_unprivileged


def marker() -> Path:
    """A fresh path in the host's /tmp that an attack tries to create."""
    return Path(f"/tmp/vpo-attack-{uuid.uuid4().hex[:12]}")


def toy(code: str, **kwargs: float) -> list[bool]:
    return run_tests(f"```python\n{code}\n```", TOY, **{"test_timeout_s": 2.0, "total_timeout_s": 6.0, **kwargs})


# ---------------------------------------------------------------------------------------------- forged reward


def test_reference_solutions_are_unreadable(mode: str) -> None:
    """A candidate that loads HumanEval's reference solution from the installed package scores 0."""
    from vpo_lightning.tasks.code import humaneval_path, load_humaneval, make_record

    path = str(humaneval_path())
    for problem in load_humaneval()[:3]:
        entry, tid = problem["entry_point"], problem["task_id"]
        cheat = (
            "import gzip, json\n"
            f"def {entry}(*args, **kwargs):\n"
            f"    for line in gzip.open({path!r}, 'rt'):\n"
            "        p = json.loads(line)\n"
            f"        if p['task_id'] == {tid!r}:\n"
            "            ns = {}\n"
            "            exec(p['prompt'] + p['canonical_solution'], ns)\n"
            f"            return ns[{entry!r}](*args, **kwargs)\n"
        )
        gt = make_record(problem, "attack")["ground_truth"]
        assert not any(run_tests(f"```python\n{cheat}```", gt, test_timeout_s=2.0, total_timeout_s=6.0)), tid


def test_hidden_tests_are_unreadable(mode: str) -> None:
    """A candidate that answers from a lookup table read out of the project's data files scores 0."""
    records = [json.loads(line) for line in (REPO / "data/code/test.jsonl").read_text().splitlines()[:6]]
    scored = 0
    for record in records:
        entry = record["ground_truth"]["entry_point"]
        cheat = (
            "import ast, glob, json, re\n_T = {{}}\n"
            "for f in glob.glob({!r}):\n"
            "    for line in open(f):\n"
            "        r = json.loads(line)\n"
            "        if r['ground_truth']['entry_point'] != {!r}:\n"
            "            continue\n"
            "        for t in r['ground_truth']['tests']:\n"
            "            for m in re.finditer(r'candidate\\((.*?)\\) == (.+)$', t, re.M):\n"
            "                try:\n"
            "                    _T[repr(ast.literal_eval('(' + m.group(1) + ',)'))] = ast.literal_eval(m.group(2))\n"
            "                except Exception:\n"
            "                    pass\n"
            "def {}(*args):\n    return _T.get(repr(args))\n"
        ).format(str(REPO / "data/code/*.jsonl"), entry, entry)
        scored += sum(run_tests(f"```python\n{cheat}```", record["ground_truth"], total_timeout_s=6.0))
    assert scored == 0


# ------------------------------------------------------------------------------------------ the in-process guard


def test_rebinding_the_guard_state_gains_nothing(mode: str) -> None:
    """With the guard on (as in training), a candidate rebinds the hook's deny lists, then spawns a shell."""
    target = marker()
    header = (
        "import __main__, sys\n"
        "for mod in list(sys.modules.values()):\n"
        "    for name in ('_DENY', '_NO_IMPORT', '_PATH_EVENTS'):\n"
        "        if hasattr(mod, name):\n"
        "            setattr(mod, name, {'_DENY': (), '_NO_IMPORT': frozenset(), '_PATH_EVENTS': {}}[name])\n"
        "try:\n"
        "    import subprocess\n"
        f"    subprocess.run(['/bin/sh', '-c', 'echo pwned > {target}'], timeout=2)\n"
        "except Exception:\n"
        "    pass\n"
    )
    toy(header + "def add(a, b):\n    return a + b\n")
    assert not target.exists()


def test_path_objects_answering_differently(mode: str) -> None:
    """A path-like object that names the run directory to the guard and another place to ``open``/``mkdir``."""
    target = marker()
    header = (
        "import sys\n"
        "class P:\n    def __fspath__(self):\n"
        "        caller = sys._getframe(1).f_code.co_name\n"
        f"        return 'inside.txt' if caller in ('inside', 'hook', 'fsdecode') else {str(target)!r}\n"
        "import os\n"
        "for attempt in (lambda: open(P(), 'w').write('pwned'), lambda: os.mkdir(P())):\n"
        "    try:\n        attempt()\n    except Exception:\n        pass\n"
    )
    toy(header + "def add(a, b):\n    return a + b\n")
    assert not target.exists()


def test_proc_spellings_do_not_reach_the_trainer(mode: str) -> None:
    """Other spellings of ``/proc/<trainer>/environ`` (guard on): the secret in the trainer's environment."""
    pid = os.getpid()
    spellings = [f"/proc/self/root/proc/{pid}/environ", f"/proc/self/cwd/../../proc/{pid}/environ",
                 f"/proc//{pid}/environ", f"/dev/fd/../../proc/{pid}/environ", "/proc/self/root/proc/1/environ"]
    code = (
        "import os\n"
        f"def add(a, b):\n    for p in {spellings!r}:\n"
        "        try:\n"
        f"            if {SECRET!r}.encode() in open(p, 'rb').read():\n                return a + b\n"
        "        except Exception:\n            pass\n"
        "        try:\n"
        "            d = os.open(os.path.dirname(p), os.O_RDONLY)\n"
        f"            if {SECRET!r}.encode() in os.read(os.open('environ', os.O_RDONLY, dir_fd=d), 1 << 20):\n"
        "                return a + b\n"
        "        except Exception:\n            pass\n"
        "    return -1\n"
    )
    assert toy(code) == [False, False, False]


# --------------------------------------------------------------------------------------------- the filesystem


def test_writes_to_tmp_and_shm_do_not_persist(mode: str) -> None:
    """Files written to /tmp and /dev/shm are not on the host afterwards, and a later candidate cannot read them."""
    name = f"vpo-attack-{uuid.uuid4().hex[:12]}"
    write = "\n".join(f"try:\n    open('{d}/{name}', 'w').write('{SECRET}')\nexcept OSError:\n    pass"
                      for d in ("/tmp", "/dev/shm", "/var/tmp"))
    sandbox.run_python(write, guard=False)
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not os.path.exists(f"{d}/{name}")
    read = "\n".join(f"try:\n    print(open('{d}/{name}').read())\nexcept OSError:\n    pass"
                     for d in ("/tmp", "/dev/shm", "/var/tmp"))
    assert SECRET not in sandbox.run_python(read, guard=False).stdout


def test_files_outside_cannot_be_overwritten_or_read(mode: str) -> None:
    """A root-owned 0644 file in the project (standing in for the reward code) keeps its content and stays
    unreadable."""
    target = REPO / f".vpo-attack-target-{uuid.uuid4().hex[:8]}.py"
    target.write_text(SECRET)
    target.chmod(0o644)
    try:
        code = (f"try:\n    print(open({str(target)!r}).read())\nexcept OSError:\n    pass\n"
                f"try:\n    open({str(target)!r}, 'w').write('pwned')\nexcept OSError:\n    pass\n")
        result = sandbox.run_python(code, guard=False)
        assert target.read_text() == SECRET and SECRET not in result.stdout
    finally:
        target.unlink()


def test_total_disk_use_is_capped(mode: str) -> None:
    """Many files just under the per-file limit: the run's total writes stay bounded."""
    code = (
        "import os\ntotal = 0\n"
        "for j, d in enumerate(('.', os.environ.get('TMPDIR', '.'), '/tmp', '/dev/shm')):\n"
        "    for i in range(20):\n"
        "        try:\n"
        "            with open(os.path.join(d, 'f%d-%d' % (j, i)), 'wb') as f:\n"
        "                f.write(b'x' * (15 << 20))\n"
        "            total += 15 << 20\n"
        "        except OSError:\n"
        "            break\n"
        "print(total >> 20)\n"
    )
    result = sandbox.run_python(code, guard=False, timeout_s=10)
    assert int(result.stdout.strip() or 0) <= 64, result.stdout


# -------------------------------------------------------------------------------------------------- network


def test_filesystem_and_abstract_unix_sockets_are_unreachable(mode: str, tmp_path: Path) -> None:
    """A Unix socket listening outside the sandbox (world-accessible, so only isolation can stop it)."""
    path = marker()
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    name = f"vpo-attack-{uuid.uuid4().hex[:8]}"
    servers = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    try:
        servers[0].bind(str(path / "s"))
        os.chmod(path / "s", 0o777)
        servers[1].bind("\0" + name)
        for s in servers:
            s.listen(4)
            s.settimeout(0.2)
        code = (
            "import socket\n"
            f"for addr in ({str(path / 's')!r}, '\\0{name}'):\n"
            "    try:\n"
            "        c = socket.socket(socket.AF_UNIX)\n        c.connect(addr)\n        c.sendall(b'pwned')\n"
            "        print('connected', addr)\n"
            "    except OSError as e:\n        print('refused', e)\n"
        )
        result = sandbox.run_python(code, guard=False)
        for s in servers:
            with pytest.raises(socket.timeout):
                s.accept()
        assert "connected" not in result.stdout
    finally:
        for s in servers:
            s.close()
        with contextlib.suppress(OSError):
            (path / "s").unlink()
        path.rmdir()


# ------------------------------------------------------------------------------------------- the verdict channel


def test_an_expensive_answer_cannot_stall_the_trainer(mode: str) -> None:
    """A hand-written result frame whose decoding is quadratic (ints that all hash alike) must not freeze the
    trainer past the deadline, nor another thread of it."""
    frame_src = (
        "import json, os\n"
        "P = (1 << 61) - 1\n"
        "def add(a, b):\n"
        "    body = json.dumps(['ok', {'s': [P * k for k in range(1, 40000)]}], separators=(',', ':')).encode()\n"
        "    for fd in range(3, 64):\n"
        "        try:\n"
        "            os.write(fd, len(body).to_bytes(4, 'big') + body)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return a + b\n"
    )
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.05)

    thread = threading.Thread(target=ticker)
    thread.start()
    start = time.monotonic()
    try:
        toy(frame_src, test_timeout_s=1.0, total_timeout_s=3.0)
    finally:
        elapsed = time.monotonic() - start
        stop.set()
        thread.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert elapsed < 5.0 and max(gaps, default=0) < 1.0, (elapsed, max(gaps, default=0))


# ---------------------------------------------------------------------------------------------- data is data


def test_data_file_code_never_runs_in_the_trainer(mode: str) -> None:
    """A code record whose preamble and prompt run commands: nothing happens in the trainer's process."""
    targets = [REPO / f".vpo-attack-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    record = {"ground_truth": {
        "task_id": "Evil/1", "entry_point": "add", "tests": ["assert candidate(1, 2) == 3"],
        "preamble": f"import os\nos.system('touch {targets[0]}')\nopen({str(targets[0])!r}, 'a').write('x')",
        "prompt": f"import os\nos.system('touch {targets[1]}')\ndef add(a, b):\n    '''a + b'''\n",
    }}
    try:
        code_tests_reward("```python\ndef add(a, b):\n    return a + b\n```", record)
        assert not any(t.exists() for t in targets)
    finally:
        for t in targets:
            with contextlib.suppress(OSError):
                t.unlink()


def test_code_records_without_tests_are_rejected(tmp_path: Path) -> None:
    """The data check names the file and line of a code record with no tests."""
    from vpo_lightning.training.records import read_jsonl

    good = {"task": "code", "messages": [{"role": "user", "content": "x"}],
            "ground_truth": {"entry_point": "f", "prompt": "def f(): pass\n", "tests": ["assert candidate() is None"]}}
    bad = json.loads(json.dumps(good))
    bad["ground_truth"]["tests"] = []
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2") + ".*tests"):
        read_jsonl(path)


# ---------------------------------------------------------------------------------------------------- modes


def test_unprivileged_caller_gets_the_same_isolation(tmp_path: Path) -> None:
    """The whole sandbox driven by an unprivileged user (uid 65534, system python): isolation is ``userns``,
    the project and the host's /tmp stay out of reach."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3") or not os.path.exists("/usr/bin/setpriv"):
        pytest.skip("needs root (to drop to an unprivileged uid) and /usr/bin/python3")
    target = marker()
    script = (
        "import json, sys\nfrom vpo_lightning import sandbox\n"
        "info = sandbox.isolation_info()\n"
        f"r = sandbox.run_python('''try:\n    print(open({str(REPO / 'README.md')!r}).read()[:20])\nexcept OSError:\n"
        f"    print('blocked')\nopen({str(target)!r}, 'w').write('x')\n''', guard=False)\n"
        "print(json.dumps([info['kind'], r.stdout, r.stderr[-300:]]))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/tmp", "LANG": "C.UTF-8",
           sandbox.ALLOW_MISSING_FLAG: "cgroups"}
    done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                           "/usr/bin/python3", "-c", script], env=env, capture_output=True, text=True, cwd="/",
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    kind, stdout, stderr = json.loads(done.stdout.strip().splitlines()[-1])
    if kind != "userns":
        pytest.skip(f"no user namespaces for unprivileged users here ({kind}): {stderr}")
    assert stdout.strip() == "blocked" and not target.exists()


def test_honest_candidate_still_passes(mode: str) -> None:
    """Control: in the same mode an honest candidate scores every test (the attacks above fail for cause)."""
    assert toy("def add(a, b):\n    return a + b") == [True, True, True]
    result = sandbox.run_python("import os\nopen('x', 'w').write('hi')\nprint(open('x').read(), os.getcwd() != '')")
    assert result.ok and result.stdout == "hi True\n"


def test_without_kernel_isolation_untrusted_code_is_refused(monkeypatch, caplog) -> None:
    """No bubblewrap on PATH: the sandbox refuses to run code unless weak mode is opted into by name, and the log
    says which mode is active."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(sandbox.WEAK_FLAG, raising=False)
    monkeypatch.delenv("VPO_SANDBOX_ISOLATION", raising=False)
    monkeypatch.setattr(_modes, "_ISO", None)
    with caplog.at_level("INFO", logger="vpo_lightning.sandbox"):
        assert sandbox.isolation_info()["kind"] == "unavailable"
        with pytest.raises(sandbox.SandboxUnavailable, match=sandbox.WEAK_FLAG):
            sandbox.run_python("print(1)")
        with pytest.raises(sandbox.SandboxUnavailable):
            toy("def add(a, b):\n    return a + b")
        monkeypatch.setenv(sandbox.WEAK_FLAG, "1")
        monkeypatch.setattr(_modes, "_ISO", None)
        result = sandbox.run_python("print(1)")
    assert result.ok and result.isolation == "weak" and result.stdout == "1\n"
    assert "refused" in caplog.text and "WEAK" in caplog.text


# ------------------------------------------------------------------------- the kernel layer alone (issue 41)


def test_no_kernel_setting_is_writable(run) -> None:
    """Every file under /proc/sys (and /proc's other kernel interfaces) refuses to open for writing; a candidate
    that could write ``kernel.core_pattern`` would have a crash run its binary as real root."""
    code = (
        "import os\nopened = []\n"
        "paths = ['/proc/sysrq-trigger', '/proc/sys/kernel/core_pattern']\n"
        "for d, _, files in os.walk('/proc/sys'):\n"
        "    paths += [os.path.join(d, f) for f in files]\n"
        "for p in paths:\n"
        "    try:\n        os.close(os.open(p, os.O_WRONLY))\n        opened.append(p)\n"
        "    except OSError:\n        pass\n"
        "print(len(paths), len(opened), opened[:5])\n"
    )
    result = run(code, guard=False)
    tried, opened = result["stdout"].split()[:2]
    assert int(tried) > 100 and int(opened) == 0, result["stdout"]


def test_root_trainer_is_refused_userns_mode(monkeypatch) -> None:
    """As root, ``userns`` mode (candidate = uid 0 with capabilities in its namespace) is refused with an error that
    names what root mode needs, never run."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setenv("VPO_SANDBOX_ISOLATION", "userns")
    monkeypatch.delenv(sandbox.WEAK_FLAG, raising=False)
    monkeypatch.setattr(_modes, "_ISO", None)
    with pytest.raises(sandbox.SandboxUnavailable, match="setpriv"):
        sandbox.run_python("print(1)")


def test_switching_off_the_guard_gains_nothing(run) -> None:
    """The candidate finds the audit hook through ``gc`` and rewrites its closure (issue 41, item 2): the hook is
    off, and still no anonymous memory file, no socket but AF_UNIX, no kernel setting, no new namespace."""
    code = (
        "import gc, os\n"
        "for f in gc.get_objects():\n"
        "    if type(f).__name__ == 'function' and f.__name__ == 'hook' and f.__closure__:\n"
        "        for name, cell in zip(f.__code__.co_freevars, f.__closure__):\n"
        "            if name == 'deny':\n                cell.cell_contents = lambda event: None\n"
        "import ctypes, socket\nprint('guard-off')\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def attempt(name, fn):\n"
        "    try:\n        out = fn()\n        print(name, 'ok' if out is None or out >= 0 else 'failed')\n"
        "    except OSError as e:\n        print(name, 'failed', e.errno)\n"
        "attempt('memfd', lambda: os.memfd_create('x'))\n"
        "attempt('memfd-libc', lambda: libc.memfd_create(b'x', 0))\n"
        "attempt('vsock', lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).fileno())\n"
        "attempt('inet', lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).fileno())\n"
        "attempt('netlink', lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM).fileno())\n"
        "attempt('sysctl', lambda: os.open('/proc/sys/kernel/core_pattern', os.O_WRONLY))\n"
        "attempt('unshare', lambda: libc.unshare(0x10000000 | 0x40000000))\n"  # CLONE_NEWUSER | CLONE_NEWNET
        "attempt('mount', lambda: libc.mount(b'none', b'/sandbox', b'tmpfs', 0, None))\n"
        "attempt('ptrace', lambda: libc.ptrace(16, 1, 0, 0))\n"  # PTRACE_ATTACH to the namespace's init
        "attempt('keyctl', lambda: libc.syscall(250, 0, -4, 0, 0))\n"  # KEYCTL_GET_KEYRING_ID, user keyring
        "attempt('bpf', lambda: libc.syscall(321, 0, 0, 0))\n"
        "attempt('io_uring', lambda: libc.syscall(425, 8, ctypes.create_string_buffer(120)))\n"
    )
    result = run(code, guard=True)
    lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in result["stdout"].splitlines())
    assert "guard-off" in lines, result  # the hook was switched off: what follows is the kernel layer alone
    got = {k: v for k, v in lines.items() if k != "guard-off"}
    assert len(got) == 12 and all(v.startswith("failed") for v in got.values()), got


def test_memfd_cannot_escape_the_memory_limit(run) -> None:
    """Anonymous memory files are not address space: 40 of them just under ``RLIMIT_FSIZE`` would hold ~600 MiB
    under a 64 MiB ``RLIMIT_AS`` (issue 41, item 4). ``memfd_create`` is refused."""
    code = (
        "import os\ntotal, chunk, fds = 0, b'x' * (8 << 20), []\n"
        "try:\n"
        "    for _ in range(40):\n        fds.append(os.memfd_create('x'))\n"
        "        os.write(fds[-1], chunk)\n        total += 8\n"
        "except (OSError, MemoryError) as e:\n    print('stopped', type(e).__name__)\n"
        "print(total)\n"
    )
    result = run(code, guard=False, memory_mb=64, timeout_s=10)
    assert int(result["stdout"].split()[-1]) <= 64, result


def test_no_socket_but_af_unix(run) -> None:
    """AF_VSOCK is not confined by the network namespace (issue 41, item 5); no family but AF_UNIX is needed."""
    code = (
        "import socket\n"
        "for fam, kind in (('AF_VSOCK', 'SOCK_STREAM'), ('AF_INET', 'SOCK_STREAM'), ('AF_INET6', 'SOCK_DGRAM'),\n"
        "                  ('AF_NETLINK', 'SOCK_RAW'), ('AF_PACKET', 'SOCK_DGRAM')):\n"
        "    try:\n        socket.socket(getattr(socket, fam), getattr(socket, kind))\n        print(fam, 'ok')\n"
        "    except OSError as e:\n        print(fam, 'refused', e.errno)\n"
        "a, b = socket.socketpair()\na.sendall(b'unix-ok')\nprint(b.recv(16).decode())\n"
    )
    result = run(code, guard=False)
    assert " ok" not in result["stdout"] and result["stdout"].count("refused") == 5, result
    assert "unix-ok" in result["stdout"]


def test_daemon_thread_left_running_at_exit(run) -> None:
    """A correct program that leaves a busy daemon thread at exit exits 0 (issue 41, item 7: glibc loads
    ``libgcc_s`` to unwind the thread; without it the run died with SIGSEGV and a right answer scored 0)."""
    code = ("import threading\n"
            "def spin():\n    while True:\n        pass\n"
            "threading.Thread(target=spin, daemon=True).start()\nprint(sum(map(int, input().split())))\n")
    result = run(code, stdin="2 3\n", guard=False)
    assert result["returncode"] == 0 and result["stdout"] == "5\n", result


def test_a_missing_layer_is_refused_unless_accepted_by_name(monkeypatch, caplog) -> None:
    """No seccomp filter for this machine: the sandbox refuses to run (issue 54: it ran with a WARNING unless
    ``VPO_SANDBOX_STRICT=1``), naming the layer and the setting that accepts it; ``VPO_SANDBOX_ALLOW_MISSING=seccomp``
    runs with a WARNING, ``VPO_SANDBOX_STRICT=1`` refuses even then, and a name that is no layer is an error."""
    from vpo_lightning.sandbox import _seccomp

    monkeypatch.delenv("VPO_SANDBOX_ISOLATION", raising=False)
    monkeypatch.delenv(sandbox.WEAK_FLAG, raising=False)
    monkeypatch.delenv(sandbox.STRICT_FLAG, raising=False)
    monkeypatch.setenv(sandbox.ALLOW_MISSING_FLAG, "cgroups")
    monkeypatch.setattr(_modes, "_ISO", None)
    if sandbox.isolation_info()["kind"] not in ("root", "userns"):
        pytest.skip("needs kernel isolation")
    monkeypatch.setattr(_seccomp, "program", lambda machine=None: None)
    monkeypatch.setattr(_modes, "_ISO", None)
    info = sandbox.isolation_info()
    assert info["kind"] == "unavailable" and "seccomp" in info["reason"]
    with pytest.raises(sandbox.SandboxUnavailable, match=f"{sandbox.ALLOW_MISSING_FLAG}=seccomp"):
        sandbox.run_python("print(1)")
    monkeypatch.setenv(sandbox.ALLOW_MISSING_FLAG, "seccomp,cgroups")
    monkeypatch.setattr(_modes, "_ISO", None)
    with caplog.at_level("INFO", logger="vpo_lightning.sandbox"):
        info = sandbox.isolation_info()
        assert sandbox.run_python("print(1)").stdout == "1\n"
    assert info["seccomp"] is False and any("seccomp" in m for m in info["missing"])
    assert any(r.levelname == "WARNING" and "seccomp" in r.getMessage() and sandbox.ALLOW_MISSING_FLAG in r.getMessage()
               for r in caplog.records)
    monkeypatch.setenv(sandbox.STRICT_FLAG, "1")
    monkeypatch.setattr(_modes, "_ISO", None)
    with pytest.raises(sandbox.SandboxUnavailable, match="seccomp"):
        sandbox.run_python("print(1)")
    monkeypatch.delenv(sandbox.STRICT_FLAG)
    monkeypatch.setenv(sandbox.ALLOW_MISSING_FLAG, "network")
    monkeypatch.setattr(_modes, "_ISO", None)
    with pytest.raises(sandbox.SandboxUnavailable, match="network is not a sandbox layer"):
        sandbox.run_python("print(1)")


def test_a_failed_probe_does_not_fall_back_quietly(mode: str, monkeypatch) -> None:
    """The first probe fails because of the cgroups (here: their folder is gone): the sandbox used to keep a setup
    without them with only a WARNING (issue 54); now it refuses, naming the layer and what accepts it."""
    from vpo_lightning.sandbox import _cgroup

    found, _ = _modes._cgroups()
    if found is None:
        pytest.skip("no per-run cgroups here")
    gone = _cgroup.Cgroups(found.version, tuple(p + "-gone" for p in found.parents), found.shell)
    monkeypatch.setattr(_modes, "_cgroups", lambda: (gone, ""))
    monkeypatch.delenv(sandbox.ALLOW_MISSING_FLAG, raising=False)
    monkeypatch.setattr(_modes, "_ISO", None)
    info = sandbox.isolation_info()
    assert info["kind"] == "unavailable" and "cgroups: refused here" in info["reason"], info
    assert f"{sandbox.ALLOW_MISSING_FLAG}=cgroups" in info["reason"]
    monkeypatch.setenv(sandbox.ALLOW_MISSING_FLAG, "cgroups")
    monkeypatch.setattr(_modes, "_ISO", None)
    assert sandbox.isolation_info()["cgroup"] is None and sandbox.run_python("print(1)").stdout == "1\n"


def test_uid_pool_as_small_as_the_scoring_threads(mode: str, monkeypatch) -> None:
    """As many scoring threads as private uids (issue 41, item 6: each candidate took its two uids one at a time,
    so with ``reward_workers`` = pool size every thread held one and waited forever): scoring finishes, all pass."""
    from vpo_lightning.tasks.code import score_candidates

    workers = 4
    pool = _uids._UidPool(workers)
    monkeypatch.setattr(_uids, "_UIDS", pool)
    record = {"ground_truth": TOY}
    done: list = []
    thread = threading.Thread(target=lambda: done.append(score_candidates(
        ["def add(a, b):\n    return a + b"] * 8, [record] * 8, max_workers=workers, total_timeout_s=30.0)),
        daemon=True)
    thread.start()
    thread.join(90)
    if thread.is_alive():  # deadlocked: hand out spare uids so the stuck threads can end, then fail
        for uid in range(3_000_000_000, 3_000_000_064):
            if hasattr(pool._free, "put"):  # the old pool: a queue of single uids
                pool._free.put(uid)
        thread.join(120)
    assert done and all(r == [True, True, True] for r in done[0]), done


def test_a_livecodebench_answer_cannot_stall_the_trainer(mode: str) -> None:
    """A function-call answer that is a set of frozensets with one hash (issue 41, item 3: decoded in the trainer it
    held the GIL ~30 s per 1 MB frame): the trainer's other threads keep ticking and an honest candidate scored
    beside it keeps its full score."""
    from vpo_lightning.tasks.livecodebench import run_tests as lcb_run_tests

    tests = [{"input": f"{a}\n{b}", "output": str(a + b)} for a, b in ((1, 2), (5, 7), (-3, 3), (10, 0))]
    truth = {"testtype": "functional", "func_name": "add", "tests": tests, "time_limit_s": 2.0}
    flood = (
        "import json, os\n"
        "def add(a, b):\n"
        "    P = (1 << 61) - 1\n"  # frozenset({k, k + P}): both elements hash to k, so every pair hashes alike
        "    body = json.dumps(['ok', {'s': [{'f': [k, k + P]} for k in range(1, 20000)]}],\n"
        "                      separators=(',', ':')).encode()\n"
        "    for fd in range(3, 64):\n"
        "        try:\n            os.write(fd, len(body).to_bytes(4, 'big') + body)\n"
        "        except OSError:\n            pass\n"
        "    return a + b\n"
    )
    honest = "```python\ndef add(a, b):\n    return a + b\n```"
    ticks: list[float] = []
    results: dict[str, list[bool]] = {}
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.05)

    def score(name: str, answer: str) -> None:
        results[name] = lcb_run_tests(answer, truth, total_timeout_s=20.0)

    threads = [threading.Thread(target=ticker),
               threading.Thread(target=score, args=("attack", f"```python\n{flood}```")),
               threading.Thread(target=score, args=("honest", honest))]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < 1.0, max(gaps)
    assert results["honest"] == [True] * 4 and not any(results["attack"]), results


def _needs_cgroups() -> None:
    if sandbox.isolation_info()["cgroup"] is None:
        pytest.skip(f"no per-run cgroups here: {sandbox.isolation_info()['missing']}")


def test_memory_is_limited_per_sandbox_not_per_process(mode: str) -> None:
    """Eight processes each touch 48 MiB under ``memory_mb=128`` (``RLIMIT_AS`` is per process, so they held
    8 x 48 MiB): at most what the run's budget (memory + its tmpfs) holds is alive at once."""
    _needs_cgroups()
    code = (  # every child still alive at `moment` holds its block then
        "import os, time\nmoment = time.time() + 3\n"
        "for i in range(8):\n"
        "    if os.fork() == 0:\n"
        "        try:\n            block = b'x' * (48 << 20)\n"
        "            time.sleep(max(0, moment - time.time()))\n            print('held', flush=True)\n"
        "        finally:\n            os._exit(0)\n"
        "for i in range(8):\n    os.wait()\n"
    )
    result = sandbox.run_python(code, guard=False, memory_mb=128, max_disk_mb=32, timeout_s=10)
    assert result.stdout.count("held") * 48 <= 128 + 32, result


def test_an_honest_neighbour_keeps_its_time_beside_spinners(mode: str) -> None:
    """Four runs start 15 CPU spinners each in their own sessions (issue 41: an honest neighbour fell from 8/8 to
    1/8 tests). Each run's cgroup gets one core's worth and an equal share, so an honest run beside them keeps its
    pace (measured on the loaded 2-core machine: 0.2-0.4 s each, 0.8-1.6 s without per-run cgroups)."""
    _needs_cgroups()
    spinners = ("import os, time\nfor _ in range(15):\n"
                "    if os.fork() == 0:\n        os.setsid()\n        while True:\n            pass\ntime.sleep(6)\n")
    attackers = [threading.Thread(target=sandbox.run_python, args=(spinners,), kwargs={"guard": False,
                                                                                       "timeout_s": 8})
                 for _ in range(4)]
    for t in attackers:
        t.start()
    try:
        time.sleep(1.5)  # the spinners are running
        latencies, results = [], []
        for _ in range(4):
            start = time.monotonic()
            results.append(sandbox.run_python("print(sum(range(10**6)))", timeout_s=5))
            latencies.append(time.monotonic() - start)
    finally:
        for t in attackers:
            t.join()
    assert all(r.ok and r.stdout == "499999500000\n" for r in results), results
    assert sorted(latencies)[len(latencies) // 2] < 0.8, latencies


def test_the_trainer_side_decoder_refuses_frozenset_floods() -> None:
    """:meth:`FunctionSession.call` decodes in the trainer: frozensets that all hash alike are refused like ints
    are (a set of 20k of them took ~30 s to build)."""
    from vpo_lightning.sandbox import _codec

    p = (1 << 61) - 1
    frame = _codec.dumps(["ok", {"s": [{"f": [k, k + p]} for k in range(1, 3000)]}])
    start = time.monotonic()
    with pytest.raises(ValueError, match="one hash"):
        _codec.loads(frame)
    assert time.monotonic() - start < 1.0


def test_an_empty_file_flood_is_bounded_by_the_run_budget(mode: str) -> None:
    """Empty files take no tmpfs space but kernel memory (inodes, dentries: 138 MiB in issue 41, 391k files in 6 s
    here before): the run's memory cgroup counts that memory, so the flood ends well before its deadline."""
    _needs_cgroups()
    code = (
        "import sys, time\nend, n = time.time() + 12, 0\n"
        "while time.time() < end:\n"
        "    for _ in range(10000):\n        open('f%d' % n, 'w').close()\n        n += 1\n"
        "    print(n, flush=True)\n"
        "print('done', flush=True)\n"
    )
    result = sandbox.run_python(code, guard=False, memory_mb=32, max_disk_mb=8, timeout_s=15)
    counts = [int(line) for line in result.stdout.split() if line.isdigit()]
    assert "done" not in result.stdout and max(counts, default=0) <= 100_000, result.stdout[-200:]


# ------------------------------------------------------------------- nothing outlives the trainer (issue 54, item 1)

_OUTLIVER = (  # clears its parent-death signal, forks setsid spinners that clear theirs, then execs a sleeper
    "import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "print('cleared', libc.prctl(1, 0, 0, 0, 0), ctypes.get_errno(), flush=True)\n"  # PR_SET_PDEATHSIG = 1
    "for i in range(3):\n"
    "    if os.fork() == 0:\n"
    "        os.setsid()\n        libc.prctl(1, 0, 0, 0, 0)\n"
    "        os.execv(sys.executable, [sys.executable, '-c', 'while True: pass', {token!r}])\n"
    "os.execv(sys.executable, [sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.1)', {token!r}])\n"
)
_TRAINER = (  # runs one candidate; "note": SIGTERM only takes note (as Lightning's handler does), the trainer lives on
    "import signal, sys, time\nfrom vpo_lightning import sandbox\n"
    "if sys.argv[1] == 'note':\n    signal.signal(signal.SIGTERM, lambda *a: print('sigterm noted', flush=True))\n"
    "print(sandbox.isolation_info()['kind'], flush=True)\n"
    "print(sandbox.run_python(sys.stdin.read(), guard=False, timeout_s=60).returncode, flush=True)\n"
    "time.sleep(60)\n"
)


def _pids_with(token: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if token.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    pids.append(int(name))
    return pids


def _trainer_command(kind: str) -> tuple[list[str], dict[str, str]]:
    """A trainer process's command line and environment in isolation ``kind`` (skips where it is unavailable)."""
    import sys

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/tmp", "LANG": "C.UTF-8",
           "VPO_SANDBOX_ISOLATION": kind, "VPO_SANDBOX_ALLOW_MISSING": "cgroups"}
    if kind == "root" or os.geteuid() != 0:
        if (kind == "root") != (os.geteuid() == 0):
            pytest.skip(f"{kind} mode needs {'root' if kind == 'root' else 'a non-root user'}")
        return [sys.executable, "-c", _TRAINER], env
    if not os.path.exists("/usr/bin/python3") or shutil.which("setpriv") is None:
        pytest.skip("userns from root needs /usr/bin/python3 and setpriv to drop to an unprivileged user")
    return ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3", "-c",
            _TRAINER], env


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["root", "userns"])
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGTERM-noted"])
def test_no_candidate_process_outlives_its_trainer(kind: str, how: str) -> None:
    """A candidate clears its parent-death signal and forks setsid children that clear theirs (issue 54: as PID 1 of
    its namespace it could, and outlived a killed trainer with its uid and cgroup). 2 s after its trainer is
    SIGKILLed, SIGTERMed, or SIGTERMed with a handler that only takes note, no process of the candidate is alive."""
    token = f"vpo-outlive-{uuid.uuid4().hex[:12]}"
    cmd, env = _trainer_command(kind)
    trainer = subprocess.Popen([*cmd, "note" if how == "SIGTERM-noted" else "plain"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd="/", text=True)
    try:
        assert trainer.stdin is not None and trainer.stdout is not None
        trainer.stdin.write(_OUTLIVER.format(token=token))
        trainer.stdin.close()
        got = trainer.stdout.readline().strip()
        if got != kind:
            pytest.skip(f"{kind} isolation is not available here (got {got!r}): {trainer.communicate()[1][-300:]}")
        end = time.monotonic() + 30
        while len(_pids_with(token)) < 4 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(_pids_with(token)) == 4, trainer.stderr.read() if trainer.poll() is not None else "slow start"
        trainer.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
        time.sleep(2)
        assert _pids_with(token) == [], how
        if how == "SIGTERM-noted":  # the trainer's own handler still ran, and the trainer lives on
            assert trainer.poll() is None
            assert "sigterm noted" in trainer.stdout.readline() + trainer.stdout.readline()
    finally:
        trainer.kill()
        trainer.wait(10)
        for pid in _pids_with(token):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _reap_test_trainers()


def _reap_test_trainers() -> None:
    """Remove the cgroups of the trainers these tests killed (the next trainer's start-up would)."""
    from vpo_lightning.sandbox import _cgroup

    found, _ = _modes._cgroups() if os.geteuid() == 0 else (None, "")
    if found is not None:
        _cgroup.reap_stale(tuple(os.path.dirname(p) for p in found.parents))


def test_cgroups_of_a_killed_trainer_are_reaped_at_start_up() -> None:
    """A trainer SIGKILLed mid-run leaves its ``vpo-sandbox-<pid>`` cgroups (its exit handler never ran): the next
    trainer's start-up removes them."""
    from vpo_lightning.sandbox import _cgroup

    if os.geteuid() != 0:
        pytest.skip("per-run cgroups need root here")
    cmd, env = _trainer_command("root")
    trainer = subprocess.Popen([*cmd, "plain"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env, cwd="/", text=True)
    assert trainer.stdin is not None and trainer.stdout is not None
    trainer.stdin.write("import time\ntime.sleep(60)\n")
    trainer.stdin.close()
    assert trainer.stdout.readline().strip() == "root"
    found, why = _cgroup.detect()
    if found is None:
        trainer.kill()
        pytest.skip(f"no per-run cgroups here: {why}")
    stale = [os.path.join(os.path.dirname(p), f"vpo-sandbox-{trainer.pid}") for p in found.parents]
    end = time.monotonic() + 20
    while not all(os.path.isdir(d) and any(n.startswith("run-") for n in os.listdir(d)) for d in stale) \
            and time.monotonic() < end:
        time.sleep(0.05)
    trainer.kill()
    trainer.wait(10)
    assert all(os.path.isdir(d) for d in stale)  # left behind
    _cgroup.detect()  # what a trainer does at start-up
    assert not any(os.path.exists(d) for d in stale)


def test_processes_left_on_a_dead_trainers_uids_are_reaped() -> None:
    """A process still running on a private uid of a trainer that is gone (as a candidate of a trainer before issue
    54 could) is killed when the next trainer's uid pool starts; a process on that uid outside a one-uid user
    namespace (a container's) is left alone."""
    if os.geteuid() != 0 or shutil.which("bwrap") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, bubblewrap and setpriv")
    owner = next(p for p in range(400_000, 500_000) if not _uids._pool_owner_alive(_uids._POOL_BASE + p * 256))
    uid = str(_uids._POOL_BASE + owner * _uids._POOL_STRIDE + 3)
    outer = subprocess.Popen(["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "bwrap", "--unshare-user",
                              "--die-with-parent", "--ro-bind", "/", "/", "sleep", "60"])
    inner = -1
    try:
        end = time.monotonic() + 10
        while not Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split() and \
                time.monotonic() < end:
            time.sleep(0.05)
        (inner,) = map(int, Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split())
        end = time.monotonic() + 10  # bubblewrap writes the child's uid map after the fork: wait for it (loaded CI)
        while Path(f"/proc/{inner}/uid_map").read_text().split() != [uid, uid, "1"] and time.monotonic() < end:
            time.sleep(0.05)
        killed = _uids.reap_stale_uids()
        assert inner in killed and outer.pid not in killed
        assert outer.wait(10) != 0
    finally:
        outer.kill()
        outer.wait(10)
        if inner > 0:
            with contextlib.suppress(OSError):
                os.kill(inner, signal.SIGKILL)


# ------------------------------------------------------------ seccomp is an allow-list (issue 54, item 2)

def test_host_wide_kernel_resources_are_refused(run) -> None:
    """Calls nobody listed as dangerous before issue 54 reach machine-wide kernel state: AIO events (``fs.aio-max-nr``
    is global), System V shared memory (outside ``RLIMIT_AS``), semaphores, message queues, inotify (sees opens by
    other sandboxes on the shared standard library). The allow-list refuses them, a call nobody listed at all,
    clearing the parent-death signal and raising socket buffers past the default."""
    code = (
        "import ctypes, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def attempt(name, *args):\n"
        "    out = libc.syscall(*args)\n    print(name, 'ok' if out >= 0 else 'refused', ctypes.get_errno())\n"
        "attempt('io_setup', 206, 64, ctypes.byref(ctypes.c_ulong(0)))\n"
        "attempt('shmget', 29, 0, 1 << 20, 0o1600)\n"  # IPC_PRIVATE, IPC_CREAT | 0600
        "attempt('semget', 64, 0, 1, 0o1600)\n"
        "attempt('msgget', 68, 0, 0o1600)\n"
        "attempt('mq_open', 240, b'vpo', 0o102, 0o600, None)\n"  # O_CREAT | O_RDWR
        "attempt('inotify_init1', 294, 0)\n"
        "attempt('inotify_init', 253)\n"
        "attempt('fanotify_init', 300, 0, 0)\n"
        "attempt('vmsplice', 278, 0, 0, 0, 0)\n"  # allowed by the deny list, listed nowhere now
        "attempt('pdeathsig-clear', 157, 1, 0)\n"  # prctl(PR_SET_PDEATHSIG, 0)
        "attempt('pdeathsig-term', 157, 1, 15)\n"
        "a, b = socket.socketpair()\n"
        "for opt in ('SO_SNDBUF', 'SO_RCVBUF'):\n"
        "    try:\n        a.setsockopt(socket.SOL_SOCKET, getattr(socket, opt), 1 << 22)\n        print(opt, 'ok')\n"
        "    except OSError as e:\n        print(opt, 'refused', e.errno)\n"
        "attempt('pdeathsig-kill', 157, 1, 9)\n"  # setting SIGKILL (what bubblewrap does) stays allowed
    )
    result = run(code, guard=False)
    got = dict(line.split(" ", 1) for line in result["stdout"].splitlines())
    assert len(got) == 14 and got.pop("pdeathsig-kill").startswith("ok"), result
    assert all(v.startswith("refused") for v in got.values()), got


REPRESENTATIVE = (  # what candidates do: the standard library, threads, files, fork, a subprocess, pipes, signals
    "import array, base64, bisect, collections, copy, dataclasses, datetime, decimal, enum, fractions, functools\n"
    "import hashlib, heapq, io, itertools, json, math, mmap, operator, os, queue, random, re, select, signal\n"
    "import socket, statistics, string, struct, subprocess, sys, tempfile, textwrap, threading, time, typing\n"
    "import unicodedata, zlib, concurrent.futures, resource, locale, cmath, pickle, csv, difflib, shutil, glob\n"
    "out = [sum(map(int, sys.stdin.read().split())), math.comb(30, 15), json.loads('{\"a\": [2.5]}')['a'][0],\n"
    "       re.sub(r'(\\d+)', lambda m: str(int(m.group(1)) * 2), 'a1b22'), str(decimal.Decimal(1) / 7)[:6],\n"
    "       str(fractions.Fraction(3, 9)), hashlib.sha256(b'x').hexdigest()[:8], len(zlib.compress(b'x' * 1000)),\n"
    "       statistics.median([3, 1, 2]), unicodedata.name('a'), random.Random(1).randint(1, 9)]\n"
    "with concurrent.futures.ThreadPoolExecutor(2) as ex:\n    out.append(sum(ex.map(abs, [-1, 2, -3])))\n"
    "threading.stack_size(64 << 20)\nsys.setrecursionlimit(100000)\n"
    "def deep(n):\n    return 0 if n == 0 else 1 + deep(n - 1)\n"
    "r = []\nt = threading.Thread(target=lambda: r.append(deep(20000)))\nt.start()\nt.join()\nout.append(r[0])\n"
    "open('f.txt', 'w').write('hello')\nos.rename('f.txt', 'g.txt')\nos.remove('g.txt')\n"
    "os.makedirs('d/e')\nshutil.rmtree('d')\nglob.glob('*')\n"
    "with tempfile.TemporaryDirectory() as d, tempfile.NamedTemporaryFile() as f:\n    f.write(b'x')\n    f.flush()\n"
    "pid = os.fork()\nif pid == 0:\n    os._exit(7)\nout.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    "out.append(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True,\n"
    "                          timeout=5).stdout.strip())\n"
    "a, b = socket.socketpair()\na.sendall(b'pair')\nout.append(b.recv(4).decode())\n"
    "rfd, wfd = os.pipe()\nos.write(wfd, b'p')\nselect.select([rfd], [], [], 1)\nos.read(rfd, 1)\n"
    "m = mmap.mmap(-1, 1 << 20)\nm[:4] = b'mmap'\nout.append(m[:4].decode())\n"
    "signal.signal(signal.SIGALRM, lambda *a: None)\nsignal.setitimer(signal.ITIMER_REAL, 0.01)\ntime.sleep(0.05)\n"
    "big = bytearray(64 << 20)\ndel big\nlocale.getlocale()\ndatetime.datetime.now().isoformat()\n"
    "print(pickle.loads(pickle.dumps(out)))\n"
)
REPRESENTATIVE_OUT = "[6, 155117520, 2.5, 'a2b44', '0.1428', '1/3', '2d711642', 17, 2, 'LATIN SMALL LETTER A', 3, 6, " \
    "20000, 7, '42', 'pair', 'mmap']\n"


def test_a_representative_candidate_runs_under_the_allow_list(run) -> None:
    """Control for the allow-list: the standard library, threads with deep recursion, files, fork, a subprocess of
    the interpreter, socketpair, pipes, mmap, timers and a 64 MiB allocation all work (guard off, so that only
    the kernel layers decide); with the guard on, starting a subprocess is still refused by the hook."""
    result = run(REPRESENTATIVE, stdin="1 2 3", guard=False, timeout_s=20)
    assert result["returncode"] == 0 and result["stdout"] == REPRESENTATIVE_OUT, result
    guarded = run("import subprocess\nsubprocess.run(['true'])\n")
    assert guarded["returncode"] != 0 and "sandbox: importing _posixsubprocess is not allowed" in guarded["stderr"]


def test_the_filter_tables_match_the_kernel_headers() -> None:
    """The hand-written x86_64 numbers agree with the kernel's headers where installed, and no call is in two of the
    allowed, argument-checked and named-refusal tables."""
    from vpo_lightning.sandbox import _seccomp

    tables = (_seccomp.X86_64_ALLOW, _seccomp.X86_64_CHECKED, _seccomp.X86_64_DENY)
    names = [n for t in tables for n in t]
    numbers = [nr for t in tables for nr in t.values()]
    assert len(set(names)) == len(names) and len(set(numbers)) == len(numbers)
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if not header.exists():
        pytest.skip("no kernel headers here (linux-libc-dev)")
    known = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+) (\d+)", header.read_text())}
    wrong = {n: (nr, known[n]) for t in tables for n, nr in t.items() if n in known and known[n] != nr}
    assert not wrong and sum(n in known for n in names) > len(names) - 10, wrong


def test_the_allow_list_covers_what_the_interpreter_calls(tmp_path: Path) -> None:
    """The system calls the sandbox's interpreter makes for the representative candidate (listed by ``strace``
    outside the sandbox) are all allowed, and none is in the named deny list."""
    from vpo_lightning.sandbox import _seccomp

    if shutil.which("strace") is None:
        pytest.skip("needs strace")
    python = _modes._candidate_pythons()[0]
    (tmp_path / "main.py").write_text(REPRESENTATIVE)
    trace = tmp_path / "trace"
    done = subprocess.run(["strace", "-f", "-qq", "-o", str(trace), python, "-I", "-S", "-B", "main.py"],
                          input="1 2 3", capture_output=True, text=True, cwd=tmp_path, timeout=120)
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr[-200:]}")
    assert done.stdout == REPRESENTATIVE_OUT, done.stderr[-2000:]
    called = set(re.findall(r"^\d+\s+(?:<\.\.\. )?([a-z0-9_]+)\(", trace.read_text(), re.M))
    allowed = set(_seccomp.X86_64_ALLOW) | set(_seccomp.X86_64_CHECKED)
    assert len(called) > 40 and called <= allowed, sorted(called - allowed)


def test_vpo_checks_the_sandbox_before_a_code_run(monkeypatch) -> None:
    """``vpo fit``/``validate`` with a reward that runs model-written code learn the isolation before the model loads
    (printed and recorded as ``sandbox.json``), and stop with the sandbox's reason where it refuses (issue 54,
    item 3); a run without such a reward does not touch the sandbox."""
    from vpo_lightning.training.cli import sandbox_summary

    monkeypatch.delenv("VPO_SANDBOX_ISOLATION", raising=False)
    monkeypatch.delenv(sandbox.WEAK_FLAG, raising=False)
    monkeypatch.setattr(_modes, "_ISO", None)
    assert sandbox_summary(["format", "tool_name"]) is None and _modes._ISO is None
    kind = sandbox.isolation_info()["kind"]
    if kind not in ("root", "userns"):
        pytest.skip(f"no kernel isolation here ({kind})")
    summary = sandbox_summary(["code_tests", "format", "lcb_tests"])
    assert summary is not None and summary["rewards"] == ["code_tests", "lcb_tests"] and summary["kind"] == kind
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(_modes, "_ISO", None)
    with pytest.raises(ValueError, match=f"code_tests run model-written code; .*{sandbox.WEAK_FLAG}=1"):
        sandbox_summary(["code_tests"])


def test_socket_buffers_count_against_the_run_budget(mode: str) -> None:
    """13 processes fill 30 AF_UNIX socket pairs each (~13 MiB queued in the kernel per process, outside
    ``RLIMIT_AS``; issue 54 saw ~400 MB from a 160 MiB candidate with raised buffers): the run's memory cgroup counts
    the buffers, so the run ends (killed) or reports at most its budget (``memory_mb + max_disk_mb``)."""
    _needs_cgroups()
    code = (
        "import os, socket, time\n"
        "def fill(kind):\n"
        "    total, socks = 0, []\n"
        "    try:\n"
        "        for _ in range(30):\n"
        "            socks += socket.socketpair(socket.AF_UNIX, kind)\n"
        "            for s in socks[-2:]:\n"
        "                s.setblocking(False)\n"
        "                try:\n"
        "                    while True:\n                        total += s.send(b'x' * 60000)\n"
        "                except OSError:\n                    pass\n"
        "    except OSError:\n        pass\n"
        "    return total, socks\n"
        "r, w = os.pipe()\n"
        "for i in range(12):\n"
        "    if os.fork() == 0:\n"
        "        total, socks = fill(socket.SOCK_DGRAM if i % 2 else socket.SOCK_STREAM)\n"
        "        os.write(w, b'%d ' % total)\n        time.sleep(6)\n        os._exit(0)\n"
        "os.close(w)\ntotal, socks = fill(socket.SOCK_STREAM)\ntime.sleep(2)\n"
        "print((total + sum(map(int, os.read(r, 1 << 16).split()))) >> 20, flush=True)\n"
    )
    result = sandbox.run_python(code, guard=False, memory_mb=128, max_disk_mb=32, timeout_s=12)
    queued = int(result.stdout.split()[-1]) if result.stdout.split() else 0
    assert result.returncode != 0 or queued <= 128 + 32, result
