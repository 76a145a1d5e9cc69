"""LiveCodeBench: decoding the public ``code_generation_lite`` records, prompts, and the per-test reward.

The ``livecodebench`` task package: this module holds the prompt, the answer parsing and the reward (pure Python);
``reward.py`` registers the reward; ``build.py`` (``python -m vpo_lightning.tasks.livecodebench.build``) writes the
JSONL splits from the public files.

Public record (one JSON object per problem): ``question_title``, ``question_content``, ``platform`` (leetcode,
codeforces, atcoder), ``question_id``, ``contest_id``, ``contest_date`` (ISO date-time), ``starter_code``,
``difficulty``, ``public_test_cases`` (a JSON string: a list of ``{"input", "output", "testtype"}``),
``private_test_cases`` (the same list, either as a JSON string or, in the public release, as
base64(zlib(pickle(JSON string)))) and ``metadata`` (a JSON string; ``{"func_name": ...}`` for function-call
problems). :func:`decode_tests` reads both encodings; its unpickler refuses every global, so a tampered file cannot
run code through pickle (the release pickles a plain ``str``).

Tests. ``testtype`` ``stdin``: the program reads ``input`` on stdin and must print ``output``; outputs are compared
line by line after stripping, tokens equal as text or as decimal numbers (``1.50`` = ``1.5``). ``functional``: the
``input`` is one JSON value per line (the positional arguments) and ``output`` a JSON value; the candidate defines
``class Solution`` with the method ``func_name`` (LeetCode style, as the starter code shows) or a top-level function
of that name. All public and private tests are pooled and the :data:`NUM_TEST_DIMS` (16) smallest kept (size =
``len(input) + len(output)``, ties in file order).

Running. Candidates run only in the sandbox (:mod:`vpo_lightning.sandbox`): a stdin test is one
:func:`~vpo_lightning.sandbox.run_python` run with a :data:`TIME_LIMIT_S` (6 s) wall clock, its captured stdout
(capped) compared as text here; function-call tests share one sandboxed process per candidate, 6 s per call, and are
compared with the expected value in a second sandbox, the checker (:func:`vpo_lightning.tasks.code.run_checked`, as
the code task does): the trainer relays the answer as bytes and reads only the verdict, so no answer is ever decoded
into Python objects in the trainer. Every program gets :data:`PREAMBLE` (``from typing
import *`` and common standard modules) first, as LiveCodeBench's own runner does. Once
:data:`TOTAL_TIMEOUT_S` is spent on a candidate, its remaining tests fail.

Reward ``lcb_tests``: one value in {0, 1} per kept test, D = t (at most 16; the paper's "D = number of tests"); in a
batch the dimensions past t are padding that the registry masks (``real_dims``, as the HumanEval task does).
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import pickle
import textwrap
import time
import zlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from vpo_lightning.sandbox import run_python
from vpo_lightning.tasks.code import extract_code, num_tests, run_checked

TASK = "livecodebench"
NUM_TEST_DIMS = 16
TIME_LIMIT_S = 6.0
TOTAL_TIMEOUT_S = 60.0
MEMORY_MB = 1024
MAX_DECODED_BYTES = 1 << 30  # a private-test blob larger than this when inflated is refused
DIMS = tuple(f"test_{i}" for i in range(NUM_TEST_DIMS))
SOURCE = "LiveCodeBench code_generation_lite (livecodebench/code_generation_lite)"
PREAMBLE = (
    "from typing import *\n"
    "import bisect, collections, functools, heapq, itertools, math, re, string, sys\n"
    "from collections import Counter, defaultdict, deque\n"
    "from functools import cache, lru_cache, reduce\n"
    "from itertools import accumulate, combinations, permutations, product\n"
    "from math import ceil, floor, gcd, inf, sqrt\n"
    "sys.setrecursionlimit(100000)\n\n"
)
_CALL = "__vpo_lcb_call__"
SYSTEM_PROMPT = (
    "You are an expert Python programmer. You will be given a competitive programming problem; write a correct, "
    "efficient Python 3 program that meets the specification and passes all tests."
)


# ------------------------------------------------------------------------------------------------- decoding


class _StrictUnpickler(pickle.Unpickler):
    """An unpickler for plain data only: any global (class or function) is refused, so loading runs no code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: LiveCodeBench test blobs hold only a string")


