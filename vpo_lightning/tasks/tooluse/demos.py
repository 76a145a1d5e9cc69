"""Tool-use demonstrations for the supervised cold start (``data.builder: tooluse``, registered in
:mod:`vpo_lightning.tasks.demos`): the gold call(s) alone, and chains of m attempts in which the gold is one attempt
at a random position and the others are plausible, well-formed alternatives."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vpo_lightning.tasks.demos import chain_completion, demo, register_demos, seeded_rng
from vpo_lightning.tasks.tooluse import format_answer
from vpo_lightning.tasks.tooluse.reward import gold_calls


def _first_value(acceptable: Any) -> tuple[bool, Any]:
    """(present, value): the first acceptable non-empty BFCL value; absent when the argument is optional only."""
    values = acceptable if isinstance(acceptable, list) else [acceptable]
    concrete = [v for v in values if v != ""]
    return (True, concrete[0]) if concrete else (False, None)


def gold_answer_calls(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The record's gold calls as concrete calls: each argument at its first acceptable value; optional ones
    (whose acceptable values are only ``""``) left out."""
    calls = []
    for name, args in gold_calls(record):
        params = {}
        for key, acceptable in args.items():
            present, value = _first_value(acceptable)
            if present:
                params[key] = value
        calls.append({"name": name, "parameters": params})
    return calls


def _tool_docs(record: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(t.get("name")): t for t in record.get("tools") or [] if isinstance(t, Mapping)}


def _typed_default(schema: Mapping[str, Any], pool: Sequence[Any]) -> Any:
    """A plausible value for a parameter of this schema: a same-typed value from ``pool`` (the gold's values)
    when there is one, else the documented default or enum's first value, else a neutral value of the type."""
    kind = str(schema.get("type", "string"))
    checks: dict[str, Callable[[Any], bool]] = {
        "string": lambda v: isinstance(v, str), "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, float), "number": lambda v: isinstance(v, (int, float)),
        "boolean": lambda v: isinstance(v, bool), "array": lambda v: isinstance(v, list),
        "tuple": lambda v: isinstance(v, list), "dict": lambda v: isinstance(v, dict),
        "object": lambda v: isinstance(v, dict),
    }
    same = [v for v in pool if checks.get(kind, lambda v: False)(v)]
    if same:
        return same[0]
    if schema.get("enum"):
        return schema["enum"][0]
    if "default" in schema and schema["default"] not in (None, ""):
        return schema["default"]
    return {"string": "", "integer": 1, "float": 1.0, "number": 1, "boolean": True, "array": [], "tuple": [],
            "dict": {}, "object": {}}.get(kind, "")


