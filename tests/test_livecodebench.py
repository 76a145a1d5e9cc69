"""LiveCodeBench: decoding the public test encodings (and refusing pickled code), the 16 smallest tests, the date
split from hand-made records in the ``code_generation_lite`` shape, per-test rewards run in the sandbox for stdin
and function-call problems, malformed answers, and the offline error."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import pickle
import zlib
from pathlib import Path

import pytest

from vpo_lightning.rewards import RewardVector
from vpo_lightning.tasks.livecodebench import (
    build,
    build_program,
    decode_tests,
    encode_private_tests,
    lcb_reward,
    outputs_match,
    run_tests,
    smallest_tests,
    values_match,
)
from vpo_lightning.tasks.public_data import read_records
from vpo_lightning.training.records import read_jsonl

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "public" / "livecodebench"


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    splits = build.build_splits(build.load_public(FIXTURES))
    return {r["id"]: r for split in splits.values() for r in split}


def _fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\n"


# ------------------------------------------------------------------------------------------------ decoding


def test_decode_both_public_encodings():
    tests = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    assert decode_tests(json.dumps(tests)) == tests
    assert decode_tests(encode_private_tests(tests)) == tests
    assert decode_tests("") == [] and decode_tests(tests) == tests
    # the release's encoding, built here by hand: base64(zlib(pickle(json string)))
    blob = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests), protocol=4))).decode()
    assert decode_tests(blob) == tests


@pytest.mark.parametrize("blob", ["not json and not base64!", base64.b64encode(b"not zlib").decode(),
                                  json.dumps({"input": "x"}), json.dumps([{"input": "x"}]), 42])
def test_undecodable_tests_are_a_clear_error(blob):
    with pytest.raises(ValueError, match="test field"):
        decode_tests(blob)


def test_pickled_globals_are_refused(tmp_path):
    """A tampered blob whose pickle would call a function (here os.system) is refused before anything runs."""
    marker = tmp_path / "ran"
    evil = pickle.dumps(_Evil(f"touch {marker}"))
    with pytest.raises(ValueError, match="refusing"):
        decode_tests(base64.b64encode(zlib.compress(evil)).decode())
    assert not marker.exists()


class _Evil:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_smallest_16_tests_in_size_order():
    tests = [{"input": "x" * n, "output": "y"} for n in (30, 5, 12, 5, *range(40, 56))]  # 20 tests
    kept = smallest_tests(tests)
    assert len(kept) == 16
    assert [len(t["input"]) for t in kept] == [5, 5, 12, 30, *range(40, 52)]  # ties keep file order


# ------------------------------------------------------------------------------------------------ builder


def test_date_split_and_records(tmp_path, records):
    assert build.main(["--source", str(FIXTURES), "--out", str(tmp_path)]) == 0
    train, test = read_jsonl(tmp_path / "train.jsonl"), read_jsonl(tmp_path / "test.jsonl")
    assert [r["id"] for r in train] == ["lcb-abc900_a", "lcb-3999"]  # 2024-11 and 2024-12
    assert [r["id"] for r in test] == ["lcb-abc905_b", "lcb-4001"]  # 2025-03 and 2025-04; 2025-06 left out
    stdin, functional = records["lcb-abc900_a"], records["lcb-3999"]
    assert stdin["ground_truth"]["testtype"] == "stdin" and stdin["ground_truth"]["func_name"] is None
    assert functional["ground_truth"] == {**functional["ground_truth"], "testtype": "functional",
                                          "func_name": "maximumGap", "time_limit_s": 6.0}
    assert stdin["meta"]["num_tests"] == stdin["meta"]["total_tests"] == 5  # 1 public + 4 private
    sizes = [len(t["input"]) + len(t["output"]) for t in stdin["ground_truth"]["tests"]]
    assert sizes == sorted(sizes)
    assert "class Solution:" in functional["messages"][-1]["content"]
    assert "standard input" in stdin["messages"][-1]["content"]
    raw = {p["question_id"]: p for p in read_records(FIXTURES / "test5.jsonl")}
    assert decode_tests(raw["abc900_a"]["private_test_cases"])[0] == {"input": "1\n5 5\n", "output": "10\n",
                                                                      "testtype": "stdin"}  # the encoded blob
    assert json.loads(raw["3999"]["metadata"]) == {"func_name": "maximumGap"}


def test_offline_error_names_the_files(tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("datasets") is not None:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert build.main([]) == 2
    err = capsys.readouterr().err
    assert "test.jsonl, test2.jsonl" in err and "test6.jsonl" in err and "data/livecodebench/raw/" in err
    (tmp_path / "empty").mkdir()
    assert build.main(["--source", str(tmp_path / "empty")]) == 2
    assert "holds no .jsonl file" in capsys.readouterr().err


def test_bad_problem_is_a_clear_error(records):
    problem = read_records(FIXTURES / "test5.jsonl")[1]
    problem["metadata"] = "{}"
    with pytest.raises(ValueError, match="no metadata.func_name"):
        build.build_splits([problem])
    with pytest.raises(ValueError, match="'3999': no usable contest_date"):
        build.build_splits([{**problem, "contest_date": "last spring"}])


# ------------------------------------------------------------------------------------------------ reward (sandbox)


SUM_OK = "n = int(input())\nfor _ in range(n):\n    a, b = map(int, input().split())\n    print(a + b)"


def test_stdin_rewards_per_test(records):
    record = records["lcb-abc900_a"]
    # tests by size: N=1 (5 5), N=2 (public), N=4, N=3, N=1 (big numbers)
    assert [t["input"].split("\n")[0] for t in record["ground_truth"]["tests"]] == ["1", "2", "4", "3", "1"]
    assert run_tests(_fenced(SUM_OK), record["ground_truth"]) == [True] * 5
    only_small = "import sys\nn = int(input())\nif n > 2:\n    sys.exit(1)\n" + SUM_OK.split("\n", 1)[1]
    assert run_tests(_fenced(only_small), record["ground_truth"]) == [True, True, False, False, True]
    reward = lcb_reward(_fenced(only_small), record)
    assert reward == [1.0, 1.0, 0.0, 0.0, 1.0]  # D = the record's 5 tests, not 16


def test_stdin_decimal_outputs(records):
    record = records["lcb-abc905_b"]
    prog = "input()\nxs = list(map(int, input().split()))\nprint(f'{sum(xs) / len(xs):.2f}')"  # 1.50, 2.00
    assert run_tests(_fenced(prog), record["ground_truth"]) == [True, True, True]
    assert outputs_match("1.50\n", "1.5") and outputs_match("  3 4\n\n", "3 4")
    assert not outputs_match("1.5 2", "1.5") and not outputs_match("nan", "NaN") and not outputs_match("", "0")


def test_function_call_rewards(records):
    record = records["lcb-3999"]
    solution = ("class Solution:\n    def maximumGap(self, nums: List[int]) -> int:\n        best, low = 0, nums[0]\n"
                "        for x in nums:\n            best, low = max(best, x - low), min(low, x)\n        return best")
    assert run_tests(_fenced(solution), record["ground_truth"]) == [True] * 5
    # tests by size: [1] -> 0, [2, 2] -> 0, [7, 1, 5, 4] -> 4, [9, 4, 3, 2] -> 0, [1, 5, 2, 10] -> 9
    assert [t["input"] for t in record["ground_truth"]["tests"]] == ["[1]", "[2, 2]", "[7, 1, 5, 4]", "[9, 4, 3, 2]",
                                                                     "[1, 5, 2, 10]"]
    plain = "def maximumGap(nums):\n    return max(0, max(nums) - min(nums))"  # top level; 6 and 7 where max is first
    assert run_tests(_fenced(plain), record["ground_truth"]) == [True, True, False, False, True]
    crash = "class Solution:\n    def maximumGap(self, nums):\n        return 1 // (len(nums) - 1)"  # [1] raises
    assert run_tests(_fenced(crash), record["ground_truth"]) == [False, False, False, True, False]
    tuple_answer = "def maximumGap(nums):\n    return (0,) if len(nums) == 1 else 0"  # a tuple is not an int
    assert run_tests(_fenced(tuple_answer), record["ground_truth"]) == [False, True, False, True, False]


def test_timeouts_fail_only_their_tests(records):
    gt = {**records["lcb-4001"]["ground_truth"], "time_limit_s": 0.5}
    slow = ("class Solution:\n    def countPairs(self, nums):\n        while nums[:2] == [1, 1]:\n            pass\n"
            "        return sum(a == b for i, a in enumerate(nums) for b in nums[i + 1:])")
    passed = run_tests(_fenced(slow), gt)
    looping = [json.loads(t["input"])[:2] == [1, 1] for t in gt["tests"]]
    assert passed == [not loop for loop in looping] and any(looping)
    stdin_gt = {**records["lcb-abc900_a"]["ground_truth"], "time_limit_s": 0.5}
    assert run_tests(_fenced("while True:\n    pass"), stdin_gt, total_timeout_s=1.2) == [False] * 5


@pytest.mark.parametrize("answer", ["", "no code here", "```python\n\n```", "```python\ndef (:\n```", None,
                                    "```python\nprint(open('/etc/passwd').read())\n```"])
def test_malformed_answers_score_zero(answer, records):
    assert lcb_reward(answer, records["lcb-abc900_a"]) == [0.0] * 5  # type: ignore[arg-type]


def test_helpers():
    assert values_match((1, [2, (3,)]), [1, [2, [3]]]) and values_match(1, 1.0)
    assert not values_match(True, 1) and not values_match([1], [1, 2]) and not values_match({"a": 1}, {"b": 1})
    assert build_program("", "stdin", None) is None
    assert "__vpo_lcb_call__" in build_program("```python\ndef f(x):\n    return x\n```", "functional", "f")
    vector = RewardVector(["lcb_tests"])
    assert vector.dim == 16 and vector.entries[0].parallel
