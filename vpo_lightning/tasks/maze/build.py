"""Build the maze splits: ``python -m vpo_lightning.tasks.maze.build [--out data/maze] [--size 9] [--rules sparse]
[--seed_offset 0] [--train 2000 --val 100 --test 100]``.

Each split draws generator seeds from its own disjoint range (train from ``seed_offset``, val from
``seed_offset + 1_000_000``, test from ``seed_offset + 2_000_000``), so no maze is shared between splits. The
paper's 9x9 sparse splits in ``data/maze/`` use offset 0; other settings use their own offsets (a multiple of
10_000_000, see ``SETTINGS``) so their seeds are disjoint from every other split's as well. Every maze is checked
with :func:`~vpo_lightning.tasks.maze.check_maze` before it is written. Records follow docs/ARCHITECTURE.md;
``ground_truth`` is the maze (``Maze.to_dict()``, with its ``rules``) that the ``maze`` reward simulates routes on.
See :mod:`vpo_lightning.tasks.maze`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.tasks import write_jsonl
from vpo_lightning.tasks.maze import RULES, SIZE, SIZES, check_maze, generate_maze, make_record

SEED_OFFSETS = {"train": 0, "val": 1_000_000, "test": 2_000_000}
# The shipped settings: (size, rules) -> (output folder, seed offset). Seed ranges never overlap across them.
SETTINGS: dict[tuple[int, str], tuple[str, int]] = {
    (9, "sparse"): ("data/maze", 0),
    (5, "shaped"): ("data/maze/5x5_shaped", 10_000_000),
    (7, "shaped"): ("data/maze/7x7_shaped", 20_000_000),
    (5, "sparse"): ("data/maze/5x5", 30_000_000),  # the reference's reward on the small grid (docs/FIDELITY.md)
}


def build_split(split: str, count: int, size: int = SIZE, rules: str = "sparse",
                seed_offset: int = 0) -> list[dict[str, Any]]:
    """``count`` records of ``split``, from seeds ``seed_offset + SEED_OFFSETS[split] + i``.

    Raises:
        ValueError: a generated maze breaks a guarantee (a generator bug; the message names the seed).
    """
    records = []
    for i in range(count):
        maze = generate_maze(seed_offset + SEED_OFFSETS[split] + i, size, rules=rules)
        problems = check_maze(maze)
        if problems:
            raise ValueError(f"maze seed {maze.seed} (size {size}) breaks its guarantees: {'; '.join(problems)}")
        records.append(make_record(maze, split, i))
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: the folder of the setting in SETTINGS, else data/maze)")
    parser.add_argument("--size", type=int, choices=SIZES, default=SIZE, help="grid side (default: 9, the paper's)")
    parser.add_argument("--rules", choices=RULES, default="sparse", help="reward mode (default: sparse, the paper's)")
    parser.add_argument("--seed_offset", type=int, default=None,
                        help="added to every seed (default: the setting's offset in SETTINGS, else 0)")
    parser.add_argument("--train", type=int, default=2000, help="number of training mazes")
    parser.add_argument("--val", type=int, default=100, help="number of validation mazes")
    parser.add_argument("--test", type=int, default=100, help="number of test mazes")
    args = parser.parse_args(argv)
    folder, offset = SETTINGS.get((args.size, args.rules), ("data/maze", 0))
    out = args.out if args.out is not None else Path(folder)
    offset = args.seed_offset if args.seed_offset is not None else offset
    if offset < 0:
        parser.error(f"--seed_offset must be >= 0, got {offset}")
    for split in ("train", "val", "test"):
        records = build_split(split, getattr(args, split), args.size, args.rules, offset)
        write_jsonl(records, out / f"{split}.jsonl", separators=(",", ":"))
        print(f"{out / f'{split}.jsonl'}: {len(records)} mazes ({args.size}x{args.size}, {args.rules})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
