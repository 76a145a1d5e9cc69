"""``vpo compare``: put several ``eval.json`` files (from ``vpo eval``) side by side in a markdown report.

    vpo compare checkpoints/eval-base/eval.json checkpoints/tooluse-vpo/eval-last/eval.json \\
        checkpoints/tooluse-grpo/eval-last/eval.json --out docs/results.md

Writes ``report.md`` (a metrics table with one row per input, and a provenance table) and one PNG with every
input's best@k curve beside it (``<report stem>_best_at_k.png``). Inputs evaluated on different prompts, reward
dimensions or budgets are still compared, with a warning in the report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vpo_lightning.app import parse_args
from vpo_lightning.commands.evaluate import FORMAT, plot_curves


def build_parser() -> argparse.ArgumentParser:
    """The ``vpo compare`` argument parser."""
    p = argparse.ArgumentParser(prog="vpo compare", description="Side-by-side markdown report of eval.json files "
                                "written by `vpo eval`, with one best@k plot.")
    p.add_argument("evals", nargs="+", help="eval.json files written by `vpo eval` (or their directories)")
    p.add_argument("--out", default="report.md",
                   help="markdown report to write; the plot goes beside it (default: report.md)")
    p.add_argument("--ks", help="comma-separated k for best@k columns (default: 1, 2, 4, 8, ... and the pool size)")
    p.add_argument("--labels", help="comma-separated names for the inputs (default: each eval.json's label)")
    p.add_argument("--title", default="Evaluation results", help="heading of the report")
    return p


def read_eval(path: str | Path) -> dict[str, Any]:
    """Load one ``eval.json`` (a directory means the eval.json inside it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "eval.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist (run `vpo eval` first)")
    report = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an eval.json written by `vpo eval` (format {FORMAT})")
    report["_path"] = str(path)
    return report


def default_ks(n: int) -> list[int]:
    """1, 2, 4, 8, ... below n, then n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value).replace("|", "\\|")


def _at(curve: list[float], k: int) -> float | None:
    return curve[k - 1] if 1 <= k <= len(curve) else None


def metrics_table(reports: list[dict[str, Any]], ks: list[int]) -> list[str]:
    """The side-by-side metrics table, one row per report."""
    n_max = max(r["n"] for r in reports)
    head = ["run", "method", "m", "solutions / prompt", "prompts", *[f"best@{k}" for k in ks], "pass@1",
            f"pass@{n_max}", "chain pass@all", "diversity (L1)", "within-chain L1", "E_w best", "Pareto frac.",
            "tokens / solution", "train steps", "train tokens"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in reports:
        agg, train = r["aggregate"], r.get("training") or {}
        cells = [r["label"], r["estimator"], r["m"], r["n"], r["num_prompts"],
                 *[_at(agg["best_at_k"], k) for k in ks], _at(agg["pass_at_k"], 1), _at(agg["pass_at_k"], n_max),
                 agg["chain_pass_at_k"][-1], agg["pairwise_l1_diversity"], agg["within_chain_diversity"],
                 agg["expected_best_weighted"], agg["pareto_fraction"], agg["tokens_per_solution"],
                 train.get("optimizer_steps"), train.get("generated_tokens")]
        rows.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    return rows


def provenance_table(reports: list[dict[str, Any]]) -> list[str]:
    """Where each row came from: eval.json, config, weights and their sha256, data, seeds, time."""
    rows = ["| run | eval.json | config | model | weights | sha256 | data | seed / prompt seed | max_new_tokens | "
            "timestamp |", "|" + "---|" * 10]
    for r in reports:
        weights = r.get("ckpt") or r.get("adapter") or "base"
        sha = (r.get("weights_sha256") or "-")[:12]
        cells = [r["label"], f"`{r['_path']}`", f"`{r['config']}`", r["model"], f"`{weights}`", sha,
                 f"`{r['data_file']}` ({r['split']})", f"{r['seed']} / {r['prompt_seed']}",
                 r["sampling"]["max_new_tokens"], r["timestamp"]]
        rows.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    return rows


def warnings_for(reports: list[dict[str, Any]]) -> list[str]:
    """Reasons the rows may not be comparable (different prompts, reward dimensions or budgets)."""
    out = []
    ids = [tuple(p["id"] for p in r["prompts"]) for r in reports]
    if len(set(ids)) > 1:
        out.append("the inputs were evaluated on different prompts (check --prompt_seed, --max_prompts, the data)")
    if len({tuple(r["dim_names"]) for r in reports}) > 1:
        out.append("the inputs use different reward dimensions")
    if len({r["n"] for r in reports}) > 1:
        out.append("the inputs have different solution budgets n; best@k beyond a run's n is left blank")
    if len({r["sampling"]["max_new_tokens"] for r in reports}) > 1:
        out.append("the inputs used different max_new_tokens")
    return out


def render(reports: list[dict[str, Any]], ks: list[int], title: str, plot_name: str) -> str:
    """The whole markdown report."""
    first = reports[0]
    lines = [f"# {title}", "",
             f"{first['num_prompts']} prompts from `{first['data_file']}`; reward dimensions "
             f"{', '.join(first['dim_names'])}. k counts individual solutions: a chain method's pool of n solutions is "
             "n / m chains of m answers. best@k: mean over prompts of the best mean reward among k solutions of the "
             "pool in random order; pass@k: unbiased estimator, a solution solves when every dimension is 1; "
             "diversity: mean pairwise L1 distance between reward vectors in a prompt's pool; E_w best: "
             "E over w ~ Dir(1) of max over the pool of w.r; Pareto frac.: non-dominated share of the pool. "
             "Train tokens: generated tokens over training (TensorBoard `train/rollout/tokens`).", ""]
    lines += [line for w in warnings_for(reports) for line in (f"> warning: {w}", "")]
    lines += [*metrics_table(reports, ks), "", f"![best@k]({plot_name})", "", "## Runs", "",
              *provenance_table(reports), ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Path:
    """Write the report and the plot; returns the report path."""
    reports = [read_eval(p) for p in args.evals]
    if args.labels:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(reports):
            raise ValueError(f"--labels has {len(labels)} names for {len(reports)} inputs")
        for report, label in zip(reports, labels):
            report["label"] = label
    ks = [int(k) for k in args.ks.split(",")] if args.ks else default_ks(min(r["n"] for r in reports))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = out.with_name(f"{out.stem}_best_at_k.png")
    curves = {f"{r['label']} ({r['estimator']}, m={r['m']})": r["aggregate"]["best_at_k"] for r in reports}
    plot_curves(curves, "best@k (mean reward of the best of k)", plot, "best@k, same solution budget")
    out.write_text(render(reports, ks, args.title, plot.name), encoding="utf-8")
    return out


def main(argv: list[str]) -> int:
    """Entry point of ``vpo compare``."""
    args = parse_args(build_parser(), argv)
    try:
        out = run(args)
    except (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError) as err:
        print(f"vpo compare: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} and {out.with_name(out.stem + '_best_at_k.png')}")
    return 0
