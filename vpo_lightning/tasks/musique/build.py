"""Build the MuSiQue splits: ``python -m vpo_lightning.tasks.musique.build [--source DIR] [--out data/musique]``.

Source: the public MuSiQue v1.0 *answerable* files ``musique_ans_v1.0_train.jsonl`` (19,938 questions) and
``musique_ans_v1.0_dev.jsonl`` (2,417), from a local directory or file (``--source``, default ``data/musique/raw``)
or, when the optional ``datasets`` package is importable and the hub reachable, ``dgslibisey/MuSiQue`` on the
Hugging Face hub. Offline without a local copy the builder stops at once, naming the files to download.

Splits (records as in docs/ARCHITECTURE.md, see :mod:`vpo_lightning.tasks.musique`):

* ``train.jsonl``: every answerable training question, in file order;
* ``test.jsonl``: the paper's hop-stratified evaluation sample of the validation file, ``--per_hop`` (100) questions
  each of 2, 3 and 4 hops (300), drawn with ``random.Random(--seed)`` (42): for h = 2, 3, 4 in turn,
  ``rng.sample`` of the h-hop questions in file order; written in hop order, file order within a hop;
* ``val.jsonl``: ``--val_per_hop`` (20) more questions per hop count from the validation questions not in test,
  drawn with the same generator after the test sample (for validation during training).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.tasks.musique import make_record, num_hops
from vpo_lightning.tasks.public_data import (
    DataUnavailable,
    find_file,
    from_hub,
    missing_data_message,
    read_records,
    split_parser,
    write_splits,
)

FILES = {"train": "musique_ans_v1.0_train", "validation": "musique_ans_v1.0_dev"}
HUB_ID = "dgslibisey/MuSiQue"
URL = "https://huggingface.co/datasets/dgslibisey/MuSiQue (or the MuSiQue GitHub release, StonyBrookNLP/musique)"
DEFAULT_RAW = Path("data/musique/raw")
HOPS = (2, 3, 4)


def load_public(source: Path | None) -> dict[str, list[dict[str, Any]]]:
    """``{"train": [...], "validation": [...]}`` public records: from ``source`` (or ``data/musique/raw``) if it
    holds the files, else from the hub.

    Raises:
        DataUnavailable: no local copy and no hub (the message names the files and where to put them).
    """
    names = [f"{stem}.jsonl" for stem in FILES.values()]
    local = source if source is not None else DEFAULT_RAW
    found = {split: find_file(local, stem) for split, stem in FILES.items()}
    if all(found.values()):
        return {split: read_records(path) for split, path in found.items() if path is not None}
    if source is not None:
        missing = [f"{FILES[s]}.jsonl" for s, p in found.items() if p is None]
        raise DataUnavailable(missing_data_message("musique", missing, URL, source, f"{source} lacks them"))

    def load() -> dict[str, list[dict[str, Any]]]:
        import datasets

        files = {split: f"{stem}.jsonl" for split, stem in FILES.items()}
        ds = datasets.load_dataset(HUB_ID, data_files=files)
        return {split: [dict(r) for r in ds[split]] for split in FILES}

    return from_hub(load, "musique", names, URL, DEFAULT_RAW)


def stratified_sample(examples: Sequence[dict[str, Any]], per_hop: int, rng: random.Random,
                      exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """``per_hop`` examples of each hop count 2, 3, 4 (see the module docstring), hop order then file order.

    Raises:
        ValueError: fewer than ``per_hop`` questions of some hop count.
    """
    picked: list[dict[str, Any]] = []
    for hops in HOPS:
        pool = [i for i, ex in enumerate(examples) if num_hops(ex) == hops and ex["id"] not in exclude]
        if len(pool) < per_hop:
            raise ValueError(f"the MuSiQue validation file has {len(pool)} {hops}-hop questions left, fewer than "
                             f"the {per_hop} asked for: lower --per_hop / --val_per_hop")
        picked += [examples[i] for i in sorted(rng.sample(pool, per_hop))]
    return picked


def build_splits(public: dict[str, list[dict[str, Any]]], *, per_hop: int = 100, val_per_hop: int = 20,
                 seed: int = 42) -> dict[str, list[dict[str, Any]]]:
    """The train, val and test records (see the module docstring); unanswerable records are skipped."""
    train = [ex for ex in public["train"] if ex.get("answerable", True)]
    dev = [ex for ex in public["validation"] if ex.get("answerable", True)]
    rng = random.Random(seed)
    test = stratified_sample(dev, per_hop, rng)
    val = stratified_sample(dev, val_per_hop, rng, frozenset(ex["id"] for ex in test)) if val_per_hop else []
    return {"train": [make_record(ex, "train") for ex in train], "val": [make_record(ex, "val") for ex in val],
            "test": [make_record(ex, "test") for ex in test]}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    parser = split_parser(__doc__, "musique", "the public JSONL files")
    parser.add_argument("--per_hop", type=int, default=100, help="test questions per hop count 2, 3, 4")
    parser.add_argument("--val_per_hop", type=int, default=20, help="val questions per hop count (0 = no val)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the stratified samples")
    args = parser.parse_args(argv)
    return write_splits(lambda: build_splits(load_public(args.source), per_hop=args.per_hop,
                                             val_per_hop=args.val_per_hop, seed=args.seed),
                        args.out, lambda records: f"{len(records)} questions")


if __name__ == "__main__":
    sys.exit(main())
