"""The committed tool-use splits (data/tooluse): reproducible from bfcl-eval, well-formed, expected sizes."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from vpo_lightning.tasks.tooluse import build as bfcl

DATA = Path(__file__).resolve().parents[1] / "data" / "tooluse"
SPLITS = ("train", "val", "test")
SIZES = {"train": 1424, "val": 75, "test": 1240}


def load(split: str) -> list[dict[str, Any]]:
    with (DATA / f"{split}.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict[str, Any]]]:
    if not all((DATA / f"{s}.jsonl").exists() for s in SPLITS):
        pytest.skip("data/tooluse not generated: python -m vpo_lightning.tasks.tooluse.build")
    return {s: load(s) for s in SPLITS}


@pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None, reason="bfcl-eval is not installed")
def test_regeneration_is_byte_identical(tmp_path: Path, splits: dict) -> None:
    counts = bfcl.generate(tmp_path)
    assert counts == SIZES
    for split in SPLITS:
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (DATA / f"{split}.jsonl").read_bytes(), split


def test_files_are_canonical_jsonl(splits: dict) -> None:
    for split in SPLITS:
        raw = (DATA / f"{split}.jsonl").read_text(encoding="utf-8")
        assert raw.endswith("\n") and "\n\n" not in raw
        assert raw.splitlines() == [bfcl.dumps_record(r) for r in splits[split]]


def test_records_have_required_fields(splits: dict) -> None:
    for records in splits.values():
        for r in records:
            assert set(r) == {"id", "task", "messages", "tools", "ground_truth", "meta"}
            assert r["task"] == "tooluse" and isinstance(r["id"], str)
            roles = [m["role"] for m in r["messages"]]
            assert roles[0] == "system" and roles[-1] == "user" and "system" not in roles[1:]
            assert all(isinstance(m["content"], str) for m in r["messages"])
            assert r["tools"] and all({"name", "description", "parameters"} <= set(t) for t in r["tools"])
            tool_names = {t["name"] for t in r["tools"]}
            assert all(len(call) == 1 and set(call) <= tool_names for call in r["ground_truth"])
            assert all(isinstance(v, list) for call in r["ground_truth"] for a in call.values() for v in a.values())
            meta = r["meta"]
            assert (not r["ground_truth"]) == ("irrelevance" in meta["category"])
            assert meta["source"] == f"BFCL_v4_{meta['category']}.json"
            assert meta["prompt_chars"] == sum(len(m["content"]) for m in r["messages"])
            assert meta["num_tools"] == len(r["tools"]) and meta["num_calls"] == len(r["ground_truth"])


def test_split_sizes_and_categories(splits: dict) -> None:
    assert {s: len(r) for s, r in splits.items()} == SIZES
    ids = {s: {r["id"] for r in records} for s, records in splits.items()}
    assert all(len(ids[s]) == SIZES[s] for s in SPLITS)  # unique ids
    assert not ids["train"] & ids["val"] and not ids["train"] & ids["test"] and not ids["val"] & ids["test"]
    train_cats = Counter(r["meta"]["category"] for s in ("train", "val") for r in splits[s])
    assert set(train_cats) == {*bfcl.TRAIN_CATEGORIES, bfcl.TRAIN_IRRELEVANCE}
    pool = sum(train_cats.values())
    assert train_cats[bfcl.TRAIN_IRRELEVANCE] / pool == pytest.approx(0.10, abs=0.005)
    assert SIZES["val"] >= bfcl.VAL_MIN and SIZES["val"] / pool == pytest.approx(0.05, abs=0.005)
    test_cats = Counter(r["meta"]["category"] for r in splits["test"])
    assert test_cats == {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200,
                         "irrelevance": 240}


def test_total_size_is_small() -> None:
    total = sum((DATA / f"{s}.jsonl").stat().st_size for s in SPLITS if (DATA / f"{s}.jsonl").exists())
    assert total < 16_000_000
