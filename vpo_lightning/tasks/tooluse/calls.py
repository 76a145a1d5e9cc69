"""Tool-use calls and their scores (ToolRL style, VPO-SPEC section 8): ``format``, ``tool_name``, ``arg_key``,
``arg_value``; :mod:`vpo_lightning.tasks.tooluse.reward` registers the four rewards.

The candidate is model text in the format of :mod:`vpo_lightning.tasks.tooluse`: ``<think>..</think>``, then
``<tool_call>`` blocks holding JSON call objects ``{"name": ..., "parameters": {...}}`` and/or a ``<response>``.
The gold (``sample["ground_truth"]``) is BFCL's possible answer: a list of calls ``{func_name: {arg: [acceptable
values...]}}``; an empty list means no call is expected. An acceptable value ``""`` marks an optional argument.

Calls are aligned greedily: pairs with the same name first, then most shared argument keys, then (a tie-break
the spec leaves open) the best value agreement, so parallel calls given in another order still align.

Value matching: bools by equality, numbers within 1e-9 (int and float alike), strings by SQuAD token F1 (1 when
BFCL's own string standardisation makes them equal), lists by multiset F1 (elements matched greedily with the same
value match), dicts by key F1 where each shared key counts its value match (plain key F1 when the values agree;
BFCL gold dicts hold acceptable-value lists per key, like top-level arguments, and ``""`` marks optional keys).

Where the record carries its tool documents (``sample["tools"]``), the gold is reconciled with them the way
BFCL's checker reads them: an argument the document requires stays required even when the gold also accepts
``""``, and an optional gold argument the document does not define is not expected (a few BFCL entries have both
inconsistencies).

Every function here is total: arbitrary text yields values in [0, 1] and never raises.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

_JSON_START = re.compile(r"[{\[]")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_BFCL_STRIP = re.compile(r"[ ,./\-_*^]")
_PUNCT = str.maketrans("", "", string.punctuation)
_DECODER = json.JSONDecoder()
MAX_FAILED_DECODES = 64  # per <tool_call> block: keeps parsing linear on pathological text

Call = tuple[str, dict]  # (name, parameters)


class Parsed(NamedTuple):
    """A candidate's structure: where its blocks start (-1 = absent) and the calls it makes."""

    think_end: int
    tool_call_start: int  # first complete <tool_call> block
    response_start: int  # first complete <response> block
    has_tool_call_tag: bool  # any "<tool_call>" text at all, closed or not
    calls: tuple[Call, ...]


# ---------------------------------------------------------------- parsing


