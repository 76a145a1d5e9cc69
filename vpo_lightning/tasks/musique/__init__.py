"""MuSiQue: prompt, answer parsing and the D = 5 reward of VPO-SPEC section 8.

The ``musique`` task package: this module holds the prompt, the answer parsing and the reward (pure Python);
``reward.py`` registers the reward; ``build.py`` (``python -m vpo_lightning.tasks.musique.build``) writes the
JSONL splits from the public files.

Answer format (one answer): any reasoning, then ``<support>i, j, k</support>`` with the indices of the paragraphs
that support the reasoning steps and ``<answer>...</answer>`` with a short answer. In a chain, each
``<response_i>`` block holds one such answer.

Reward ``[hop_1, hop_2, hop_3, hop_4, answer_f1]``:

* the cited indices are the integers inside the first closed ``<support>`` block, truncated to the first 4 distinct
  ones (citing every paragraph gains nothing);
* ``hop_i`` = 1 when the cited indices include the gold supporting paragraph of reasoning step i (the
  ``paragraph_support_idx`` of the i-th entry of ``question_decomposition``); hops beyond the question's hop count
  score 1;
* ``answer_f1`` = SQuAD token F1 (lower case, punctuation and articles removed) of the answer, best over the gold
  answer and its aliases;
* no closed ``<answer>`` block, or an empty one, scores the zero vector (hops included): a cite-only answer earns
  nothing.

Scalar f = (hop_1 + hop_2 + hop_3 + hop_4 + 3 * answer_f1) / 7 (:data:`F_WEIGHTS`), used for best@k in ``vpo eval``.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from vpo_lightning.core.chains import tagged_block

TASK = "musique"
MAX_HOPS = 4
DIMS = ("hop_1", "hop_2", "hop_3", "hop_4", "answer_f1")
F_WEIGHTS = (1.0, 1.0, 1.0, 1.0, 3.0)  # f = (sum of hops + 3 * answer_f1) / 7
SOURCE = "MuSiQue v1.0 answerable (Trivedi et al., 2022; CC BY 4.0)"

SYSTEM_PROMPT = "You answer multi-hop questions from the paragraphs you are given, citing the paragraphs you used."
ANSWER_FORMAT = (
    "Reason step by step about which paragraphs are needed. Then give the indices of the supporting paragraphs, one "
    "per reasoning step in order (at most 4), and a short answer (a name, date or number, not a sentence):\n"
    "<support>3, 7</support>\n<answer>your answer</answer>"
)
_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_INDEX = re.compile(r"\d+")


# ------------------------------------------------------------------------------------------------ prompt


def format_paragraphs(paragraphs: Sequence[Mapping[str, Any]]) -> str:
    """Numbered paragraphs ``[idx] title: text``, one per line, with MuSiQue's own ``idx`` numbers."""
    return "\n".join(f"[{p['idx']}] {p.get('title', '')}: {p.get('paragraph_text', '')}" for p in paragraphs)


def user_prompt(question: str, paragraphs: Sequence[Mapping[str, Any]]) -> str:
    """The user message: the paragraphs, the question and the single-answer format."""
    return f"Paragraphs:\n{format_paragraphs(paragraphs)}\n\nQuestion: {question}\n\n{ANSWER_FORMAT}"


def num_hops(example: Mapping[str, Any]) -> int:
    """Hop count of a public MuSiQue record: the length of its ``question_decomposition``."""
    return len(example["question_decomposition"])


def make_record(example: Mapping[str, Any], split: str) -> dict[str, Any]:
    """The JSONL record (docs/ARCHITECTURE.md) of one public MuSiQue example.

    Raises:
        ValueError: the example lacks a field the reward needs, or has more than 4 hops.
    """
    for key in ("id", "question", "paragraphs", "question_decomposition", "answer"):
        if key not in example:
            raise ValueError(f"MuSiQue example {example.get('id', '?')!r} has no {key!r} field")
    hops = num_hops(example)
    if not 1 <= hops <= MAX_HOPS:
        raise ValueError(f"MuSiQue example {example['id']!r} has {hops} hops; the reward covers 1..{MAX_HOPS}")
    return {
        "id": str(example["id"]),
        "task": TASK,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user_prompt(example["question"], example["paragraphs"])},
        ],
        "ground_truth": {
            "answer": str(example["answer"]),
            "answer_aliases": [str(a) for a in example.get("answer_aliases") or []],
            "support": [int(step["paragraph_support_idx"]) for step in example["question_decomposition"]],
        },
        "meta": {"split": split, "num_hops": hops, "category": f"{hops}hop", "source": SOURCE},
    }


# ------------------------------------------------------------------------------------------------ parsing


def parse_answer(text: str) -> tuple[list[int], str | None]:
    """``(cited indices, answer)`` of one answer; never raises.

    Cited indices are the first 4 distinct integers of the first closed ``<support>`` block (numbers of more than
    6 digits are skipped); the answer is the stripped content of the first closed ``<answer>`` block, None when
    there is none or it is empty.
    """
    if not isinstance(text, str):
        return [], None
    cited: list[int] = []
    support = tagged_block(text, "support")
    if support is not None:
        for token in _INDEX.findall(support):
            if len(token) <= 6 and int(token) not in cited:
                cited.append(int(token))
                if len(cited) == MAX_HOPS:
                    break
    answer = tagged_block(text, "answer")
    answer = answer.strip() if answer is not None else None
    return cited, answer or None


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, punctuation and the articles a/an/the removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 of two strings (both normalising to nothing: 1; one of them: 0)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, answer: str, aliases: Sequence[str] = ()) -> float:
    """Token F1 against the answer and each alias, the best one."""
    return max(token_f1(prediction, gold) for gold in (answer, *aliases))


# ------------------------------------------------------------------------------------------------ reward


def score(cited: Sequence[int], answer: str | None, ground_truth: Mapping[str, Any]) -> list[float]:
    """The 5 reward values of parsed citations and answer against a record's ``ground_truth``."""
    if not answer:
        return [0.0] * len(DIMS)
    gold = list(ground_truth["support"])
    kept = set(list(dict.fromkeys(cited))[:MAX_HOPS])
    hops = [1.0 if i >= len(gold) or gold[i] in kept else 0.0 for i in range(MAX_HOPS)]
    return [*hops, best_f1(answer, ground_truth["answer"], ground_truth.get("answer_aliases") or ())]


def musique_reward(candidate: str, sample: Mapping[str, Any]) -> list[float]:
    """The ``musique`` reward: ``[hop_1, hop_2, hop_3, hop_4, answer_f1]`` of one answer; malformed -> zeros."""
    cited, answer = parse_answer(candidate)
    return score(cited, answer, sample["ground_truth"])


def scalar_f(values: Sequence[float]) -> float:
    """f = (sum of hops + 3 * answer_f1) / 7."""
    return sum(w * v for w, v in zip(F_WEIGHTS, values)) / sum(F_WEIGHTS)


__all__ = ["DIMS", "F_WEIGHTS", "make_record", "musique_reward", "normalize_answer", "parse_answer", "scalar_f",
           "score", "token_f1", "user_prompt"]
