"""Built-in tasks, one package each: ``<name>/__init__.py`` (prompt, parser, reward functions), ``<name>/reward.py``
(registers the task's rewards; imported by the registry on first lookup) and ``<name>/build.py`` (the data builder,
``python -m vpo_lightning.tasks.<name>.build``). Every package in this folder is a built-in task: see
docs/ADDING_A_TASK.md.
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path, **dumps_kwargs: Any) -> int:
    """Write one JSON object per line (UTF-8 text, no ASCII escaping; ``dumps_kwargs`` go to ``json.dumps``, e.g.
    ``sort_keys=True``), creating the folder; returns the number of bytes written."""
    data = "".join(json.dumps(r, ensure_ascii=False, **dumps_kwargs) + "\n" for r in records).encode("utf-8")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return len(data)


def builtin_tasks() -> list[str]:
    """The built-in tasks: every package in this folder (the folder is the list)."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if info.ispkg)


@functools.cache
def prompt_lists_tools(task: str) -> bool:
    """Whether the built-in task ``task`` writes a record's tools into the prompt text itself (its package sets
    ``PROMPT_LISTS_TOOLS = True``), so that the chat template must not be given them again. False for any other
    name (a user's task, no task)."""
    if task not in builtin_tasks():
        return False
    return bool(getattr(importlib.import_module(f"{__name__}.{task}"), "PROMPT_LISTS_TOOLS", False))
