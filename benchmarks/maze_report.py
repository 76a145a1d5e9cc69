"""The maze comparison's report (issue 38, docs/results_maze.md), built from committed small files only.

Three helpers for ``benchmarks/maze_protocol.sh`` and one report:

    python benchmarks/maze_report.py --positions checkpoints/maze5-eval/vpo-s0      # per-position rates (JSON)
    python benchmarks/maze_report.py --curves checkpoints/maze5-vpo-s0              # training curves (JSON)
    python benchmarks/maze_report.py --results docs/results/maze --out docs/results_maze.md

``--positions`` reads an evaluation's ``samples.jsonl`` and prints, per answer position (a single answer is position 1):
the fraction of answers that parse, that reach the exit (reward dimension ``exit`` = 1), each dimension's mean (unparsed
answers score 0, as in training), and for chains the fraction with every position parsed. ``--curves`` reads a run's
TensorBoard files and prints per-step train/ rewards, KL, parse rate, diversity and tokens. ``--results`` reads
``<results>/<method>-s<seed>/{eval.json,positions.json,curves.json,times.tsv}`` and writes the table (mean over seeds
and prompts with hierarchical 95% bootstrap intervals, vpo_lightning.commands.replicates), the best@k plot, the maze's
exits-and-trade-offs table (exit pass@k, whole-zone routes, both@k: :func:`tradeoff_metrics`), the cold start's
per-position table, the first/last-10-step training summaries and wall times.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CURVE_TAGS = ("train/reward/all/mean", "train/reward/exit", "train/reward/gold", "train/reward/diamond",
              "train/reward/safety", "train/reward/set", "train/kl", "train/chains/candidate_parse_rate",
              "train/chains/parse_rate", "train/diversity/within_group", "train/diversity/within_chain",
              "train/rollout/tokens", "train/chains/repeated_candidates", "train/reward/best_in_chain",
              "train/reward/all/format", "train/reward/all/tool_name", "train/reward/all/arg_key",
              "train/reward/all/arg_value")
MARKER = "<!-- written by hand below this line; kept when the report is regenerated -->"
LABELS = {"vpo": "VPO", "grpo": "GRPO", "multi_rlvr": "Multi-RLVR", "sft_chains": "SFT, 3-route chains",
          "sft_single": "SFT, single answers"}
TASK_LABELS = {"sft_chains": "SFT, 3-answer chains"}  # the labels that differ off the maze (a chain of tool calls)
MAZE_DIMS = {"exit", "gold", "diamond"}


def is_maze(dim_names: Sequence[str]) -> bool:
    """Whether a report's reward is the maze's (its exit/zone tables apply); otherwise a task-neutral report."""
    return set(dim_names) >= MAZE_DIMS


def label(method: str, maze: bool) -> str:
    """The report's name for a method folder (``vpo``, ``sft_chains``, ...) on the maze or another task."""
    return LABELS.get(method, method) if maze else TASK_LABELS.get(method, LABELS.get(method, method))


