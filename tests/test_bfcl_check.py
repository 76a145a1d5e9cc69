"""BFCL's own checker on our answers (issue 51): gold answers written from each record's possible answers pass
BFCL's ast_checker in every category of the shipped test split; wrong values, a missing call and a call on an
irrelevance record fail; the checker's import leaves BFCL's model registry as it was."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vpo_lightning.tasks.tooluse import format_answer
from vpo_lightning.tasks.tooluse.bfcl_check import bfcl_correct

ROOT = Path(__file__).resolve().parents[1]
RECORDS = [json.loads(line) for line in (ROOT / "data" / "tooluse" / "test.jsonl").read_text().splitlines()]


def _gold_answer(record: dict) -> str:
    """An answer that calls every gold function with the first possible value of each required argument."""
    calls = [{"name": name, "parameters": {k: alts[0] for k, alts in args.items() if alts and alts[0] != ""}}
             for call in record["ground_truth"] for name, args in call.items()]
    return format_answer(calls)


@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel", "parallel_multiple"])
def test_gold_answers_pass_and_wrong_ones_fail(category: str) -> None:
    records = [r for r in RECORDS if r["meta"]["category"] == category][:8]
    assert len(records) == 8
    for record in records:
        gold = _gold_answer(record)
        assert bfcl_correct(gold, record), (record["id"], gold)
        calls = json.loads(gold.split("<tool_call>\n", 1)[1].split("\n</tool_call>")[0].splitlines()[0])
        wrong = format_answer([{"name": calls["name"] + "_x", "parameters": calls["parameters"]}])
        assert not bfcl_correct(wrong, record)  # an unknown function
        assert not bfcl_correct(format_answer([]), record)  # no call where one is due
        assert not bfcl_correct(None, record) and not bfcl_correct("<tool_call>{oops</tool_call>", record)


def test_a_wrong_value_fails() -> None:
    record = RECORDS[0]  # calculate_triangle_area(base=10, height=5)
    assert record["ground_truth"] == [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}]
    ok = format_answer([{"name": "calculate_triangle_area", "parameters": {"base": 10, "height": 5}}])
    assert bfcl_correct(ok, record)
    assert not bfcl_correct(ok.replace("10", "11"), record)
    assert bfcl_correct(ok.replace('"height": 5', '"height": 5, "unit": "units"'), record)  # an allowed optional


def test_irrelevance_is_correct_without_a_call() -> None:
    record = next(r for r in RECORDS if r["meta"]["category"] == "irrelevance")
    assert bfcl_correct(format_answer([]), record) and bfcl_correct(None, record)
    tool = record["tools"][0]["name"]
    assert not bfcl_correct(format_answer([{"name": tool, "parameters": {}}]), record)


def test_the_checker_import_restores_bfcls_model_registry() -> None:
    name = "bfcl_eval.constants.model_config"
    assert name not in sys.modules  # our import never loads BFCL's API clients
    bfcl_correct(_gold_answer(RECORDS[0]), RECORDS[0])
    assert name not in sys.modules and "anthropic" not in sys.modules
