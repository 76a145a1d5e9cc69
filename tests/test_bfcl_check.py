"""BFCL's own checker on our answers (issue 51): gold answers written from each record's possible answers pass
BFCL's ast_checker in every category of the shipped test split; wrong values, a missing call and a call on an
irrelevance record fail; the checker's import leaves BFCL's model registry as it was."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vpo_lightning.tasks.tooluse import format_answer
from vpo_lightning.tasks.tooluse.bfcl_check import bfcl_correct, main

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
    assert bfcl_correct(format_answer([]), record) and bfcl_correct("I cannot help with that.", record)
    assert not bfcl_correct(None, record)  # an answer slot the chain never wrote
    tool = record["tools"][0]["name"]
    assert not bfcl_correct(format_answer([{"name": tool, "parameters": {}}]), record)


def test_the_checker_import_restores_bfcls_model_registry() -> None:
    name = "bfcl_eval.constants.model_config"
    assert name not in sys.modules  # our import never loads BFCL's API clients
    bfcl_correct(_gold_answer(RECORDS[0]), RECORDS[0])
    assert name not in sys.modules and "anthropic" not in sys.modules


def test_check_eval_reads_an_evaluation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An evaluation of two prompts, one chain of 3 each (eval.json + samples.jsonl as `vpo eval` writes them):
    prompt 0's answers are wrong (f .5), right (f 1) and missing; prompt 1 (irrelevance) answers without a call,
    with a call, and with text. pass@k and the best-f answer's correctness follow exactly at k = n."""
    simple = RECORDS[0]
    irrelevant = next(r for r in RECORDS if r["meta"]["category"] == "irrelevance")
    right = _gold_answer(simple)
    wrong = right.replace("10", "11")
    call = format_answer([{"name": irrelevant["tools"][0]["name"], "parameters": {}}])
    chains = {simple["id"]: f"<response_1>{wrong}</response_1><response_2>{right}</response_2>",
              irrelevant["id"]: (f"<response_1>{format_answer([])}</response_1><response_2>{call}</response_2>"
                                 "<response_3>No tool fits.</response_3>")}
    report = {"label": "t", "estimator": "vpo", "m": 3, "tag_family": "response", "seed": 0,
              "data_file": str(ROOT / "data" / "tooluse" / "test.jsonl"), "prompts": [
                  {"id": simple["id"], "rewards": [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]},
                  {"id": irrelevant["id"], "rewards": [[1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1]]}]}
    (tmp_path / "eval.json").write_text(json.dumps(report))
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"id": i, "chain": 0, "text": t}) + "\n"
                                                    for i, t in chains.items()))
    assert main([str(tmp_path)]) == 0
    out = json.loads((tmp_path / "bfcl.json").read_text())
    assert [p["correct"] for p in out["prompts"]] == [[False, True, False], [True, False, True]]
    assert out["checker_pass_at_k"][0] == pytest.approx((1 / 3 + 2 / 3) / 2, abs=1e-6)
    assert out["checker_pass_at_k"][2] == 1.0
    assert out["best_answer_correct_at_k"][2] == 1.0  # the highest-f answer of each prompt is a right one
    assert out["accuracy_by_category"] == {"irrelevance": pytest.approx(2 / 3, abs=1e-6),
                                           "simple_python": pytest.approx(1 / 3, abs=1e-6)}
    assert "BFCL checker pass@1 0.500" in capsys.readouterr().out
