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
    SIZES,
    Maze,
    check_maze,
    generate_maze,
    make_record,
    maze_reward,
    parse_moves,
    route_text,
    shortest_route,
    simulate,
)
from vpo_lightning.tasks.maze.draw import draw_main, draw_maze

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
            if 0 <= r < len(maze.grid) and 0 <= c < len(maze.grid) and maze.grid[r][c] != "#":
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


# The reference's rules (ryanboldi/vpo vpo_tasks/maze.py, docs/FIDELITY.md): walls block (the walker stays, the move
# counts), the whole vector is 0 unless the exit is reached within the budget, items count when visited before the
# exit, safety = 1 - distinct lava cells stepped on / lava cells (HAND has 2: (1,2) and (4,3)).
@pytest.mark.parametrize(
    ("route", "reward"),
    [
        ("R R R R D D D D", [1.0, 1.0, 0.0, 1.0]),  # all gold, no lava
        ("<route>RRDDDDRR</route>", [1.0, 0.0, 0.0, 0.0]),  # both lava cells stepped on
        ("D D D D R R R R", [1.0, 0.0, 1.0, 0.5]),  # diamonds (3,0) (4,0) (4,1); lava (4,3): 1 of 2 cells
        ("D D D D R R R L R R", [1.0, 0.0, 1.0, 0.5]),  # (4,3) stepped on twice: still 1 distinct cell of 2
        ("R R R D R D D D D", [1.0, 1.0, 0.0, 1.0]),  # D at (0,3) is blocked by a wall, the walk goes on
        ("down down down right", [0.0] * 4),  # R into the wall at (3,1) is blocked; the exit is not reached
        ("R R R R D D D D L L", [1.0, 1.0, 0.0, 1.0]),  # moves after the exit are ignored
        ("R R R R D", [0.0] * 4),  # all gold but no exit: gated to 0
        ("U", [0.0] * 4),  # off the grid: blocked, no exit
        ("R L R L R R R R D D D D", [0.0] * 4),  # only the first 10 moves (budget) count: stops at (2,4)
        ("x <answer>R R R R D D D D</answer> y", [1.0, 1.0, 0.0, 1.0]),  # the reference's <answer> block
        ("", [0.0] * 4),
    ],
)
def test_exact_rewards_on_a_hand_made_maze(route: str, reward: list[float]) -> None:
    assert maze_reward(route, {"ground_truth": HAND.to_dict()}) == pytest.approx(reward)


def _reference_vector(maze: Maze, moves: list[str]) -> list[float]:
    """The reference's definition, written out independently: walk (walls block), stop at the exit, gate."""
    pos, seen = maze.start, set()
    for move in moves[: maze.budget]:
        dr, dc = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}[move]
        r, c = pos[0] + dr, pos[1] + dc
        if 0 <= r < len(maze.grid) and 0 <= c < len(maze.grid) and maze.grid[r][c] != "#":
            pos = (r, c)
        if pos == maze.exit:
            break
        seen.add(pos)
    if pos != maze.exit:
        return [0.0] * 4
    return [1.0, len(seen & set(maze.gold)) / len(maze.gold), len(seen & set(maze.diamond)) / len(maze.diamond),
            1.0 - len(seen & set(maze.lava)) / len(maze.lava) if maze.lava else 1.0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("UDLR"), max_size=30), st.integers(0, 5), st.sampled_from((5, 9)))
def test_reward_equals_the_reference_definition(moves: list[str], seed: int, size: int) -> None:
    maze = generate_maze(seed, size)
    assert simulate(maze, moves).reward == pytest.approx(_reference_vector(maze, moves))
    walk = shortest_route(maze, 0b000111)  # a gold route reaches the exit: the gate is open
    assert simulate(maze, walk).reward == pytest.approx(_reference_vector(maze, walk))
    assert simulate(maze, walk).reward[0] == 1


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
        ("<route_2>L, L</route_2><route_3>U</route_3>", "LLU"),  # no <route>/<answer> block: the whole text
        ("<answer>R R</answer> D", "RR"),  # the reference's single-answer tag
        ("<ROUTE>D D", "DD"),
        ("Moves: [R, R, D]", "RRD"),
        ("go 3 steps", ""),
    ],
)
def test_tolerant_parsing(text: str, moves: str) -> None:
    assert "".join(parse_moves(text)) == moves


def test_route_text_without_tag_is_whole_text() -> None:
    assert route_text("R R D") == "R R D"
    # the reference's rule: a closed block, else the whole text (an unclosed tag is not a block)
    assert route_text("<route>R R D") == "<route>R R D" and route_text("a <ROUTE>L</ROUTE> b") == "L"


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


