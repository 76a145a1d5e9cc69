"""Evaluate a maze RL run's checkpoints on validation and seen-training mazes (issue 50: the step-size rule and the
diagnosis of why RL ended below its cold start). Not part of CI; built from `vpo eval` and committed small files.

    python benchmarks/maze_checkpoints.py --run checkpoints/maze5-vpo-s0 --config configs/maze5.yaml \\
        --coldstart docs/results/maze-settled/coldstart/adapter --steps 0 20 40 60 80 100 \\
        --out docs/results/maze-settled/checkpoints/vpo-lr1e-4-s0.json [--diagnose]

For every step (0 = the cold start, evaluated in the run's format) it runs `vpo eval` on the **selection set**:
``--val_prompts`` validation mazes (the seeded sample ``--prompt_seed``), ``--n`` answers each, at temperature 0.7.
With ``--diagnose`` it also evaluates, on ``--diag_prompts`` mazes: the validation sample at temperature 1.0 (the
training temperature) and at 0.7, and the first training mazes the run itself was given (its first steps, from its data
order: seen by RL) at 0.7 and 1.0. Each evaluation lands under ``--work`` and is reused when its eval.json exists
(the sweep resumes); the summary (one row per step, set and temperature, plus the run's KL around each step) is
written to ``--out``: best@1 / best@k over answers, best@c over whole chains (each chain's best f; a single-answer
method's "chain" is ``CHAIN`` consecutive samples), one chain's E_w[max w.r] (VPO's own objective), the exit rate
per answer, the pool's diversity and E_w best.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from maze_report import CHAIN, chain_metrics, curves

ROOT = Path(__file__).resolve().parent.parent


def chain_best_at(values: Sequence[float], c: int) -> float:
    """E[max of c values drawn without replacement from ``values``] (the unbiased best@c over whole chains)."""
    v, n = sorted(values), len(values)
    if not 1 <= c <= n:
        return math.nan
    return sum(v[i] * math.comb(i, c - 1) for i in range(c - 1, n)) / math.comb(n, c)


def summarise(report: dict[str, Any], weights: Any) -> dict[str, float]:
    """One evaluation's metrics, means over its prompts (see the module docstring)."""
    dims = list(report["dim_names"])
    ex = dims.index("exit")
    agg = report["aggregate"]
    n = int(report["n"])
    out: dict[str, float] = {"best@1": agg["best_at_k"][0], f"best@{n}": agg["best_at_k"][n - 1],
                             "diversity": agg["pairwise_l1_diversity"], "ew_best_pool": agg["expected_best_weighted"]}
    chains = n // CHAIN
    per_chain_c = {c: [] for c in (1, 2, 4, chains) if c <= chains}
    one_chain, exits = [], []
    for p in report["prompts"]:
        rows = p["rewards"]
        exits.append(sum(r[ex] >= 1 for r in rows) / len(rows))
        one_chain.append(chain_metrics(p, weights)["chain_ew_max"])
        best_f = [max(sum(r) / len(r) for r in rows[i * CHAIN:(i + 1) * CHAIN]) for i in range(chains)]
        for c in per_chain_c:
            per_chain_c[c].append(chain_best_at(best_f, c))
    out["exit_rate"] = sum(exits) / len(exits)
    out["chain_ew_max"] = sum(one_chain) / len(one_chain)
    for c, vals in per_chain_c.items():
        out[f"chain_best@{c}"] = sum(vals) / len(vals)
    return out


def seen_training_mazes(config: Path, seed: int, count: int, out: Path) -> Path:
    """The first ``count`` training mazes of a run's data order (``data.seed`` = ``seed``), written as JSONL."""
    import yaml

    from vpo_lightning.training.datamodule import PromptStream
    from vpo_lightning.training.records import read_records

    cfg = yaml.safe_load(config.read_text())
    records = [r for f in cfg["data"]["train_files"] for r in read_records(str(ROOT / f))]
    stream = PromptStream(records, int(cfg["data"]["batch_size"]), seed)
    chosen: list[dict[str, Any]] = []
    for batch in stream:
        chosen += batch["records"]
        if len(chosen) >= count:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in chosen[:count]), encoding="utf-8")
    return out