def decode_tests(blob: Any) -> list[dict[str, Any]]:
    """The test list of a ``public_test_cases`` / ``private_test_cases`` field (JSON, or base64-zlib-pickled JSON).

    Raises:
        ValueError: the field is neither encoding, or does not hold a list of ``{input, output}`` objects.
    """
    if isinstance(blob, list):
        tests = blob
    elif not isinstance(blob, str):
        raise ValueError(f"test field must be a string or a list, got {type(blob).__name__}")
    elif not blob.strip():
        tests = []
    else:
        try:
            tests = json.loads(blob)
        except json.JSONDecodeError:
            try:
                packed = base64.b64decode(blob.encode("ascii"), validate=False)
                inflater = zlib.decompressobj()
                raw = inflater.decompress(packed, MAX_DECODED_BYTES)
                if inflater.unconsumed_tail:
                    raise ValueError(f"private tests inflate to more than {MAX_DECODED_BYTES >> 20} MiB")
                text = _StrictUnpickler(io.BytesIO(raw)).load()
                tests = json.loads(text) if isinstance(text, (str, bytes)) else text
            except Exception as err:  # noqa: BLE001 - a corrupt pickle stream can raise almost anything
                raise ValueError(f"test field is neither JSON nor base64/zlib/pickle-encoded JSON ({err})") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        raise ValueError("test field must hold a list of {input, output, testtype} objects")
    return tests


def encode_private_tests(tests: Sequence[Mapping[str, Any]]) -> str:
    """The public release's encoding of a test list: base64(zlib(pickle(JSON string))) (for hand-made records)."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(list(tests))))).decode("ascii")


def contest_date(value: Any) -> datetime:
    """``contest_date`` as a naive datetime (the hub gives datetimes, the JSONL files ISO strings).

    Raises:
        ValueError: not a date.
    """
    if isinstance(value, datetime):
        return value.replace(tzinfo=None)
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).replace(tzinfo=None)
    except ValueError:
        raise ValueError(f"contest_date {value!r} is not an ISO date") from None


def problem_date(problem: Mapping[str, Any]) -> datetime:
    """A public problem's contest date; a missing or malformed one is a ValueError naming the problem."""
    try:
        return contest_date(problem["contest_date"])
    except (KeyError, ValueError) as err:
        raise ValueError(f"LiveCodeBench problem {problem.get('question_id', '?')!r}: no usable contest_date "
                         f"({err})") from None


def smallest_tests(tests: Sequence[Mapping[str, Any]], k: int = NUM_TEST_DIMS) -> list[dict[str, Any]]:
    """The ``k`` tests with the smallest ``len(input) + len(output)``, ties kept in order."""
    order = sorted(range(len(tests)), key=lambda i: (len(tests[i]["input"]) + len(tests[i]["output"]), i))
    return [dict(tests[i]) for i in order[:k]]


# ------------------------------------------------------------------------------------------------- prompt


def func_name(example: Mapping[str, Any]) -> str | None:
    """The function-call entry point from ``metadata`` (a JSON string or dict), None for stdin problems."""
    meta = example.get("metadata") or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta) if meta.strip() else {}
        except json.JSONDecodeError:
            meta = {}
    name = meta.get("func_name") if isinstance(meta, dict) else None
    return str(name) if name else None


def user_prompt(question: str, starter_code: str, functional: bool) -> str:
    """The user message: the problem, then the single-answer format for its kind."""
    if functional:
        fmt = ("Complete the starter code below and answer with the whole class (imports included) in a single "
               f"```python fenced code block.\n```python\n{starter_code.rstrip()}\n```")
    else:
        fmt = ("Write a complete program that reads the input from standard input and writes the answer to standard "
               "output (do not just test the sample). Answer with the program in a single ```python fenced code "
               "block.")
    return f"### Problem\n{question.strip()}\n\n### Format\n{fmt}"


