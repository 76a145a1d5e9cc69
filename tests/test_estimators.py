"""The estimator table (issue 52): every estimator's name is written once, in ``core/estimators.py``; everything
else asks the table's entry for its traits."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from vpo_lightning.core.estimators import DEFAULT_ESTIMATOR, ESTIMATORS, EstimatorName, get_estimator
from vpo_lightning.core.protocol import ChainProtocol

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "vpo_lightning" / "core" / "estimators.py"
# String literals equal to an estimator's name that mean something else, per file: how many, and why.
OTHER_MEANINGS = {
    ("vpo_lightning/api.py", "vpo"): (1, "the default run name"),
    ("vpo_lightning/launcher.py", "grpo"): (1, "`vpo grpo` is an alias of the command `vpo fit`"),
    ("vpo_lightning/serve/server.py", "vpo"): (1, "the served adapter's default model id"),
    ("vpo_lightning/training/cli.py", "vpo"): (2, "the program's name"),
    ("vpo_lightning/training/schema.py", "vpo"): (2, "the program's name and `vpo fit`'s default run_name"),
    ("vpo_lightning/training/config_check.py", "vpo"): (1, "the program's name"),
}


def _name_literals(path: Path) -> list[tuple[int, str]]:
    """``(line, value)`` of every string literal in ``path`` that equals an estimator's name, ``__all__`` aside
    (it lists functions of :mod:`~vpo_lightning.core.advantages` named after their estimators)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    exported = {id(node) for stmt in tree.body if isinstance(stmt, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets)
                for node in ast.walk(stmt.value)}
    return [(node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and node.value in ESTIMATORS and id(node) not in exported]


def test_estimator_names_appear_only_in_the_table():
    problems = []
    for path in sorted((REPO / "vpo_lightning").rglob("*.py")):
        if path == TABLE:
            continue
        rel = str(path.relative_to(REPO))
        found = _name_literals(path)
        for value in sorted({v for _, v in found}):
            lines = [n for n, v in found if v == value]
            allowed, _ = OTHER_MEANINGS.get((rel, value), (0, ""))
            if len(lines) != allowed:
                problems.append(f"{rel}:{','.join(map(str, lines))} writes {value!r} ({len(lines)} times, "
                                f"{allowed} allowed)")
    assert not problems, ("an estimator's name outside vpo_lightning/core/estimators.py: ask the table's entry for "
                          "the trait instead (ESTIMATORS[name].chained, ...), or, for another meaning of the "
                          "word, list it in OTHER_MEANINGS:\n" + "\n".join(problems))


def test_the_allowed_other_meanings_are_still_there():
    for (rel, value), (count, why) in OTHER_MEANINGS.items():
        assert [v for _, v in _name_literals(REPO / rel)].count(value) == count, (rel, value, why)


def test_entries_are_consistent_with_their_functions():
    assert DEFAULT_ESTIMATOR in ESTIMATORS and set(EstimatorName.__args__) == set(ESTIMATORS)
    for name, entry in ESTIMATORS.items():
        params = inspect.signature(entry.fn).parameters
        assert set(entry.extras) <= set(params), name  # the extras are keyword arguments of the function
        assert "dim_mask" in params, name
        assert inspect.signature(entry) == inspect.signature(entry.fn), name
        assert not entry.shows_weights or entry.weights is not None, name  # a shown weight must be drawn
        assert not entry.set_reward or entry.weights == "step", name  # the set reward needs the step's weights


def test_the_protocol_reads_the_traits():
    for name, entry in ESTIMATORS.items():
        protocol = ChainProtocol(["maze"], name, num_candidates=2, num_weights=3, tag_family="route")
        assert protocol.method is entry and protocol.m == (2 if entry.chained else 1), name
        weights = protocol.step_weights([0, 1], step=0)
        if entry.weights is None:
            assert weights is None, name
        else:
            assert weights.shape == (2, 3 if entry.weights == "step" else 1, protocol.dim), name
        record = {"messages": [{"role": "user", "content": "Go."}], "id": "r", "grid": []}
        shown = protocol.messages(record, torch.full((protocol.dim,), 1 / protocol.dim))[-1]["content"]
        assert ("objective weights" in shown) == entry.shows_weights, name


def test_extras_are_computed_only_when_the_estimator_takes_them():
    asked = []
    available = {key: (lambda key=key: asked.append(key) or key) for key in ("k", "vector_repeats", "token_counts")}
    for name, entry in ESTIMATORS.items():
        asked.clear()
        assert entry.extra_kwargs(available) == {key: key for key in entry.extras}, name
        assert asked == list(entry.extras), name


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"rollout.estimator='vpoo' is not one of \["):
        get_estimator("vpoo")


def test_the_adding_an_estimator_doc_adds_one(monkeypatch):
    """docs/ADDING_AN_ESTIMATOR.md stays true: its function, run in core/advantages.py's namespace, and its entry,
    put in the table, make an estimator the chain protocol uses, with the doc's hand-worked values."""
    import re

    from vpo_lightning.core import advantages, estimators

    doc = (REPO / "docs" / "ADDING_AN_ESTIMATOR.md").read_text(encoding="utf-8")
    blocks = dict(re.findall(r"```python\n# (\S+)\n(.*?)```", doc, re.DOTALL))
    namespace = dict(vars(advantages))
    exec(blocks["vpo_lightning/core/advantages.py"], namespace)
    monkeypatch.setattr(advantages, "rloo", namespace["rloo"], raising=False)
    table = eval("{" + blocks["vpo_lightning/core/estimators.py"] + "}", vars(estimators))
    monkeypatch.setitem(ESTIMATORS, *next(iter(table.items())))
    protocol = ChainProtocol(["maze"], "rloo", num_candidates=3, tag_family="route")
    assert protocol.m == 1 and protocol.step_weights([0], step=0) is None
    rewards = torch.tensor([1.0, 0.0, 0.0])[None, :, None, None]  # one group: f = (1, 0, 0)
    torch.testing.assert_close(protocol.method(rewards), torch.tensor([[1.0, -0.5, -0.5]]))
