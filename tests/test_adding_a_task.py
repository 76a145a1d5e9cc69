"""docs/ADDING_A_TASK.md stays true: its code blocks, written to a scratch copy of the paths they name, make a task
that the registry finds by listing the tasks folder, whose builder writes valid data, whose config loads, and whose
reward scores the candidates of an m-answer chain through the chain protocol."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import vpo_lightning.tasks as tasks_pkg
from vpo_lightning import rewards as registry
from vpo_lightning.commands import runs
from vpo_lightning.core.protocol import ChainProtocol
from vpo_lightning.training.records import read_jsonl

DOC = Path(__file__).resolve().parents[1] / "docs" / "ADDING_A_TASK.md"
BLOCK = re.compile(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", re.DOTALL)


@pytest.fixture
def toy_task(tmp_path, monkeypatch):
    """Write the doc's files under tmp_path and put its tasks folder on vpo_lightning.tasks' search path."""
    files = dict(BLOCK.findall(DOC.read_text(encoding="utf-8")))
    assert set(files) == {"vpo_lightning/tasks/addition/__init__.py", "vpo_lightning/tasks/addition/reward.py",
                          "vpo_lightning/tasks/addition/build.py", "configs/addition.yaml"}
    for path, body in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body, encoding="utf-8")
    registry.registered_names()  # built-ins first, so the restore below keeps them
    saved = dict(registry.REWARDS)
    monkeypatch.setattr(tasks_pkg, "__path__", [*tasks_pkg.__path__, str(tmp_path / "vpo_lightning" / "tasks")])
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("vpo_lightning.tasks.addition")]:
        del sys.modules[name]
    registry.REWARDS.clear()
    registry.REWARDS.update(saved)


def test_the_documented_steps_make_a_working_task(toy_task, monkeypatch):
    assert "addition" in tasks_pkg.builtin_tasks()  # step 1-2: found by listing the folder, no list to edit
    from vpo_lightning.tasks.addition import build

    assert build.main(["--out", str(toy_task / "data" / "addition")]) == 0  # step 3
    train = read_jsonl(toy_task / "data" / "addition" / "train.jsonl")
    assert len(train) == 200 and train[0]["task"] == "addition"

    monkeypatch.chdir(toy_task)  # step 4: the config's relative data paths resolve from the repository root
    cfg = runs.load_config("configs/addition.yaml", require=("rollout",))
    assert all(Path(f).is_file() for f in cfg["data"]["train_files"] + cfg["data"]["val_files"])
    ro = cfg["rollout"]
    protocol = ChainProtocol(ro["rewards"], ro["estimator"], ro["num_candidates"], tag_family=ro["tag_family"])
    assert protocol.dim_names == ["exact", "brief"] and protocol.m == 3
    assert "<response_3>" in protocol.messages(train[0])[-1]["content"]

    record = train[0]
    right = record["ground_truth"]
    chain = f"<response_1>{right}</response_1><response_2>it is {right + 1}, I think so</response_2>"
    scores = protocol.score([protocol.candidates(chain)], [record])
    assert scores.rewards[0].tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert scores.mask[0].tolist() == [True, True, False] and scores.num_errors == 0
