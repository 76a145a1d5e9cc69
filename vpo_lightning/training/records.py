"""Prompt records from files: JSONL (read here, line by line), and JSON, Parquet, CSV, a ``save_to_disk`` folder or
a Hub dataset id through the ``datasets`` library. No Lightning or torch import.

Every record becomes a dict with ``messages`` (a chat ending with a user turn), whichever of these it came as:

- ours: ``{"messages": [...], ...}``;
- TRL standard prompt-only: ``{"prompt": "..."}`` -> one user message;
- TRL conversational prompt-only: ``{"prompt": [{"role": ..., "content": ...}, ...]}``.

The other fields stay in the record: rewards see them (``sample`` of a VPO reward; keyword arguments of a TRL
reward function, as in TRL), and a record's ``tools`` (a list of JSON schemas, or a JSON string of one) go to the
chat template (``apply_chat_template(tools=...)``). Fields this module adds (``messages`` for a TRL prompt, ``id``)
are listed under :data:`DERIVED`, so that TRL reward functions get the dataset's own columns only. Bad records are
refused with ``file:line`` (JSONL, CSV) or ``file: row N`` (Parquet, JSON arrays, saved datasets).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vpo_lightning.core.types import DERIVED
from vpo_lightning.tasks import prompt_lists_tools

_ROLES = {"system", "user", "assistant", "tool"}
_DATASETS_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv"}


def template_tools(record: Mapping[str, Any]) -> list[dict] | None:
    """The tools to give the chat template for ``record``: its ``tools`` (TRL), except for built-in tasks whose
    prompt text lists them already (:func:`vpo_lightning.tasks.prompt_lists_tools`, e.g. tool use)."""
    task = record.get("task")
    if isinstance(task, str) and prompt_lists_tools(task):
        return None
    return record.get("tools") or None


def _message(msg: Any) -> Any:
    """A message with the keys Arrow fills with None for rows that lack them dropped (Parquet, saved datasets)."""
    return {k: v for k, v in msg.items() if v is not None} if isinstance(msg, Mapping) else msg


def _prompt_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: 'prompt' is empty")
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt:
        return [_message(m) for m in prompt]
    raise ValueError(f"{where}: 'prompt' must be a string (TRL standard format) or a non-empty list of "
                     f"{{role, content}} messages (TRL conversational format), got {type(prompt).__name__}")


def _tools(tools: Any, where: str) -> list[dict] | None:
    if tools is None:
        return None
    if isinstance(tools, str):  # datasets stores nested schemas of varying shape as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: 'tools' is a string but not valid JSON ({err.msg})") from None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ValueError(f"{where}: 'tools' must be a list of JSON-schema objects (or a JSON string of one)")
    return [dict(t) for t in tools]


def check_record(record: Any, where: str) -> dict[str, Any]:
    """Validate one record and return it with ``messages`` (see the module docstring); errors name ``where``."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    record, derived = dict(record), []
    if "messages" not in record:
        if "prompt" not in record:
            raise ValueError(f"{where}: missing field 'messages' (each record needs 'messages', or TRL's 'prompt': "
                             "a string or a list of {role, content} messages)")
        record["messages"], derived = _prompt_messages(record["prompt"], where), ["messages"]
    elif isinstance(record["messages"], list):
        record["messages"] = [_message(m) for m in record["messages"]]
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES or not isinstance(msg.get("content"), str):
            raise ValueError(f"{where}: messages[{i}] must be {{'role': one of {sorted(_ROLES)}, 'content': str}}")
    if messages[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message must have role 'user' (the prompt to answer); a TRL "
                         "language-modeling record ends with the answer: give the conversation without it")
    if "tools" in record:
        record["tools"] = _tools(record["tools"], where)
    from vpo_lightning.tasks.code.build import check_code_record

    check_code_record(record, where)
    if derived:
        record[DERIVED] = derived
    return record