def positions(eval_dir: Path) -> dict[str, Any]:
    """Per-position parse and exit rates and reward means of one evaluation (``samples.jsonl`` + ``eval.json``)."""
    report = json.loads((eval_dir / "eval.json").read_text(encoding="utf-8"))
    dims, m = list(report["dim_names"]), int(report["m"])
    parsed, exits, sums, chains, complete = [0] * m, [0] * m, [[0.0] * len(dims) for _ in range(m)], 0, 0
    for line in (eval_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines():
        rewards = json.loads(line)["rewards"]
        chains += 1
        complete += all(r is not None for r in rewards)
        for j, r in enumerate(rewards[:m]):
            if r is None:
                continue
            parsed[j] += 1
            exits[j] += r[dims.index("exit")] >= 1.0 if "exit" in dims else 0
            for d, v in enumerate(r):
                sums[j][d] += v
    n = max(1, chains)
    return {"m": m, "chains": chains, "dim_names": dims, "all_parsed": complete / n,
            "parse_rate": [p / n for p in parsed], "exit_rate": [e / n for e in exits],
            "mean_reward": [[v / n for v in row] for row in sums]}


def _none_of(n: int, avoid: int, k: int) -> float:
    """Probability that k of n answers drawn without replacement avoid a given set of ``avoid`` answers."""
    return math.comb(n - avoid, k) / math.comb(n, k)


def route_kinds(prompt: dict[str, Any], dims: Sequence[str]) -> tuple[int, int, int, int]:
    """``(n, exits, gold routes, diamond routes)`` of one prompt's answers (``eval.json``'s per-prompt ``rewards``
    [n, D], absent answers as zero vectors): answers that reach the exit, and those that also collect the whole gold
    (diamond) zone. The maze's budget makes a route with both whole zones impossible, so the two are disjoint."""
    rewards = prompt["rewards"]
    ex, gd, dm = dims.index("exit"), dims.index("gold"), dims.index("diamond")
    exits = sum(r[ex] >= 1 for r in rewards)
    gold = sum(r[ex] >= 1 and r[gd] >= 1 for r in rewards)
    diamond = sum(r[ex] >= 1 and r[dm] >= 1 for r in rewards)
    return len(rewards), exits, gold, diamond


def tradeoff_metrics(prompt: dict[str, Any], dims: Sequence[str], ks: Sequence[int]) -> dict[str, float]:
    """One prompt's exit pass@k (some answer among k reaches the exit: the unbiased estimator over k of the n
    answers), the shares of whole-gold and whole-diamond routes, and both-routes@k: the probability that k answers
    drawn from the n include a whole-gold route AND a whole-diamond route, the two best answers under opposite
    trade-offs (inclusion-exclusion: 1 - P(no gold) - P(no diamond) + P(neither))."""
    n, exits, gold, diamond = route_kinds(prompt, dims)
    out = {"gold_share": gold / n, "diamond_share": diamond / n}
    for k in ks:
        out[f"exit_pass@{k}"] = 1.0 - _none_of(n, exits, k)
        both = 1.0 - _none_of(n, gold, k) - _none_of(n, diamond, k) + _none_of(n, gold + diamond, k)
        out[f"both@{k}"] = max(0.0, both)  # (rounding: 1 - 1 - 1 + 1 can print as -0.000)
    return out


def pool_size(groups: dict[str, list[dict[str, Any]]]) -> int:
    """The smallest number of answers per prompt among the reports (the largest k every table can show)."""
    return min(r["n"] for rs in groups.values() for r in rs)


def best_at_k_ks(groups: dict[str, list[dict[str, Any]]]) -> list[int]:
    """The k of the best@k columns."""
    return [k for k in (1, 2, 4, 8, 12, 16, 24) if k <= pool_size(groups)]


def tradeoff_rows(groups: dict[str, list[dict[str, Any]]], heading: bool = True) -> list[str]:
    """The maze's own table: exit pass@k (the generic pass@k needs every dimension at 1, which the budget rules
    out on every maze), whole-zone route shares and both-routes@k, mean over seeds and prompts with the same
    hierarchical bootstrap intervals as the main table; nothing for reports without the maze's dimensions."""
    import torch

    from vpo_lightning.commands.replicates import _cell, bootstrap_interval

    if not all(is_maze(r["dim_names"]) for rs in groups.values() for r in rs):
        return []
    ks = [k for k in (1, 3, 24) if k <= pool_size(groups)]
    keys = [*[f"exit_pass@{k}" for k in ks], "gold_share", "diamond_share", *[f"both@{k}" for k in ks]]
    head = ["## Exits and trade-offs covered", "",
            "Per prompt over its n answers: **exit pass@k**, the probability that k of them include one that reaches "
            "the exit (the main table's pass@k asks every dimension to be 1, which the budget rules out on every "
            "maze: a route cannot collect both zones); the shares of answers that are **whole-gold** and "
            "**whole-diamond** routes (reach the exit with the whole zone collected); **both@k**, the probability "
            "that k answers include a whole-gold AND a whole-diamond route, the best answers under the two opposite "
            "trade-offs (the coverage VPO is built for). Added 2026-12-06 after GRPO s0 and before any VPO "
            "evaluation was read.", ""]
    rows = (head if heading else []) + ["| method | seeds | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for label, reports in groups.items():
        cells = [label, str(len(reports))]
        ids = [p["id"] for p in reports[0]["prompts"]]  # prompts aligned across seeds, as the main table does
        per_seed = []
        for rep in reports:
            by_id = {p["id"]: p for p in rep["prompts"]}
            per_seed.append([tradeoff_metrics(by_id[i], list(rep["dim_names"]), ks) for i in ids])
        for key in keys:
            values = torch.tensor([[m[key] for m in seed] for seed in per_seed], dtype=torch.float64)  # [S, P]
            cells.append(_cell(bootstrap_interval(values)))
        rows.append("| " + " | ".join(cells) + " |")
    return rows + [""]


PAIRS = (("vpo", "grpo"), ("vpo", "multi_rlvr"), ("vpo", "sft_chains"), ("grpo", "sft_single"),
         ("multi_rlvr", "sft_chains"))  # (row method, the method it is compared with), as method folders
CHAIN = 3  # answers per "chain" in the one-chain metrics: a chain of the m = 3 methods, 3 samples of the others


def exit_diversity(prompt: dict[str, Any], dims: Sequence[str]) -> float:
    """Mean pairwise L1 distance between the reward vectors of one prompt's answers that reach the exit (the
    headline diversity without the pairs where one answer fails and the other does not); NaN under two such."""
    ex = dims.index("exit")
    rows = [r for r, ok in zip(prompt["rewards"], prompt["present"]) if ok and r[ex] >= 1]
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]]
    return sum(sum(abs(x - y) for x, y in zip(a, b)) for a, b in pairs) / len(pairs) if pairs else math.nan


