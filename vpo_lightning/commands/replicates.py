"""``vpo replicates``: compare methods over training seeds, with 95% bootstrap intervals over prompts and seeds.

    vpo replicates --group "VPO=ev/vpo-s0,ev/vpo-s1,ev/vpo-s2" \\
        --group "GRPO=ev/grpo-s0,ev/grpo-s1,ev/grpo-s2" --group "SFT=ev/sft-s0,ev/sft-s1" --out docs/results_maze.md

``vpo compare`` puts single ``eval.json`` files side by side; this groups the ``eval.json`` files of one method (one
per training seed, or per evaluation seed for an untrained policy) and reports, for each per-prompt metric of
``vpo eval`` (best@k, pass@k, reward-space diversity, E_w best, Pareto fraction), the mean over seeds and prompts
with a hierarchical percentile bootstrap interval: each draw resamples the seeds with replacement and, jointly for
all of them, the prompts with replacement (every run of a group must be evaluated on the same prompts), then takes
the mean. Writes a markdown table and a best@k plot with the intervals as bands (``<out stem>_best_at_k.png``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

CURVES = ("best_at_k", "pass_at_k")
SCALARS = ("pairwise_l1_diversity", "within_chain_diversity", "expected_best_weighted", "pareto_fraction")


def prompt_values(reports: Sequence[dict[str, Any]], key: str, k: int | None = None) -> Tensor:
    """``[S, P]``: one per-prompt metric of each report (a curve's value at ``k`` for best@k / pass@k), aligned on
    the prompt ids of the first report; NaN where the metric is undefined (None) or k exceeds the pool.

    Raises:
        ValueError: the reports were evaluated on different prompts.
    """
    ids = [p["id"] for p in reports[0]["prompts"]]
    rows = []
    for r in reports:
        by_id = {p["id"]: p for p in r["prompts"]}
        if sorted(by_id) != sorted(ids):
            raise ValueError(f"{r.get('_path', r.get('label'))}: evaluated on other prompts than "
                             f"{reports[0].get('_path', reports[0].get('label'))} (use the same --prompt_seed, "
                             "--max_prompts and data)")
        row = []
        for pid in ids:
            value = by_id[pid].get(key)
            if k is not None:
                value = value[k - 1] if value is not None and 1 <= k <= len(value) else None
            row.append(math.nan if value is None else float(value))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)  # [S, P]


def bootstrap_interval(values: Tensor, num_draws: int = 2000, level: float = 0.95,
                       seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values [S, P]`` (seeds x prompts, NaN ignored) and its percentile bootstrap interval: each draw
    takes S seeds and P prompts with replacement (prompts shared by the drawn seeds) and averages them.

    Returns:
        ``(mean, low, high)``; NaNs when every value is NaN.
    """
    if values.dim() != 2 or values.numel() == 0:
        raise ValueError(f"values must be a non-empty [seeds, prompts] matrix, got shape {tuple(values.shape)}")
    S, P = values.shape
    mean = float(values.nanmean())
    if math.isnan(mean):
        return mean, mean, mean
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(S, (num_draws, S), generator=g)  # [B, S]
    prompts = torch.randint(P, (num_draws, P), generator=g)  # [B, P]
    draws = values[seeds[:, :, None], prompts[:, None, :]]  # [B, S, P]
    stats = draws.reshape(num_draws, -1).nanmean(dim=1)  # [B]; NaN when a draw holds only NaNs
    stats = stats[~stats.isnan()]
    tail = (1.0 - level) / 2
    low, high = torch.quantile(stats, torch.tensor([tail, 1.0 - tail], dtype=stats.dtype)).tolist()
    return mean, low, high


def paired_difference(a: Tensor, b: Tensor, num_draws: int = 2000, level: float = 0.95,
                      seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a [Sa, P]`` minus mean of ``b [Sb, P]`` (NaN ignored), where column j of both is the same prompt,
    and its paired percentile bootstrap interval: each draw takes P prompts with replacement, shared by both sides
    (the pairing: a hard prompt is hard for both), and Sa and Sb seeds with replacement, each side its own.

    Returns:
        ``(difference, low, high)``; NaNs when either side is all NaN.

    Raises:
        ValueError: ``a`` and ``b`` are not non-empty matrices over the same number of prompts.
    """
    if a.dim() != 2 or b.dim() != 2 or not a.numel() or not b.numel() or a.shape[1] != b.shape[1]:
        raise ValueError(f"a and b must be non-empty [seeds, prompts] matrices over the same prompts, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    diff = float(a.nanmean() - b.nanmean())
    if math.isnan(diff):
        return diff, diff, diff
    (sa, p), sb = a.shape, b.shape[0]
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(p, (num_draws, p), generator=g)  # [N, P], shared by both sides
    seeds_a = torch.randint(sa, (num_draws, sa), generator=g)  # [N, Sa]
    seeds_b = torch.randint(sb, (num_draws, sb), generator=g)  # [N, Sb]
    draw_a = a[seeds_a[:, :, None], prompts[:, None, :]].reshape(num_draws, -1).nanmean(dim=1)  # [N]
    draw_b = b[seeds_b[:, :, None], prompts[:, None, :]].reshape(num_draws, -1).nanmean(dim=1)  # [N]
    stats = draw_a - draw_b
    stats = stats[~stats.isnan()]
    tail = (1.0 - level) / 2
    low, high = torch.quantile(stats, torch.tensor([tail, 1.0 - tail], dtype=stats.dtype)).tolist()
    return diff, low, high


def _cell(interval: tuple[float, float, float]) -> str:
    mean, low, high = interval
    return "-" if math.isnan(mean) else f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def summary_table(groups: dict[str, list[dict[str, Any]]], ks: Sequence[int], num_draws: int = 2000) -> list[str]:
    """Markdown rows: one per group, each metric as ``mean [low, high]``."""
    n = min(r["n"] for rs in groups.values() for r in rs)
    head = ["method", "estimator", "m", "seeds", "prompts", *[f"best@{k}" for k in ks], "pass@1", f"pass@{n}",
            "diversity (L1)", "within-chain L1", "E_w best", "Pareto frac.", "train tokens (mean)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, reports in groups.items():
        cells = [label, reports[0]["estimator"], str(reports[0]["m"]), str(len(reports)),
                 str(reports[0]["num_prompts"])]
        for key, k in [*[("best_at_k", k) for k in ks], ("pass_at_k", 1), ("pass_at_k", n)]:
            cells.append(_cell(bootstrap_interval(prompt_values(reports, key, k), num_draws)))
        for key in SCALARS:
            cells.append(_cell(bootstrap_interval(prompt_values(reports, key), num_draws)))
        tokens = [(r.get("training") or {}).get("generated_tokens") for r in reports]
        tokens = [t for t in tokens if t is not None]
        cells.append(f"{sum(tokens) / len(tokens):.0f}" if tokens else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def best_at_k_bands(groups: dict[str, list[dict[str, Any]]], num_draws: int = 2000) -> dict[str, list[tuple]]:
    """Per group, ``(mean, low, high)`` of best@k for k = 1..n."""
    out = {}
    for label, reports in groups.items():
        n = min(r["n"] for r in reports)
        out[label] = [bootstrap_interval(prompt_values(reports, "best_at_k", k), num_draws) for k in range(1, n + 1)]
    return out


def plot_bands(bands: dict[str, list[tuple]], path: Path, title: str) -> None:
    """best@k curves with their 95% intervals as shaded bands (matplotlib, Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label, rows in bands.items():
        ks = list(range(1, len(rows) + 1))
        mean, low, high = zip(*rows)
        (line,) = ax.plot(ks, mean, "-o", ms=3, label=label)
        ax.fill_between(ks, low, high, color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel("k (solutions)")
    ax.set_ylabel("best@k (95% bootstrap interval)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_group(text: str) -> tuple[str, list[str]]:
    """``"LABEL=path1,path2"`` -> ``("LABEL", [path1, path2])``."""
    label, sep, paths = text.partition("=")
    if not sep or not label.strip() or not paths.strip():
        raise ValueError(f"--group {text!r}: write LABEL=eval1,eval2,... (eval.json files or their directories)")
    return label.strip(), [p.strip() for p in paths.split(",") if p.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    from vpo_lightning.commands.compare import default_ks, read_eval

    p = argparse.ArgumentParser(prog="vpo replicates", description="Compare methods over several training seeds, "
                                "with 95% bootstrap intervals over prompts and seeds.")
    p.add_argument("--group", action="append", required=True, help="LABEL=eval1,eval2,... (repeatable)")
    p.add_argument("--out", required=True, help="markdown file to write; the plot goes beside it")
    p.add_argument("--ks", help="comma-separated k for the best@k columns (default: 1, 2, 4, ... and n)")
    p.add_argument("--draws", type=int, default=2000, help="bootstrap draws (default: 2000)")
    p.add_argument("--title", default="best@k over seeds, 95% bootstrap intervals over prompts and seeds")
    from vpo_lightning.app import parse_args

    args = parse_args(p, argv)  # the one flag style: --title and --ks as every command takes them
    try:
        groups = {}
        for text in args.group:
            label, paths = parse_group(text)
            groups[label] = [read_eval(path) for path in paths]
        first = next(iter(groups.values()))
        for reports in groups.values():  # every group on the same prompts, or the comparison means nothing
            prompt_values([first[0], reports[0]], "best_at_k", 1)
        n = min(r["n"] for rs in groups.values() for r in rs)
        ks = [int(k) for k in args.ks.split(",")] if args.ks else default_ks(n)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        plot = out.with_name(f"{out.stem}_best_at_k.png")
        plot_bands(best_at_k_bands(groups, args.draws), plot, args.title)
        lines = [f"# {args.title}", "", f"{first[0]['num_prompts']} prompts from `{first[0]['data_file']}`, n = {n} "
                 "solutions per prompt for every method (chain methods: n / m chains). Each cell: mean over seeds and "
                 f"prompts [95% hierarchical bootstrap interval, {args.draws} draws].", "",
                 *summary_table(groups, ks, args.draws), "", f"![best@k]({plot.name})", ""]
        out.write_text("\n".join(lines), encoding="utf-8")
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"replicates: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
