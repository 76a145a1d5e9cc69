"""Demonstrations for the supervised cold start, built from a task's training records only.

The builders are the tasks' own (``vpo_lightning/tasks/<name>/demos.py``, registered in
:mod:`vpo_lightning.tasks.demos`, which also describes a demonstration); this module runs the one that
``data.builder`` names over the training files.

Only training files are read: :func:`check_training_file` refuses a file named ``val*``/``test*`` or holding
records marked ``meta.split`` val/test, and :func:`held_out_prompts` collects the prompts of the ``val.jsonl`` and
``test.jsonl`` beside the training file, so that a training record whose prompt also appears there is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.tasks.demos import demo_builders
from vpo_lightning.training.records import read_jsonl

HELD_OUT_SPLITS = ("val", "test")
# the tag family of each builder's chains
FAMILIES = {name: builder.family for name, builder in demo_builders().items()}


# ---------------------------------------------------------------------------------------------- split guards


def check_training_file(path: str | Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Raise ValueError if ``path`` is a validation/test file: demonstrations come from training data only."""
    stem = Path(path).stem.lower()
    if stem.startswith(HELD_OUT_SPLITS):
        raise ValueError(f"data.train_files: {str(path)!r} looks like a held-out split ({Path(path).name}); "
                         "demonstrations are built from training files only (e.g. data/tooluse/train.jsonl)")
    for i, record in enumerate(records, start=1):
        split = (record.get("meta") or {}).get("split") if isinstance(record.get("meta"), Mapping) else None
        if split in HELD_OUT_SPLITS:
            raise ValueError(f"{path}: record {i} ({record.get('id')}) is marked meta.split={split!r}; "
                             "demonstrations are built from training records only")


def prompt_key(record: Mapping[str, Any]) -> str:
    """What identifies a prompt across splits: its last user message (the task instance)."""
    return str(record["messages"][-1].get("content", "")).strip()


def held_out_prompts(path: str | Path) -> set[str]:
    """Prompt keys of the ``val.jsonl`` and ``test.jsonl`` files beside ``path`` (empty when there are none)."""
    keys: set[str] = set()
    for split in HELD_OUT_SPLITS:
        other = Path(path).with_name(f"{split}.jsonl")
        if other.is_file() and other.resolve() != Path(path).resolve():
            keys.update(prompt_key(r) for r in read_jsonl(other))
    return keys


def build_demos(files: Sequence[str | Path], builder: str, formats: Sequence[int], seed: int = 0
                ) -> tuple[list[dict[str, Any]], int]:
    """Demonstrations from training files.

    Args:
        files: training JSONL files of the task (never val/test: refused by :func:`check_training_file`).
        builder: a registered builder's name (:func:`vpo_lightning.tasks.demos.demo_builders`).
        formats: answers per demonstration, e.g. ``[1, 3]`` for single answers and 3-answer chains.
        seed: seed of every random choice (with the record id).

    Returns:
        ``(demos, skipped)``: the demonstrations, and how many records were skipped because their prompt also
        appears in the val/test files beside the training file.
    """
    builders = demo_builders()
    if builder not in builders:
        raise ValueError(f"data.builder={builder!r}: use one of {sorted(builders)} (or none for ready demos)")
    if not formats or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in formats):
        raise ValueError(f"data.formats={list(formats)!r}: give answers per demonstration, e.g. [1, 3]")
    demos, skipped = [], 0
    for path in files:
        records = read_jsonl(path)
        check_training_file(path, records)
        held_out = held_out_prompts(path)
        for record in records:
            if prompt_key(record) in held_out:
                skipped += 1
                continue
            demos.extend(builders[builder].build(record, formats, seed))
    return demos, skipped
