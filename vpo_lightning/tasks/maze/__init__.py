"""Maze task: a seeded maze generator (5x5, 7x7 or the paper's 9x9), its text rendering, route parsing and
simulation under two reward modes (sparse, the paper's; shaped, for small models) and the reward. Drawing
mazes and routes as PNG: :mod:`vpo_lightning.tasks.maze.draw`.

The maze is a tile grid: cells with two even coordinates are rooms, a randomized Prim's algorithm opens the
walls between rooms to make a spanning tree, then a few more walls are removed to create cycles. The start and
the exit are on opposite corners, a gold zone and a diamond zone (the corner cell and its two nearest open
cells) on the other two corners, and some floor cells are lava. The step budget is drawn so that, checked by
breadth-first search over (cell, visited zone cells) for every maze of every size (otherwise the maze is
resampled; :func:`check_maze` re-checks a finished maze):

* collecting the whole gold zone and then reaching the exit fits the budget, and so does the whole diamond zone;
* touching even one gold cell and one diamond cell and reaching the exit does not;
* a lava-free route to the exit fits the budget.

Routes. An answer is a list of moves U (row - 1), D (row + 1), L (column - 1), R (column + 1). Move words are
tolerant: ``U, R, R``, ``URRD``, ``up right``, arrows; other words are ignored; repeat counts are not supported.
Which text is read follows the reference implementation (``ryanboldi/vpo``, ``vpo_tasks/maze.py``; docs/FIDELITY.md):
a single answer is the content of its first closed ``<route>...</route>`` block (the reference's
``<answer>...</answer>`` is read too), else the whole text. A chain's answers are split by
:func:`vpo_lightning.core.chains.parse_chain` (closed ``<route_i>`` blocks, then the reference's fallbacks), and
identical routes within one chain count once (:func:`route_key`). In both modes only the first ``budget`` moves
count, a move into a wall or off the grid is blocked (the walker stays put; the move still uses one move of the
budget), and the route ends at its first arrival on the exit (later moves are ignored).

Reward (D = 4, VPO-SPEC section 8): ``[exit, gold, diamond, safety]``.

* ``sparse`` (the reference's, the default): a route that does not reach the exit within the budget scores 0 on
  every dimension. Otherwise the vector is [1, fraction of gold cells visited before the exit, fraction of
  diamond cells visited before the exit, 1 - distinct lava cells stepped on / number of lava cells] (1 when the
  maze has no lava).
* ``shaped`` (a deviation from the reference, for small models whose routes rarely reach the exit; kept only as
  an explicitly named option, used by the results produced before docs/FIDELITY.md): let ``e`` = 1 if the route
  reaches the exit within the budget, else ``0.5 * progress``, with ``progress = max(0, d0 - d) / d0``, ``d0``
  the walking distance from the start to the exit and ``d`` the one from where the route stops. The vector is
  ``e * [1, gold fraction, diamond fraction, 1 - lava fraction]`` with the lava fraction over the moves taken
  (0 for no move). Its safety dimension is nearly a copy of its exit dimension on random walks (correlation 0.994
  measured on cold-start samples), which is why it is no longer the default. A route that stops short of the
  exit scores at most 0.5 on every dimension.

Why no route scores 1 on every dimension, in either mode: exit = 1 needs the exit reached within the budget,
and the budget is drawn below the shortest route that touches one gold cell and one diamond cell before the exit,
so such a route has gold = 0 or diamond = 0. The best routes are a gold route and a diamond route (plus their
lava trade-offs): a real Pareto front with D = 4, which is what VPO's set reward rewards covering.
"""

from __future__ import annotations

import random
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SIZE = 9
SIZES = (5, 7, 9)
RULES = ("sparse", "shaped")
WALL, FLOOR = "#", "."
# per size: (min, max) extra openings (cycles) and (min, max) lava tiles; 9 is the paper's setting
_FEATURES: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {5: ((1, 2), (1, 2)), 7: ((2, 5), (2, 5)),
                                                                   9: ((4, 8), (4, 8))}
ZONE_SIZE = 3
TASK = "maze"
DIMS = ("exit", "gold", "diamond", "safety")
MOVES: dict[str, tuple[int, int]] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
Cell = tuple[int, int]

SYSTEM_PROMPT = (
    "You are an expert at grid puzzles. Trace routes carefully cell by cell, then answer in exactly the "
    "requested format."
)


