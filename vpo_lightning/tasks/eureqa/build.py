"""Build the EUREQA splits: ``python -m vpo_lightning.tasks.eureqa.build [--source DIR] [--out data/eureqa]``.

Source: the public EUREQA 5-entity question sets ``questions_normal_5`` (428 questions) and ``questions_hard_5``
(1,363), from a local directory (``--source``, default ``data/eureqa/raw``) holding a file per set whose name starts
with the set name (``questions_normal_5.jsonl``, ``.json`` or ``.parquet``, as exported from the hub), or, when the
optional ``datasets`` package is importable and the hub reachable, ``vincentleebang/EUREQA`` on the Hugging Face
hub. Offline without a local copy the builder stops at once, naming the files to download.

Mixed split of VPO-SPEC section 8 (seed 0): the hard set is permuted with ``numpy.random.default_rng(seed)
.permutation(n)`` (the permutation ``datasets.Dataset.shuffle(seed=seed)`` applies); train = the normal set + the
first half of the permuted hard set (428 + 681 = 1,109), test = the other half (682). ``--val N`` moves a seeded N
of the training questions to ``val.jsonl`` (default 0: the paper's split, no val file).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vpo_lightning.tasks.eureqa import make_record
from vpo_lightning.tasks.public_data import (
    DataUnavailable,
    find_file,
    from_hub,
    missing_data_message,
    read_records,
    split_parser,
    write_splits,
)

SUBSETS = ("questions_normal_5", "questions_hard_5")
HUB_ID = "vincentleebang/EUREQA"
URL = "https://huggingface.co/datasets/vincentleebang/EUREQA (export each split to JSONL)"
DEFAULT_RAW = Path("data/eureqa/raw")


def load_public(source: Path | None) -> dict[str, list[dict[str, Any]]]:
    """``{"questions_normal_5": [...], "questions_hard_5": [...]}`` from ``source`` (or ``data/eureqa/raw``), else
    the hub.

    Raises:
        DataUnavailable: no local copy and no hub (the message names the files and where to put them).
    """
    names = [f"{s}.jsonl" for s in SUBSETS]
    local = source if source is not None else DEFAULT_RAW
    found = {s: find_file(local, s) for s in SUBSETS}
    if all(found.values()):
        return {s: read_records(p) for s, p in found.items() if p is not None}
    if source is not None:
        missing = [f"{s}.jsonl" for s, p in found.items() if p is None]
        raise DataUnavailable(missing_data_message("eureqa", missing, URL, source, f"{source} lacks them"))

    def load() -> dict[str, list[dict[str, Any]]]:
        import datasets

        ds = datasets.load_dataset(HUB_ID)
        return {s: [dict(r) for r in ds[s]] for s in SUBSETS}

    return from_hub(load, "eureqa", names, URL, DEFAULT_RAW)


def build_splits(public: dict[str, list[dict[str, Any]]], *, seed: int = 0, val: int = 0) -> dict[str, list[dict]]:
    """The mixed split (see the module docstring) as JSONL records."""
    normal, hard = public["questions_normal_5"], public["questions_hard_5"]
    order = np.random.default_rng(seed).permutation(len(hard)).tolist()
    half = len(hard) // 2
    train = [(ex, "questions_normal_5") for ex in normal] + [(hard[i], "questions_hard_5") for i in order[:half]]
    test = [(hard[i], "questions_hard_5") for i in order[half:]]
    if not 0 <= val < len(train):
        raise ValueError(f"--val {val}: must be between 0 and {len(train) - 1} (the training questions)")
    held = set(random.Random(seed).sample(range(len(train)), val))
    return {
        "train": [make_record(ex, "train", s) for i, (ex, s) in enumerate(train) if i not in held],
        "val": [make_record(ex, "val", s) for i, (ex, s) in enumerate(train) if i in held],
        "test": [make_record(ex, "test", s) for ex, s in test],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    parser = split_parser(__doc__, "eureqa", "the public question sets")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mixed split")
    parser.add_argument("--val", type=int, default=0, help="training questions moved to val.jsonl (default 0)")
    args = parser.parse_args(argv)
    return write_splits(lambda: build_splits(load_public(args.source), seed=args.seed, val=args.val), args.out,
                        lambda records: f"{len(records)} questions")


if __name__ == "__main__":
    sys.exit(main())