def _with_id(record: dict[str, Any], default: str) -> dict[str, Any]:
    if "id" not in record:
        record["id"] = default
        record[DERIVED] = [*record.get(DERIVED, []), "id"]
    return record


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a JSONL prompt file; errors name the file, the line and the problem."""
    return [_with_id(check_record(row, where), default_id) for where, default_id, row in _jsonl_rows(path)]


def _jsonl_rows(path: str | Path) -> list[tuple[str, str, Any]]:
    """``(where, default id, parsed JSON)`` of every non-blank line of a JSONL file (UTF-8 and JSON checked)."""
    path = Path(path)
    _check_path(path)
    rows = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            rows.append((where, f"{path.stem}-{lineno}", record))
    if not rows:
        raise ValueError(f"data file {str(path)!r} is empty: it needs one JSON record per line")
    return rows


def _check_path(path: Path) -> None:
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.jsonl"))[:4]
        hint = f"name a file inside it ({', '.join(inside)})" if inside else "name a JSONL file (one record per line)"
        raise ValueError(f"data file {str(path)!r} is a directory without a saved dataset: {hint}, or a folder "
                         "written by datasets' save_to_disk, in data.train_files / data.val_files")
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist (check data.train_files / data.val_files)")


def _datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()  # "Generating train split" bars for a few rows: noise
    return datasets


def _rows(dataset: Any, source: str, line_offset: int | None) -> list[tuple[str, str, Any]]:
    """``(where, default id, row)`` of a ``datasets.Dataset``: ``file:line`` when rows map to lines (CSV), else
    ``row N``."""
    rows = []
    stem = Path(source).stem or source.replace("/", "-")
    for i, row in enumerate(dataset):
        where = f"{source}:{i + line_offset}" if line_offset is not None else f"{source}: row {i + 1}"
        rows.append((where, f"{stem}-{i + 1}", row))
    if not rows:
        raise ValueError(f"data {source!r} has no rows")
    return rows


def _saved_dataset(path: Path) -> Any:
    datasets = _datasets()
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"data {str(path)!r} is a saved DatasetDict with splits {splits}: name one split's folder, "
                         f"e.g. {path / (splits[0] if splits else 'train')}")
    return datasets.load_from_disk(str(path))


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be asked (offline switch, no route), found in at most a few seconds; None if it may."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in (
            "", "0"):
        return "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set"
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as err:  # without this check, datasets retries for ~25 s before failing
        return f"{host} cannot be reached ({err.strerror or err})"
    return None


def _hub_dataset(name: str) -> Any:
    """``owner/name`` or ``owner/name:split`` from a Hub (train split by default); a clear error offline."""
    fix = ("Without a Hub connection, save the dataset with save_to_disk (or to_parquet/to_json) on a machine that "
           "has one and give that path.")
    if reason := _hub_unreachable():
        raise ValueError(f"data {name!r} is not a local file or folder, and it cannot be loaded as a Hugging Face "
                         f"Hub dataset: {reason}. {fix}")
    datasets = _datasets()
    repo, _, split = name.partition(":")
    try:
        return datasets.load_dataset(repo, split=split or "train")
    except Exception as err:  # noqa: BLE001 - missing, gated or a bad split: one message saying which
        raise ValueError(f"data {name!r} is not a local file or folder, and loading it as a Hugging Face Hub "
                         f"dataset failed ({type(err).__name__}: {' '.join(str(err).split())[:300]}). {fix}") from None


def read_records(source: str | Path) -> list[dict[str, Any]]:
    """Read and validate prompt records from ``source``: a ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a folder
    written by ``Dataset.save_to_disk``, or (when no such path exists) a Hub dataset id ``owner/name[:split]``."""
    return [_with_id(check_record(row, where), default_id) for where, default_id, row in read_rows(source)]


def read_rows(source: str | Path) -> list[tuple[str, str, Any]]:
    """The rows of ``source`` as :func:`read_records` finds them, not yet checked as prompt records: ``(where,
    default id, row)``, ``where`` naming the file and line or row (``vpo sft`` reads its demonstrations here)."""
    path = Path(source)
    if path.suffix == ".jsonl" or (path.is_dir() and not (path / "dataset_info.json").is_file()
                                    and not (path / "dataset_dict.json").is_file()):
        return _jsonl_rows(path)
    if path.is_dir():
        return _rows(_saved_dataset(path), str(path), None)
    if path.suffix in _DATASETS_BUILDERS:
        _check_path(path)
        datasets = _datasets()
        try:
            ds = datasets.load_dataset(_DATASETS_BUILDERS[path.suffix], data_files=str(path), split="train")
        except Exception as err:  # noqa: BLE001 - pyarrow/pandas parse errors: name the file
            raise ValueError(f"data file {str(path)!r} could not be read as {path.suffix[1:]} "
                             f"({type(err).__name__}: {' '.join(str(err).split())[:300]})") from None
        return _rows(ds, str(path), 2 if path.suffix == ".csv" else None)  # CSV: line 1 is the header
    if not path.exists() and "/" in str(source) and not path.suffix and not str(source).startswith((".", "/")):
        return _rows(_hub_dataset(str(source)), str(source), None)
    _check_path(path)
    raise ValueError(f"data file {str(path)!r}: unknown format {path.suffix!r}; give .jsonl, .json, .parquet, .csv "
                     "or a folder written by datasets' save_to_disk")