# ---- sizes and the shaped reward mode -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sized_mazes() -> dict[int, list[Maze]]:
    return {size: [generate_maze(s, size, rules="shaped" if s % 2 else "sparse") for s in range(12)] for size in SIZES}


@pytest.mark.parametrize("size", SIZES)
def test_guarantees_hold_for_every_size(size: int, sized_mazes: dict[int, list[Maze]]) -> None:
    """Opposite corners, zones on the other corners, and the budget (one full zone + exit fits, a route touching
    both zones does not, a lava-free route fits), checked by check_maze and by an independent BFS."""
    n = size - 1
    for m in sized_mazes[size]:
        assert check_maze(m) == [], (size, m.seed)
        assert len(m.grid) == size and all(len(row) == size for row in m.grid)
        assert m.exit == (n - m.start[0], n - m.start[1]) and m.start in {(0, 0), (0, n), (n, 0), (n, n)}
        assert {m.gold[0], m.diamond[0]} == {(0, 0), (0, n), (n, 0), (n, n)} - {m.start, m.exit}
        best = _independent_exit_moves(m)
        full_gold = min(d for seen, d in best.items() if set(m.gold) <= seen)
        full_dia = min(d for seen, d in best.items() if set(m.diamond) <= seen)
        both = min((d for seen, d in best.items() if seen & set(m.gold) and seen & set(m.diamond)), default=10**9)
        assert max(full_gold, full_dia) <= m.budget < both, (size, m.seed)
        gold, dia = simulate(m, shortest_route(m, 0b000111)), simulate(m, shortest_route(m, 0b111000))
        assert gold.reward[:3] == [1.0, 1.0, 0.0] and dia.reward[:3] == [1.0, 0.0, 1.0]


def test_nine_by_nine_default_is_unchanged() -> None:
    """The paper's setting stays the default: size 9, sparse rules, the shipped data regenerates exactly."""
    assert generate_maze(5) == generate_maze(5, 9, rules="sparse") and generate_maze(5).rules == "sparse"
    first = json.loads((DATA / "val.jsonl").read_text().splitlines()[0])
    maze = Maze.from_dict(first["ground_truth"])  # an old record (no "rules" key) reads as sparse
    assert maze.rules == "sparse" and make_record(maze, "val", 0)["messages"] == first["messages"]


def test_check_maze_reports_broken_mazes() -> None:
    assert check_maze(HAND) == []
    loose = Maze(HAND.grid, HAND.start, HAND.exit, HAND.gold, HAND.diamond, HAND.lava, budget=30)
    assert any("budget 30" in p for p in check_maze(loose))
    moved = Maze(HAND.grid, (0, 1), HAND.exit, HAND.gold, HAND.diamond, HAND.lava, budget=10)
    assert "start and exit are not on opposite corners" in check_maze(moved)
    with pytest.raises(ValueError, match="size must be one of"):
        generate_maze(0, 6)
    with pytest.raises(ValueError, match="rules must be one of"):
        generate_maze(0, 5, rules="dense")


SHAPED = Maze(HAND.grid, HAND.start, HAND.exit, HAND.gold, HAND.diamond, HAND.lava, budget=10, rules="shaped")


# Hand-worked on HAND (drawn above): the walking distance from S (0,0) to E (4,4) is d0 = 8; e = 1 at the exit,
# else 0.5 * (8 - d) / 8 with d the distance left; the vector is e * [1, gold, diamond, 1 - lava fraction].
@pytest.mark.parametrize(
    ("route", "reward"),
    [
        ("R R R R D D D D", [1.0, 1.0, 0.0, 1.0]),  # as in sparse
        ("D D D D R R R R", [1.0, 0.0, 1.0, 0.875]),  # as in sparse: lava (4,3) on 1 of 8 moves
        ("R R R D R D D D D", [1.0, 1.0, 0.0, 1.0]),  # D at (0,3) hits a wall: skipped, 9 moves <= 10
        ("R R", [0.125, 0.0, 0.0, 0.125]),  # stops at (0,2), d = 6: e = 0.5 * 2/8
        ("D D D D", [0.25, 0.0, 0.25 * 2 / 3, 0.25]),  # (4,0), d = 4: e = 0.25; diamonds (3,0) (4,0) of 3
        ("R R D D", [0.25, 0.0, 0.0, 0.1875]),  # (2,2), d = 4: e = 0.25; lava (1,2) on 1 of 4 moves
        ("down down down right", [0.1875, 0.0, 0.0625, 0.1875]),  # R into (3,1) skipped; (3,0), d = 5: e = 3/16
        ("D D D D R R L L R R R R", [0.375, 0.0, 0.375, 0.375]),  # budget 10: stops at (4,2), d = 2, 3 diamonds
        ("U U", [0.0] * 4),  # both off the grid: skipped, no progress
        ("", [0.0] * 4),
    ],
)
def test_shaped_rewards_on_hand_worked_routes(route: str, reward: list[float]) -> None:
    assert maze_reward(route, {"ground_truth": SHAPED.to_dict()}) == pytest.approx(reward)
    sparse = maze_reward(route, {"ground_truth": HAND.to_dict()})
    # shaped only adds credit where sparse gives 0 (its safety is a different definition: moves, not cells)
    assert sparse[:3] == pytest.approx(reward[:3]) or sparse == [0.0] * 4


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("UDLR"), max_size=40), st.integers(0, 5), st.sampled_from(SIZES))
def test_shaped_keeps_the_trade_off(moves: list[str], seed: int, size: int) -> None:
    """No route scores 1 on every dimension: at the exit the budget forbids both zones; short of it e <= 0.5."""
    values = simulate(_shaped(seed, size), moves).reward
    assert len(values) == 4 and all(0.0 <= v <= 1.0 for v in values)
    if values[0] == 1.0:
        assert not (values[1] > 0 and values[2] > 0)
    else:
        assert max(values) <= 0.5 and all(v <= values[0] + 1e-12 for v in values)


