"""Maze task: generator determinism and BFS-checked constraints, exact rewards, tolerant parsing, drawing, data."""

from __future__ import annotations

import json
from collections import deque
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpo_lightning.tasks.maze import (
    DIMS,
    SIZE,
    Maze,
    draw_maze,
    generate_maze,
    make_record,
    maze_reward,
    parse_moves,
    route_text,
    shortest_route,
    simulate,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "maze"
SEEDS = range(40)


@pytest.fixture(scope="module")
def mazes() -> list[Maze]:
    return [generate_maze(s) for s in SEEDS]


def _independent_exit_moves(maze: Maze) -> dict[frozenset, int]:
    """Brute-force BFS over (cell, set of visited zone cells), written independently of the generator."""
    zone = set(maze.gold) | set(maze.diamond)
    start = (maze.start, frozenset())
    dist, todo, best = {start: 0}, deque([start]), {}
    while todo:
        cell, seen = state = todo.popleft()
        if cell == maze.exit:
            best.setdefault(seen, dist[state])
            continue
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            r, c = cell[0] + dr, cell[1] + dc
            if 0 <= r < SIZE and 0 <= c < SIZE and maze.grid[r][c] != "#":
                new = ((r, c), seen | ({(r, c)} & zone))
                if new not in dist:
                    dist[new] = dist[state] + 1
                    todo.append(new)
    return best


def test_generator_is_deterministic_and_seeds_differ() -> None:
    assert generate_maze(7) == generate_maze(7)
    assert generate_maze(7).to_dict() == generate_maze(7).to_dict()
    assert len({generate_maze(s).grid for s in range(10)}) == 10


def test_layout(mazes: list[Maze]) -> None:
    corners = {(0, 0), (0, SIZE - 1), (SIZE - 1, 0), (SIZE - 1, SIZE - 1)}
    for m in mazes:
        assert len(m.grid) == SIZE and all(len(row) == SIZE for row in m.grid)
        assert m.start in corners and m.exit == (SIZE - 1 - m.start[0], SIZE - 1 - m.start[1])
        assert {m.gold[0], m.diamond[0]} == corners - {m.start, m.exit}
        assert len(m.gold) == len(m.diamond) == 3
        cells = [m.start, m.exit, *m.gold, *m.diamond, *m.lava]
        assert len(set(cells)) == len(cells), "features overlap"
        assert all(m.is_open(c) for c in cells)
        assert 4 <= len(m.lava) <= 8
        # 16 odd-odd cells are always walls; a spanning tree of 25 rooms keeps 16 of the 40 room-separating
        # walls; 4 to 8 of those are opened to make cycles
        assert 24 <= sum(row.count("#") for row in m.grid) <= 28


def test_budget_constraints_by_bfs(mazes: list[Maze]) -> None:
    for m in mazes:
        best = _independent_exit_moves(m)
        gold, dia = set(m.gold), set(m.diamond)
        full_gold = min(d for seen, d in best.items() if gold <= seen)
        full_dia = min(d for seen, d in best.items() if dia <= seen)
        both = min((d for seen, d in best.items() if seen & gold and seen & dia), default=10**9)
        assert full_gold <= m.budget and full_dia <= m.budget, m.seed
        assert both > m.budget, m.seed
        no_lava = Maze(tuple("".join("#" if (r, c) in m.lava else ch for c, ch in enumerate(row))
                             for r, row in enumerate(m.grid)), m.start, m.exit, (), (), (), m.budget)
        assert 0 < len(shortest_route(no_lava)) <= m.budget, "a lava-free route to the exit fits the budget"


def test_oracle_routes_score_as_expected(mazes: list[Maze]) -> None:
    for m in mazes:
        gold = simulate(m, shortest_route(m, 0b000111))
        dia = simulate(m, shortest_route(m, 0b111000))
        assert gold.reached_exit and gold.reward[:2] == [1.0, 1.0] and gold.reward[2] == 0.0
        assert dia.reached_exit and dia.reward[0] == 1.0 and dia.reward[1] == 0.0 and dia.reward[2] == 1.0
        assert shortest_route(m, 0b001001) == [] or len(shortest_route(m, 0b001001)) > m.budget


# A hand-made 5x5 maze for exact rewards:
#     0 1 2 3 4
#  0  S . . $ $
#  1  . # ~ # $
#  2  . # . # .
#  3  * # . . .
#  4  * * . ~ E
HAND = Maze(
    grid=(".....", ".#.#.", ".#.#.", ".#...", "....."),
    start=(0, 0), exit=(4, 4), gold=((0, 3), (0, 4), (1, 4)), diamond=((3, 0), (4, 0), (4, 1)),
    lava=((1, 2), (4, 3)), budget=10, seed=-1,
)


@pytest.mark.parametrize(
    ("route", "reward"),
    [
        ("R R R R D D D D", [1.0, 1.0, 0.0, 1.0]),  # all gold, no lava
        ("<route>RRDDDDRR</route>", [1.0, 0.0, 0.0, 0.75]),  # lava at (1,2) and (4,3): 2 of 8 moves
        ("D D D D R R R R", [1.0, 0.0, 1.0, 0.875]),  # diamonds (3,0) (4,0) (4,1); lava (4,3): 1 of 8
        ("down down down right", [0.0] * 4),  # (3,1) is a wall: invalid
        ("R R R R D D D D L L", [1.0, 1.0, 0.0, 1.0]),  # moves after the exit are ignored
        ("R R R D", [0.0] * 4),  # (1,3) is a wall: invalid
        ("U", [0.0] * 4),  # off the grid: invalid
        ("R R R R D D D", [0.0] * 4),  # does not reach the exit
        ("R L R L R R R R D D D D", [0.0] * 4),  # 12 moves > budget 10
        ("", [0.0] * 4),
    ],
)
def test_exact_rewards_on_a_hand_made_maze(route: str, reward: list[float]) -> None:
    assert maze_reward(route, {"ground_truth": HAND.to_dict()}) == pytest.approx(reward)


def test_route_ending_exactly_at_budget_counts() -> None:
    tight = Maze(HAND.grid, HAND.start, HAND.exit, HAND.gold, HAND.diamond, HAND.lava, budget=8)
    assert simulate(tight, list("RRRRDDDD")).reward == [1.0, 1.0, 0.0, 1.0]
    assert simulate(tight, list("RLRRRRDDDD")).reward == [0.0] * 4


@pytest.mark.parametrize(
    ("text", "moves"),
    [
        ("U, R, R", "URR"),
        ("URRD", "URRD"),
        ("up Right DOWN left", "URDL"),
        ("north east south west", "URDL"),
        ("↑ → ↓ ←", "URDL"),
        ("I think: <route>R D</route> then L", "RD"),
        ("<route_2>L, L</route_2><route_3>U</route_3>", "LL"),
        ("<ROUTE>D D", "DD"),
        ("Moves: [R, R, D]", "RRD"),
        ("go 3 steps", ""),
    ],
)
def test_tolerant_parsing(text: str, moves: str) -> None:
    assert "".join(parse_moves(text)) == moves


def test_route_text_without_tag_is_whole_text() -> None:
    assert route_text("R R D") == "R R D"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_parsing_never_raises_and_rewards_in_range(text: str) -> None:
    moves = parse_moves(text)
    assert set(moves) <= set("UDLR")
    values = maze_reward(text, {"ground_truth": HAND.to_dict()})
    assert len(values) == 4 and all(0.0 <= v <= 1.0 for v in values)


@cache
def _maze_dict(seed: int) -> dict:
    return generate_maze(seed).to_dict()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("UDLR"), max_size=40), st.integers(0, 5))
