"""Does a policy give RL a gradient? Parse rate, reward dimensions and reward spread of `vpo eval` samples.

Reads one or more ``vpo eval`` output directories (``samples.jsonl`` + ``eval.json``) and prints, per directory:
the fraction of answers (single answers) or chains (chain methods: all m answers present) that parse, each reward
dimension's mean and fraction of non-zero values over all answers (unparsed answers score 0, as in training), and
the fraction of training groups that would have a non-zero advantage: each prompt's pool of n/m chains (or n
answers) is cut, in sampling order, into groups of G, and a group has signal when the estimator it would train with
(``grpo`` for single answers, ``vpo`` for chains; ``--estimator`` overrides) gives some member a non-zero
advantage (the same test as dynamic sampling, :func:`vpo_lightning.core.dynamic_sampling.groups_with_signal`).

    python benchmarks/group_spread.py checkpoints/maze-eval/sft-single checkpoints/maze-eval/sft-chain --group 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vpo_lightning.commands.evaluate import chain_tensors, read_samples
from vpo_lightning.core.dynamic_sampling import groups_with_signal
from vpo_lightning.core.estimators import ESTIMATORS


def summarise(out: Path, group: int, estimator: str | None, seed: int = 0) -> dict:
    report = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    pools = read_samples(out)
    m, dim = int(report["m"]), len(report["dim_names"])
    name = estimator or ("vpo" if m > 1 else "grpo")
    rows, present, chain_ok, signal, groups = [], 0, 0, 0, 0
    gen = torch.Generator().manual_seed(seed)
    for pool in pools.values():
        rewards, mask = chain_tensors(pool, dim)  # [C, m, D], [C, m]
        rows.append(rewards.reshape(-1, dim))
        present += int(mask.sum())
        chain_ok += int(mask.all(dim=1).sum())
        for g0 in range(0, len(pool) - group + 1, group):
            adv = ESTIMATORS[name](rewards[None, g0:g0 + group], mask[None, g0:g0 + group], generator=gen)  # [1, G]
            signal += int(groups_with_signal(adv).sum())
            groups += 1
    allr = torch.cat(rows)  # [answers, D]
    n_chains = sum(len(p) for p in pools.values())
    return {
        "dir": str(out), "label": report.get("label"), "prompts": len(pools), "chains": n_chains, "m": m,
        "answers_parsed": present / allr.shape[0], "chains_all_parsed": chain_ok / n_chains,
        "dim_mean": allr.mean(0).tolist(), "dim_nonzero": (allr > 0).float().mean(0).tolist(),
        "estimator": name, "group_size": group, "groups": groups,
        "groups_with_spread": signal / groups if groups else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="vpo eval output directories")
    ap.add_argument("--group", type=int, default=8, help="G, chains per training group (default 8)")
    ap.add_argument("--estimator", default=None, help="advantage estimator (default: grpo if m = 1, else vpo)")
    ap.add_argument("--json", type=Path, default=None, help="also write the summaries here")
    args = ap.parse_args(argv)
    results = [summarise(d, args.group, args.estimator) for d in args.dirs]
    for r in results:
        dims = " ".join(f"{a:.3f}/{b:.2f}" for a, b in zip(r["dim_mean"], r["dim_nonzero"]))
        print(f"{r['label'] or r['dir']}: {r['prompts']} prompts x {r['chains']//r['prompts']} chains (m={r['m']}); "
              f"answers parsed {r['answers_parsed']:.3f}, chains fully parsed {r['chains_all_parsed']:.3f}; "
              f"per-dim mean/nonzero {dims}; groups (G={r['group_size']}, {r['estimator']}) with spread "
              f"{r['groups_with_spread']:.3f} of {r['groups']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
