"""EUREQA: prompt, answer parsing and the D = 5 reward of VPO-SPEC section 8.

The ``eureqa`` task package: this module holds the prompt, the answer parsing and the reward (pure Python);
``reward.py`` registers the reward; ``build.py`` (``python -m vpo_lightning.tasks.eureqa.build``) writes the
JSONL splits from the public files.

A public EUREQA question (Li et al., NAACL 2024) describes a chain of masked entities ("Person A", "Country B", ...)
linked by relations; only the last entity of the chain is named. ``question`` holds the sentences, ``entity_masks``
the mask names in order of introduction and ``entities`` the Wikipedia-style names behind them (``entities[0]`` is
the answer, entity A). The model resolves the first five masks.

Answer format (one answer): ``<entity_A>name</entity_A>`` ... ``<entity_E>name</entity_E>``; in a chain, each
``<response_i>`` block holds one such answer.

Reward ``[entity_A, ..., entity_E]``: 1 where the first closed ``<entity_X>`` block, normalised, equals the gold
name, normalised; else 0 (missing, unclosed or empty tags score 0). Normalisation (:func:`normalize_entity`):
Unicode NFKC, underscores become spaces, lower case, punctuation and the articles a/an/the removed, whitespace
collapsed, so ``Robert_Rodriguez``, ``robert rodriguez`` and ``Robert Rodriguez.`` all match. f = the mean.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from vpo_lightning.core.chains import tagged_block

TASK = "eureqa"
LETTERS = ("A", "B", "C", "D", "E")
DIMS = tuple(f"entity_{x}" for x in LETTERS)
SOURCE = "EUREQA (Li et al., NAACL 2024), hub vincentleebang/EUREQA"
SYSTEM_PROMPT = "You resolve chains of masked entities by following the stated relations step by step."
_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def narrative(question: Any) -> str:
    """The question text: its sentences joined by newlines (a string stays as it is)."""
    if isinstance(question, str):
        return question.strip()
    return "\n".join(str(s).strip() for s in question)


def user_prompt(question: Any, masks: Sequence[str]) -> str:
    """The user message: the narrative, the five masks to resolve and the single-answer format."""
    lines = "\n".join(f"<entity_{x}>...</entity_{x}>   ({mask})" for x, mask in zip(LETTERS, masks))
    return (
        f"Narrative:\n{narrative(question)}\n\n"
        "Each masked entity stands for one real entity. Resolve these masked entities, in this order:\n"
        + "\n".join(f"- {x}: {mask}" for x, mask in zip(LETTERS, masks))
        + "\n\nThink step by step, then give each entity's canonical Wikipedia name (for example "
        "`Robert_Rodriguez` or `From Dusk till Dawn: The Series`) and nothing else inside its tags:\n"
        f"{lines}\nEntity A is the answer to the question."
    )


def make_record(example: Mapping[str, Any], split: str, subset: str) -> dict[str, Any]:
    """The JSONL record of one public EUREQA question.

    Args:
        example: a public record (``idx``, ``question``, ``entity_masks``, ``entities``).
        split: the split it goes to.
        subset: the public subset it comes from (``questions_normal_5`` or ``questions_hard_5``).

    Raises:
        ValueError: fewer than 5 masks or entities.
    """
    masks, entities = list(example.get("entity_masks") or []), list(example.get("entities") or [])
    if len(masks) < 5 or len(entities) < 5 or "question" not in example:
        raise ValueError(f"EUREQA {subset} question {example.get('idx', '?')!r}: needs a question and at least 5 "
                         f"entity_masks and entities, got {len(masks)} and {len(entities)}")
    return {
        "id": f"{subset}-{example.get('idx', '?')}",
        "task": TASK,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user_prompt(example["question"], masks[:5])},
        ],
        "ground_truth": {"entities": [str(e) for e in entities[:5]], "masks": [str(m) for m in masks[:5]]},
        "meta": {"split": split, "category": subset, "source": SOURCE},
    }


def parse_entities(text: str) -> list[str | None]:
    """The five ``<entity_A>``..``<entity_E>`` contents (stripped; None where missing, unclosed or empty)."""
    if not isinstance(text, str):
        return [None] * 5
    out: list[str | None] = []
    for x in LETTERS:
        block = tagged_block(text, f"entity_{x}")
        out.append(block.strip() or None if block is not None else None)
    return out


def normalize_entity(name: str) -> str:
    """Wikipedia-style entity name normalisation (see the module docstring)."""
    text = unicodedata.normalize("NFKC", name).replace("_", " ").lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def entity_match(prediction: str | None, gold: str) -> float:
    """1.0 when both normalise to the same non-empty name."""
    if not prediction:
        return 0.0
    pred = normalize_entity(prediction)
    return float(bool(pred) and pred == normalize_entity(gold))


def eureqa_reward(candidate: str, sample: Mapping[str, Any]) -> list[float]:
    """The ``eureqa`` reward: exact match of entities A..E; malformed -> zeros."""
    gold = sample["ground_truth"]["entities"]
    return [entity_match(p, g) for p, g in zip(parse_entities(candidate), gold)]


__all__ = ["DIMS", "entity_match", "eureqa_reward", "make_record", "normalize_entity", "parse_entities",
           "user_prompt"]