def _as_call(obj: Any) -> Call | None:
    """``{"name": str, "parameters"|"arguments": dict or JSON text}`` -> (name, params), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    params = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except Exception:  # noqa: BLE001 - malformed model text
            return None
    if params is None:
        params = {}
    return (obj["name"], params) if isinstance(params, dict) else None


def _json_values(text: str) -> list[Any]:
    """Every JSON object/array decodable in ``text``, scanning left to right (invalid spans are skipped).

    After ``MAX_FAILED_DECODES`` failed attempts the rest is ignored, so the cost stays linear in ``len(text)``.
    """
    values, pos, failures = [], 0, 0
    while failures < MAX_FAILED_DECODES and (match := _JSON_START.search(text, pos)) is not None:
        try:
            value, end = _DECODER.raw_decode(text, match.start())
        except Exception:  # noqa: BLE001 - JSONDecodeError, RecursionError on deep nesting, huge ints ...
            pos, failures = match.start() + 1, failures + 1
            continue
        values.append(value)
        pos = end
    return values


def parse_calls(block: str) -> list[Call]:
    """The tool calls in one ``<tool_call>`` block: JSON call objects, one per line or in a JSON list."""
    calls = []
    for value in _json_values(block):
        for item in value if isinstance(value, list) else [value]:
            call = _as_call(item)
            if call is not None:
                calls.append(call)
    return calls


def _blocks(text: str, tag: str, first_only: bool = False) -> list[tuple[int, str]]:
    """(start, inner text) of each complete ``<tag>...</tag>`` block, like a non-greedy regex but linear."""
    open_tag, close_tag, out, pos = f"<{tag}>", f"</{tag}>", [], 0
    while (start := text.find(open_tag, pos)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            break
        out.append((start, text[start + len(open_tag) : end]))
        pos = end + len(close_tag)
        if first_only:
            break
    return out


@lru_cache(maxsize=1024)
def parse_output(text: str) -> Parsed:
    """Parse a candidate answer; never raises. Calls come from all complete ``<tool_call>`` blocks.

    Args:
        text: the model's completion.

    Returns:
        A :class:`Parsed` (treat it as read-only: results are cached).
    """
    text = text if isinstance(text, str) else ""
    think = _blocks(text, "think", first_only=True)
    blocks = _blocks(text, "tool_call")
    response = _blocks(text, "response", first_only=True)
    return Parsed(
        think_end=think[0][0] + len("<think></think>") + len(think[0][1]) if think else -1,
        tool_call_start=blocks[0][0] if blocks else -1,
        response_start=response[0][0] if response else -1,
        has_tool_call_tag="<tool_call>" in text,
        calls=tuple(call for _, inner in blocks for call in parse_calls(inner)),
    )


def _tool_docs(sample: Mapping[str, Any]) -> dict[str, tuple[set, set]]:
    """Tool name -> (parameter names, required names) from the record's tool documents, where given."""
    docs = {}
    for tool in sample.get("tools") or []:
        if isinstance(tool, Mapping) and isinstance(tool.get("parameters"), Mapping):
            params = tool["parameters"]
            props, required = params.get("properties"), params.get("required")
            docs[str(tool.get("name"))] = (
                set(props) if isinstance(props, Mapping) else set(),
                {r for r in required if isinstance(r, str)} if isinstance(required, list) else set(),
            )
    return docs


def _reconcile(args: Mapping[str, Any], doc: tuple[set, set] | None) -> dict[str, Any]:
    """Make gold arguments agree with the tool document, as BFCL's checker reads them.

    An argument the document requires stays required even if the gold allows ``""``; an optional gold argument
    the document lacks is not expected.
    """
    if doc is None:
        return dict(args)
    props, required = doc
    out = {}
    for key, acceptable in args.items():
        alternatives = _alternatives(acceptable)
        if "" in alternatives and key not in props:
            continue
        if "" in alternatives and key in required and any(a != "" for a in alternatives):
            acceptable = [a for a in alternatives if a != ""]
        out[key] = acceptable
    return out


def gold_calls(sample: Mapping[str, Any]) -> list[Call]:
    """The gold calls of a record: BFCL ``[{name: {arg: [acceptable...]}}]`` -> ``[(name, {arg: [...]})]``.

    Where the record carries tool documents, the gold is reconciled with them (see :func:`_reconcile`).
    """
    docs, out = _tool_docs(sample), []
    for item in sample.get("ground_truth") or []:
        if isinstance(item, Mapping):
            for name, args in item.items():
                args = args if isinstance(args, Mapping) else {}
                out.append((str(name), _reconcile(args, docs.get(str(name)))))
    return out


# ---------------------------------------------------------------- value matching


def _alternatives(gold: Any) -> list[Any]:
    """BFCL lists the acceptable values of an argument; a bare value is its only alternative."""
    return gold if isinstance(gold, list) else [gold]


def _is_optional(gold: Any) -> bool:
    return "" in _alternatives(gold)


def _f1(overlap: float, n_pred: int, n_gold: int) -> float:
    if n_pred == 0 and n_gold == 0:
        return 1.0
    if overlap <= 0:
        return 0.0
    precision, recall = overlap / n_pred, overlap / n_gold
    return 2 * precision * recall / (precision + recall)


def _normalize(text: str) -> list[str]:
    """SQuAD answer normalisation: lower case, no punctuation, no articles, whitespace-split tokens."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split()


def string_match(pred: str, gold: str) -> float:
    """SQuAD token F1; 1 when BFCL's standardisation (no spaces/``,./-_*^``, lower case) makes them equal."""
    if len(pred) + len(gold) <= 512:
        return _string_match_cached(pred, gold)
    return _string_match(pred, gold)


