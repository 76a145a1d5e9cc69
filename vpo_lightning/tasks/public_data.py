"""Reading the public data files of the MuSiQue, EUREQA and LiveCodeBench tasks, from a local copy or the hub.

Every builder (``python -m vpo_lightning.tasks.<name>.build``) takes ``--source``: a local file or directory of the
public files. Without one it looks in ``data/<name>/raw/``; failing that it asks the Hugging Face hub through
``datasets.load_dataset`` when the optional ``datasets`` package is importable; otherwise (or when the hub is
unreachable) it stops at once with :class:`DataUnavailable`, whose message names the files to download and where to
put them. Nothing here downloads anything on its own.

Local files may be JSONL (one record per line), JSON (a list of records, or an object holding such a list) or
Parquet (needs ``pyarrow``), optionally gzip-compressed (``.gz``).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.tasks import write_jsonl


class DataUnavailable(FileNotFoundError):
    """The public data is neither on disk nor reachable; the message says what to download and where."""


def missing_data_message(task: str, files: Sequence[str], url: str, dest: Path | str, reason: str) -> str:
    """One actionable message: why nothing was loaded, which files to fetch, from where, where to put them."""
    names = ", ".join(files)
    return (f"{task}: no local copy of the public data and {reason}. Download {names} from {url} into {dest}/ "
            f"(or pass --source DIR_OR_FILE), then run `python -m vpo_lightning.tasks.{task}.build` again")


def hub_status() -> str | None:
    """None when ``datasets.load_dataset`` may be tried, else the reason it cannot be."""
    if importlib.util.find_spec("datasets") is None:
        return "the optional `datasets` package is not installed (pip install datasets) to fetch it from the hub"
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return "the hub is switched off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE = 1)"
    return None


def from_hub(load: Callable[[], Any], task: str, files: Sequence[str], url: str, dest: Path | str) -> Any:
    """Run ``load`` (a ``datasets.load_dataset`` call); any failure becomes :class:`DataUnavailable`."""
    reason = hub_status()
    if reason is not None:
        raise DataUnavailable(missing_data_message(task, files, url, dest, reason))
    try:
        return load()
    except Exception as err:  # network, auth, missing repo: all mean "get the files by hand"
        why = f"loading it from the hub failed ({type(err).__name__}: {str(err)[:200]})"
        raise DataUnavailable(missing_data_message(task, files, url, dest, why)) from err


def read_records(path: Path | str) -> list[dict[str, Any]]:
    """The records of one local public file (JSONL, JSON list, or Parquet; ``.gz`` allowed).

    Raises:
        ValueError: a line or file that is not JSON, naming the file and line.
    """
    path = Path(path)
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if name.endswith(".parquet"):
        if importlib.util.find_spec("pyarrow") is None:
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or give the JSONL files")
        import pyarrow.parquet as pq

        return list(pq.read_table(path).to_pylist())
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        text = fh.read()
    stripped = text.lstrip()
    if stripped.startswith("[") or (stripped.startswith("{") and name.endswith(".json")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            if not stripped.startswith("{"):
                raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        else:
            if isinstance(data, dict):  # {"data": [...]} or {"split": [...]}: the first list of records
                data = next((v for v in data.values() if isinstance(v, list)), [data])
            return [dict(r) for r in data]
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    return records


def find_file(source: Path, stem: str) -> Path | None:
    """The file under ``source`` (a directory, searched recursively) whose name starts with ``stem``, preferring
    JSONL over JSON over Parquet; ``source`` itself when it is such a file."""
    if source.is_file():
        return source if source.name.startswith(stem) else None
    if not source.is_dir():
        return None
    found = sorted(p for p in source.rglob(f"{stem}*") if p.is_file())
    for suffix in (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet"):
        for p in found:
            if p.name.endswith(suffix):
                return p
    return None


def split_parser(doc: str, task: str, what: str) -> argparse.ArgumentParser:
    """The builders' shared arguments: ``--source`` (the public files) and ``--out`` (``data/<task>``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--source", type=Path, default=None,
                        help=f"directory or file of {what} (default: data/{task}/raw, else the hub)")
    parser.add_argument("--out", type=Path, default=Path(f"data/{task}"), help="output directory")
    return parser


def write_splits(build: Callable[[], dict[str, list[dict[str, Any]]]], out: Path,
                 describe: Callable[[list[dict[str, Any]]], str]) -> int:
    """Build the splits and write each non-empty one to ``out/<split>.jsonl`` (compact JSON lines); a missing source
    or a bad argument is one line on stderr and exit code 2."""
    try:
        splits = build()
    except (DataUnavailable, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, records in splits.items():
        if records:
            write_jsonl(records, out / f"{name}.jsonl", separators=(",", ":"))
            print(f"{out / f'{name}.jsonl'}: {describe(records)}")
    return 0
