"""Build the tool-use splits from the BFCL v4 data shipped inside the ``bfcl-eval`` package.

Run ``python -m vpo_lightning.tasks.tooluse.build [--out data/tooluse]``. It writes ``train.jsonl``, ``val.jsonl`` and
``test.jsonl`` (records as in docs/ARCHITECTURE.md):

* train: the live categories (``live_simple``, ``live_multiple``, ``live_parallel``, ``live_parallel_multiple``)
  plus a seeded sample of ``live_irrelevance`` making up about 10% of the pool, less the val slice;
* val: a seeded ~5% slice (at least 50 records) held out of that pool;
* test: the non-live Python categories (``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``,
  ``irrelevance``), complete.

Entries whose possible answer gives an argument no acceptable value at all are left out (:func:`answerable`).

The package directory is located with :func:`importlib.util.find_spec`; ``bfcl_eval`` itself is never imported
(its dependencies need not be installed). The output is deterministic: a fixed seed, sorted JSON keys and records
in source order, so re-running reproduces the files byte for byte.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.tasks import write_jsonl
from vpo_lightning.tasks.tooluse import build_messages

SEED = 20250
TRAIN_CATEGORIES = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
TRAIN_IRRELEVANCE = "live_irrelevance"
TEST_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
IRRELEVANCE_FRACTION = 0.10  # share of live_irrelevance in the train + val pool
VAL_FRACTION, VAL_MIN = 0.05, 50
FILE_PREFIX = "BFCL_v4_"
_CATEGORY_ALIASES = {"simple_python": ("simple_python", "simple")}


def bfcl_data_dir() -> Path:
    """The ``data`` directory of the installed ``bfcl-eval`` package, found without importing it.

    Raises:
        FileNotFoundError: when ``bfcl_eval`` is not installed.
    """
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("bfcl_eval is not installed: pip install --no-deps bfcl-eval")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def bfcl_version() -> str:
    """The installed ``bfcl-eval`` distribution version (read from its metadata, not by importing it)."""
    for name in ("bfcl-eval", "bfcl_eval"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def category_file(data_dir: Path, category: str) -> Path:
    """The question file of ``category`` (``simple_python`` may be named ``simple`` in some versions)."""
    for name in _CATEGORY_ALIASES.get(category, (category,)):
        path = data_dir / f"{FILE_PREFIX}{name}.json"
        if path.exists():
            return path
    raise FileNotFoundError(f"no BFCL file for category {category!r} in {data_dir}")


def load_category(data_dir: Path, category: str) -> list[dict[str, Any]]:
    """Records of one BFCL category, its possible answers joined in by id (irrelevance: no call expected)."""
    path = category_file(data_dir, category)
    entries = _read_jsonl(path)
    answer_path = data_dir / "possible_answer" / path.name
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(answer_path)} if answer_path.exists() else {}
    if "irrelevance" not in category and len(answers) != len(entries):
        raise ValueError(f"{path.name}: {len(entries)} questions but {len(answers)} possible answers")
    records = [to_record(e, answers.get(e["id"], []), category, path.name) for e in entries]
    return [r for r in records if answerable(r["ground_truth"])]


def answerable(ground_truth: list) -> bool:
    """False when an argument has no acceptable value at all (``[]``): no answer can pass BFCL's checker then.

    Two BFCL v4 entries (live_simple_106-63-0, live_simple_112-68-0) have this; they are left out.
    """
    return all(
        not (isinstance(values, list) and not values)
        for call in ground_truth
        for args in call.values()
        for values in args.values()
    )


def to_record(entry: dict[str, Any], ground_truth: list, category: str, source: str) -> dict[str, Any]:
    """One BFCL entry -> a tooluse record; the prompt is the ToolRL system message plus the first turn."""
    tools = entry["function"]
    messages = build_messages(tools, entry["question"][0])
    return {
        "id": entry["id"],
        "task": "tooluse",
        "messages": messages,
        "tools": tools,
        "ground_truth": ground_truth,
        "meta": {
            "category": category,
            "source": source,
            "num_tools": len(tools),
            "num_calls": len(ground_truth),
            "prompt_chars": sum(len(m["content"]) for m in messages),
        },
    }


def _seeded_sample(records: Sequence[dict], k: int, seed: int) -> set[str]:
    """Ids of a seeded sample of ``k`` records (independent of input order)."""
    ids = sorted(r["id"] for r in records)
    return set(random.Random(seed).sample(ids, min(k, len(ids))))


def build_splits(data_dir: Path, seed: int = SEED) -> dict[str, list[dict[str, Any]]]:
    """The train/val/test records, each list in source order (category order, then BFCL order)."""
    live = [r for c in TRAIN_CATEGORIES for r in load_category(data_dir, c)]
    irrelevance = load_category(data_dir, TRAIN_IRRELEVANCE)
    n_irr = round(len(live) * IRRELEVANCE_FRACTION / (1 - IRRELEVANCE_FRACTION))
    keep = _seeded_sample(irrelevance, n_irr, seed)
    pool = live + [r for r in irrelevance if r["id"] in keep]
    val_ids = _seeded_sample(pool, max(VAL_MIN, round(len(pool) * VAL_FRACTION)), seed + 1)
    return {
        "train": [r for r in pool if r["id"] not in val_ids],
        "val": [r for r in pool if r["id"] in val_ids],
        "test": [r for c in TEST_CATEGORIES for r in load_category(data_dir, c)],
    }


def dumps_record(record: dict[str, Any]) -> str:
    """The canonical JSON line of a record (sorted keys, UTF-8 text, no trailing newline)."""
    return json.dumps(record, ensure_ascii=False, sort_keys=True)


def generate(out_dir: Path, data_dir: Path | None = None, seed: int = SEED) -> dict[str, int]:
    """Write ``{train,val,test}.jsonl`` into ``out_dir``.

    Returns:
        The number of records per split.
    """
    splits = build_splits(data_dir or bfcl_data_dir(), seed)
    for name, records in splits.items():
        write_jsonl(records, Path(out_dir) / f"{name}.jsonl", sort_keys=True)  # = dumps_record per line
    return {name: len(records) for name, records in splits.items()}


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point: ``python -m vpo_lightning.tasks.tooluse.build [--out DIR] [--seed N]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=Path("data/tooluse"), help="output directory")
    parser.add_argument("--seed", type=int, default=SEED, help="sampling seed")
    args = parser.parse_args(argv)
    counts = generate(args.out, seed=args.seed)
    sizes = {name: (args.out / f"{name}.jsonl").stat().st_size for name in counts}
    print(f"bfcl-eval {bfcl_version()} -> {args.out}")
    for name, count in counts.items():
        print(f"  {name}: {count} records, {sizes[name] / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
