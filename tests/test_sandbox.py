"""Attacks on the sandbox: each is contained, scores 0 through the code reward, and this process survives.

The attacks run twice where it matters: through the code reward (audit-hook guard on, as in training), and with
the guard off through ``run_python`` to check the OS layer alone (root isolation: namespaces + private uid).
"""

from __future__ import annotations

import ast
import glob
import os
import subprocess
import time
from pathlib import Path

import pytest

from vpo_lightning import sandbox
from vpo_lightning.tasks.code import run_tests

REPO = Path(__file__).resolve().parents[1]
SECRET = "vpo-fake-secret-4f1c9a"
PROBLEM = {
    "task_id": "Toy/add", "entry_point": "add", "preamble": "",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "tests": ["assert candidate(1, 2) == 3", "assert candidate(0, 0) == 0", "assert candidate(-1, 1) == 0"],
}
OS_LAYER = pytest.mark.skipif(
    sandbox.isolation_info()["kind"] not in ("root", "userns"), reason="needs kernel isolation (bubblewrap)"
)


def score(body: str, header: str = "", **kwargs: float) -> list[bool]:
    """Pass/fail of the 3 toy tests for ``def add(a, b):`` + ``body`` (indented), after ``header``."""
    code = header + "\ndef add(a, b):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return run_tests(f"```python\n{code}```", PROBLEM, **{"test_timeout_s": 1.0, "total_timeout_s": 3.0, **kwargs})


def _ours(uid: int) -> bool:
    """A uid of this test process's sandbox pool (other helpers on a shared machine have their own pools)."""
    base = 1_000_000 + (os.getpid() % 1_000_000) * 64
    return base <= uid < base + 64


def _processes() -> list[tuple[int, int, str, str]]:
    out = subprocess.run(["ps", "-eo", "uid=,ppid=,stat=,comm="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) + [""] for line in out.splitlines()]
    return [(int(r[0]), int(r[1]), r[2], r[3].strip()) for r in rows]


def _zombies() -> int:
    """Zombies of our sandbox uids or our children (other zombies on the machine are not ours)."""
    return sum(stat.startswith("Z") and (_ours(uid) or ppid == os.getpid()) for uid, ppid, stat, _ in _processes())


@pytest.fixture(autouse=True)
def _no_leaks():
    """Every test: no sandbox directory (weak mode), sandbox-uid process or new zombie is left behind, and we are
    alive."""
    dirs, zombies = set(glob.glob("/tmp/vpo-sandbox-*")), _zombies()
    os.environ["VPO_TEST_SECRET"] = SECRET
    yield
    if sandbox.isolation_info()["kind"] == "weak":
        assert set(glob.glob("/tmp/vpo-sandbox-*")) <= dirs
    time.sleep(0.05)
    assert _zombies() <= zombies
    assert not [p for p in _processes() if _ours(p[0])], "a sandbox process survived"


def test_honest_candidate_passes() -> None:
    assert score("return a + b") == [True, True, True]


def test_infinite_loop() -> None:
    start = time.monotonic()
    assert score("while True:\n    pass", test_timeout_s=0.5, total_timeout_s=1.5) == [False, False, False]
    assert time.monotonic() - start < 5


def test_infinite_loop_at_import_fails_fast() -> None:
    start = time.monotonic()
    assert score("return a + b", header="while True:\n    pass\n") == [False, False, False]
    assert time.monotonic() - start < 2.5  # one load timeout, not one per test


def test_fork_bomb() -> None:
    assert score("import os\nwhile True:\n    os.fork()\nreturn a + b") == [False, False, False]


@OS_LAYER
def test_fork_bomb_os_layer() -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork() or os.setsid()\n    except OSError:\n        pass\n"
    result = sandbox.run_python(bomb, timeout_s=1.5, guard=False)
    assert result.timed_out and result.killed_reason == "timeout"


@pytest.mark.parametrize("guard", [True, False])
def test_memory_bomb(guard: bool) -> None:
    if not guard:
        result = sandbox.run_python("x = bytearray(4 << 30)\nprint('allocated')", guard=False, memory_mb=256)
        assert "MemoryError" in result.stderr and "allocated" not in result.stdout
        return
    assert score("x = bytearray(4 << 30)\nreturn a + b") == [False, False, False]


TMP_TARGET = "/tmp/vpo-pwned.txt"


@pytest.mark.parametrize("target", [str(REPO / "pwned.txt"), TMP_TARGET])
def test_write_outside_its_directory(target: str) -> None:
    body = f"open({target!r}, 'w').write('x')\nreturn a + b"
    scores = score(body)
    # the sandbox's /tmp is its own run directory: a file straight under it can be written (and vanishes with the
    # run); the project's path cannot, wherever the clone lies (under /tmp too)
    if target == TMP_TARGET and sandbox.isolation_info()["kind"] in ("root", "userns"):
        assert scores == [True, True, True]  # the sandbox's /tmp is its own run directory
    else:
        assert scores == [False, False, False]
    assert not os.path.exists(target)


@OS_LAYER
def test_write_project_dir_os_layer() -> None:
    target = REPO / "pwned.txt"
    result = sandbox.run_python(f"open({str(target)!r}, 'w').write('x')", guard=False)
    assert ("PermissionError" in result.stderr or "FileNotFoundError" in result.stderr) and not target.exists()


def test_writes_inside_its_directory_work() -> None:
    result = sandbox.run_python("import os, tempfile\nopen('a.txt', 'w').write('hi')\ntempfile.mkstemp()\nprint('ok')")
    assert result.ok and result.stdout == "ok\n"


def test_socket() -> None:
    body = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=0.5)\nreturn a + b"
    assert score(body) == [False, False, False]


