"""Maze demonstrations for the supervised cold start (``data.builder: maze``, ``maze_shortest``, ``maze_direct``,
registered in :mod:`vpo_lightning.tasks.demos`): random valid walks or random shortest routes, in ``<route>`` tags
(m = 1) or chains of m different routes in ``<route_i>`` tags."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vpo_lightning.tasks.demos import chain_completion, demo, register_demos, seeded_rng
from vpo_lightning.tasks.maze import MOVES, Maze


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
        routes = _maze_routes(maze, m, seeded_rng(seed, record.get("id"), m), dist, draws)
        if len(routes) < m:
            continue
        completion = f"<route>{routes[0]}</route>" if m == 1 else chain_completion(routes, "route")
        out.append(demo(record, m, "route", completion))
    return out


@register_demos("maze", family="route")
def maze_demos(record: Mapping[str, Any], formats: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """Demonstrations for one maze record (``data.builder: maze``): a random valid walk (see :func:`random_walk`)
    in ``<route>`` tags (m = 1), and chains of m different random walks in ``<route_i>`` tags (records whose budget
    leaves fewer than m different walks in 50 draws get no chain)."""
    return _maze_demos(record, formats, seed, (random_walk,))


@register_demos("maze_shortest", family="route")
def maze_shortest_demos(record: Mapping[str, Any], formats: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """Demonstrations for one maze record (``data.builder: maze_shortest``): a random shortest route (see
    :func:`random_shortest_route`) for m = 1; for a chain, m different shortest routes, completed with different
    random valid walks (:func:`random_walk`, longer) where the maze has fewer than m shortest routes, shortest
    first."""
    return _maze_demos(record, formats, seed, (random_shortest_route, random_walk))


@register_demos("maze_direct", family="route")
def maze_direct_demos(record: Mapping[str, Any], formats: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """Demonstrations for one maze record (``data.builder: maze_direct``): as :func:`maze_shortest_demos` (the
    same single answers), but a chain is completed with near-shortest routes (:func:`near_shortest_walk`: one
    detour) before any longer walk, so that no chain position is taught to wander: with ``maze_shortest`` the
    third route of most 5x5 chains was a 10-12-move walk, and the model's third routes reached the exit half as
    often as its first (docs/results_maze.md)."""
    return _maze_demos(record, formats, seed, (random_shortest_route, near_shortest_walk, random_walk))
