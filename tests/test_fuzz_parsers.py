"""Property-based fuzzing of every parser that sees model output, end to end through the reward vector.

Model text -> ``parse_chain`` (the m candidates) -> the task's rewards through ``RewardVector``. Properties, for any
text: nothing raises, the reward vector counts no reward error (``RewardVector`` would catch and zero one that
raises, so ``num_errors == 0`` is what shows that the parsers are total), every value lies in [0, 1], and a candidate
is scored exactly where the parser found one. Text is drawn from the tags, fences and JSON pieces the parsers look
for, mixed with arbitrary unicode, so that the interesting branches are reached. Example counts stay modest.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vpo_lightning.core.chains import parse_chain
from vpo_lightning.rewards import RewardVector

REPO = Path(__file__).resolve().parents[1]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FRAGMENTS = [
    *(f"<{t}_{i}>" for t in ("response", "route") for i in (1, 2, 3)),
    *(f"</{t}_{i}>" for t in ("response", "route") for i in (1, 2, 3)),
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<response>", "</response>", "<route>", "</route>",
    "```", "```python\n", "```py\n", "```bash\n", "\n---\n", "\n", " ", "\t",
    "{", "}", "[", "]", ":", ",", '"', '"name"', '"parameters"', '"arguments"', "null", "1e999", "-0", "true",
    "U", "D", "L", "R", "up", "left", "→", "↓", "RRDD", "UUUU",
    "def ", "return ", "(", ")", "    ", "import os", "lambda", "\\", "\x00", "\udcff", "😀", "ı", "İ",
    "<support>", "</support>", "<answer>", "</answer>", "4, 6", "99999999999", "-1",
    *(f"<entity_{x}>" for x in "ABCDE"), *(f"</entity_{x}>" for x in "ABCDE"), "Mira_Okafor", "the ",
]
model_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=40).map("".join)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@cache
def _records(task: str) -> tuple[dict, ...]:
    path = REPO / "data" / task / "val.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not there")
    lines = path.read_text(encoding="utf-8").splitlines()
    return tuple(json.loads(line) for line in lines[:8] if line.strip())


@cache
def _public_records(task: str) -> tuple[dict, ...]:
    """Records built from the hand-made public-shape files under tests/fixtures/public (MuSiQue, EUREQA, LCB)."""
    import importlib

    build = importlib.import_module(f"vpo_lightning.tasks.{task}.build")
    public = build.load_public(REPO / "tests" / "fixtures" / "public" / task)
    splits = build.build_splits(public, per_hop=1, val_per_hop=1) if task == "musique" else build.build_splits(public)
    return tuple(r for split in splits.values() for r in split)


def _check_scores(names: list[str], chains: list[list[str | None]], samples: list[dict]) -> torch.Tensor:
    vector = RewardVector(names, max_workers=2)
    scores = vector.score(chains, samples)
    assert scores.num_errors == 0, scores.errors
    assert scores.rewards.shape == (len(chains), max(len(c) for c in chains), vector.dim)
    assert bool(torch.isfinite(scores.rewards).all())
    assert float(scores.rewards.min()) >= 0.0 and float(scores.rewards.max()) <= 1.0
    for i, chain in enumerate(chains):
        for j, cand in enumerate(chain):
            assert bool(scores.mask[i, j]) == bool(cand)
            if not cand:
                assert float(scores.rewards[i, j].abs().sum()) == 0.0
    return scores.rewards


@FAST
@given(text=model_text | st.text(max_size=300), m=st.integers(1, 4),
       family=st.sampled_from(["response", "route", "fence"]))
def test_parse_chain_is_total(text, m, family):
    out = parse_chain(text, m, family)
    assert len(out) == m
    assert all(c is None or (isinstance(c, str) and c.strip()) for c in out)


@FAST
@given(texts=st.lists(model_text, min_size=1, max_size=3), calls=st.lists(st.tuples(st.text(max_size=6), json_value),
       max_size=3), data=st.data())
def test_tooluse_rewards_total_through_the_reward_vector(texts, calls, data):
    records = _records("tooluse")
    record = data.draw(st.sampled_from(records))
    gold_names = [name for item in record.get("ground_truth") or [] for name in item]
    # Also well-formed-looking tool calls, with the gold names, random names and random (often invalid) parameters.
    blocks = "".join(
        "<tool_call>" + json.dumps({"name": data.draw(st.sampled_from(gold_names or ["f"])) if i % 2 else name,
                                    "parameters": params}, default=str) + "</tool_call>"
        for i, (name, params) in enumerate(calls))
    chain_texts = [*texts, "<think>x</think>" + blocks, "<response_1><think>t</think>" + blocks + "</response_1>"]
    chains = [parse_chain(t, 3, "response") for t in chain_texts] + [[t] for t in chain_texts]  # chains and single
    _check_scores(["format", "tool_name", "arg_key", "arg_value"], chains, [record] * len(chains))


@FAST
@given(texts=st.lists(model_text, min_size=1, max_size=3), walk=st.lists(st.sampled_from("UDLR"), max_size=60),
       data=st.data())
def test_maze_rewards_total_through_the_reward_vector(texts, walk, data):
    record = data.draw(st.sampled_from(_records("maze")))
    route = ", ".join(walk)
    chain_texts = [*texts, f"<route_1>{route}</route_1><route_2>{route[::-1]}</route_2>", f"<route>{route}</route>"]
    chains = [parse_chain(t, 2, "route") for t in chain_texts] + [[t] for t in chain_texts]
    _check_scores(["maze"], chains, [record] * len(chains))


BODIES = ["    return None", "    return 1 / 0", "    raise SystemExit(1)", "    return [0] * 3",
          "    return __import__('sys').exit(0)", "def {entry}(*args, **kwargs):\n    return args[0] if args else 0",
          "def {entry}(:", "print('hi')"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(model_text, min_size=1, max_size=2), bodies=st.lists(st.sampled_from(BODIES), max_size=2),
       data=st.data())
def test_code_rewards_total_through_the_reward_vector(texts, bodies, data):
    """Few examples: a candidate that compiles runs its tests in a sandbox subprocess."""
    record = data.draw(st.sampled_from(_records("code")))
    code = [b.format(entry=record["ground_truth"]["entry_point"]) for b in bodies]
    fenced = "\n---\n".join(f"```python\n{c}\n```" for c in code)
    chains = [parse_chain(t, 2, "fence") for t in [*texts, fenced]] + [[t] for t in [*texts, *code]]
    _check_scores(["code_tests"], chains, [record] * len(chains))


@FAST
@given(text=model_text | st.text(max_size=300))
def test_code_extraction_is_total(text):
    from vpo_lightning.tasks.code import build_program, extract_code

    record = _records("code")[0]["ground_truth"]
    assert isinstance(extract_code(text), str)
    program = build_program(text, record["prompt"], record["entry_point"])
    assert program is None or isinstance(program, str)


@FAST
@given(texts=st.lists(model_text, min_size=1, max_size=3), cited=st.lists(st.integers(-3, 10**9), max_size=8),
       answer=st.text(max_size=20), data=st.data())
def test_musique_rewards_total_through_the_reward_vector(texts, cited, answer, data):
    record = data.draw(st.sampled_from(_public_records("musique")))
    body = f"<support>{', '.join(map(str, cited))}</support><answer>{answer}</answer>"
    chain_texts = [*texts, f"<response_1>{body}</response_1><response_2>{answer}</response_2>", body]
    chains = [parse_chain(t, 3, "response") for t in chain_texts] + [[t] for t in chain_texts]
    _check_scores(["musique"], chains, [record] * len(chains))


@FAST
@given(texts=st.lists(model_text, min_size=1, max_size=3), names=st.lists(st.text(max_size=12), min_size=5,
       max_size=5), data=st.data())
def test_eureqa_rewards_total_through_the_reward_vector(texts, names, data):
    record = data.draw(st.sampled_from(_public_records("eureqa")))
    gold = record["ground_truth"]["entities"]
    body = "".join(f"<entity_{x}>{data.draw(st.sampled_from([n, g]))}</entity_{x}>"
                   for x, n, g in zip("ABCDE", names, gold))
    chain_texts = [*texts, f"<response_1>{body}</response_1>", body]
    chains = [parse_chain(t, 3, "response") for t in chain_texts] + [[t] for t in chain_texts]
    scores = _check_scores(["eureqa"], chains, [record] * len(chains))
    assert set(scores.unique().tolist()) <= {0.0, 1.0}


LCB_BODIES = ["print(input())", "import sys\nsys.exit(3)", "raise ValueError", "print('1' * 10**6)",
              "class Solution:\n    def {name}(self, *a):\n        return a", "def {name}(*a):\n    return 0",
              "def {name}(:", "while True: pass"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(model_text, min_size=1, max_size=2), bodies=st.lists(st.sampled_from(LCB_BODIES), max_size=2),
       data=st.data())
def test_lcb_rewards_total_through_the_reward_vector(texts, bodies, data):
    """Few examples, a 0.3 s test limit: a candidate that compiles runs its tests in sandbox subprocesses."""
    record = dict(data.draw(st.sampled_from(_public_records("livecodebench"))))
    record["ground_truth"] = {**record["ground_truth"], "time_limit_s": 0.3}
    code = [b.format(name=record["ground_truth"]["func_name"] or "f") for b in bodies]
    fenced = "\n---\n".join(f"```python\n{c}\n```" for c in code)
    chains = [parse_chain(t, 2, "fence") for t in [*texts, fenced]] + [[t] for t in texts]
    _check_scores(["lcb_tests"], chains, [record] * len(chains))


def _packed(raw: bytes) -> str:
    import base64
    import zlib

    return base64.b64encode(zlib.compress(raw)).decode()


@FAST
@given(blob=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: __import__("base64").b64encode(b).decode())
       | st.binary(max_size=200).map(_packed) | st.binary(max_size=60).map(lambda b: _packed(b"\x80\x04" + b)))
def test_lcb_test_decoding_is_total(blob):
    """Any text, base64 junk, or zlib-packed junk (including pickle-looking streams): a list or a ValueError."""
    from vpo_lightning.tasks.livecodebench import decode_tests

    try:
        tests = decode_tests(blob)
    except ValueError:
        return
    assert isinstance(tests, list)


@FAST
@given(got=st.text(max_size=40), expected=st.text(max_size=40), value=json_value)
def test_lcb_output_comparison_is_total(got, expected, value):
    from vpo_lightning.tasks.livecodebench import outputs_match, values_match

    assert outputs_match(got, expected) in (True, False)
    assert outputs_match(got, got)
    assert values_match(value, value) in (True, False)
