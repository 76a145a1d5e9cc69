"""Evaluate a maze RL run's checkpoints on validation and seen-training mazes (issue 50: the step-size rule and the
diagnosis of why RL ended below its cold start). Not part of CI; built from `vpo eval` and committed small files.
The rule that chooses a checkpoint and the report's rows of the sweeps are in maze_report.py (``choose``,
``selection_rows``, ``diagnosis_rows``), which reads the sweeps this script writes.

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
from maze_report import CHAIN, chain_best_at, chain_metrics, choose, curves, load_sweeps

ROOT = Path(__file__).resolve().parent.parent


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