def evaluate(args: argparse.Namespace, step: int, name: str, data: list[str], prompts: int, temperature: float,
             seed: int) -> dict[str, Any]:
    """Run (or reuse) one `vpo eval` of the run's step-``step`` adapter and return its report."""
    out = args.work / f"step={step}-{name}-T{temperature}"
    if not (out / "eval.json").exists():
        source = (["--config", str(args.config), "--set", f"model.model.adapter={args.coldstart}"] if step == 0 else
                  ["--config", str(args.config), "--adapter", str(args.run / "adapters" / f"step={step}")])
        cmd = [sys.executable, "-m", "vpo_lightning", "eval", *source, *data, "--n", str(args.n),
               "--max_prompts", str(prompts), "--seed", str(seed), "--prompt_seed", str(args.prompt_seed),
               "--set", f"eval.temperature={temperature}",
               "--set", f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
               "--label", f"{args.run.name}-step{step}-{name}-T{temperature}", "--out", str(out), "--overwrite",
               *shlex.split(args.extra_eval)]
        print("===", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env=os.environ.copy())
    return json.loads((out / "eval.json").read_text(encoding="utf-8"))


def kl_near(kl: dict[str, float], step: int, window: int = 10) -> float:
    """Mean of the run's logged KL over the ``window`` steps up to ``step``; NaN at step 0 or when not logged."""
    vals = [v for s, v in kl.items() if step - window < int(s) <= step]
    return sum(vals) / len(vals) if vals else math.nan


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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--choose", type=Path, default=None,
                   help="a folder of sweeps: print the rule's `<method> <lr> <step>` for each method, and exit")
    p.add_argument("--run", type=Path, help="the run folder (checkpoints/<run_name>)")
    p.add_argument("--config", type=Path, help="the run's method config (its format and rewards)")
    p.add_argument("--coldstart", type=Path, help="the cold-start adapter (step 0)")
    p.add_argument("--steps", type=int, nargs="+", default=[0, 20, 40, 60, 80, 100])
    p.add_argument("--seed", type=int, default=0, help="the run's seed (its data order for the seen mazes)")
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--val_prompts", type=int, default=50)
    p.add_argument("--diag_prompts", type=int, default=16)
    p.add_argument("--prompt_seed", type=int, default=0)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--diagnose", action="store_true", help="also T = 1.0 and the seen training mazes")
    p.add_argument("--extra_eval", default="", help="more `vpo eval` arguments (one string)")
    p.add_argument("--work", type=Path, default=None, help="where the evaluations go [checkpoints/<run>-ckpt-eval]")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.choose is not None:
        for method, by_lr in load_sweeps(args.choose).items():
            lr, step, score = choose(by_lr)
            print(f"{method} {lr:g} {step} {score:.4f}")
        return 0
    if not (args.run and args.config and args.coldstart and args.out):
        p.error("--run, --config, --coldstart and --out are required (or --choose)")
    args.work = args.work or args.run.parent / f"{args.run.name}-ckpt-eval"
    import torch

    from vpo_lightning.core.advantages import sample_weights

    weights = sample_weights(1000, 4, 1.0, generator=torch.Generator().manual_seed(0))  # [K, D], fixed for all
    sets = [("val", ["--split", "val"], args.val_prompts, 0.7)]
    if args.diagnose:
        seen = seen_training_mazes(args.config, args.seed, args.diag_prompts, args.work / "seen_train.jsonl")
        sets += [(name, data, args.diag_prompts, t) for name, data in (("val16", ["--split", "val"]),
                                                                        ("seen", ["--data_file", str(seen)]))
                 for t in (0.7, 1.0)]
    kl = curves(args.run).get("train/kl", {}) if args.run.exists() else {}
    rows = []
    for step in args.steps:
        for name, data, prompts, temperature in sets:
            report = evaluate(args, step, name, data, prompts, temperature, args.seed)
            rows.append({"step": step, "set": name, "prompts": report["num_prompts"], "temperature": temperature,
                         "kl": kl_near(kl, step), **summarise(report, weights)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"run": args.run.name, "config": str(args.config), "seed": args.seed,
                                    "coldstart": str(args.coldstart), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