def make_record(example: Mapping[str, Any], split: str, max_tests: int = NUM_TEST_DIMS) -> dict[str, Any]:
    """The JSONL record of one public problem: its 16 smallest tests in ``ground_truth``.

    Raises:
        ValueError: undecodable tests, no tests, or mixed/unknown test types.
    """
    qid = example.get("question_id", "?")
    try:
        tests = decode_tests(example.get("public_test_cases") or "[]")
        tests += decode_tests(example.get("private_test_cases") or "[]")
    except ValueError as err:
        raise ValueError(f"LiveCodeBench problem {qid!r}: {err}") from None
    kinds = {t.get("testtype", "stdin") for t in tests}
    if not tests or len(kinds) != 1 or not kinds <= {"stdin", "functional"}:
        raise ValueError(f"LiveCodeBench problem {qid!r}: needs tests of one type, stdin or functional; got "
                         f"{len(tests)} tests of types {sorted(kinds)}")
    testtype = kinds.pop()
    name = func_name(example)
    if testtype == "functional" and not name:
        raise ValueError(f"LiveCodeBench problem {qid!r}: functional tests but no metadata.func_name")
    kept = smallest_tests(tests, max_tests)
    date = problem_date(example)
    return {
        "id": f"lcb-{qid}",
        "task": TASK,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user_prompt(str(example.get("question_content", "")),
                                                    str(example.get("starter_code") or ""),
                                                    testtype == "functional")},
        ],
        "ground_truth": {
            "testtype": testtype,
            "func_name": name if testtype == "functional" else None,
            "tests": [{"input": str(t["input"]), "output": str(t["output"])} for t in kept],
            "time_limit_s": TIME_LIMIT_S,
        },
        "meta": {"split": split, "category": str(example.get("difficulty", "")), "platform": example.get("platform"),
                 "contest_date": date.date().isoformat(), "num_tests": len(kept), "total_tests": len(tests),
                 "title": example.get("question_title"), "source": SOURCE},
    }


# ------------------------------------------------------------------------------------------------- checking


def outputs_match(got: str, expected: str) -> bool:
    """stdout equals the expected output: same non-empty line count after stripping, each line equal as text or
    token by token (whitespace-split) as text or as decimal numbers."""
    lines_got, lines_exp = got.strip().splitlines(), expected.strip().splitlines()
    if len(lines_got) != len(lines_exp):
        return False
    for a, b in zip(lines_got, lines_exp):
        a, b = a.strip(), b.strip()
        if a == b:
            continue
        ta, tb = a.split(), b.split()
        if len(ta) != len(tb):
            return False
        for x, y in zip(ta, tb):
            if x == y:
                continue
            try:
                if Decimal(x) != Decimal(y) or not Decimal(x).is_finite():
                    return False
            except (InvalidOperation, ValueError):
                return False
    return True


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively (JSON has no tuples; LiveCodeBench compares a returned tuple as a list)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def values_match(got: Any, expected: Any) -> bool:
    """A function-call result equals the expected JSON value (bools are not numbers, 1 == 1.0 is)."""
    got, expected = _plain(got), _plain(expected)
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(values_match(a, b) for a, b in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_match(got[k], expected[k]) for k in got)
    try:
        return bool(got == expected)
    except Exception:  # noqa: BLE001 - a comparison that cannot be made is a mismatch
        return False


def build_program(candidate: str, testtype: str, name: str | None) -> str | None:
    """The program to run: :data:`PREAMBLE` + the candidate's code (+ a call shim for function-call problems);
    None when there is no code or it does not compile (then every test fails without starting a process)."""
    code = textwrap.dedent(extract_code(candidate))
    if not code.strip():
        return None
    program = PREAMBLE + code
    if testtype == "functional":
        program += (
            f"\n\n\ndef {_CALL}(*args):\n"
            f"    _cls = globals().get('Solution')\n"
            f"    if isinstance(_cls, type) and hasattr(_cls, {name!r}):\n"
            f"        return getattr(_cls(), {name!r})(*args)\n"
            f"    return globals()[{name!r}](*args)\n"
        )
    try:
        compile(program, "<candidate>", "exec")
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return None
    return program