@dataclass(frozen=True)
class Maze:
    """A generated maze (coordinates are ``(row, column)``, row 0 at the top).

    Attributes:
        grid: ``SIZE`` strings of ``#`` (wall) and ``.`` (floor); features are listed separately.
        start, exit: the start and exit cells (opposite corners).
        gold, diamond: the zone cells (the other two corners and their nearest open cells).
        lava: lava floor cells (stepping on them is allowed but lowers the safety reward).
        budget: the maximum number of moves.
        seed: the generator seed.
        rules: the reward mode, ``sparse`` (the paper's) or ``shaped`` (see the module docstring).
    """

    grid: tuple[str, ...]
    start: Cell
    exit: Cell
    gold: tuple[Cell, ...]
    diamond: tuple[Cell, ...]
    lava: tuple[Cell, ...]
    budget: int
    seed: int = -1
    stats: dict[str, int] = field(default_factory=dict, compare=False)
    rules: str = "sparse"

    def is_open(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < len(self.grid) and 0 <= c < len(self.grid[0]) and self.grid[r][c] == FLOOR

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (cells as ``[row, col]`` lists), as stored in a record's ``ground_truth``."""
        return {
            "grid": list(self.grid), "start": list(self.start), "exit": list(self.exit),
            "gold": [list(c) for c in self.gold], "diamond": [list(c) for c in self.diamond],
            "lava": [list(c) for c in self.lava], "budget": self.budget, "seed": self.seed, "stats": self.stats,
            "rules": self.rules,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Maze:
        """Inverse of :meth:`to_dict`."""

        def cells(key: str) -> tuple[Cell, ...]:
            return tuple((int(r), int(c)) for r, c in d[key])

        return cls(tuple(d["grid"]), (int(d["start"][0]), int(d["start"][1])), (int(d["exit"][0]), int(d["exit"][1])),
                   cells("gold"), cells("diamond"), cells("lava"), int(d["budget"]), int(d.get("seed", -1)),
                   dict(d.get("stats", {})), str(d.get("rules", "sparse")))


# --------------------------------------------------------------------------------------------- generation


def _neighbors(cell: Cell, size: int = SIZE) -> Iterable[Cell]:
    r, c = cell
    for dr, dc in MOVES.values():
        if 0 <= r + dr < size and 0 <= c + dc < size:
            yield (r + dr, c + dc)


def _prim(rng: random.Random, size: int = SIZE) -> list[list[str]]:
    """A randomized Prim's maze: rooms at even coordinates, a spanning tree of opened walls between them."""
    grid = [[WALL] * size for _ in range(size)]
    first = (2 * rng.randrange((size + 1) // 2), 2 * rng.randrange((size + 1) // 2))
    grid[first[0]][first[1]] = FLOOR
    frontier = [(first, (first[0] + 2 * dr, first[1] + 2 * dc)) for dr, dc in MOVES.values()]
    while frontier:
        room, nxt = frontier.pop(rng.randrange(len(frontier)))
        if not (0 <= nxt[0] < size and 0 <= nxt[1] < size) or grid[nxt[0]][nxt[1]] == FLOOR:
            continue
        grid[(room[0] + nxt[0]) // 2][(room[1] + nxt[1]) // 2] = FLOOR
        grid[nxt[0]][nxt[1]] = FLOOR
        frontier += [(nxt, (nxt[0] + 2 * dr, nxt[1] + 2 * dc)) for dr, dc in MOVES.values()]
    return grid


def _add_cycles(grid: list[list[str]], rng: random.Random, count: int) -> None:
    """Open ``count`` random walls that separate two rooms (each one closes a cycle)."""
    size = len(grid)
    walls = [(r, c) for r in range(size) for c in range(size) if (r % 2) != (c % 2) and grid[r][c] == WALL]
    for r, c in rng.sample(walls, min(count, len(walls))):
        grid[r][c] = FLOOR


def _nearest_open(grid: Sequence[Sequence[str]], corner: Cell, n: int) -> tuple[Cell, ...]:
    """The ``n`` open cells closest to ``corner`` by walking distance (BFS order), the corner first."""
    seen, order, todo = {corner}, [corner], deque([corner])
    while todo and len(order) < n:
        for nxt in _neighbors(todo.popleft(), len(grid)):
            if nxt not in seen and grid[nxt[0]][nxt[1]] == FLOOR:
                seen.add(nxt)
                order.append(nxt)
                todo.append(nxt)
    return tuple(order[:n])


def exit_distances(maze: Maze, *, avoid_lava: bool = False) -> dict[int, int]:
    """Shortest number of moves to the exit for each set of visited zone cells (BFS over (cell, mask)).

    Args:
        maze: the maze (its budget is ignored).
        avoid_lava: forbid lava cells.

    Returns:
        ``{mask: moves}``: bit i of ``mask`` is zone cell i of ``maze.gold + maze.diamond`` (gold first); only
        masks with which the exit is reachable appear. The route stops at its first arrival on the exit.
    """
    zone = {cell: i for i, cell in enumerate(maze.gold + maze.diamond)}
    lava = set(maze.lava) if avoid_lava else set()
    start = (maze.start, 0)
    dist, todo, best = {start: 0}, deque([start]), {}
    while todo:
        state = todo.popleft()
        cell, mask = state
        if cell == maze.exit:
            best.setdefault(mask, dist[state])
            continue
        for nxt in _neighbors(cell, len(maze.grid)):
            if not maze.is_open(nxt) or nxt in lava:
                continue
            new = (nxt, mask | (1 << zone[nxt]) if nxt in zone else mask)
            if new not in dist:
                dist[new] = dist[state] + 1
                todo.append(new)
    return best


def budget_bounds(maze: Maze) -> tuple[int, int] | None:
    """``(lo, hi)``: the budgets that satisfy the task's constraints (see the module docstring), or None."""
    best, safe = exit_distances(maze), exit_distances(maze, avoid_lava=True)
    n_gold = len(maze.gold)
    gold_bits, dia_bits = (1 << n_gold) - 1, ((1 << len(maze.diamond)) - 1) << n_gold
    full_gold = min((d for m, d in best.items() if m & gold_bits == gold_bits), default=None)
    full_dia = min((d for m, d in best.items() if m & dia_bits == dia_bits), default=None)
    both = min((d for m, d in best.items() if m & gold_bits and m & dia_bits), default=10**9)
    if full_gold is None or full_dia is None or not safe:
        return None
    lo, hi = max(full_gold, full_dia, min(safe.values())), both - 1
    return (lo, hi) if lo <= hi else None


def generate_maze(seed: int, size: int = SIZE, max_tries: int = 1000, rules: str = "sparse") -> Maze:
    """Generate the maze of ``seed`` (deterministic), resampling until the budget constraints hold.

    Args:
        seed: generator seed.
        size: grid side, one of ``SIZES`` (5, 7, 9; 9 is the paper's). The numbers of extra openings and lava
            tiles scale with the size; a 9x9 maze of a seed is the same as before sizes existed.
        max_tries: resampling attempts before giving up.
        rules: reward mode stored in the maze, ``sparse`` or ``shaped`` (it does not change the layout).

    Raises:
        ValueError: an unsupported ``size`` or ``rules``.
        RuntimeError: no valid maze within ``max_tries`` (not seen for the supported sizes).
    """
    if size not in _FEATURES:
        raise ValueError(f"maze size must be one of {SIZES}, got {size!r}")
    if rules not in RULES:
        raise ValueError(f"maze rules must be one of {RULES}, got {rules!r}")
    (cyc_lo, cyc_hi), (lava_lo, lava_hi) = _FEATURES[size]
    rng = random.Random(seed)
    corners = [(0, 0), (0, size - 1), (size - 1, size - 1), (size - 1, 0)]
    for _ in range(max_tries):
        grid = _prim(rng, size)
        _add_cycles(grid, rng, rng.randint(cyc_lo, cyc_hi))
        k = rng.randrange(4)
        start, gold_corner, exit_, dia_corner = (corners[(k + i) % 4] for i in range(4))
        if rng.random() < 0.5:
            gold_corner, dia_corner = dia_corner, gold_corner
        gold, diamond = _nearest_open(grid, gold_corner, ZONE_SIZE), _nearest_open(grid, dia_corner, ZONE_SIZE)
        taken = {start, exit_, *gold, *diamond}
        if len(taken) != 2 + 2 * ZONE_SIZE:  # a zone too small or overlapping (possible on small grids)
            continue
        floor = [(r, c) for r in range(size) for c in range(size) if grid[r][c] == FLOOR and (r, c) not in taken]
        lava = tuple(sorted(rng.sample(floor, min(len(floor), rng.randint(lava_lo, lava_hi)))))
        maze = Maze(tuple("".join(row) for row in grid), start, exit_, gold, diamond, lava, 0, seed)
        bounds = budget_bounds(maze)
        if bounds is None:
            continue
        budget = rng.randint(bounds[0], min(bounds[1], bounds[0] + 4))
        stats = {"min_budget": bounds[0], "both_zones_moves": bounds[1] + 1}
        return Maze(maze.grid, start, exit_, gold, diamond, lava, budget, seed, stats, rules)
    raise RuntimeError(f"no valid maze for seed {seed} (size {size}) in {max_tries} tries")


def check_maze(maze: Maze) -> list[str]:
    """The task's guarantees that ``maze`` breaks (empty when it is valid); checked by BFS, independent of how the
    maze was made: start and exit on opposite corners, the zones on (holding) the other two corners, features
    on distinct floor cells, each full zone plus the exit within the budget, no route touching both zones before
    the exit within it, and a lava-free route to the exit within it."""
    n = len(maze.grid)
    problems: list[str] = []
    if any(len(row) != n for row in maze.grid):
        problems.append("the grid is not square")
    corners = {(0, 0), (0, n - 1), (n - 1, 0), (n - 1, n - 1)}
    if maze.start not in corners or maze.exit != (n - 1 - maze.start[0], n - 1 - maze.start[1]):
        problems.append("start and exit are not on opposite corners")
    others = corners - {maze.start, maze.exit}
    if not any(c in maze.gold and d in maze.diamond for c in others for d in others - {c}):
        problems.append("the gold and diamond zones are not on the other two corners")
    cells = [maze.start, maze.exit, *maze.gold, *maze.diamond, *maze.lava]
    if len(set(cells)) != len(cells) or not all(maze.is_open(c) for c in cells):
        problems.append("features overlap or lie on walls")
    if maze.rules not in RULES:
        problems.append(f"unknown rules {maze.rules!r}")
    if problems:
        return problems
    bounds = budget_bounds(maze)
    if bounds is None or not bounds[0] <= maze.budget <= bounds[1]:
        problems.append(f"budget {maze.budget} outside the valid range {bounds} (one zone + exit fits, both do not, "
                        "a lava-free route fits)")
    return problems


# ------------------------------------------------------------------------------------------------ prompts


def render_maze(maze: Maze) -> str:
    """The maze as text: a legend, the grid with row/column numbers, and the feature coordinates."""
    symbols = {maze.start: "S", maze.exit: "E"}
    symbols.update(dict.fromkeys(maze.gold, "$"))
    symbols.update(dict.fromkeys(maze.diamond, "*"))
    symbols.update(dict.fromkeys(maze.lava, "~"))
    n = len(maze.grid)
    lines = ["Legend: # wall, . floor, S start, E exit, $ gold, * diamond, ~ lava", "",
             "    " + " ".join(str(c) for c in range(n))]
    for r, row in enumerate(maze.grid):
        lines.append(f"{r:>2}  " + " ".join(symbols.get((r, c), ch) for c, ch in enumerate(row)))

    def fmt(cells: Iterable[Cell]) -> str:
        return ", ".join(f"({r},{c})" for r, c in cells)

    lines += ["", f"Start S: {fmt([maze.start])}. Exit E: {fmt([maze.exit])}.",
              f"Gold $: {fmt(maze.gold)}. Diamond *: {fmt(maze.diamond)}.", f"Lava ~: {fmt(maze.lava)}."]
    return "\n".join(lines)


def rules_text(maze: Maze) -> str:
    """The rules and scoring paragraph of the prompt, for the maze's reward mode (the shaped text is unchanged
    since its data was built, so data/maze/*_shaped regenerates exactly)."""
    head = ("Rules: you start on S. A move is U (up: row - 1), D (down: row + 1), L (left: column - 1) or R (right: "
            "column + 1). ")
    if maze.rules == "shaped":
        return (head + "A move into a wall (#) or off the grid is skipped: you stay where you are, and it still "
                f"uses one move. Only the first {maze.budget} moves count, and the route ends as soon as it reaches "
                "the exit E. A route that reaches E in time is scored on four criteria, each between 0 and 1: "
                "reaching the exit; the fraction of gold cells ($) visited; the fraction of diamond cells (*) "
                "visited; and 1 minus the fraction of moves that land on lava (~). A route that does not reach E "
                "gets partial credit: all four scores are multiplied by half the fraction of the distance to E it "
                "covered. The move budget is too small to visit both the gold and the diamond zone and still reach "
                "E, so a route has to choose.")
    return (head + "A move into a wall (#) or off the grid is blocked: you stay where you are, and it still uses one "
            f"move. Only the first {maze.budget} moves count, and the route ends as soon as it reaches the exit E. "
            "You MUST reach E: a route that does not reach E within the budget scores 0 everywhere. A route that "
            "reaches E is scored on four criteria, each between 0 and 1: reaching the exit; the fraction of gold "
            "cells ($) visited before E; the fraction of diamond cells (*) visited before E; and 1 minus the "
            "fraction of lava cells (~) stepped on. The move budget is too small to visit both the gold and the "
            "diamond zone and still reach E, so a route has to choose.")


def user_prompt(maze: Maze) -> str:
    """The user message: the maze, the rules and scoring of its reward mode, and the single-answer format."""
    return (
        f"Find a route through this {len(maze.grid)}x{len(maze.grid)} maze. Coordinates are (row, column), "
        "row 0 at the top.\n\n"
        f"{render_maze(maze)}\n\n"
        f"{rules_text(maze)}\n\n"
        "Answer with the moves, separated by spaces, inside <route></route> tags, for example "
        "<route>R R D L</route>."
    )


def make_record(maze: Maze, split: str, index: int) -> dict[str, Any]:
    """The JSONL record (docs/ARCHITECTURE.md) of one maze; ids are ``maze-<split>-<index>`` for the paper's 9x9
    sparse setting and ``maze<size>-<rules>-<split>-<index>`` for the others."""
    n = len(maze.grid)
    name = "maze" if (n, maze.rules) == (SIZE, "sparse") else f"maze{n}-{maze.rules}"  # ids unique across settings
    return {
        "id": f"{name}-{split}-{index:05d}",
        "task": TASK,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(maze)}],
        "ground_truth": maze.to_dict(),
        "meta": {"split": split, "seed": maze.seed, "budget": maze.budget, "size": len(maze.grid),
                 "rules": maze.rules, **maze.stats},
    }


# ------------------------------------------------------------------------------------------------- routes

_SINGLE_TAGS = ("route", "answer")  # ours, and the reference's single-answer tag
_TOKEN = re.compile(r"[A-Za-z]+")
_WORDS = {"UP": "U", "DOWN": "D", "LEFT": "L", "RIGHT": "R", "NORTH": "U", "SOUTH": "D", "WEST": "L", "EAST": "R"}
_ARROWS = str.maketrans({"↑": " U ", "↓": " D ", "←": " L ", "→": " R "})


def route_text(text: str) -> str:
    """The text a single answer's moves are read from (the reference's rule): the content of the first closed
    ``<route>...</route>`` block, else of the first closed ``<answer>...</answer>`` block (tags in any case), else
    the whole text. A chain candidate (a ``<route_i>`` block's content) has no such tag and is read whole."""
    lower = text.lower()
    for tag in _SINGLE_TAGS:
        start = lower.find(f"<{tag}>")
        if start >= 0:
            start += len(tag) + 2
            end = lower.find(f"</{tag}>", start)
            if end >= 0:
                return text[start:end]
    return text


def route_key(text: str) -> tuple[str, ...] | None:
    """What makes two routes of one chain identical (counted once, as in the reference): their move lists;
    None for a route with no moves (it scores 0 anyway)."""
    moves = parse_moves(text)
    return tuple(moves) if moves else None


def parse_moves(text: str, max_moves: int = 10_000) -> list[str]:
    """Moves (``"U"``/``"D"``/``"L"``/``"R"``) written in ``text``; never raises (non-strings give ``[]``).

    Args:
        text: a route answer (read as :func:`route_text` says).
        max_moves: stop after this many moves.
    """
    if not isinstance(text, str):
        return []
    moves: list[str] = []
    for token in _TOKEN.finditer(route_text(text).translate(_ARROWS)):
        word = token.group().upper()
        if word in _WORDS:
            moves.append(_WORDS[word])
        elif set(word) <= set(MOVES):
            moves.extend(word)
        if len(moves) >= max_moves:
            return moves[:max_moves]
    return moves


@dataclass
class RouteResult:
    """A simulated route: the cells walked (the start first, up to the exit, the budget or an invalid move),
    whether it stayed valid and reached the exit in time, and its reward vector."""

    path: list[Cell]
    valid: bool
    reached_exit: bool
    reward: list[float]
    reason: str = ""


def walking_distances(maze: Maze, target: Cell) -> dict[Cell, int]:
    """Moves from every open cell to ``target`` (BFS over floor cells, lava allowed); unreachable cells absent."""
    dist, todo = {target: 0}, deque([target])
    while todo:
        cell = todo.popleft()
        for nxt in _neighbors(cell, len(maze.grid)):
            if nxt not in dist and maze.is_open(nxt):
                dist[nxt] = dist[cell] + 1
                todo.append(nxt)
    return dist


def simulate(maze: Maze, moves: Sequence[str]) -> RouteResult:
    """Walk ``moves`` from the start under ``maze.rules`` (module docstring) and score the route.

    ``path`` has one entry per move taken (the start first; a blocked move repeats the cell), up to the exit or
    the budget."""
    pos, path, blocked = maze.start, [maze.start], 0
    for move in moves[: maze.budget]:
        dr, dc = MOVES[move]
        nxt = (pos[0] + dr, pos[1] + dc)
        if maze.is_open(nxt):
            pos = nxt
        else:
            blocked += 1
        path.append(pos)
        if pos == maze.exit:
            break
    note = f"{blocked} blocked move(s)" if blocked else ""
    if pos == maze.exit:
        return RouteResult(path, True, True, _vector(maze, path, 1.0), note)
    if maze.rules == "shaped":
        return _shaped_partial(maze, path, note)
    why = f"the route does not reach the exit within {maze.budget} moves"
    return RouteResult(path, True, False, [0.0] * 4, "; ".join(x for x in (note, why) if x))


def _vector(maze: Maze, path: Sequence[Cell], e: float) -> list[float]:
    """``e * [1, gold fraction, diamond fraction, safety]`` of a walked path (start first). Safety under the
    reference's rule (sparse): 1 - distinct lava cells visited / lava cells; under shaped: 1 - the fraction of
    moves that end on lava."""
    visited, lava, steps = set(path), set(maze.lava), len(path) - 1
    if maze.rules == "shaped":
        safety = 1.0 - (sum(cell in lava for cell in path[1:]) / steps if steps else 0.0)
    else:
        safety = 1.0 - len(visited & lava) / len(lava) if lava else 1.0
    return [e, e * len(visited & set(maze.gold)) / len(maze.gold),
            e * len(visited & set(maze.diamond)) / len(maze.diamond), e * safety]


def _shaped_partial(maze: Maze, path: Sequence[Cell], note: str) -> RouteResult:
    """Shaped rules' partial credit ``e = 0.5 * progress`` toward the exit for a route that stops short."""
    pos = path[-1]
    dist = walking_distances(maze, maze.exit)
    d0 = dist[maze.start]
    e = 0.5 * max(0, d0 - dist.get(pos, d0)) / d0
    return RouteResult(list(path), True, False, _vector(maze, path, e),
                       "; ".join(x for x in (note, f"stops {dist.get(pos, d0)} moves from the exit") if x))


def maze_reward(candidate: str, sample: Mapping[str, Any]) -> list[float]:
    """The maze reward (registered as ``maze``): ``[exit, gold, diamond, safety]`` of one route answer."""
    maze = Maze.from_dict(sample["ground_truth"])
    return simulate(maze, parse_moves(candidate, max_moves=maze.budget + 1)).reward


def shortest_route(maze: Maze, target_mask: int = 0) -> list[str]:
    """A shortest route to the exit that visits at least the zone cells in ``target_mask`` (bits as in
    :func:`exit_distances`); ``[]`` if there is none. Used by tests and as an oracle."""
    zone = {cell: i for i, cell in enumerate(maze.gold + maze.diamond)}
    start = (maze.start, 0)
    parent: dict[tuple[Cell, int], tuple[tuple[Cell, int], str] | None] = {start: None}
    todo = deque([start])
    while todo:
        state = todo.popleft()
        cell, mask = state
        if cell == maze.exit:
            if mask & target_mask == target_mask:
                moves: list[str] = []
                while parent[state] is not None:
                    state, move = parent[state]  # type: ignore[misc]
                    moves.append(move)
                return moves[::-1]
            continue
        for move, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if maze.is_open(nxt):
                new = (nxt, mask | (1 << zone[nxt]) if nxt in zone else mask)
                if new not in parent:
                    parent[new] = (state, move)
                    todo.append(new)
    return []
