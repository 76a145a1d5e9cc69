"""Demonstrations for the supervised cold start, built from a task's training records only.

A demonstration is ``{"id", "source_id", "m", "messages", "completion"}``: ``messages`` is the prompt exactly as a
rollout builds it (the record's messages; for a chain, the m-answer instruction of :mod:`vpo_lightning.core.chains`
appended to the last user message) and ``completion`` the assistant text the model learns to write. Each training
record gives one demonstration per entry of ``formats`` (``1`` = single answer, ``m > 1`` = an m-answer chain), so
that every estimator (GRPO's single answers, VPO's chains) can start from the same SFT adapter.

Only training files are read: :func:`check_training_file` refuses a file named ``val*``/``test*`` or holding
records marked ``meta.split`` val/test, and :func:`held_out_prompts` collects the prompts of the ``val.jsonl`` and
``test.jsonl`` beside the training file, so that a training record whose prompt also appears there is skipped.

The builders are pure Python and seeded: ``(seed, record id)`` fixes every random choice.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.core.chains import build_instruction
from vpo_lightning.tasks.maze import MOVES, Maze
from vpo_lightning.tasks.tooluse import format_answer
from vpo_lightning.tasks.tooluse.reward import gold_calls
from vpo_lightning.training.datamodule import read_jsonl

HELD_OUT_SPLITS = ("val", "test")
FAMILIES = {"tooluse": "response", "maze": "route"}


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


def _rng(seed: int, *parts: Any) -> random.Random:
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


# ---------------------------------------------------------------------------------------------- tool use


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


def tooluse_demos(record: Mapping[str, Any], formats: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """Demonstrations for one tool-use record: the gold call(s) alone (m = 1), and chains of m attempts in which
    the gold is one attempt at a random position and the others come from :func:`tooluse_alternatives`."""
    gold = tooluse_answer(gold_answer_calls(record))
    out = []
    for m in formats:
        rng = _rng(seed, record.get("id"), m)
        if m == 1:
            completion = gold
        else:
            alts = tooluse_alternatives(record, m - 1, rng)
            if len(alts) < m - 1:
                continue
            answers = list(alts)
            answers.insert(rng.randrange(m), gold)
            completion = chain_completion(answers, "response")
        out.append(_demo(record, m, "response", completion))
    return out


# ---------------------------------------------------------------------------------------------- maze


def distances_to_exit(maze: Maze) -> dict[tuple[int, int], int]:
    """Moves from every open cell to the exit (BFS from the exit; lava and zones are ordinary floor here)."""
    dist = {maze.exit: 0}
    todo = deque([maze.exit])
    n = len(maze.grid)
    while todo:
        r, c = todo.popleft()
        for dr, dc in MOVES.values():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < n and 0 <= nxt[1] < n and maze.is_open(nxt) and nxt not in dist:
                dist[nxt] = dist[(r, c)] + 1
                todo.append(nxt)
    return dist


def random_walk(maze: Maze, rng: random.Random, dist: Mapping[tuple[int, int], int] | None = None,
                slack: int | None = None) -> list[str]:
    """A random route from the start that reaches the exit within the budget (and, with ``slack``, within
    ``slack`` moves of the shortest route: a near-shortest route with at most slack/2 detours).

    Each move is drawn uniformly among the moves into an open cell from which the exit is still reachable within
    the budget left (so the walk never fails), not turning straight back unless it has to. The walk wanders
    where the budget leaves slack and heads for the exit where it does not. Gold, diamonds and lava play no part
    in the choice: the walk visits them only by chance.

    Why not better routes: the cold start teaches the answer format and the rules (stay on open cells, reach
    the exit within the budget), nothing about the gold-versus-diamond trade-off, so that whatever RL later
    learns about that trade-off is RL's doing and not the demonstrations'.

    ``dist`` is :func:`distances_to_exit` of the maze when the caller has it already.
    """
    def choices(pos: tuple[int, int], moves: list[str], steps: list[tuple[str, tuple[int, int]]]
                ) -> list[tuple[str, tuple[int, int]]]:
        options = [(name, nxt) for name, nxt in steps if len(moves) + 1 + dist[nxt] <= limit]
        back = {"U": "D", "D": "U", "L": "R", "R": "L"}.get(moves[-1]) if moves else None
        return [o for o in options if o[0] != back] or options

    dist = distances_to_exit(maze) if dist is None else dist
    limit = maze.budget if slack is None or maze.start not in dist else min(maze.budget, dist[maze.start] + slack)
    return _route(maze, rng, dist, choices)


def near_shortest_walk(maze: Maze, rng: random.Random, dist: Mapping[tuple[int, int], int] | None = None
                       ) -> list[str]:
    """:func:`random_walk` at most 2 moves longer than the shortest route (one detour)."""
    return random_walk(maze, rng, dist, slack=2)


def _route(maze: Maze, rng: random.Random, dist: Mapping[tuple[int, int], int],
           choices: Callable[[tuple[int, int], list[str], list[tuple[str, tuple[int, int]]]],
                             list[tuple[str, tuple[int, int]]]]) -> list[str]:
    """Moves from the start to the exit, each drawn uniformly from ``choices(position, moves so far, steps)``,
    where ``steps`` are the (move, cell) pairs into open cells that can reach the exit; ``[]`` when the exit is
    out of reach or beyond the budget."""
    if maze.start not in dist or dist[maze.start] > maze.budget:
        return []
    n = len(maze.grid)
    pos, moves = maze.start, []
    while pos != maze.exit:
        steps = [(name, (pos[0] + dr, pos[1] + dc)) for name, (dr, dc) in MOVES.items()
                 if 0 <= pos[0] + dr < n and 0 <= pos[1] + dc < n and (pos[0] + dr, pos[1] + dc) in dist]
        name, pos = rng.choice(choices(pos, moves, steps))
        moves.append(name)
    return moves


def random_shortest_route(maze: Maze, rng: random.Random, dist: Mapping[tuple[int, int], int] | None = None
                          ) -> list[str]:
    """A shortest route from the start to the exit, drawn move by move: each move is uniform among the moves that
    bring the exit one move closer (``[]`` when the exit is out of reach or beyond the budget).

    Like :func:`random_walk`, blind to gold, diamonds and lava: a route passes the gold or the diamond zone only
    when a shortest route happens to, which on the corner-to-corner 5x5 mazes is about as often one as the other.
    What it teaches that a wandering walk does not: every move heads for the exit, so the direction of each move
    follows from where S and E are (a small model trained on wandering walks ignored them; docs/results_maze.md).
    """
    dist = distances_to_exit(maze) if dist is None else dist
    return _route(maze, rng, dist, lambda pos, moves, steps: [o for o in steps if dist[o[1]] == dist[pos] - 1])


def _maze_routes(maze: Maze, m: int, rng: random.Random, dist: Mapping[tuple[int, int], int],
                 draws: Sequence[Callable[..., list[str]]]) -> list[str]:
    """Up to m different routes: 50 draws from each route maker of ``draws`` in turn until m are found."""
    routes: list[str] = []
    for draw in draws:
        for _ in range(50):
            if len(routes) == m:
                return routes
            walk = " ".join(draw(maze, rng, dist))
            if walk and walk not in routes:
                routes.append(walk)
    return routes


def _maze_demos(record: Mapping[str, Any], formats: Sequence[int], seed: int,
                draws: Sequence[Callable[..., list[str]]]) -> list[dict[str, Any]]:
    maze = Maze.from_dict(record["ground_truth"])
    dist = distances_to_exit(maze)
    out = []
    for m in formats:
        routes = _maze_routes(maze, m, _rng(seed, record.get("id"), m), dist, draws)
        if len(routes) < m:
            continue
        completion = f"<route>{routes[0]}</route>" if m == 1 else chain_completion(routes, "route")
        out.append(_demo(record, m, "route", completion))
    return out


def maze_demos(record: Mapping[str, Any], formats: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """Demonstrations for one maze record (``data.builder: maze``): a random valid walk (see :func:`random_walk`)
    in ``<route>`` tags (m = 1), and chains of m different random walks in ``<route_i>`` tags (records whose budget
    leaves fewer than m different walks in 50 draws get no chain)."""
    return _maze_demos(record, formats, seed, (random_walk,))


def maze_shortest_demos(record: Mapping[str, Any], formats: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """Demonstrations for one maze record (``data.builder: maze_shortest``): a random shortest route (see
    :func:`random_shortest_route`) for m = 1; for a chain, m different shortest routes, completed with different
    random valid walks (:func:`random_walk`, longer) where the maze has fewer than m shortest routes, shortest
    first."""
    return _maze_demos(record, formats, seed, (random_shortest_route, random_walk))


# ---------------------------------------------------------------------------------------------- all together


def _demo(record: Mapping[str, Any], m: int, family: str, completion: str) -> dict[str, Any]:
    return {"id": f"{record.get('id')}-m{m}", "source_id": record.get("id"), "m": m,
            "messages": chain_messages(record["messages"], m, family), "completion": completion}


def maze_direct_demos(record: Mapping[str, Any], formats: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """Demonstrations for one maze record (``data.builder: maze_direct``): as :func:`maze_shortest_demos` (the
    same single answers), but a chain is completed with near-shortest routes (:func:`near_shortest_walk`: one
    detour) before any longer walk, so that no chain position is taught to wander: with ``maze_shortest`` the
    third route of most 5x5 chains was a 10-12-move walk, and the model's third routes reached the exit half as
    often as its first (docs/results_maze.md)."""
    return _maze_demos(record, formats, seed, (random_shortest_route, near_shortest_walk, random_walk))


BUILDERS: dict[str, Callable[[Mapping[str, Any], Sequence[int], int], list[dict[str, Any]]]] = {
    "tooluse": tooluse_demos, "maze": maze_demos, "maze_shortest": maze_shortest_demos,
    "maze_direct": maze_direct_demos,
}


def build_demos(files: Sequence[str | Path], builder: str, formats: Sequence[int], seed: int = 0
                ) -> tuple[list[dict[str, Any]], int]:
    """Demonstrations from training files.

    Args:
        files: training JSONL files of the task (never val/test: refused by :func:`check_training_file`).
        builder: ``tooluse`` or ``maze``.
        formats: answers per demonstration, e.g. ``[1, 3]`` for single answers and 3-answer chains.
        seed: seed of every random choice (with the record id).

    Returns:
        ``(demos, skipped)``: the demonstrations, and how many records were skipped because their prompt also
        appears in the val/test files beside the training file.
    """
    if builder not in BUILDERS:
        raise ValueError(f"data.builder={builder!r}: use one of {sorted(BUILDERS)} (or none for ready demos)")
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
            demos.extend(BUILDERS[builder](record, formats, seed))
    return demos, skipped
