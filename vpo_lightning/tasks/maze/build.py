"""Build the maze splits: ``python -m vpo_lightning.tasks.maze.build [--out data/maze] [--train 2000 --val 100
--test 100]``.

Each split draws generator seeds from its own disjoint range (train from 0, val from 1_000_000, test from
2_000_000), so no maze is shared between splits. Records follow docs/ARCHITECTURE.md; ``ground_truth`` is the maze
(``Maze.to_dict()``) that the ``maze`` reward simulates routes on. See :mod:`vpo_lightning.tasks.maze`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.tasks import write_jsonl
from vpo_lightning.tasks.maze import generate_maze, make_record

SEED_OFFSETS = {"train": 0, "val": 1_000_000, "test": 2_000_000}


def build_split(split: str, count: int) -> list[dict[str, Any]]:
    """``count`` records of ``split``, from seeds ``SEED_OFFSETS[split] + i``."""
    return [make_record(generate_maze(SEED_OFFSETS[split] + i), split, i) for i in range(count)]


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/maze"), help="output directory")
    parser.add_argument("--train", type=int, default=2000, help="number of training mazes")
    parser.add_argument("--val", type=int, default=100, help="number of validation mazes")
    parser.add_argument("--test", type=int, default=100, help="number of test mazes")
    args = parser.parse_args(argv)
    for split in ("train", "val", "test"):
        records = build_split(split, getattr(args, split))
        write_jsonl(records, args.out / f"{split}.jsonl", separators=(",", ":"))
        print(f"{args.out / f'{split}.jsonl'}: {len(records)} mazes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