def chain_metrics(prompt: dict[str, Any], weights: Any) -> dict[str, float]:
    """One-chain metrics of one prompt: over each run of ``CHAIN`` consecutive answers (``eval.json`` lists a
    chain's answers together), the best f (mean of the dimensions) and VPO's own objective E_w[max_j w.r_j] under
    the fixed Dirichlet draws ``weights [K, D]``, averaged over the chains. Absent answers score 0."""
    import torch

    r = torch.tensor(prompt["rewards"], dtype=torch.float64)  # [n, D], absent answers zero rows
    r = r[: r.shape[0] // CHAIN * CHAIN].view(-1, CHAIN, r.shape[-1])  # [C, 3, D]
    scores = torch.einsum("cjd,kd->cjk", r, weights.to(r))  # [C, 3, K]
    return {"chain_best": float(r.mean(-1).amax(-1).mean()), "chain_ew_max": float(scores.amax(1).mean())}


def chain_best_at(values: Sequence[float], c: int) -> float:
    """E[max of c values drawn without replacement from ``values``] (the unbiased best@c over whole chains)."""
    v, n = sorted(values), len(values)
    if not 1 <= c <= n:
        return math.nan
    return sum(v[i] * math.comb(i, c - 1) for i in range(c - 1, n)) / math.comb(n, c)


def tooluse_metrics(prompt: dict[str, Any], correct: Sequence[bool], dims: Sequence[str],
                    ks: Sequence[int]) -> dict[str, float]:
    """One tool-use prompt's per-prompt metrics beyond ``vpo eval``'s, from its ``rewards [n, D]`` (eval.json's order:
    chain by chain; absent answers as zero rows) and BFCL's verdict on each answer (bfcl.json's ``correct``):
    **checker pass@k** (some answer among k is correct, the unbiased estimator), **best-correct@k** (the answer with
    the highest f, the mean of the dimensions, among k drawn at random is correct, ties uniform:
    :func:`vpo_lightning.core.metrics.best_pick_correct_at_k`), each dimension's mean over the n answers, and
    **chain best@c**: the best f over c whole chains drawn from the n / ``CHAIN`` (``CHAIN`` consecutive answers:
    one chain of a chain method, ``CHAIN`` samples of a single-answer one), :func:`chain_best_at`; and, where the
    prompt records its ``generated_tokens``, **tokens per chain**: the tokens generated for ``CHAIN`` answers (a
    chain's length; ``CHAIN`` single answers' together), the length a missing last answer would shorten."""
    from vpo_lightning.core.metrics import best_pick_correct_at_k, pass_at_k

    rewards = prompt["rewards"]
    n = len(rewards)
    if len(correct) != n:
        raise ValueError(f"prompt {prompt.get('id')}: {n} rewards but {len(correct)} BFCL verdicts")
    f = [sum(r) / len(r) for r in rewards]  # [n]
    solved = sum(map(bool, correct))
    out: dict[str, float] = {}
    for k in ks:
        out[f"checker_pass@{k}"] = pass_at_k(n, solved, k)
        out[f"best_correct@{k}"] = best_pick_correct_at_k(f, correct, k)
    for d, name in enumerate(dims):
        out[f"mean_{name}"] = sum(r[d] for r in rewards) / n
    best_f = [max(f[i * CHAIN:(i + 1) * CHAIN]) for i in range(n // CHAIN)]  # [C]
    for c in range(1, len(best_f) + 1):
        out[f"chain_best@{c}"] = chain_best_at(best_f, c)
    if "generated_tokens" in prompt:
        out["tokens_per_chain"] = prompt["generated_tokens"] * CHAIN / n
    return out


def tooluse_matrix(reports: list[dict[str, Any]], key: str, ids: list[str], ks: Sequence[int]) -> Any:
    """``[S, P]``: one :func:`tooluse_metrics` key of each report over the prompts ``ids`` (NaN where a report has
    no bfcl.json and the key needs it)."""
    import torch

    rows = []
    for rep in reports:
        cache = rep.setdefault("_tooluse", {})
        if not cache:
            verdicts = {p["id"]: p["correct"] for p in (rep.get("_bfcl") or {}).get("prompts", [])}
            for p in rep["prompts"]:
                correct = verdicts.get(p["id"])
                cache[p["id"]] = tooluse_metrics(p, [False] * len(p["rewards"]) if correct is None else correct,
                                                 list(rep["dim_names"]), ks)
                if correct is None:  # no verdicts: the checker's keys are unknown, not zero
                    cache[p["id"]].update({k: math.nan for k in cache[p["id"]] if "correct" in k or "checker" in k})
        rows.append([cache[i].get(key, math.nan) for i in ids])
    return torch.tensor(rows, dtype=torch.float64)  # [S, P]


def tooluse_rows(groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Tool use's own tables (issue 51): BFCL's checker on the answers (pass@k and the best-scoring answer's
    accuracy), the reward per dimension, best@c in whole chains, and the checker's accuracy per BFCL category;
    means over seeds and prompts with the main table's hierarchical bootstrap intervals. Nothing on the maze."""
    from vpo_lightning.commands.replicates import _cell, bootstrap_interval

    if not groups or any(is_maze(r["dim_names"]) for rs in groups.values() for r in rs):
        return []
    n = pool_size(groups)
    ks = sorted({k for k in (1, 4, n) if k <= n})
    dims = list(next(iter(groups.values()))[0]["dim_names"])
    chains = n // CHAIN
    cs = sorted({c for c in (1, chains) if c >= 1})
    keys = [*[f"checker_pass@{k}" for k in ks], *[f"best_correct@{k}" for k in ks], *[f"mean_{d}" for d in dims],
            *[f"chain_best@{c}" for c in cs], "tokens_per_chain"]
    names = [*[f"checker pass@{k}" for k in ks], *[f"best answer correct@{k}" for k in ks], *dims,
             *[f"chain best@{c}" for c in cs], "tokens per chain"]
    lines = ["## BFCL's checker, the reward per dimension, whole chains", "",
             "Per prompt over its n answers, judged by BFCL's own AST checker (`bfcl.json`, "
             "`python -m vpo_lightning.tasks.tooluse.bfcl_check`): **checker pass@k**, the chance that k answers "
             "include a correct one; **best answer correct@k**, the chance that the answer the reward scores highest "
             "(f, the mean of the four dimensions) among k drawn at random is correct, ties broken uniformly: what a "
             "user who keeps the best-scoring of k samples reads on BFCL. Then each reward dimension's mean over all "
             f"answers (an unparsed answer scores 0), and **chain best@c**: the best f over c whole chains ({CHAIN} "
             f"consecutive answers: one generation of a chain method, {CHAIN} samples of a single-answer one; "
             f"{chains} per prompt), and the **tokens** generated for those {CHAIN} answers (a chain's length; the "
             "budget is a chain's). Mean over seeds and prompts, 95% hierarchical bootstrap intervals.", "",
             "| method | seeds | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
    for name, reports in groups.items():
        ids = [p["id"] for p in reports[0]["prompts"]]
        cells = [name, str(len(reports))]
        for key in keys:
            interval = bootstrap_interval(tooluse_matrix(reports, key, ids, ks))
            tokens = key == "tokens_per_chain" and not math.isnan(interval[0])
            cells.append("{:.0f} [{:.0f}, {:.0f}]".format(*interval) if tokens else _cell(interval))
        lines.append("| " + " | ".join(cells) + " |")
    cats: dict[str, dict[str, list[bool]]] = {}  # method -> category -> every answer's verdict over its seeds
    for name, reports in groups.items():
        for rep in reports:
            for p in (rep.get("_bfcl") or {}).get("prompts", []):
                cats.setdefault(name, {}).setdefault(str(p["category"]), []).extend(map(bool, p["correct"]))
    if cats:
        names_cat = sorted({c for per in cats.values() for c in per})
        counts = {c: max(len(per.get(c, [])) // max(1, len(groups[m])) for m, per in cats.items()) for c in names_cat}
        lines += ["", "BFCL's checker per category (accuracy of all answers, k = 1, over seeds; answers per seed):",
                  "", "| method | " + " | ".join(f"{c} ({counts[c]})" for c in names_cat) + " |",
                  "|" + "---|" * (len(names_cat) + 1)]
        for name, per in cats.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{sum(per[c]) / len(per[c]):.3f}" if per.get(c) else "-" for c in names_cat) + " |")
    return lines + [""]


def paired_rows(groups: dict[str, list[dict[str, Any]]], num_draws: int = 2000) -> list[str]:
    """Paired differences (row method minus column method) over the shared test prompts: best@1/4/24, diversity
    (all answers and, on the maze, exit-reaching ones), E_w best over the pool, the one-chain metrics and, on tool
    use, BFCL's checker (best answer correct@1/24, checker pass@24), each with its paired bootstrap interval
    (prompts resampled for both sides together, seeds per side:
    :func:`vpo_lightning.commands.replicates.paired_difference`)."""
    import torch

    from vpo_lightning.commands.replicates import _cell, paired_difference, prompt_values
    from vpo_lightning.core.advantages import sample_weights

    maze = all(is_maze(r["dim_names"]) for rs in groups.values() for r in rs)
    unit = "mazes" if maze else "prompts"
    pairs = [(label(a, maze), label(b, maze)) for a, b in PAIRS]
    pairs = [(a, b) for a, b in pairs if a in groups and b in groups]
    if not pairs:
        return []
    n = pool_size(groups)
    ks = [k for k in (1, 4, 24) if k <= n]
    bfcl = not maze and all(r.get("_bfcl") for rs in groups.values() for r in rs)
    tool_ks = sorted({k for k in (1, 4, n) if k <= n})
    dim = len(next(iter(groups.values()))[0]["dim_names"])
    weights = sample_weights(1000, dim, 1.0, generator=torch.Generator().manual_seed(0))  # [K, D], one draw for all

    one_chain: dict[int, dict[str, float]] = {}  # id(prompt) -> its chain metrics, for both columns and every pair

    def chains_of(prompt: dict[str, Any]) -> dict[str, float]:
        if id(prompt) not in one_chain:
            one_chain[id(prompt)] = chain_metrics(prompt, weights)
        return one_chain[id(prompt)]

    def matrix(reports: list[dict[str, Any]], key: str, ids: list[str]) -> Any:
        if key.startswith("best@"):
            return prompt_values(reports, "best_at_k", int(key[5:]))
        if key in ("pairwise_l1_diversity", "expected_best_weighted"):
            return prompt_values(reports, key)
        if key.startswith(("best_correct@", "checker_pass@")):
            return tooluse_matrix(reports, key, ids, tool_ks)
        rows = []
        for rep in reports:
            by_id = {p["id"]: p for p in rep["prompts"]}
            if key == "exit_diversity":
                rows.append([exit_diversity(by_id[i], list(rep["dim_names"])) for i in ids])
            else:
                rows.append([chains_of(by_id[i])[key] for i in ids])
        return torch.tensor(rows, dtype=torch.float64)  # [S, P]

    checker_keys = [f"best_correct@{tool_ks[0]}", f"best_correct@{tool_ks[-1]}", f"checker_pass@{tool_ks[-1]}"]
    keys = [*[f"best@{k}" for k in ks], "pairwise_l1_diversity", *(["exit_diversity"] if maze else []),
            "expected_best_weighted", "chain_best", "chain_ew_max", *(checker_keys if bfcl else [])]
    names = [*[f"best@{k}" for k in ks], "diversity (L1)", *(["diversity, exit routes"] if maze else []),
             "E_w best (pool)", "chain best f", "chain E_w max",
             *([f"BFCL: best correct@{tool_ks[0]}", f"BFCL: best correct@{tool_ks[-1]}",
                f"BFCL: pass@{tool_ks[-1]}"] if bfcl else [])]
    exit_note = ("*Diversity, exit routes*: the mean L1 between answers that both reach the exit (mazes with fewer "
                 "than two such answers skipped). ") if maze else ""
    bfcl_note = ("*BFCL*: BFCL's checker on the answers, as in the table below (best correct@k: the best-scoring of "
                 "k answers is correct; pass@k: one of k is). ") if bfcl else ""
    lines = [f"## Paired differences over the shared test {unit}", "",
             f"Row method minus the method it is compared with, on the same {unit}: the difference of the means over "
             f"seeds and {unit}, with a 95% paired bootstrap interval (each draw resamples the {unit} for both sides "
             "together and each side's seeds on its own). An interval that excludes 0 is a separated difference. "
             f"{exit_note}{bfcl_note}*Chain* metrics: over each {CHAIN} consecutive answers (one chain of a "
             f"chain method, {CHAIN} independent samples of a single-answer one), the best f and E_w[max w.r] under "
             "one fixed set of 1,000 Dirichlet(1) draws: VPO's own objective for one chain.", "",
             "| difference | seeds | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
    for a, b in pairs:
        ids = [p["id"] for p in groups[a][0]["prompts"]]
        cells = [f"{a} - {b}", f"{len(groups[a])} / {len(groups[b])}"]
        for key in keys:
            cells.append(_cell(paired_difference(matrix(groups[a], key, ids), matrix(groups[b], key, ids),
                                                 num_draws)))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def curves(run_dir: Path) -> dict[str, dict[int, float]]:
    """The run's per-step training scalars of ``CURVE_TAGS`` (those it logged)."""
    from vpo_lightning.commands.runs import read_scalars

    scalars = read_scalars(run_dir)
    return {tag: {int(k): float(v) for k, v in sorted(scalars[tag].items())} for tag in CURVE_TAGS if tag in scalars}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def curve_rows(name: str, data: dict[str, dict[str, float]], first: int = 10, last: int = 10) -> list[str]:
    rows = []
    for tag, series in data.items():
        steps = sorted(series, key=int)
        head, tail = [series[s] for s in steps[:first]], [series[s] for s in steps[-last:]]
        rows.append(f"| {name} | {tag.removeprefix('train/')} | {len(steps)} | {_mean(head):.4f} | {_mean(tail):.4f} |")
    return rows


POSITION_HEAD = {True: ["| run | position | chains | parses | reaches the exit | mean reward |",
                        "|---|---|---|---|---|---|"],
                 False: ["| run | position | chains | parses | mean reward |", "|---|---|---|---|---|"]}


def position_rows(name: str, pos: dict[str, Any]) -> list[str]:
    """One run's rows of the per-position table (:data:`POSITION_HEAD`; the exit column on the maze only)."""
    dims = pos["dim_names"]
    maze = is_maze(dims)
    rows = []
    for j in range(pos["m"]):
        means = ", ".join(f"{v:.3f}" for v in pos["mean_reward"][j])
        exit_cell = f" {pos['exit_rate'][j]:.1%} |" if maze else ""
        rows.append(f"| {name} | {j + 1} | {pos['chains']} | {pos['parse_rate'][j]:.1%} |{exit_cell} "
                    f"{means} ({', '.join(dims)}) |")
    if pos["m"] > 1:
        rows.append(f"| {name} | all {pos['m']} parsed | {pos['chains']} | {pos['all_parsed']:.1%} |"
                    + (" - | - |" if maze else " - |"))
    return rows


def coldstart_rows(folder: Path) -> list[str]:
    """The cold start's gate (issue 38: >= 50% of single and of chain answers reach the exit, every chain position
    parses in >= 95% of chains) from ``<folder>/<method>-s<seed>/positions.json``."""
    runs = sorted(p for p in folder.iterdir() if (p / "positions.json").exists()) if folder.exists() else []
    if not runs:
        return []
    rows = ["## Before RL: the cold start on validation mazes", "",
            f"From `{folder}/` (`benchmarks/maze_protocol.sh`, `RESULTS_DIR={folder}`, `EXTRA_EVAL=--split val`).",
            "", *POSITION_HEAD[True]]
    for run in runs:
        rows += position_rows(run.name, json.loads((run / "positions.json").read_text()))
    return rows + [""]


def load_groups(results: Path) -> tuple[list[Path], dict[str, list[dict[str, Any]]]]:
    """The run folders of ``results`` that hold an ``eval.json``, and their reports grouped by method label."""
    runs = sorted(p for p in results.iterdir() if (p / "eval.json").exists()) if results.exists() else []
    loaded = []
    for run in runs:
        rep = json.loads((run / "eval.json").read_text(encoding="utf-8"))
        rep["_path"] = str(run)
        if (run / "bfcl.json").exists():  # tool use: BFCL's verdict on every answer
            rep["_bfcl"] = json.loads((run / "bfcl.json").read_text(encoding="utf-8"))
        loaded.append((run.name.rsplit("-s", 1)[0], rep))
    maze = all(is_maze(rep["dim_names"]) for _, rep in loaded)
    groups: dict[str, list[dict[str, Any]]] = {}
    for method, rep in loaded:
        groups.setdefault(label(method, maze), []).append(rep)
    return runs, groups


def midpoint_rows(folder: Path) -> list[str]:
    """A post-hoc diagnostic section: the runs' step-50 adapters (``<folder>/<method>-s<seed>/eval.json``), evaluated
    as the final ones are, in the same two tables."""
    from vpo_lightning.commands.replicates import summary_table

    _, groups = load_groups(folder)
    if not groups:
        return []
    lines = ["## Post-hoc diagnostic: each run at step 50 of 100", "",
             f"From `{folder}/`: the step-50 adapter of each finished run, evaluated exactly as the final one (test "
             "split, same mazes, samples, temperature and budget). Decided after VPO s0's KL ran away after step ~70; "
             "not the protocol's result (that is the table above), a look at the runs before the end.", ""]
    return lines + summary_table(groups, best_at_k_ks(groups)) + [""] + tradeoff_rows(groups, heading=False)


# ---- issue 50: the checkpoint sweeps of benchmarks/maze_checkpoints.py, the rule that chooses one, their rows
TIE = 0.005  # validation best@24 within this of the highest counts as a tie (docs/EXPERIMENTS.md, issue 50 item 5)


def _lr_of(path: Path) -> float:
    """The learning rate in a sweep file's name, ``<method>-lr<lr>-s<seed>.json``."""
    return float(path.stem.split("-lr", 1)[1].rsplit("-s", 1)[0])


def selection_score(sweep: dict[str, Any], step: int) -> float:
    """The selection metric of one step: best@24 on the selection set (validation, temperature 0.7); NaN if absent."""
    for row in sweep["rows"]:
        if row["step"] == step and row["set"] == "val" and row["temperature"] == 0.7:
            return float(row.get("best@24", math.nan))
    return math.nan


def choose(sweeps: dict[float, dict[str, Any]]) -> tuple[float, int, float]:
    """The rule of docs/EXPERIMENTS.md (issue 50 item 5) over one method's sweeps ``{lr: sweep}``: among steps > 0,
    the highest validation best@24; within ``TIE`` of it, the smaller lr, then the earlier step.
    Returns ``(lr, step, score)``."""
    cands = [(lr, row["step"], selection_score(sw, row["step"])) for lr, sw in sweeps.items() for row in sw["rows"]
             if row["step"] > 0 and row["set"] == "val" and row["temperature"] == 0.7]
    cands = [c for c in cands if not math.isnan(c[2])]
    if not cands:
        raise ValueError("no checkpoint after step 0 has a selection-set evaluation")
    top = max(c[2] for c in cands)
    return min((c for c in cands if c[2] >= top - TIE), key=lambda c: (c[0], c[1]))


def load_sweeps(folder: Path) -> dict[str, dict[float, dict[str, Any]]]:
    """``{method: {lr: sweep}}`` from ``<folder>/<method>-lr<lr>-s0.json`` (the grid's seed-0 runs)."""
    out: dict[str, dict[float, dict[str, Any]]] = {}
    for path in sorted(folder.glob("*-lr*-s0.json")) if folder.exists() else []:
        out.setdefault(path.stem.split("-lr", 1)[0], {})[_lr_of(path)] = json.loads(path.read_text())
    return out


def _num(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def selection_rows(folder: Path) -> list[str]:
    """Markdown: each method's validation best@24 per (lr, step), and the checkpoint the rule chooses."""
    sweeps = load_sweeps(folder)
    if not sweeps:
        return []
    steps = sorted({row["step"] for by_lr in sweeps.values() for sw in by_lr.values() for row in sw["rows"]})
    lines = ["## The step size, chosen on validation", "",
             "Validation best@24 (50 validation mazes x 24 answers, temperature 0.7) of each grid run's checkpoints "
             "(step 0: the cold start in the method's format); the rule (docs/EXPERIMENTS.md): the highest after step "
             f"0, within {TIE} of it the smaller lr, then the earlier step.", "",
             "| method | lr | " + " | ".join(f"step {s}" for s in steps) + " | chosen |",
             "|" + "---|" * (len(steps) + 3)]
    for method, by_lr in sweeps.items():
        lr_c, step_c, _ = choose(by_lr)
        for lr, sw in sorted(by_lr.items()):
            cells = [_num(selection_score(sw, s)) for s in steps]
            mark = f"step {step_c}" if lr == lr_c else ""
            lines.append(f"| {method} | {lr:g} | " + " | ".join(cells) + f" | {mark} |")
    return lines + [""]


def diagnosis_rows(folder: Path) -> list[str]:
    """Markdown: the diagnosed runs (sweeps with the seen-training set) per step: KL, and best@24, one chain's
    E_w max and the exit rate on 16 validation and 16 seen training mazes at temperatures 0.7 and 1.0."""
    files = [p for p in sorted(folder.glob("*.json")) if folder.exists()]
    diag = [(p.stem, json.loads(p.read_text())) for p in files]
    diag = [(name, sw) for name, sw in diag if any(r["set"] == "seen" for r in sw["rows"])]
    if not diag:
        return []
    sets = [("val16", 0.7), ("val16", 1.0), ("seen", 0.7), ("seen", 1.0)]
    head = ["run", "step", "KL (10-step mean)",
            *[f"{s} T{t}: best@24 / chain E_w / exit" for s, t in sets]]
    lines = ["## Diagnosis: where the drop comes from", "",
             "16 validation mazes (`val16`) and the 16 training mazes each run was given first (`seen`), 24 answers, "
             "at the evaluation temperature (0.7) and the training one (1.0); per cell: best@24, one chain's E_w max "
             "(VPO's own objective), the exit rate per answer. The readings fixed before the runs are in "
             "docs/EXPERIMENTS.md.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, sw in diag:
        for step in sorted({r["step"] for r in sw["rows"]}):
            cells = [name, str(step), _num(next((r["kl"] for r in sw["rows"] if r["step"] == step), math.nan))]
            for s, t in sets:
                r = next((r for r in sw["rows"] if r["step"] == step and r["set"] == s and r["temperature"] == t),
                         None)
                cells.append("-" if r is None else
                             f"{_num(r.get('best@24'))} / {_num(r['chain_ew_max'])} / {_num(r['exit_rate'])}")
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def report(results: Path, out: Path, coldstart: Path | None = None, midpoint: Path | None = None,
           checkpoints: Path | None = None, title: str | None = None) -> None:
    from vpo_lightning.commands.replicates import best_at_k_bands, plot_bands, summary_table

    runs, groups = load_groups(results)
    maze = all(is_maze(r["dim_names"]) for rs in groups.values() for r in rs)
    task = "Maze (5x5, the reference's reward)" if maze else "Tool use (BFCL, 4-dimension reward)"
    lines = [f"# {title or task + ': VPO vs GRPO vs Multi-RLVR from one cold start'}", "",
             "Generated by `bash benchmarks/maze_protocol.sh report` from the files under "
             f"`{results}/` alone (one folder per method and seed). Protocol: benchmarks/maze_protocol.sh.", ""]
    if groups:
        lines += summary_table(groups, best_at_k_ks(groups))
        plot = out.with_name(out.stem + "_best_at_k.png")
        plot_bands(best_at_k_bands(groups), plot,
                   f"{'Maze 5x5' if maze else 'Tool use'} (test split): best@k, 95% intervals over prompts and seeds")
        lines += ["", f"![best@k]({plot.name})", ""] + paired_rows(groups) + tradeoff_rows(groups) \
            + tooluse_rows(groups)
    if checkpoints is not None:  # issue 50: the step-size choice on validation and the diagnosis
        lines += selection_rows(checkpoints) + diagnosis_rows(checkpoints)
    if midpoint is not None:
        lines += midpoint_rows(midpoint)
    if coldstart is not None:
        lines += coldstart_rows(coldstart)
    pos = [(run.name, json.loads((run / "positions.json").read_text())) for run in runs
           if (run / "positions.json").exists()]
    if pos:
        lines += ["## Per answer position", "", *POSITION_HEAD[maze]]
        for name, p in pos:
            lines += position_rows(name, p)
        lines.append("")
    cur = [(run.name, json.loads((run / "curves.json").read_text())) for run in runs if (run / "curves.json").exists()]
    if cur:
        lines += ["## Training curves (mean of the first and last 10 logged steps)", "",
                  "| run | scalar | steps | first 10 | last 10 |", "|---|---|---|---|---|"]
        for name, c in cur:
            lines += curve_rows(name, c)
        lines.append("")
    times = [(run.name, (run / "times.tsv").read_text().splitlines()) for run in runs if (run / "times.tsv").exists()]
    if times:
        lines += ["## Wall times", "", "| run | phase | from step | seconds |", "|---|---|---|---|"]
        for name, rows in times:
            for row in rows:
                phase, _, start, secs = (row.split("\t") + ["", "", "", ""])[:4]
                lines.append(f"| {name} | {phase} | {start} | {secs} |")
    kept = out.read_text(encoding="utf-8").split(MARKER, 1)[1] if out.exists() and MARKER in out.read_text() else "\n"
    out.write_text("\n".join(lines) + "\n\n" + MARKER + kept, encoding="utf-8")
    print(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=Path, help="a `vpo eval` output directory: print its per-position rates")
    p.add_argument("--curves", type=Path, help="a `vpo fit` run directory: print its training curves")
    p.add_argument("--results", type=Path, help="the committed results folder (docs/results/maze)")
    p.add_argument("--coldstart", type=Path, default=None, help="the committed cold-start folder (its gate table)")
    p.add_argument("--midpoint", type=Path, default=None, help="a folder of step-50 evaluations (a post-hoc section)")
    p.add_argument("--checkpoints", type=Path, default=None,
                   help="a folder of checkpoint sweeps (benchmarks/maze_checkpoints.py): the selection and diagnosis")
    p.add_argument("--out", type=Path, default=Path("docs/results_maze.md"))
    p.add_argument("--title", default=None, help="the report's first heading [the task and the methods]")
    args = p.parse_args(argv)
    if args.positions:
        print(json.dumps(positions(args.positions), indent=1))
    elif args.curves:
        print(json.dumps(curves(args.curves)))
    elif args.results:
        report(args.results, args.out, args.coldstart, args.midpoint, args.checkpoints, args.title)
    else:
        p.error("give --positions, --curves or --results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
