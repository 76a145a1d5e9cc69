"""`vpo search` on the HumanEval code task: the tiny random Llama end to end with a tiny budget, and a scripted
engine with known answers for exact best-of-k / rejection accounting (single answers and m-answer chains)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from vpo_lightning.commands.search import chains_for
from vpo_lightning.launcher import main as vpo
from vpo_lightning.tasks.code import load_humaneval

REPO = Path(__file__).resolve().parents[1]
WRONG = "no code here"


def _config(folder: Path, **rollout) -> Path:
    """configs/debug.yaml turned into a code-task config (HumanEval splits, the 16-test reward, fenced chains)."""
    cfg = yaml.safe_load((REPO / "configs/debug.yaml").read_text())
    cfg["data"]["train_files"] = [str(REPO / "data/code/train.jsonl")]
    cfg["data"]["val_files"] = [str(REPO / "data/code/val.jsonl")]
    cfg["rollout"].update({"rewards": ["code_tests"], "tag_family": "fence", "reward_workers": 2}, **rollout)
    cfg["rollout"]["sampling"]["max_new_tokens"] = 8
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "code_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def _search(*args: str) -> dict:
    assert vpo(["search", *args]) == 0
    return json.loads((Path(args[args.index("--out") + 1]) / "search.json").read_text())


def _num_tests(task_id: str) -> int:
    from vpo_lightning.training.records import read_jsonl

    code = Path(__file__).resolve().parents[1] / "data" / "code"
    records = {r["id"]: r for split in ("train", "val", "test") for r in read_jsonl(code / f"{split}.jsonl")}
    return min(len(records[task_id]["ground_truth"]["tests"]), 16)


def test_chains_for():
    assert [chains_for(16, 1), chains_for(16, 3), chains_for(15, 3), chains_for(1, 3)] == [16, 6, 5, 1]


def test_search_tiny_model_end_to_end(tmp_path, tiny_model_dir):
    r = _search("--config", str(_config(tmp_path)), "--budget", "4", "--max_prompts", "2", "--out",
                str(tmp_path / "out"), "--max_prompt_tokens", "0")
    assert r["format"] == "vpo-search/1" and r["mode"] == "best_of_k" and r["m"] == 3
    assert r["chains_per_problem"] == 2 and r["num_prompts"] == 2 and r["dim_names"][0] == "test_0"
    for p in r["problems"]:
        assert p["chains"] == 2 and p["candidates_generated"] == 4 and p["candidates_used"] == 4  # 6 slots, 4 count
        tests = _num_tests(p["id"])  # D = the problem's number of tests (at most 16), not a padded 16
        assert len(p["best_reward"]) == tests <= 16 and isinstance(p["solved"], bool)
    agg = r["aggregate"]
    assert len(agg["solved_by_k"]) == 4 and 0 <= agg["solved_fraction"] <= 1
    assert agg["solved_fraction"] == sum(p["solved"] for p in r["problems"]) / 2


@pytest.fixture()
def scripted(script_generation, tmp_path):
    """Problem 0 is solved by the 3rd candidate it is given, problem 1 never; counts generations per problem."""
    records = [json.loads(line) for line in (REPO / "data/code/test.jsonl").read_text().splitlines()[:2]]
    gold = {p["task_id"]: p["canonical_solution"] for p in load_humaneval()}
    calls: Counter = Counter()

    def answer(prompt: str, row: int) -> str:
        rec = next(r for r in records if f"def {r['ground_truth']['entry_point']}(" in prompt)
        i = records.index(rec)
        calls[i] += 1
        good = "```python\n" + rec["ground_truth"]["prompt"] + gold[rec["id"]] + "```"
        if "Give 3" in prompt:  # the m-answer instruction
            blocks = [f"```python\n{WRONG}\n```"] * 2 + [good if i == 0 else f"```python\n{WRONG}\n```"]
            return "\n---\n".join(blocks)
        return good if i == 0 and calls[i] == 3 else WRONG

    script_generation(answer)
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return calls, data


def test_rejection_stops_at_first_solver(tmp_path, tiny_model_dir, scripted):
    calls, data = scripted
    r = _search("--config", str(_config(tmp_path, estimator="grpo")), "--mode", "rejection", "--budget", "5",
                "--data_file", str(data), "--max_prompt_tokens", "0", "--out", str(tmp_path / "rej"))
    by_id = {p["id"]: p for p in r["problems"]}
    first, second = by_id["HumanEval/1"], by_id["HumanEval/2"]
    assert first["solved"] and first["first_solved_at"] == 3 and first["candidates_used"] == 3
    assert first["best_reward"] == [1.0] * _num_tests("HumanEval/1") and first["best_candidate"].startswith("```python")
    assert not second["solved"] and second["candidates_used"] == 5 and second["first_solved_at"] is None
    assert calls[0] == 3 and calls[1] == 5  # problem 0 got no generation after it was solved
    assert r["m"] == 1 and r["chains_per_problem"] == 5


def test_best_of_k_and_chain_budget(tmp_path, tiny_model_dir, scripted):
    calls, keep = scripted
    r = _search("--config", str(_config(tmp_path, estimator="grpo")), "--budget", "4", "--data_file", str(keep),
                "--max_prompt_tokens", "0", "--out", str(tmp_path / "bok"))
    first, second = r["problems"]
    assert first["solved"] and first["first_solved_at"] == 3 and first["candidates_used"] == 4
    assert first["num_solved"] == 1 and not second["solved"] and second["best_score"] == 0.0
    assert r["aggregate"]["solved_by_k"] == [0.0, 0.0, 0.5, 0.5] and r["aggregate"]["solved_fraction"] == 0.5
    # VPO chains of m = 3: a budget of 4 is 2 chains; the solver is the 3rd answer of the first chain
    calls.clear()
    r = _search("--config", str(_config(tmp_path, estimator="vpo")), "--mode", "rejection", "--budget", "4",
                "--data_file", str(keep), "--max_prompt_tokens", "0", "--out", str(tmp_path / "chain"))
    first, second = r["problems"]
    assert r["m"] == 3 and first["solved"] and first["candidates_used"] == 3 and first["chains"] == 1
    assert not second["solved"] and second["chains"] == 2 and second["candidates_used"] == 4
    assert calls == Counter({0: 1, 1: 2})


def test_search_errors(tmp_path, tiny_model_dir):
    with pytest.raises(SystemExit) as err:
        vpo(["search", "--config", str(_config(tmp_path)), "--budget", "0", "--out", str(tmp_path / "x")])
    assert err.value.code == 2
