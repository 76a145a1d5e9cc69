"""benchmarks/maze_protocol.sh end to end on the random tiny model (slow): train, evaluate, record and commit one
(method, seed); a second call with more steps resumes from the checkpoint and re-evaluates; the report is rebuilt
from the committed files alone. Numbers are meaningless; the plumbing is what is tested."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_FIT = ("--model.model.name=tiny-llama --data.batch_size=1 --rollout.group_size=2 --model.optim.mini_batches=1 "
            "--trainer.val_check_interval=null --trainer.limit_val_batches=0 --rollout.sampling.max_new_tokens=16")
TINY_EVAL = "--set model.model.name=tiny-llama"


def _run(args: list[str], env: dict[str, str], cwd: Path) -> str:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def _results_repo(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An empty git repository that records results, and the environment the protocol script runs in."""
    results = tmp_path / "results_repo"
    results.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=results, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "0"],
                   cwd=results, check=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PY": sys.executable, "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return results, env


@pytest.mark.slow
def test_protocol_trains_resumes_records_and_reports(tmp_path: Path) -> None:
    results, env = _results_repo(tmp_path)
    prefix = f"pytest-{os.getpid()}"
    adapter = ROOT / "checkpoints" / f"{prefix}-sft" / "adapters" / "last"
    try:
        _run([sys.executable, "-m", "vpo_lightning", "sft", "--config", "configs/maze5_sft.yaml",
              "--model.model.name", "tiny-llama", "--trainer.max_steps", "1", "--run_name", f"{prefix}-sft",
              "--data.max_train_examples", "8", "--trainer.val_check_interval", "1"], env, ROOT)
        env.update(METHOD="vpo", SEED="0", PREFIX=prefix, SFT_ADAPTER=str(adapter), N="3", PROMPTS="2",
                   RESULTS_REPO=str(results), EXTRA_FIT=TINY_FIT, EXTRA_EVAL=TINY_EVAL, EVAL_MAX_NEW_TOKENS="16")
        first = _run(["bash", "benchmarks/maze_protocol.sh"], {**env, "MAX_STEPS": "1"}, ROOT)
        assert "from step 0 of 1" in first and "=== committed docs/results/maze/vpo-s0" in first
        again = _run(["bash", "benchmarks/maze_protocol.sh"], {**env, "MAX_STEPS": "1"}, ROOT)
        assert "=== train" not in again and "=== eval" not in again  # finished: neither retrained nor re-evaluated
        assert "=== nothing new to commit" in again
        resumed = _run(["bash", "benchmarks/maze_protocol.sh"], {**env, "MAX_STEPS": "2"}, ROOT)
        assert "from step 1 of 2" in resumed and "=== eval vpo-s0" in resumed  # resumed, stale evaluation redone
        run = results / "docs" / "results" / "maze" / "vpo-s0"
        assert {p.name for p in run.iterdir()} >= {"eval.json", "positions.json", "curves.json", "run_summary.md",
                                                   "times.tsv", "adapter.sha256", "commit.txt"}
        assert [r.split("\t")[:3] for r in (run / "times.tsv").read_text().splitlines() if r.startswith("train")] \
            == [["train", f"{prefix}-vpo-s0", "0"], ["train", f"{prefix}-vpo-s0", "1"]]
        pos = json.loads((run / "positions.json").read_text())
        assert pos["m"] == 3 and len(pos["parse_rate"]) == 3 and pos["chains"] == 2  # 2 prompts x 1 chain of 3
        # the evaluated adapter is recorded as its trained ranks (the run stacked on the SFT adapter)
        assert (run / "adapter-delta" / "trained_lora.safetensors").exists() and not (run / "adapter").exists()
        # EVAL=0: seed 1 trained and recorded without the test split; then its run is deleted and the recorded
        # adapter alone is evaluated (ADAPTER=, rebuilt from the delta and SHA-checked), training nothing
        recorded = _run(["bash", "benchmarks/maze_protocol.sh"], {**env, "MAX_STEPS": "1", "SEED": "1", "EVAL": "0"},
                        ROOT)
        assert "=== eval" not in recorded and "=== committed docs/results/maze/vpo-s1" in recorded
        s1 = results / "docs" / "results" / "maze" / "vpo-s1"
        assert {p.name for p in s1.iterdir()} >= {"adapter-delta", "adapter.sha256", "curves.json", "run_summary.md",
                                                  "times.tsv", "config.yaml", "commit.txt"}
        assert not (s1 / "eval.json").exists()
        trained_commit, sha = (s1 / "commit.txt").read_text(), (s1 / "adapter.sha256").read_text()
        subprocess.run(["rm", "-rf", str(ROOT / "checkpoints" / f"{prefix}-vpo-s1")], check=True)
        evaluated = _run(["bash", "benchmarks/maze_protocol.sh"],
                         {**env, "SEED": "1", "ADAPTER": str(s1 / "adapter-delta")}, ROOT)
        assert "=== train" not in evaluated and "=== eval vpo-s1" in evaluated and "rebuilt, sha256" in evaluated
        assert json.loads((s1 / "eval.json").read_text())["n"] == 3
        assert (s1 / "commit.txt").read_text() == trained_commit and (s1 / "eval_commit.txt").exists()
        assert (s1 / "adapter.sha256").read_text() == sha
        assert [r.split("\t")[0] for r in (s1 / "times.tsv").read_text().splitlines()] == ["train", "eval"]
        _run([sys.executable, "benchmarks/maze_checkpoints.py", "--run", f"checkpoints/{prefix}-vpo-s0", "--config",
              "configs/maze5.yaml", "--coldstart", str(adapter), "--steps", "0", "--n", "3", "--val_prompts", "2",
              "--diag_prompts", "2", "--max_new_tokens", "16", "--diagnose", "--extra_eval", TINY_EVAL,
              "--out", str(tmp_path / "ck.json")], env, ROOT)
        rows = json.loads((tmp_path / "ck.json").read_text())["rows"]
        assert [(r["set"], r["temperature"]) for r in rows] == [("val", 0.7), ("val16", 0.7), ("val16", 1.0),
                                                                 ("seen", 0.7), ("seen", 1.0)]
        assert all(r["step"] == 0 and r["prompts"] == 2 and 0 <= r["exit_rate"] <= 1 for r in rows)
        log = subprocess.run(["git", "log", "--format=%s"], cwd=results, capture_output=True, text=True).stdout
        assert log.count("maze results: vpo-s0 (") == 2  # the first result, then the resumed run's
        assert log.count("maze results: vpo-s1 trained, not evaluated") == 1
        assert log.count("maze results: vpo-s1 (") == 1
        # with no RESULTS_DIR the maze report is the settled comparison's; these runs went to the default folder
        report = _run(["bash", "benchmarks/maze_protocol.sh", "report"], {**env, "RESULTS_DIR": "docs/results/maze"},
                      ROOT)
        text = (results / "docs" / "results_maze.md").read_text()
        assert "wrote" in report and "| VPO | vpo | 3 | 2 | 2 |" in text and "## Training curves" in text
    finally:
        subprocess.run(["rm", "-rf", *[str(p) for p in (ROOT / "checkpoints").glob(f"{prefix}-*")]], check=False)


