"""Drawing a maze and routes on it as a PNG (matplotlib), and ``python -m vpo_lightning.tasks.maze``, its command.

    python -m vpo_lightning.tasks.maze --data data/maze/test.jsonl --samples EVAL/samples.jsonl --chains 0 --out m.png
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.core.chains import parse_chain
from vpo_lightning.tasks.maze import MOVES, WALL, Maze, parse_moves, simulate

_COLORS = {"wall": (0.2, 0.2, 0.25), "floor": (1.0, 1.0, 1.0), "lava": (0.93, 0.35, 0.15),
           "gold": (1.0, 0.84, 0.2), "diamond": (0.55, 0.85, 1.0), "start": (0.45, 0.8, 0.45),
           "exit": (0.35, 0.45, 0.95)}
_ROUTE_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _image(maze: Maze) -> list[list[tuple[float, float, float]]]:
    kinds = {maze.start: "start", maze.exit: "exit"}
    kinds.update(dict.fromkeys(maze.gold, "gold"))
    kinds.update(dict.fromkeys(maze.diamond, "diamond"))
    kinds.update(dict.fromkeys(maze.lava, "lava"))
    return [[_COLORS["wall" if ch == WALL else kinds.get((r, c), "floor")] for c, ch in enumerate(row)]
            for r, row in enumerate(maze.grid)]


def draw_maze(maze: Maze | Mapping[str, Any], routes: Sequence[str | Sequence[str]], path_png: str,
              *, labels: Sequence[str] | None = None, title: str | None = None) -> None:
    """Draw a maze and routes on it into a PNG (matplotlib, Agg canvas; no global backend change).

    Args:
        maze: a :class:`Maze` or its ``to_dict()`` form (a record's ``ground_truth``).
        routes: route answers (text, parsed with :func:`parse_moves`) or move lists; each is drawn up to where it
            ends (exit, budget or invalid move), slightly offset so overlapping routes stay visible.
        path_png: output file.
        labels: legend label per route (default: ``route i`` and its reward vector).
        title: figure title (default: the seed and budget).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    maze = maze if isinstance(maze, Maze) else Maze.from_dict(maze)
    n = len(maze.grid)
    fig = Figure(figsize=(6.0, 6.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(_image(maze), interpolation="nearest")
    for cell, mark in ((maze.start, "S"), (maze.exit, "E")):
        ax.text(cell[1], cell[0], mark, ha="center", va="center", fontsize=14, weight="bold", color="white")
    for i, route in enumerate(routes):
        moves = parse_moves(route) if isinstance(route, str) else [m for m in route if m in MOVES]
        result = simulate(maze, moves)
        off = (i - (len(routes) - 1) / 2) * 0.1
        xs, ys = [c + off for _, c in result.path], [r + off for r, _ in result.path]
        reward = ", ".join(f"{v:.2f}" for v in result.reward)
        label = labels[i] if labels else f"route {i + 1}: [{reward}]" + ("" if result.valid else " invalid")
        color = _ROUTE_COLORS[i % len(_ROUTE_COLORS)]
        ax.plot(xs, ys, "-o", color=color, lw=2.2, ms=3, alpha=0.85, label=label)
        ax.plot(xs[-1:], ys[-1:], "X" if not result.reached_exit else "s", color=color, ms=9)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_title(title or f"maze seed {maze.seed}, budget {maze.budget} moves ([exit, gold, diamond, safety])",
                 fontsize=9)
    if routes:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), fontsize=8, ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)


def chain_routes(text: str, m: int) -> list[str]:
    """The routes of one completion: its ``<route_1>``..``<route_m>`` blocks when it has any (missing blocks are
    dropped), else the whole text as one single-answer route."""
    if re.search(r"<route_\d+>", text, re.IGNORECASE):
        return [r for r in parse_chain(text, m, "route") if r is not None]
    return [text]


def draw_main(argv: Sequence[str] | None = None) -> int:
    """``python -m vpo_lightning.tasks.maze --data FILE --id ID --samples samples.jsonl --chains 0 --out maze.png``:
    draw one maze with the routes of some completions of a ``vpo eval`` run (a chain's m routes, or k single
    answers: ``--chains 0 1 2 3``), or with routes given on the command line (``--route "R R D" --route ...``)."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m vpo_lightning.tasks.maze",
                                description="Draw one maze with routes in different colours into a PNG.")
    p.add_argument("--data", required=True, help="maze JSONL (a data split or the file `vpo eval` read)")
    p.add_argument("--id", default=None, help="record id (default: the first record of --data)")
    p.add_argument("--samples", default=None, help="samples.jsonl written by `vpo eval`")
    p.add_argument("--chains", type=int, nargs="+", default=[0], help="chain indices in --samples (default: 0)")
    p.add_argument("--m", type=int, default=3, help="routes per chain for chain methods (default: 3)")
    p.add_argument("--route", action="append", default=[], help="a route text, repeatable")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--out", required=True, help="output PNG")
    args = p.parse_args(argv)

    def fail(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    try:
        lines = Path(args.data).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        return fail(f"--data {args.data}: {err}")
    records = [json.loads(line) for line in lines if line.strip()]
    record = next((r for r in records if args.id in (None, r.get("id"))), None)
    if record is None:
        return fail(f"--data {args.data} has no record with id {args.id!r}")
    routes, labels = list(args.route), [f"route {i + 1}" for i in range(len(args.route))]
    if args.samples:
        try:
            rows = [json.loads(line) for line in Path(args.samples).read_text(encoding="utf-8").splitlines() if line]
        except (OSError, json.JSONDecodeError) as err:
            return fail(f"--samples {args.samples}: {err}")
        by_chain = {row["chain"]: row["text"] for row in rows if row.get("id") == record.get("id")}
        missing = [c for c in args.chains if c not in by_chain]
        if missing:
            return fail(f"--samples {args.samples} has no chain {missing[0]} for id {record.get('id')!r} "
                        f"(it has {len(by_chain)} chains for it)")
        for c in args.chains:
            found = chain_routes(by_chain[c], args.m)
            routes += found
            labels += [f"chain {c}" + (f" route {j + 1}" if len(found) > 1 else "") for j in range(len(found))]
    maze = Maze.from_dict(record["ground_truth"])
    labels = [f"{lab}: [{', '.join(f'{v:.2f}' for v in simulate(maze, parse_moves(r)).reward)}]"
              for lab, r in zip(labels, routes)]
    draw_maze(maze, routes, args.out, labels=labels, title=args.title)
    print(f"wrote {args.out} ({len(routes)} routes on {record.get('id')})")
    return 0