@cache
def _shaped(seed: int, size: int) -> Maze:
    return generate_maze(seed, size, rules="shaped")


def test_shaped_prompt_and_record() -> None:
    maze = generate_maze(1, 5, rules="shaped")
    record = make_record(maze, "val", 1)
    user = record["messages"][1]["content"]
    assert "5x5 maze" in user and "is skipped" in user and "partial credit" in user and "    0 1 2 3 4\n" in user
    assert record["id"] == "maze5-shaped-val-00001" and record["meta"]["rules"] == "shaped"
    assert record["meta"]["size"] == 5 and record["ground_truth"]["rules"] == "shaped"
    sparse = make_record(generate_maze(1, 5), "val", 1)["messages"][1]["content"]
    assert "is blocked" in sparse and "You MUST reach E" in sparse and "lava cells (~) stepped on" in sparse


@pytest.mark.parametrize(("folder", "size", "rules"), [("5x5_shaped", 5, "shaped"), ("7x7_shaped", 7, "shaped"),
                                                       ("5x5", 5, "sparse")])
def test_small_model_splits(folder: str, size: int, rules: str) -> None:
    """The shipped small-model splits: their settings, regenerable, and seeds disjoint from every other split."""
    from vpo_lightning.tasks.maze.build import SETTINGS

    seeds: dict[str, set[int]] = {}
    for path in sorted(DATA.glob("**/*.jsonl")):
        lines = path.read_text().splitlines()
        seeds[str(path.relative_to(DATA))] = {json.loads(line)["meta"]["seed"] for line in lines}
    for split in ("train", "val", "test"):
        lines = (DATA / folder / f"{split}.jsonl").read_text().splitlines()
        for line in lines[:: max(1, len(lines) // 5)]:
            record = json.loads(line)
            maze = Maze.from_dict(record["ground_truth"])
            assert maze.rules == rules and len(maze.grid) == size and check_maze(maze) == []
            assert maze == generate_maze(record["meta"]["seed"], size, rules=rules)
            assert record["messages"] == make_record(maze, split, int(record["id"][-5:]))["messages"]
    names = sorted(seeds)
    assert len(names) == 12 and SETTINGS[(size, rules)][0] == f"data/maze/{folder}"
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not seeds[a] & seeds[b], (a, b)


def test_draw_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "mazes.jsonl"
    data.write_text(json.dumps(make_record(SHAPED, "test", 0)) + "\n")
    chain = "<route_1>R R R R D D D D</route_1> <route_2>D D D D R R R R</route_2> <route_3>R R D D</route_3>"
    samples = tmp_path / "samples.jsonl"
    samples.write_text("\n".join(json.dumps({"id": "maze5-shaped-test-00000", "chain": c, "text": t, "rewards": []})
                                  for c, t in enumerate([chain, "<route>R R</route>"])) + "\n")
    out = tmp_path / "maze.png"
    assert draw_main(["--data", str(data), "--samples", str(samples), "--chains", "0", "1", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "4 routes" in capsys.readouterr().out
    assert draw_main(["--data", str(data), "--samples", str(samples), "--chains", "5", "--out", str(out)]) == 2
    assert "no chain 5" in capsys.readouterr().err
    assert draw_main(["--data", str(data), "--id", "nope", "--route", "R", "--out", str(out)]) == 2