@lru_cache(maxsize=16384)
def _string_match_cached(pred: str, gold: str) -> float:
    return _string_match(pred, gold)


def _string_match(pred: str, gold: str) -> float:
    if _BFCL_STRIP.sub("", pred).lower() == _BFCL_STRIP.sub("", gold).lower():
        return 1.0
    pred_tokens, gold_tokens = _normalize(pred), _normalize(gold)
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens and pred.strip().lower() == gold.strip().lower())
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    return _f1(common, len(pred_tokens), len(gold_tokens))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number_match(pred: float, gold: float) -> float:
    try:
        return float(pred == gold or abs(pred - gold) < 1e-9)
    except (OverflowError, TypeError, ValueError):
        return 0.0


def _greedy_overlap(scores: list[tuple[float, int, int]]) -> float:
    """Sum of pair scores under a greedy one-to-one matching (best pairs first)."""
    used_a, used_b, total = set(), set(), 0.0
    for score, a, b in sorted(scores, key=lambda t: (-t[0], t[1], t[2])):
        if score > 0 and a not in used_a and b not in used_b:
            used_a.add(a)
            used_b.add(b)
            total += score
    return total


def list_match(pred: list, gold: list) -> float:
    """Multiset F1 of two lists; elements are paired greedily by :func:`value_match` (exact -> multiset F1)."""
    scores = [(value_match(p, g), i, j) for i, p in enumerate(pred) for j, g in enumerate(gold)]
    return _f1(_greedy_overlap(scores), len(pred), len(gold))


def dict_match(pred: Mapping, gold: Mapping) -> float:
    """Key F1 of two dicts where a shared key counts its value match; gold keys allowing ``""`` are optional."""
    overlap = sum(best_match(pred[k], g) for k, g in gold.items() if k in pred)
    n_gold = sum(1 for k, g in gold.items() if k in pred or not _is_optional(g))
    return _f1(overlap, len(pred), n_gold)


def value_match(pred: Any, gold: Any) -> float:
    """Match of one predicted value against one acceptable gold value, in [0, 1]."""
    if isinstance(gold, bool) or isinstance(pred, bool):
        return float(isinstance(pred, bool) and isinstance(gold, bool) and pred == gold)
    if _is_number(gold) and _is_number(pred):
        return _number_match(pred, gold)
    if isinstance(gold, str) and isinstance(pred, str):
        return string_match(pred, gold)
    if isinstance(gold, list) and isinstance(pred, list):
        return list_match(pred, gold)
    if isinstance(gold, Mapping) and isinstance(pred, Mapping):
        return dict_match(pred, gold)
    return float(gold is None and pred is None)


def best_match(pred: Any, gold: Any) -> float:
    """The best :func:`value_match` of ``pred`` over the acceptable values in ``gold``."""
    best = 0.0
    for alternative in _alternatives(gold):
        best = max(best, value_match(pred, alternative))
        if best >= 1.0:
            break
    return best


# ---------------------------------------------------------------- per-call scores and alignment


def key_f1(pred: Mapping, gold: Mapping) -> float:
    """Key-set F1 of one call pair; optional gold keys count only when the prediction gives them."""
    shared = sum(1 for k in gold if k in pred)
    n_gold = sum(1 for k, g in gold.items() if k in pred or not _is_optional(g))
    return _f1(shared, len(pred), n_gold)


def value_score(pred: Mapping, gold: Mapping) -> float:
    """Mean over gold keys of the best value match; an omitted optional key counts as matched (1 if no keys)."""
    if not gold:
        return 1.0
    total = 0.0
    for key, acceptable in gold.items():
        if key in pred:
            total += best_match(pred[key], acceptable)
        elif _is_optional(acceptable):
            total += 1.0
    return total / len(gold)