def _stdin_tests(program: str, tests: Sequence[Mapping[str, str]], limit: float, end: float) -> list[bool]:
    passed: list[bool] = []
    for test in tests:
        left = end - time.monotonic()
        if left <= 0:
            break
        result = run_python(program, stdin=test["input"], timeout_s=min(limit, left), memory_mb=MEMORY_MB,
                            max_output_bytes=max(64_000, 4 * len(test["output"])))
        passed.append(result.returncode == 0 and result.killed_reason is None
                      and outputs_match(result.stdout, test["output"]))
    return passed


# The checker of function-call problems: the comparison below, run in its own sandbox. Its ``__vpo_call__`` relays
# (as undecoded bytes, through the trainer) to the candidate's ``__vpo_lcb_call__``; the answer is decoded and
# compared here, so a crafted answer (a set of hash-colliding frozensets: ~30 s to decode) stalls only this process,
# which its deadline kills.
_CHECKER_RUNNER = """

def __vpo_lcb_check__(args, expected):
    try:
        got = __vpo_call__(args, {})
    except Exception:
        return False
    return values_match(got, expected)
"""


def checker_program() -> str:
    """The checker's source: :func:`values_match` (with its helper) and the check the trainer asks for per test."""
    return ("from __future__ import annotations\nfrom typing import Any\n\n\n" + inspect.getsource(_plain) + "\n\n"
            + inspect.getsource(values_match) + _CHECKER_RUNNER)


def _functional_tests(program: str, tests: Sequence[Mapping[str, str]], limit: float, total_s: float) -> list[bool]:
    checks: list[tuple[str, list] | None] = []
    for test in tests:
        try:  # trusted data from the record: JSON arguments, one per line, and the expected JSON value
            args = [json.loads(line) for line in test["input"].split("\n") if line.strip()]
            checks.append(("__vpo_lcb_check__", [args, json.loads(test["output"])]))
        except json.JSONDecodeError:
            checks.append(None)
    return run_checked(program, checker_program(), _CALL, checks, test_timeout_s=limit, total_timeout_s=total_s,
                       memory_mb=MEMORY_MB)


def run_tests(candidate: str, ground_truth: Mapping[str, Any], *, total_timeout_s: float = TOTAL_TIMEOUT_S
              ) -> list[bool]:
    """Pass/fail of each kept test of a problem for one candidate (see the module docstring)."""
    tests = list(ground_truth["tests"])
    testtype, name = ground_truth["testtype"], ground_truth.get("func_name")
    program = build_program(candidate, testtype, name)
    if program is None:
        return [False] * len(tests)
    limit = float(ground_truth.get("time_limit_s", TIME_LIMIT_S))
    end = time.monotonic() + total_timeout_s
    if testtype == "functional":
        passed = _functional_tests(program, tests, limit, total_timeout_s)
    else:
        passed = _stdin_tests(program, tests, limit, end)
    return passed + [False] * (len(tests) - len(passed))


def lcb_reward(candidate: str, sample: Mapping[str, Any]) -> list[float]:
    """The ``lcb_tests`` reward: one pass/fail value per kept test (at most 16); malformed or empty answers score
    zeros."""
    if not isinstance(candidate, str) or not candidate.strip():
        return [0.0] * num_tests(sample)
    return [1.0 if ok else 0.0 for ok in run_tests(candidate, sample["ground_truth"])[:NUM_TEST_DIMS]]


__all__ = ["DIMS", "NUM_TEST_DIMS", "build_program", "contest_date", "decode_tests", "encode_private_tests",
           "lcb_reward", "make_record", "outputs_match", "problem_date", "run_tests", "smallest_tests",
           "values_match"]
