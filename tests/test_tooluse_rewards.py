"""Tool-use rewards: hand-worked exact values, parsing edge cases, registry wiring and hypothesis fuzzing."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vpo_lightning.rewards import RewardVector, get_reward
from vpo_lightning.tasks.tooluse import build_messages, format_answer, to_json_schema
from vpo_lightning.tasks.tooluse.calls import best_match, parse_output, string_match, tooluse_rewards, value_match

NAMES = ["format", "tool_name", "arg_key", "arg_value"]


def sample(*calls: dict, tools: list | None = None) -> dict[str, Any]:
    return {"ground_truth": list(calls), "tools": tools or []}


def answer(*calls: tuple[str, dict], **kwargs: Any) -> str:
    return format_answer([{"name": n, "parameters": p} for n, p in calls], **kwargs)


def approx(values: list[float]) -> Any:
    return pytest.approx(values, abs=1e-12)


GOLD_FG = sample({"f": {"a": [1], "b": ["", "x y"]}}, {"g": {"c": [[1, 2]]}})


# ---------------------------------------------------------------- hand-worked values


def test_exact_answer_scores_one_in_any_order() -> None:
    assert tooluse_rewards(answer(("g", {"c": [2, 1]}), ("f", {"a": 1})), GOLD_FG) == [1.0] * 4


def test_partial_answer_hand_worked() -> None:
    # one of two calls; f's keys {a, b} both right; a = 1 exact, b: "x" vs "x y" token F1 = 2/3
    text = answer(("f", {"a": 1.0, "b": "x"}))
    # tool_name: P = 1, R = 1/2 -> 2/3; arg_key: (1 + 0) / 2; arg_value: ((1 + 2/3) / 2 + 0) / 2
    assert tooluse_rewards(text, GOLD_FG) == approx([1.0, 2 / 3, 1 / 2, 5 / 12])


def test_extra_and_missing_keys() -> None:
    gold = sample({"f": {"a": [1], "b": [2]}})
    # extra key z: key F1 P = 1/2, R = 1 -> 2/3; both gold values right -> 1
    assert tooluse_rewards(answer(("f", {"a": 1, "b": 2, "z": 0})), gold) == approx([1, 1, 0.8, 1])
    # missing required b: key F1 P = 1, R = 1/2 -> 2/3; value 1/2
    assert tooluse_rewards(answer(("f", {"a": 1})), gold) == approx([1, 1, 2 / 3, 1 / 2])


def test_optional_arguments_may_be_omitted_or_given() -> None:
    gold = sample({"f": {"a": [1], "unit": ["", "celsius"]}})
    assert tooluse_rewards(answer(("f", {"a": 1})), gold) == [1.0] * 4
    assert tooluse_rewards(answer(("f", {"a": 1, "unit": "Celsius"})), gold) == [1.0] * 4
    assert tooluse_rewards(answer(("f", {"a": 1, "unit": "kelvin"})), gold) == approx([1, 1, 1, 1 / 2])


def test_gold_reconciled_with_tool_documents() -> None:
    tools = [{"name": "f", "parameters": {"type": "dict", "required": ["a", "b"], "properties": {"a": {}, "b": {}}}}]
    gold = sample({"f": {"a": [1], "b": ["", 2], "ghost": ["", 3]}}, tools=tools)
    assert tooluse_rewards(answer(("f", {"a": 1, "b": 2})), gold) == [1.0] * 4
    assert tooluse_rewards(answer(("f", {"a": 1})), gold) == approx([1, 1, 2 / 3, 1 / 2])  # b required by the doc
    assert tooluse_rewards(answer(("f", {"a": 1, "b": 2, "ghost": 3})), gold) == approx([1, 1, 0.8, 1])


def test_wrong_name_keeps_argument_credit() -> None:
    text = answer(("h", {"a": 1}))
    assert tooluse_rewards(text, sample({"f": {"a": [1]}})) == [1.0, 0.0, 1.0, 1.0]


def test_extra_calls_dilute() -> None:
    gold = sample({"f": {"a": [1]}})
    text = answer(("f", {"a": 1}), ("f", {"a": 2}), ("g", {}))
    # tool_name: P = 1/3, R = 1 -> 1/2; the aligned pair is perfect, two unmatched -> 1/3
    assert tooluse_rewards(text, gold) == approx([1, 1 / 2, 1 / 3, 1 / 3])


def test_parallel_same_name_aligned_by_value() -> None:
    gold = sample({"w": {"city": ["Paris"]}}, {"w": {"city": ["London"]}}, {"w": {"city": ["Rome"]}})
    text = answer(("w", {"city": "rome"}), ("w", {"city": "Paris"}), ("w", {"city": "London"}))
    assert tooluse_rewards(text, gold) == [1.0] * 4


def test_no_call_expected() -> None:
    gold = sample()
    assert tooluse_rewards(answer(), gold) == [1.0] * 4
    assert tooluse_rewards(answer(("f", {})), gold) == [0.0] * 4
    # a malformed answer is no abstention: it earns nothing on any dimension (it used to earn 1 on three)
    assert tooluse_rewards("<think> x </think>", gold) == [0.0] * 4  # no <response>
    assert tooluse_rewards("", gold) == [0.0] * 4
    assert tooluse_rewards("ber ber ber", gold) == [0.0] * 4
    assert tooluse_rewards('<think> x </think>\n<tool_call>\n{"name": "f", "par', gold) == [0.0] * 4  # cut off
    assert tooluse_rewards("<think> x </think><tool_call>not json</tool_call><response>r</response>", gold) == [0.0] * 4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n</tool_call>', 0.0),  # no think
        ('<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n</tool_call><think>x</think>', 0.0),  # think last
        ("<think>x</think><tool_call>\nnot json\n</tool_call>", 0.0),  # nothing parsed
        ('<think>x</think><tool_call>{"name": "f", "parameters": {"a": 1}}', 0.0),  # unclosed
        ('<think></think><tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', 1.0),
        ('<think>x</think>\n<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n</tool_call>\n<response>ok</response>',
         1.0),
    ],
)
def test_format(text: str, expected: float) -> None:
    assert get_reward("format").fn(text, sample({"f": {"a": [1]}})) == expected


def test_value_matching_rules() -> None:
    assert value_match(True, True) == 1.0 and value_match(1, True) == 0.0 and value_match(True, 1) == 0.0
    assert value_match(3, 3.0) == 1.0 and value_match(0.1 + 0.2, 0.3) == 1.0 and value_match(3, 3.001) == 0.0
    assert value_match("5", 5) == 0.0 and value_match(None, None) == 1.0 and value_match(math.nan, math.nan) == 0.0
    assert string_match("new york", "New York City") == pytest.approx(0.8)
    assert string_match("The Beatles!", "beatles") == 1.0 and string_match("NewYork", "new york") == 1.0
    assert value_match([1, 2, 2], [1, 2, 3]) == pytest.approx(2 / 3)
    assert value_match([], []) == 1.0 and value_match([1], []) == 0.0
    assert value_match({"x": 1}, {"x": [1], "y": ["", 2]}) == 1.0  # BFCL gold dict: acceptable lists per key
    assert value_match({"x": 1, "z": 3}, {"x": [1]}) == pytest.approx(2 / 3)
    assert value_match({"x": 2}, {"x": [1]}) == 0.0
    assert best_match("new york", ["NYC", "New York"]) == 1.0
    assert best_match(5, []) == 0.0


def test_parsing_variants() -> None:
    calls = [("f", {"a": 1}), ("g", {})]
    variants = [
        '<tool_call>\n[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call><tool_call>{"name": "g"}</tool_call>',
        '<tool_call>\n{\n  "name": "f",\n  "parameters": {"a": 1}\n}\njunk {\n{"name": "g", "parameters": null}'
        "\n</tool_call>",
    ]
    for text in variants:
        assert list(parse_output(text).calls) == calls, text
    invalid = '<tool_call>{"name": 3}{"parameters": {}}{"name": "f", "parameters": [1]}</tool_call>'
    assert parse_output(invalid).calls == ()


def test_registry_wiring() -> None:
    vector = RewardVector(NAMES)
    assert vector.dim == 4 and vector.dim_names == NAMES
    gold = sample({"f": {"a": [1]}})
    scores = vector.score([[answer(("f", {"a": 1})), "garbage", None]], [gold])
    assert scores.num_errors == 0
    assert scores.rewards[0, 0].tolist() == [1.0] * 4 and scores.rewards[0, 1].tolist() == [0.0] * 4
    assert scores.mask.tolist() == [[True, True, False]]


def test_prompt_builder() -> None:
    tool = {"name": "f", "description": "d", "parameters": {"type": "dict", "properties": {
        "type": {"type": "float", "default": {"type": "dict"}}, "xs": {"type": "tuple", "items": {"type": "any"}}}}}
    assert to_json_schema(tool["parameters"]) == {"type": "object", "properties": {
        "type": {"type": "number", "default": {"type": "dict"}}, "xs": {"type": "array", "items": {}}}}
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    messages = build_messages([tool], turn)
    assert [m["role"] for m in messages] == ["system", "user"]
    system = messages[0]["content"]
    assert "1. Name: f" in system and '"type": "object"' in system and system.endswith("Be brief.")
    assert "<tool_call>" in system and "<response>" in system and "<think>" in system


# ---------------------------------------------------------------- fuzzing

FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<response>", "</response>", "\n", "{", "}", "[",
             '"name"', '"parameters"', ":", ",", '"f"', '{"name": "f", "parameters": {', '{"a": 1}', "}}", "NaN",
             "1e999", "9" * 50, '"\\u0000"', "[[[[[[", "null"]
json_leaf = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8)
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c,
                                                                                            max_size=4), max_leaves=8)
texts = st.text() | st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6) | json_value.map(json.dumps),
                             max_size=30).map("".join)
golds = st.lists(st.dictionaries(st.sampled_from("fgh"), st.dictionaries(st.sampled_from("abc"),
                                                                         st.lists(json_value, max_size=3)),
                                 min_size=1, max_size=1), max_size=3)


def _in_unit(values: list[float]) -> bool:
    return all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in values)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, gold=golds)
def test_fuzz_arbitrary_text_in_unit_interval(text: str, gold: list) -> None:
    assert _in_unit(tooluse_rewards(text, {"ground_truth": gold}))


@settings(max_examples=100, deadline=None)
@given(pred=json_value, gold=json_value)
def test_fuzz_value_match_in_unit_interval(pred: Any, gold: Any) -> None:
    assert 0.0 <= value_match(pred, gold) <= 1.0
    assert 0.0 <= best_match(pred, gold) <= 1.0


def _as_gold(value: Any) -> Any:
    """A concrete value in BFCL's gold convention (dict values become one-element acceptable lists)."""
    if isinstance(value, dict):
        return {k: [_as_gold(v)] for k, v in value.items()}
    if isinstance(value, list):
        return [_as_gold(v) for v in value]
    return value


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from("fgh"), st.dictionaries(st.sampled_from("abc"), json_value)),
                      max_size=4), data=st.data())
def test_fuzz_gold_answer_scores_one_in_any_order(calls: list, data: st.DataObject) -> None:
    gold = sample(*({name: {k: [_as_gold(v)] for k, v in args.items()}} for name, args in calls))
    shuffled = data.draw(st.permutations(calls))
    assert tooluse_rewards(answer(*shuffled), gold) == [1.0] * 4