@pytest.mark.slow
def test_protocol_runs_tool_use_with_bfcls_checker(tmp_path: Path) -> None:
    """TASK=tooluse (issue 51): the reference's Multi-RLVR on tool use trains, is evaluated, gets BFCL's checker
    (bfcl.json beside eval.json) and is committed; the report goes to docs/results_tooluse.md."""
    results, env = _results_repo(tmp_path)
    prefix = f"pytest-tool-{os.getpid()}"
    adapter = ROOT / "checkpoints" / f"{prefix}-sft" / "adapters" / "last"
    try:
        _run([sys.executable, "-m", "vpo_lightning", "sft", "--config", "configs/tooluse_sft.yaml",
              "--model.model.name", "tiny-llama", "--trainer.max_steps", "1", "--run_name", f"{prefix}-sft",
              "--data.max_train_examples", "4", "--data.batch_size", "2", "--trainer.val_check_interval", "1"],
             env, ROOT)
        env.update(TASK="tooluse", METHOD="multi_rlvr", SEED="0", PREFIX=prefix, SFT_ADAPTER=str(adapter), N="3",
                   PROMPTS="2", RESULTS_REPO=str(results), EXTRA_FIT=TINY_FIT, EXTRA_EVAL=TINY_EVAL,
                   EVAL_MAX_NEW_TOKENS="16", MAX_STEPS="1")
        out = _run(["bash", "benchmarks/maze_protocol.sh"], env, ROOT)
        assert "=== committed docs/results/tooluse/multi_rlvr-s0" in out and "BFCL checker pass@1" in out
        run = results / "docs" / "results" / "tooluse" / "multi_rlvr-s0"
        bfcl = json.loads((run / "bfcl.json").read_text())
        assert bfcl["num_prompts"] == 2 and len(bfcl["checker_pass_at_k"]) == 3
        assert all(len(p["correct"]) == 3 for p in bfcl["prompts"])
        _run(["bash", "benchmarks/maze_protocol.sh", "report"], env, ROOT)
        text = (results / "docs" / "results_tooluse.md").read_text()
        assert text.startswith("# Tool use (BFCL") and "| Multi-RLVR | multi_rlvr | 3 | 1 | 2 |" in text
    finally:
        subprocess.run(["rm", "-rf", *[str(p) for p in (ROOT / "checkpoints").glob(f"{prefix}-*")]], check=False)


