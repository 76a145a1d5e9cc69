"""Demonstration builders for the supervised cold start (``vpo sft``): the registry, and the layout every task's
builder shares.

A demonstration is ``{"id", "source_id", "m", "messages", "completion"}``: ``messages`` is the prompt exactly as a
rollout builds it (the record's messages; for a chain, the m-answer instruction of :mod:`vpo_lightning.core.chains`
appended to the last user message) and ``completion`` the assistant text the model learns to write. A builder turns
one training record into one demonstration per entry of ``formats`` (``1`` = single answer, ``m > 1`` = an m-answer
chain), so that every estimator (single answers, chains) can start from the same SFT adapter.

A task registers its builders in its own ``tasks/<name>/demos.py``, which the registry imports on the first lookup
(as it imports ``tasks/<name>/reward.py`` for rewards)::

    @register_demos("maze", family="route")
    def maze_demos(record, formats, seed): ...

``data.builder: maze`` in a ``vpo sft`` config then names it. Builders are pure Python and seeded: ``(seed, record
id)`` fixes every random choice (:func:`seeded_rng`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vpo_lightning.core.chains import build_instruction

Build = Callable[[Mapping[str, Any], Sequence[int], int], list[dict[str, Any]]]


@dataclass(frozen=True)
class DemoBuilder:
    """A registered builder: ``build(record, formats, seed) -> demonstrations``, and the tag family of its chains."""

    build: Build
    family: str


DEMO_BUILDERS: dict[str, DemoBuilder] = {}


def register_demos(name: str, family: str) -> Callable[[Build], Build]:
    """Register a demonstration builder under ``name`` (the value of ``data.builder``)."""
    def wrap(fn: Build) -> Build:
        if name in DEMO_BUILDERS and DEMO_BUILDERS[name].build is not fn:
            raise ValueError(f"demonstration builder {name!r} is registered twice")
        DEMO_BUILDERS[name] = DemoBuilder(fn, family)
        return fn
    return wrap


def demo_builders() -> dict[str, DemoBuilder]:
    """Every registered builder, the built-in tasks' first (``vpo_lightning.tasks.<name>.demos`` is imported for
    each task package that has one)."""
    from vpo_lightning.tasks import builtin_tasks  # the one list of built-in tasks (the folder)

    for task in builtin_tasks():
        name = f"vpo_lightning.tasks.{task}.demos"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    return DEMO_BUILDERS


def seeded_rng(seed: int, *parts: Any) -> random.Random:
    """A ``random.Random`` keyed by ``(seed, *parts)`` (independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def chain_messages(messages: Sequence[Mapping[str, str]], m: int, family: str) -> list[dict[str, str]]:
    """The prompt of an m-answer chain, built as the rollout builds it (instruction appended to the last turn)."""
    out = [dict(msg) for msg in messages]
    if m > 1:
        out[-1]["content"] += build_instruction(m, family)  # type: ignore[arg-type]
    return out


def chain_completion(answers: Sequence[str], family: str) -> str:
    """m answers laid out as the m-answer instruction asks: ``<tag_1>..</tag_1>`` one block per line."""
    tag = "response" if family == "response" else "route"
    return "\n".join(f"<{tag}_{i}>\n{a}\n</{tag}_{i}>" if "\n" in a else f"<{tag}_{i}>{a}</{tag}_{i}>"
                     for i, a in enumerate(answers, 1))


def demo(record: Mapping[str, Any], m: int, family: str, completion: str) -> dict[str, Any]:
    """One demonstration of ``record`` with ``m`` answers."""
    return {"id": f"{record.get('id')}-m{m}", "source_id": record.get("id"), "m": m,
            "messages": chain_messages(record["messages"], m, family), "completion": completion}