def _perturb_value(value: Any, rng: random.Random) -> Any:
    """A nearby but different value: numbers shifted, booleans flipped, strings shortened, lists trimmed."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([-1, 1]) * max(1, abs(value) // 10)
    if isinstance(value, float):
        return round(value * rng.choice([0.5, 2.0]), 4) if value else 1.0
    if isinstance(value, str):
        words = value.split()
        if len(words) > 1:
            return " ".join(words[:-1])
        return value.lower() if value != value.lower() else value.title() + "s"
    if isinstance(value, list) and len(value) > 1:
        return value[:-1]
    return None


def _alt_other_value(record: Mapping[str, Any], calls: list[dict], rng: random.Random) -> list[dict] | None:
    """Another value BFCL also accepts for one argument (an equally right attempt, written differently)."""
    gold = gold_calls(record)
    options = []
    for i, (_, args) in enumerate(gold[: len(calls)]):
        for key, acceptable in args.items():
            values = [v for v in (acceptable if isinstance(acceptable, list) else [acceptable]) if v != ""]
            if len(values) > 1 and key in calls[i]["parameters"]:
                options.extend((i, key, v) for v in values[1:])
    if not options:
        return None
    i, key, value = rng.choice(options)
    out = copy.deepcopy(calls)
    out[i]["parameters"][key] = value
    return out


def _alt_optional(record: Mapping[str, Any], calls: list[dict], rng: random.Random) -> list[dict] | None:
    """Add an optional parameter the tool documents (at its documented default), or drop a present one."""
    docs, options = _tool_docs(record), []
    for i, call in enumerate(calls):
        params = (docs.get(call["name"]) or {}).get("parameters") or {}
        props, required = params.get("properties") or {}, set(params.get("required") or [])
        for key, schema in props.items():
            if key in required or not isinstance(schema, Mapping):
                continue
            if key in call["parameters"]:
                options.append((i, key, None))
            elif "default" in schema and schema["default"] not in (None, ""):
                options.append((i, key, schema["default"]))
    if not options:
        return None
    i, key, value = rng.choice(options)
    out = copy.deepcopy(calls)
    if value is None:
        out[i]["parameters"].pop(key)
    else:
        out[i]["parameters"][key] = value
    return out


def _alt_perturb(record: Mapping[str, Any], calls: list[dict], rng: random.Random) -> list[dict] | None:
    """Change one argument value to a nearby one (a plausible misreading of the request)."""
    options = [(i, k) for i, c in enumerate(calls) for k, v in c["parameters"].items()
               if _perturb_value(v, random.Random(0)) is not None]
    if not options:
        return None
    i, key = rng.choice(options)
    out = copy.deepcopy(calls)
    out[i]["parameters"][key] = _perturb_value(out[i]["parameters"][key], rng)
    return out


def _alt_other_tool(record: Mapping[str, Any], calls: list[dict], rng: random.Random) -> list[dict] | None:
    """Call another listed tool instead (its required arguments filled with same-typed values from the gold)."""
    docs = _tool_docs(record)
    used = {c["name"] for c in calls}
    others = [name for name in docs if name not in used]
    if not others:
        return None
    name = rng.choice(others)
    params = (docs[name].get("parameters") or {})
    props, required = params.get("properties") or {}, params.get("required") or []
    pool = [v for c in calls for v in c["parameters"].values()]
    new = {"name": name, "parameters": {k: _typed_default(props.get(k) or {}, pool) for k in required
                                        if isinstance(k, str)}}
    if not calls:
        return [new]
    out = copy.deepcopy(calls)
    out[rng.randrange(len(out))] = new
    return out


def _alt_drop_call(record: Mapping[str, Any], calls: list[dict], rng: random.Random) -> list[dict] | None:
    """Make only some of several calls (parallel requests)."""
    if len(calls) < 2:
        return None
    out = copy.deepcopy(calls)
    out.pop(rng.randrange(len(out)))
    return out


_ALTERNATIVES = (_alt_other_value, _alt_optional, _alt_perturb, _alt_other_tool, _alt_drop_call)
_CLARIFY = "Could you give me more details so that I can pick the right tool and arguments?"


def _think(calls: Sequence[Mapping[str, Any]]) -> str:
    if not calls:
        return "None of the listed tools fits this request."
    names = list(dict.fromkeys(c["name"] for c in calls))
    return f"The request needs {' and '.join(names)}."


def tooluse_answer(calls: Sequence[Mapping[str, Any]]) -> str:
    """One answer in the ToolRL format of the system prompt: a short think naming the tool(s), then the calls
    (or, with no calls, a refusal in ``<response>``)."""
    return format_answer(calls, think=_think(calls))


def tooluse_alternatives(record: Mapping[str, Any], k: int, rng: random.Random) -> list[str]:
    """``k`` other attempts for a chain: well-formed, plausible, and different from the gold and each other.

    How: each attempt is the gold call list changed in one way, picked at random among those that apply:
    another value BFCL also accepts for an argument; an optional documented parameter added at its default (or
    a present optional one dropped); one argument value moved to a nearby one (number shifted, boolean flipped,
    string shortened by a word, list trimmed); another listed tool called instead, with same-typed values from
    the request; one of several parallel calls left out. Attempts are compared as JSON and repeats are redrawn;
    when no change applies any more, the attempt asks for clarification in ``<response>`` (still in format).
    """
    gold = gold_answer_calls(record)
    seen = {json.dumps(gold, sort_keys=True)}
    out: list[str] = []
    for _ in range(20 * k):
        if len(out) == k:
            break
        alt = rng.choice(_ALTERNATIVES)(record, gold, rng)
        if alt is None:
            continue
        key = json.dumps(alt, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        out.append(tooluse_answer(alt))
    while len(out) < k:
        text = format_answer([], think="The request is missing details.", response=_CLARIFY)
        if text in out:
            break
        out.append(text)
    return out


@register_demos("tooluse", family="response")
def tooluse_demos(record: Mapping[str, Any], formats: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """Demonstrations for one tool-use record: the gold call(s) alone (m = 1), and chains of m attempts in which
    the gold is one attempt at a random position and the others come from :func:`tooluse_alternatives`."""
    gold = tooluse_answer(gold_answer_calls(record))
    out = []
    for m in formats:
        rng = seeded_rng(seed, record.get("id"), m)
        if m == 1:
            completion = gold
        else:
            alts = tooluse_alternatives(record, m - 1, rng)
            if len(alts) < m - 1:
                continue
            answers = list(alts)
            answers.insert(rng.randrange(m), gold)
            completion = chain_completion(answers, "response")
        out.append(demo(record, m, "response", completion))
    return out