def test_fuzz_random_walks(moves: list[str], seed: int) -> None:
    values = maze_reward(" ".join(moves), {"ground_truth": _maze_dict(seed)})
    assert len(values) == 4 and all(0.0 <= v <= 1.0 for v in values)
    assert values[0] in (0.0, 1.0) and (values[0] == 1.0 or values == [0.0] * 4)
    assert not (values[1] > 0 and values[2] > 0), "the budget forbids both zones"


def test_registry_entry() -> None:
    from vpo_lightning.rewards import RewardVector, get_reward

    entry = get_reward("maze")
    assert entry.dims == DIMS == ("exit", "gold", "diamond", "safety")
    sample = make_record(HAND, "test", 0)
    scores = RewardVector(["maze"]).score([["RRRRDDDD", "RRR D", None]], [sample])
    assert scores.rewards[0, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert scores.rewards[0, 1].tolist() == [0.0] * 4 and scores.mask.tolist() == [[True, True, False]]


def test_record_and_prompt() -> None:
    maze = generate_maze(3)
    record = make_record(maze, "val", 3)
    assert record["task"] == "maze" and [m["role"] for m in record["messages"]] == ["system", "user"]
    user = record["messages"][1]["content"]
    assert "<route>" in user and str(maze.budget) in user and "    0 1 2 3 4 5 6 7 8" in user
    assert Maze.from_dict(json.loads(json.dumps(record["ground_truth"]))) == maze


def test_draw_maze(tmp_path: Path) -> None:
    maze = generate_maze(0)
    out = tmp_path / "maze.png"
    routes = [" ".join(shortest_route(maze, 0b000111)), shortest_route(maze, 0b111000), "U U U"]
    draw_maze(maze.to_dict(), routes, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


@pytest.mark.skipif(not (DATA / "train.jsonl").exists(), reason="data/maze not generated")
def test_data_files() -> None:
    seeds = {}
    for split in ("train", "val", "test"):
        records = [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text().splitlines()]
        assert records and all(r["task"] == "maze" and r["meta"]["split"] == split for r in records)
        seeds[split] = {r["meta"]["seed"] for r in records}
        maze = Maze.from_dict(records[0]["ground_truth"])
        assert maze == generate_maze(records[0]["meta"]["seed"])
        assert maze_reward(" ".join(shortest_route(maze, 0b000111)), records[0])[:2] == [1.0, 1.0]
    assert not (seeds["train"] & seeds["val"] or seeds["train"] & seeds["test"] or seeds["val"] & seeds["test"])