@OS_LAYER
def test_socket_os_layer() -> None:
    code = ("import socket\ntry:\n    s = socket.socket()\n    s.settimeout(0.5)\n"
            "    print(s.connect_ex(('1.1.1.1', 53)))\nexcept OSError as e:\n    print('refused', e.errno)")
    result = sandbox.run_python(code, guard=False)
    # seccomp refuses AF_INET (EAFNOSUPPORT); without it, ENETUNREACH: no interface in the namespace
    assert result.ok and result.stdout.strip() not in ("0", "")


def test_printing_gigabytes() -> None:
    start = time.monotonic()
    assert score("while True:\n    print('x' * 65536)") == [False, False, False]
    result = sandbox.run_python("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", max_output_bytes=10_000)
    assert result.killed_reason == "output_limit" and len(result.stdout) == 10_000
    assert time.monotonic() - start < 5


def test_environment_secrets() -> None:
    leak = f"import os\nif {SECRET!r} in str(os.environ):\n    return a + b\nreturn -1"
    assert score(leak) == [False, False, False]
    proc = "import glob\nfor p in glob.glob('/proc/*/environ'):\n    if {s!r} in open(p).read():\n        return a + b"
    assert score(proc.format(s=SECRET) + "\nreturn -1") == [False, False, False]
    result = sandbox.run_python("import os\nprint(sorted(os.environ))")
    assert SECRET not in result.stdout and "VPO_TEST_SECRET" not in result.stdout
    assert set(ast.literal_eval(result.stdout)) <= {"HOME", "LANG", "PATH", "TMPDIR", "PWD"}


@OS_LAYER
def test_environment_secrets_os_layer() -> None:
    code = (
        "import glob\nfor p in glob.glob('/proc/[0-9]*/environ'):\n    try:\n        d = open(p, 'rb').read()\n"
        "    except OSError:\n        continue\n    if b'VPO_TEST_SECRET' in d:\n        print('LEAK')"
    )
    result = sandbox.run_python(code, guard=False)
    assert result.ok and "LEAK" not in result.stdout


@pytest.mark.parametrize("guard", [True, False])
def test_killing_the_parent(guard: bool) -> None:
    if guard:
        body = "import os, signal\nos.kill(os.getppid(), 9)\nos.killpg(0, 9)\nos.kill(-1, 9)\nreturn a + b"
        assert score(body) == [False, False, False]
    elif sandbox.isolation_info()["kind"] == "root":
        code = "import os\nfor pid in (os.getppid(), 0, -1):\n    try:\n        os.kill(pid, 9)\n"
        code += "    except OSError:\n        pass\n"
        sandbox.run_python(code, guard=False)
        sandbox.run_python(f"import os\nos.kill({os.getpid()}, 9)", guard=False)  # our pid, from its view
    assert os.getpid() > 0  # still here


def test_exit_inside_a_test_zeroes_only_that_test() -> None:
    assert score("import os\nif a == 1:\n    os._exit(0)\nreturn a + b") == [False, True, True]
    assert score("import sys\nif a == 0:\n    sys.exit(0)\nreturn a + b") == [True, False, True]
    assert score("raise SystemExit(0)", header="import sys\nsys.exit(0)") == [False, False, False]


def test_forging_results() -> None:
    header = (
        "import builtins, os, sys, __main__\n"
        "frame = b'[\"ok\",3]'\n"
        "for fd in range(0, 30):\n"
        "    try:\n"
        "        os.write(fd, len(frame).to_bytes(4, 'big') + frame + b'PASS ok ready')\n"
        "    except OSError:\n"
        "        pass\n"
        "print('[\"ready\"]', 'PASS', 'all tests passed')\n"
        "__main__.encode = lambda v, _d=0: True\n"
        "builtins.AssertionError = type('Nope', (Exception,), {})\n"
    )
    assert score("return None", header=header) == [False, False, False]


def test_rigged_objects_cannot_cross_the_boundary() -> None:
    header = "class Always:\n    def __eq__(self, other):\n        return True\n\nclass Int(int):\n    pass\n"
    assert score("return Always()", header=header) == [False, False, False]
    assert score("return Int(a + b)", header=header) == [False, False, False]


def test_patching_the_server_only_changes_its_own_answers() -> None:
    header = "import sys\nsys.modules['_child'].encode = lambda v, _d=0: 3\n"
    # the patched encoder answers 3 to every call: exactly as if the function returned 3
    assert score("return 0", header=header) == [True, False, False]


def test_run_many_and_limits() -> None:
    results = sandbox.run_many(["print(1)", "import sys; sys.exit(3)", "raise ValueError('x')"], max_workers=2)
    assert [r.returncode for r in results] == [0, 3, 1] and results[0].stdout == "1\n"
    assert "ValueError" in results[2].stderr
    assert sandbox.run_python("print(input()[::-1])", stdin="abc").stdout == "cba\n"
    cpu = sandbox.run_python("while True:\n    pass", timeout_s=10, cpu_s=1)
    assert cpu.returncode != 0 and not cpu.timed_out  # RLIMIT_CPU (1 s of CPU) ended it before the wall clock


def test_function_session_restarts_after_a_crash() -> None:
    program = "import os\ndef f(x):\n    if x < 0:\n        os._exit(1)\n    return [x, (x,), {x: {x}}, b'z', 1.5]\n"
    with sandbox.FunctionSession(program) as session:
        deadline = time.monotonic() + 5
        assert session.call("f", [2], deadline=deadline) == [2, (2,), {2: {2}}, b"z", 1.5]
        with pytest.raises(sandbox.SandboxCallError, match="died"):
            session.call("f", [-1], deadline=deadline)
        assert session.call("f", [3], deadline=deadline)[0] == 3 and session.starts == 2
