"""What a `vpo fit` run's training logs say, in a few lines: each scalar's mean over the first and last N steps.

Reads the TensorBoard event files of one or more run directories (``checkpoints/<run>/``) and prints a Markdown
table per run: for every ``train/`` scalar matching ``--tags`` (substrings; default: rewards, parse rates, reward
spread, KL, tokens and timings), its mean over the first ``--first`` and the last ``--last`` logged steps, and the
number of steps logged. Where a tag was logged twice for one step (a resumed run), the last value counts.

    python benchmarks/run_summary.py checkpoints/maze5-vpo-s0 checkpoints/maze5-grpo-s0 --first 3 --last 3
    python benchmarks/run_summary.py checkpoints/tooluse --tags reward/ frac_zero_std kl
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_TAGS = ("reward/", "parse_rate", "frac_zero_std_groups", "dynamic/frac_dropped", "kl", "rollout/tokens",
                "rollout/time_s", "train_time_s", "peak_rss_gb")


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the run's event files, as {tag: {step: value}} (later files and events win)."""
    from vpo_lightning.commands.runs import event_files
    from vpo_lightning.commands.runs import read_scalars as read

    if not event_files(run_dir):
        raise SystemExit(f"{run_dir}: no TensorBoard event files (events.out.tfevents.*); is it a `vpo fit` run dir?")
    return read(run_dir)


def summarise(scalars: dict[str, dict[int, float]], tags: tuple[str, ...], first: int,
              last: int) -> list[tuple[str, int, float, float]]:
    """(tag, steps logged, mean of the first ``first`` steps, mean of the last ``last``) for the matching tags."""
    rows = []
    for tag in sorted(scalars):
        if not tag.startswith("train/") or not any(t in tag for t in tags):
            continue
        values = [scalars[tag][s] for s in sorted(scalars[tag])]
        head, tail = values[:first], values[-last:]
        rows.append((tag, len(values), sum(head) / len(head), sum(tail) / len(tail)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (checkpoints/<run>)")
    p.add_argument("--first", type=int, default=5, help="steps averaged at the start (default: 5)")
    p.add_argument("--last", type=int, default=5, help="steps averaged at the end (default: 5)")
    p.add_argument("--tags", nargs="+", default=list(DEFAULT_TAGS), help="substrings of the tags to show")
    args = p.parse_args(argv)
    if args.first < 1 or args.last < 1:
        raise SystemExit("--first and --last must be >= 1")
    for run in args.runs:
        rows = summarise(read_scalars(run), tuple(args.tags), args.first, args.last)
        print(f"\n### {run}\n\n| scalar | steps | first {args.first} | last {args.last} |\n|---|---|---|---|")
        for tag, n, head, tail in rows:
            print(f"| {tag.removeprefix('train/')} | {n} | {head:.4g} | {tail:.4g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