def align(pred: Sequence[Call], gold: Sequence[Call]) -> list[tuple[int, int]]:
    """Greedy one-to-one alignment of predicted to gold calls.

    Pairs are taken best first by (same name, number of shared argument keys, value agreement), ties by order.

    Returns:
        ``[(pred_index, gold_index), ...]``, ``min(len(pred), len(gold))`` pairs.
    """
    if len(pred) == 1 and len(gold) == 1:
        return [(0, 0)]
    ranked = []
    for i, (p_name, p_args) in enumerate(pred):
        for j, (g_name, g_args) in enumerate(gold):
            shared = sum(1 for k in g_args if k in p_args)
            values = value_score(p_args, g_args) if p_name == g_name else 0.0  # only breaks ties among same names
            ranked.append((p_name != g_name, -shared, -values, j, i))
    ranked.sort()
    used_p, used_g, pairs = set(), set(), []
    for *_, j, i in ranked:
        if i not in used_p and j not in used_g:
            used_p.add(i)
            used_g.add(j)
            pairs.append((i, j))
    return pairs


def _pair_mean(candidate: str, sample: Mapping[str, Any], score) -> float:
    """Mean of ``score(pred_args, gold_args)`` over aligned pairs, divided by max(#pred, #gold)."""
    pred, gold = parse_output(candidate).calls, gold_calls(sample)
    if not gold:
        return _abstention(candidate, sample)
    total = sum(score(pred[i][1], gold[j][1]) for i, j in align(pred, gold))
    return min(1.0, max(0.0, total / max(len(pred), len(gold))))


def _abstention(candidate: str, sample: Mapping[str, Any]) -> float:
    """tool_name, arg_key and arg_value when the gold has no call: "1 if both empty" (VPO-SPEC section 8) counts
    only a well-formed abstention, ``<think>`` then ``<response>`` and no ``<tool_call>`` tag (the format reward).

    Without this, any malformed text (an unclosed or unparseable ``<tool_call>``, prose, an empty string) parses to
    no calls and would earn 1 on three of the four dimensions of every no-call prompt: a reward a policy can forge
    by writing garbage. BFCL's irrelevance check ("no function call decoded") accepts such text; here it scores 0.
    """
    return format_reward(candidate, sample)


# ---------------------------------------------------------------- the four rewards


def format_reward(candidate: str, sample: Mapping[str, Any]) -> float:
    """1 iff the answer has the expected shape, else 0.

    A ``<think>`` block must come first; then, when the gold has calls, a ``<tool_call>`` block with at least one
    parsed call (a ``<response>`` may follow); when it has none, a ``<response>`` block and no ``<tool_call>``.
    """
    parsed = parse_output(candidate)
    if parsed.think_end < 0:
        return 0.0
    if gold_calls(sample):
        ok = parsed.tool_call_start >= parsed.think_end and len(parsed.calls) > 0
    else:
        ok = parsed.response_start >= parsed.think_end and not parsed.has_tool_call_tag
    return float(ok)


def tool_name_reward(candidate: str, sample: Mapping[str, Any]) -> float:
    """Multiset F1 of the called tool names against the gold names (no call expected: :func:`_abstention`)."""
    gold = Counter(name for name, _ in gold_calls(sample))
    if not gold:
        return _abstention(candidate, sample)
    pred = Counter(name for name, _ in parse_output(candidate).calls)
    return _f1(sum((pred & gold).values()), sum(pred.values()), sum(gold.values()))


def arg_key_reward(candidate: str, sample: Mapping[str, Any]) -> float:
    """Mean argument-key F1 over aligned call pairs; unmatched calls on either side count 0 (no call expected:
    :func:`_abstention`)."""
    return _pair_mean(candidate, sample, key_f1)


def arg_value_reward(candidate: str, sample: Mapping[str, Any]) -> float:
    """Mean fraction of matching gold argument values over aligned call pairs; unmatched calls count 0."""
    return _pair_mean(candidate, sample, value_score)


def tooluse_rewards(candidate: str, sample: Mapping[str, Any]) -> list[float]:
    """All four dimensions at once, ``[format, tool_name, arg_key, arg_value]`` (for tests and analysis)."""
    return [fn(candidate, sample) for fn in (format_reward, tool_name_reward, arg_key_reward, arg_value_reward)]