def test_tradeoff_metrics_exact_values() -> None:
    """Four answers: a whole-gold route, a whole-diamond route, an unparsed one (zeros) and an exit with neither
    zone: exit pass@1 = 3/4; any 2 include an exit; of the 6 pairs only {gold, diamond} covers both trade-offs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from maze_report import tradeoff_metrics

    prompt = {"rewards": [[1, 1, 0, 1], [1, 0, 1, 0.5], [0, 0, 0, 0], [1, 0.5, 0, 1]]}
    got = tradeoff_metrics(prompt, ["exit", "gold", "diamond", "safety"], [1, 2, 4])
    assert got["exit_pass@1"] == pytest.approx(0.75) and got["exit_pass@2"] == pytest.approx(1.0)
    assert got["gold_share"] == 0.25 and got["diamond_share"] == 0.25
    assert got["both@1"] == 0.0
    assert got["both@2"] == pytest.approx(1 / 6)
    assert got["both@4"] == pytest.approx(1.0)


def test_paired_rows_exact_values() -> None:
    """The paired section on two hand-made methods over two mazes: VPO answers reach the exit with different
    trade-offs, GRPO's repeat one route; the differences are the hand-computed means (one seed each, so the
    interval is over the two mazes) and the one-chain metrics read consecutive answers as chains."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import torch
    from maze_report import chain_metrics, exit_diversity, paired_rows

    dims = ["exit", "gold", "diamond", "safety"]
    gold, diamond, fail = [1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]
    prompt = {"rewards": [gold, diamond, fail], "present": [True, True, False]}
    assert exit_diversity(prompt, dims) == 2.0  # one exit pair, L1 |1-0| + |0-1|
    assert math.isnan(exit_diversity({"rewards": [gold, fail], "present": [True, True]}, dims))
    w = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]])  # [K=2, D]
    # one chain [gold, diamond, fail]: best f .75; w1: max 1, w2: max .5 -> E_w max .75
    assert chain_metrics(prompt, w) == {"chain_best": 0.75, "chain_ew_max": 0.75}

    def report(label: str, estimator: str, rows: list[list[list[float]]]) -> dict:
        best = [[max(sum(r) / 4 for r in rs)] * 3 for rs in rows]
        return {"label": label, "estimator": estimator, "m": 3, "n": 3, "dim_names": dims, "prompts": [
            {"id": f"p{i}", "rewards": rs, "present": [True] * 3, "best_at_k": best[i],
             "pairwise_l1_diversity": 1.0 if estimator == "vpo" else 0.0, "expected_best_weighted": 0.5}
            for i, rs in enumerate(rows)]}

    groups = {"VPO": [report("vpo-s0", "vpo", [[gold, diamond, fail], [gold, gold, fail]])],
              "GRPO": [report("grpo-s0", "grpo", [[gold, gold, gold], [fail, fail, fail]])]}
    lines = paired_rows(groups, num_draws=200)
    row = next(line for line in lines if line.startswith("| VPO - GRPO"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # best@1: VPO .75 on both mazes, GRPO .75 and 0 -> +.375, interval over the two mazes [0, .75]
    assert cells[2] == "0.375 [0.000, 0.750]"
    assert len(cells) == 8  # pool of 3: best@1 is the only best@k column
    assert cells[3] == "1.000 [1.000, 1.000]"  # diversity 1 vs 0 on both mazes
    # exit diversity: VPO 2.0 (maze 0) and 0.0 (two equal gold routes, maze 1) -> 1.0; GRPO 0.0 and NaN -> 0.0
    assert cells[4].startswith("1.000 [")
    assert cells[5] == "0.000 [0.000, 0.000]"  # E_w best over the pool: .5 on both sides
    assert cells[6] == "0.375 [0.000, 0.750]"  # chain best f: VPO .75 and .75, GRPO .75 and 0


def test_chain_best_at_is_the_unbiased_best_of_c_chains() -> None:
    """Chains whose best answers score 0, .5, 1: best of 1 chain = their mean, best of 2 = mean of the pair maxima
    (.5, 1, 1), best of all 3 = 1; more chains than there are is undefined."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from maze_checkpoints import chain_best_at

    assert chain_best_at([1.0, 0.0, 0.5], 1) == pytest.approx(0.5)
    assert chain_best_at([1.0, 0.0, 0.5], 2) == pytest.approx(2.5 / 3)
    assert chain_best_at([1.0, 0.0, 0.5], 3) == pytest.approx(1.0)
    assert math.isnan(chain_best_at([1.0], 2))


def test_the_step_size_rule_and_its_tables(tmp_path: Path) -> None:
    """docs/EXPERIMENTS.md's rule: the highest validation best@24 after step 0; within 0.005 of it the smaller lr,
    then the earlier step. The selection table marks the choice; the diagnosis table reads the seen/val16 rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from maze_report import choose, diagnosis_rows, selection_rows

    def sweep(scores: dict[int, float], diagnose: bool = False) -> dict:
        rows = [{"step": s, "set": "val", "temperature": 0.7, "best@24": v, "chain_ew_max": 0.5, "exit_rate": 0.5,
                 "kl": 0.01 * s} for s, v in scores.items()]
        if diagnose:
            rows += [{"step": s, "set": name, "temperature": t, "best@24": 0.6, "chain_ew_max": 0.7, "exit_rate": 0.4,
                      "kl": 0.01 * s} for s in scores for name in ("val16", "seen") for t in (0.7, 1.0)]
        return {"rows": rows}

    # the cold start (step 0) is not a candidate even when it is the best
    assert choose({1e-4: sweep({0: 0.9, 20: 0.60, 40: 0.62})}) == (1e-4, 40, 0.62)
    # 2e-5 at step 60 is within 0.005 of 1e-4's best: the smaller lr wins; then the earlier of its tied steps
    grid = {1e-4: sweep({0: 0.5, 20: 0.620, 40: 0.600}), 2e-5: sweep({0: 0.5, 40: 0.616, 60: 0.616, 80: 0.610})}
    assert choose(grid) == (2e-5, 40, 0.616)
    # one point more than the tie: the larger lr
    grid[1e-4] = sweep({0: 0.5, 20: 0.622})
    assert choose(grid)[:2] == (1e-4, 20)
    with pytest.raises(ValueError, match="no checkpoint"):
        choose({1e-4: sweep({0: 0.5})})

    (tmp_path / "vpo-lr0.0001-s0.json").write_text(json.dumps(sweep({0: 0.5, 20: 0.622}, diagnose=True)))
    (tmp_path / "vpo-lr2e-05-s0.json").write_text(json.dumps(sweep({0: 0.5, 40: 0.616})))
    table = selection_rows(tmp_path)
    assert "| vpo | 0.0001 | 0.500 | 0.622 | - | step 20 |" in table
    assert "| vpo | 2e-05 | 0.500 | - | 0.616 |  |" in table
    diag = diagnosis_rows(tmp_path)
    assert "| vpo-lr0.0001-s0 | 20 | 0.200 | 0.600 / 0.700 / 0.400 | 0.600 / 0.700 / 0.400 |" in "\n".join(diag)
    assert not any("2e-05" in line for line in diag)  # only the diagnosed run


def test_tooluse_rows_exact_values() -> None:
    """Tool use's own table and paired columns on two hand-made methods over two prompts of 6 answers (2 chains of
    3), with BFCL's verdicts: checker pass@k is the unbiased estimator, best-correct@k keeps the highest f (ties
    uniform), a dimension's mean counts unparsed answers as 0, and chain best@c reads 3 consecutive answers as a
    chain; the paired BFCL cells are the differences of those hand values."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from maze_report import label, paired_rows, tooluse_metrics, tooluse_rows

    dims = ["format", "tool_name", "arg_key", "arg_value"]
    good, near, bad, none = [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0] * 4
    # prompt a: f = 1, .75, .25, 0, 0, .25; BFCL accepts the good answer and (the checker is another judge) one bad
    rows_a, correct_a = [good, near, bad, none, none, bad], [True, False, False, False, False, True]
    got = tooluse_metrics({"id": "a", "rewards": rows_a}, correct_a, dims, [1, 2, 6])
    assert got["checker_pass@1"] == pytest.approx(2 / 6)
    assert got["checker_pass@2"] == pytest.approx(1 - 6 / 15)  # C(4,2)/C(6,2) pairs avoid both correct answers
    assert got["checker_pass@6"] == 1.0
    assert got["best_correct@1"] == pytest.approx(2 / 6)
    # k = 2: the good answer is in 5 of the 15 pairs (kept, correct); then near is the max in 4 (wrong); of the 6
    # others, {bad, bad'} keeps the correct one half the time, {bad', none} x2 always, {bad, none} x2 and {none,
    # none} never: (5 + 0.5 + 2) / 15
    assert got["best_correct@2"] == pytest.approx(7.5 / 15)
    assert got["best_correct@6"] == 1.0  # the good answer is always kept
    assert got["mean_format"] == pytest.approx(4 / 6) and got["mean_arg_value"] == pytest.approx(1 / 6)
    # chains: [good, near, bad] best f 1, [none, none, bad] best f .25 -> best@1 chain .625, best@2 chains 1
    assert got["chain_best@1"] == pytest.approx(0.625) and got["chain_best@2"] == 1.0
    assert "tokens_per_chain" not in got  # no generated_tokens recorded: no length
    with_tokens = tooluse_metrics({"id": "a", "rewards": rows_a, "generated_tokens": 150}, correct_a, dims, [1])
    assert with_tokens["tokens_per_chain"] == 75.0  # 150 tokens for 6 answers: 75 per 3

    def report(name: str, estimator: str, prompts: dict[str, tuple[list, list]]) -> dict:
        return {"label": name, "estimator": estimator, "m": 3, "n": 6, "num_prompts": 2, "dim_names": dims,
                "prompts": [{"id": i, "rewards": r, "present": [True] * 6, "best_at_k": [0.5] * 6,
                             "generated_tokens": 240, "pairwise_l1_diversity": 0.0, "expected_best_weighted": 0.5}
                            for i, (r, _) in prompts.items()],
                "_bfcl": {"prompts": [{"id": i, "category": "simple", "correct": c} for i, (_, c) in prompts.items()]}}

    all_bad = ([bad] * 6, [False] * 6)
    groups = {"VPO": [report("vpo-s0", "vpo", {"a": (rows_a, correct_a), "b": all_bad})],
              "SFT, 3-answer chains": [report("sft_chains-s0", "vpo", {"a": all_bad, "b": all_bad})]}
    assert label("sft_chains", maze=False) == "SFT, 3-answer chains"
    assert label("sft_chains", maze=True) == "SFT, 3-route chains"
    table = tooluse_rows(groups)
    vpo = next(line for line in table if line.startswith("| VPO |"))
    cells = [c.strip() for c in vpo.strip("|").split("|")]
    # columns: method, seeds, checker pass@1/4/6, best correct@1/4/6, 4 dims, chain best@1/2, tokens per chain
    assert cells[2].startswith(f"{2 / 6 / 2:.3f} [") and cells[7].startswith("0.500 [")  # pass@1, best correct@6
    assert cells[-1] == "120 [120, 120]"  # 240 tokens for 6 answers on both prompts: 120 per chain of 3
    assert "| VPO | 0.167 |" in "\n".join(table)  # per category: 2 of 12 answers correct
    paired = paired_rows(groups, num_draws=200)
    row = next(line for line in paired if line.startswith("| VPO - SFT, 3-answer chains"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "test prompts" in paired[0] and cells[-3].startswith(f"{2 / 6 / 2:.3f} [")  # best correct@1
    assert cells[-2].startswith("0.500 [") and cells[-1].startswith("0.500 [")  # best correct@6, pass@6
