"""Build the LiveCodeBench splits: ``python -m vpo_lightning.tasks.livecodebench.build [--source DIR] [--out ...]``.

Source: the public ``code_generation_lite`` release, the JSONL files ``test.jsonl``, ``test2.jsonl`` ..
``test6.jsonl`` of ``livecodebench/code_generation_lite`` (release v6: every problem up to 2025-05), from a local
directory or file (``--source``, default ``data/livecodebench/raw``; every ``*.jsonl`` in it is read, a problem
appearing twice is kept once) or, when the optional ``datasets`` package is importable and the hub reachable, the
hub (``version_tag=release_v6``). Offline without a local copy the builder stops at once, naming the files.

Date split of VPO-SPEC section 8: train = contest date before 2025-02-01; test = 2025-02-01 up to (not including)
2025-05-01; later problems are left out. Each record keeps the 16 smallest of its public + private tests (see
:mod:`vpo_lightning.tasks.livecodebench`). ``--val N`` moves a seeded N training problems to ``val.jsonl``
(default 0). ``--verify`` is not offered: the public release has no reference solutions.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from vpo_lightning.tasks.livecodebench import make_record, problem_date
from vpo_lightning.tasks.public_data import (
    DataUnavailable,
    from_hub,
    missing_data_message,
    read_records,
    split_parser,
    write_splits,
)

TRAIN_BEFORE = datetime(2025, 2, 1)
TEST_BEFORE = datetime(2025, 5, 1)
HUB_ID = "livecodebench/code_generation_lite"
FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")
URL = "https://huggingface.co/datasets/livecodebench/code_generation_lite"
DEFAULT_RAW = Path("data/livecodebench/raw")


def load_public(source: Path | None) -> list[dict[str, Any]]:
    """Every public problem from ``source`` (or ``data/livecodebench/raw``), else the hub; duplicates dropped.

    Raises:
        DataUnavailable: no local copy and no hub (the message names the files and where to put them).
    """
    local = source if source is not None else DEFAULT_RAW
    paths = [local] if local.is_file() else sorted(local.rglob("*.jsonl")) if local.is_dir() else []
    if paths:
        problems = [r for p in paths for r in read_records(p)]
    elif source is not None:
        raise DataUnavailable(missing_data_message("livecodebench", FILES, URL, source,
                                                   f"{source} holds no .jsonl file"))
    else:
        def load() -> list[dict[str, Any]]:
            import datasets

            ds = datasets.load_dataset(HUB_ID, split="test", version_tag="release_v6", trust_remote_code=True)
            return [dict(r) for r in ds]

        problems = from_hub(load, "livecodebench", FILES, URL, DEFAULT_RAW)
    seen: set[str] = set()
    unique = []
    for p in problems:
        key = str(p.get("question_id"))
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def build_splits(problems: Sequence[dict[str, Any]], *, val: int = 0, seed: int = 0) -> dict[str, list[dict]]:
    """Date-split records (see the module docstring), in source order within a split."""
    train = [p for p in problems if problem_date(p) < TRAIN_BEFORE]
    test = [p for p in problems if TRAIN_BEFORE <= problem_date(p) < TEST_BEFORE]
    if not 0 <= val < max(1, len(train)):
        raise ValueError(f"--val {val}: must be between 0 and {len(train) - 1} (the training problems)")
    held = set(random.Random(seed).sample(range(len(train)), val))
    return {"train": [make_record(p, "train") for i, p in enumerate(train) if i not in held],
            "val": [make_record(p, "val") for i, p in enumerate(train) if i in held],
            "test": [make_record(p, "test") for p in test]}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    parser = split_parser(__doc__, "livecodebench", "the public JSONL files")
    parser.add_argument("--val", type=int, default=0, help="training problems moved to val.jsonl (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the val sample")
    args = parser.parse_args(argv)
    return write_splits(lambda: build_splits(load_public(args.source), val=args.val, seed=args.seed), args.out,
                        lambda records: f"{len(records)} problems, {sum(r['meta']['num_tests'] for r in records)} "
                                        "tests")


if __name__ == "__main__":
    sys.exit(main())
