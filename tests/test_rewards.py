"""The reward registry's contract: failures score 0 and are counted, a reward that always fails stops the run,
duplicate names are refused, dotted paths resolve with their declared dimensions, and a vector reward must declare
its dimensions wherever it comes from."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from vpo_lightning import rewards as registry
from vpo_lightning.rewards import (
    REWARDS,
    BrokenRewardError,
    RewardDeclarationError,
    RewardRangeError,
    RewardVector,
    get_reward,
    register,
)
from vpo_lightning.tasks import builtin_tasks

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def module(monkeypatch):
    """A throwaway module ``reward_fixture_mod`` importable by dotted path; the registry is restored afterwards."""
    mod = types.ModuleType("reward_fixture_mod")
    monkeypatch.setitem(sys.modules, "reward_fixture_mod", mod)
    registry.registered_names()  # load the built-ins first: their modules register only once per process
    saved = dict(REWARDS)
    yield mod
    REWARDS.clear()
    REWARDS.update(saved)


def _length(candidate, sample):
    return min(1.0, len(candidate) / 10)


def test_failing_reward_scores_zero_is_counted_and_printed_once(module, caplog):
    def picky(candidate, sample):
        if candidate.startswith("boom"):
            raise KeyError("no such field")
        return 1.0 if candidate == "ok" else float("nan")

    module.picky = picky
    vector = RewardVector(["reward_fixture_mod.picky"])
    with caplog.at_level(logging.WARNING, logger="vpo_lightning.rewards"):
        scores = vector.score([["ok", "boom", "nan", "boom2", None]], [{"id": "rec-3"}])
    assert scores.rewards[0, :, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert scores.mask[0].tolist() == [True, True, True, True, False]
    assert scores.num_errors == 3 and len(scores.errors) == 3
    assert "KeyError" in scores.errors[0] and "'boom'" in scores.errors[0] and "record 'rec-3'" in scores.errors[0]
    assert "NaN" in scores.errors[1]
    assert vector.failures == {"reward_fixture_mod.picky": 3} and vector.successes == {"reward_fixture_mod.picky": 1}
    # issue 53: one line per reward, naming it and the record; the rest are counted only
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "reward 'reward_fixture_mod.picky' failed on record 'rec-3'" in lines[0], lines
    assert "\n" not in lines[0]


def test_a_value_outside_the_unit_interval_stops_with_the_fix(module):
    """Issue 53: out of [0, 1] is a bug in the reward, refused at once with its name, value, record and the fix;
    float rounding just past a bound is clamped."""
    module.big = lambda candidate, sample: 2.0 if candidate == "big" else 1.0 + 1e-9
    vector = RewardVector(["reward_fixture_mod.big"])
    assert vector.score([["x"]], [{}]).rewards[0, 0, 0] == 1.0  # rounding: clamped
    with pytest.raises(RewardRangeError, match=r"reward 'reward_fixture_mod.big' returned 2.0 for record 'r1' "
                                               r"\(candidate 'big'\), outside \[0, 1\].*\(r \+ 1\) / 2"):
        vector.score([["ok", "big"]], [{"id": "r1"}])


def test_fit_with_an_out_of_range_reward_stops_at_the_first_batch_with_one_line(tmp_path, monkeypatch, capsys):
    from vpo_lightning.launcher import main

    (tmp_path / "range_rewards.py").write_text(
        "def signed(prompts, completions, **kwargs):\n    return [-0.5 for _ in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = REPO / "data/tooluse/val.jsonl"
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(REPO / "configs/debug.yaml"), f"--data.train_files=[{data}]",
              "--data.val_files=null", "--rollout.estimator=grpo", "--rollout.rewards=[range_rewards.signed]"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert "vpo: error: reward 'range_rewards.signed' returned -0.5 for record" in err and "(r + 1) / 2" in err
    assert not (tmp_path / "checkpoints" / "debug").exists()  # failed before its first step: nothing left behind


def test_a_reward_failing_on_every_call_stops_after_a_bounded_count(module):
    def broken(candidate, sample):
        return sample["missing_key"]

    module.broken = broken
    vector = RewardVector(["reward_fixture_mod.broken"], fail_after=6)
    first = vector.score([["a", "b", "c"]], [{}])  # 3 failures: still below the bound, scored 0
    assert first.num_errors == 3 and float(first.rewards.abs().sum()) == 0.0
    with pytest.raises(BrokenRewardError, match=r"'reward_fixture_mod.broken' failed on all of its first 6 calls"):
        vector.score([["d", "e", "f"]], [{}])


def test_a_reward_that_sometimes_succeeds_is_not_stopped(module):
    module.flaky = lambda candidate, sample: 1.0 if candidate == "ok" else 1 / 0
    vector = RewardVector(["reward_fixture_mod.flaky"], fail_after=2)
    scores = vector.score([["ok", "x", "y", "z"]], [{}])
    assert scores.num_errors == 3 and scores.rewards[0, 0, 0] == 1.0
    assert RewardVector(["reward_fixture_mod.flaky"], fail_after=None).score([["x"] * 5], [{}]).num_errors == 5
    with pytest.raises(ValueError, match="fail_after"):
        RewardVector(["reward_fixture_mod.flaky"], fail_after=0)


def test_duplicate_registration_is_refused(module):
    register("fixture_len")(_length)
    register("fixture_len")(_length)  # the same function again (a module re-import) is fine

    def other(candidate, sample):
        return 0.0

    with pytest.raises(ValueError, match="registered twice"):
        register("fixture_len")(other)
    assert get_reward("fixture_len").fn is _length


def test_dotted_path_scalar_reward(module):
    module.length = _length
    entry = get_reward("reward_fixture_mod.length")
    assert entry.dims == ("length",) and entry.fn is _length and not entry.parallel
    scores = RewardVector(["format", "reward_fixture_mod.length"]).score([["12345"]], [{"ground_truth": []}])
    assert scores.rewards.shape == (1, 1, 2) and scores.rewards[0, 0, 1] == 0.5


def test_dotted_path_errors(module):
    with pytest.raises(ValueError, match="cannot import it as a dotted path"):
        get_reward("reward_fixture_mod.nothing_here")
    module.constant = 3
    with pytest.raises(ValueError, match="is not callable"):
        get_reward("reward_fixture_mod.constant")


def test_dotted_path_vector_reward_declares_dims_by_attribute(module):
    def pair(candidate, sample):
        return [1.0, 0.25]

    pair.dims = ("first", "second")
    module.pair = pair
    vector = RewardVector(["reward_fixture_mod.pair"])
    assert vector.dim_names == ["first", "second"]
    assert vector.score([["x"]], [{}]).rewards[0, 0].tolist() == [1.0, 0.25]
    module.bad = lambda c, s: 0.0
    module.bad.dims = "first"  # a string is not a sequence of names
    with pytest.raises(ValueError, match="dims attribute"):
        get_reward("reward_fixture_mod.bad")


def test_dotted_path_to_a_function_registered_under_another_name_keeps_its_dims(module):
    def triple(candidate, sample):
        return (0.0, 0.5, 1.0)

    register("fixture_triple", dims=("a", "b", "c"), parallel=True)(triple)
    module.triple = triple
    entry = get_reward("reward_fixture_mod.triple")
    assert entry.dims == ("a", "b", "c") and entry.parallel and entry.name == "reward_fixture_mod.triple"
    scores = RewardVector(["reward_fixture_mod.triple"], max_workers=2).score([["x", "y"]], [{}])
    assert torch.equal(scores.rewards[0], torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.5, 1.0]]))


def test_undeclared_vector_reward_stops_at_once(module):
    module.vector = lambda candidate, sample: [1.0, 0.0, 0.5, 0.5]  # four values, no declared dims
    vector = RewardVector(["reward_fixture_mod.vector"])
    assert vector.dim == 1
    with pytest.raises(RewardDeclarationError, match=r"returned 4 values but declares 1 dimension"):
        vector.score([["x"]], [{}])
    register("fixture_two", dims=("a", "b"))(lambda c, s: [1.0, 0.0, 1.0])
    with pytest.raises(RewardDeclarationError, match=r"returned 3 values but declares 2"):
        RewardVector(["fixture_two"]).score([["x"]], [{}])


def test_builtin_tasks_are_found_from_the_tasks_folder():
    assert builtin_tasks() == ["code", "eureqa", "livecodebench", "maze", "musique", "tooluse"]
    names = registry.registered_names()
    assert {"format", "tool_name", "arg_key", "arg_value", "maze", "code_tests", "musique", "eureqa",
            "lcb_tests"} <= set(names)
    assert get_reward("musique").f_weights == (1.0, 1.0, 1.0, 1.0, 3.0) and get_reward("maze").f_weights is None
    assert get_reward("maze").dims == ("exit", "gold", "diamond", "safety")
    assert len(get_reward("code_tests").dims) == 16 and get_reward("code_tests").parallel


def test_a_failing_reward_zeroes_the_whole_candidate(module):
    """VPO-SPEC section 3: a reward that raises (or returns an invalid value) makes the candidate score 0, on the
    other rewards' dimensions too."""
    module.length = _length
    module.picky = lambda candidate, sample: 1 / 0 if candidate.startswith("x") else 1.0
    vector = RewardVector(["reward_fixture_mod.length", "reward_fixture_mod.picky"])
    scores = vector.score([["12345", "x2345", "12345678"]], [{}])
    # "12345": [.5, 1]; "x2345" would have length .5 but picky raised -> [0, 0]; "12345678": [.8, 1]
    torch.testing.assert_close(scores.rewards[0], torch.tensor([[0.5, 1.0], [0.0, 0.0], [0.8, 1.0]]))
    assert scores.mask[0].tolist() == [True, True, True] and scores.num_errors == 1


def test_a_reward_with_per_record_dimensions_pads_and_masks(module):
    def tests_passed(candidate, sample):
        return [1.0 if c == "1" else 0.0 for c in candidate[: len(sample["tests"])]]

    register("fixture_tests", dims=[f"t{i}" for i in range(4)], real_dims=lambda s: len(s["tests"]))(tests_passed)
    module.length = _length
    vector = RewardVector(["fixture_tests", "reward_fixture_mod.length"])
    samples = [{"id": "three", "tests": ["a", "b", "c"]}, {"id": "four", "tests": ["a", "b", "c", "d"]}]
    scores = vector.score([["101"], ["0110"]], samples)
    # record "three" has D = 3 real test dimensions (+ length): its 4th test dimension is padding, scored 0
    assert scores.dim_mask.tolist() == [[True, True, True, False, True], [True] * 5]
    expected = torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.3], [0.0, 1.0, 1.0, 0.0, 0.4]])
    torch.testing.assert_close(scores.rewards[:, 0], expected)
    assert RewardVector(["reward_fixture_mod.length"]).score([["1"]], [{}]).dim_mask is None  # fixed D: no mask
    with pytest.raises(ValueError, match=r"record 'none' has 0 real dimensions; it must have 1..4"):
        vector.score([["1"]], [{"id": "none", "tests": []}])


def test_a_reward_returning_its_full_width_for_a_smaller_record_is_a_declaration_error(module):
    register("fixture_wide", dims=["a", "b", "c"], real_dims=lambda s: 2)(lambda candidate, sample: [1.0] * 3)
    with pytest.raises(RewardDeclarationError, match=r"returned 3 values .* \(2 real for record 'r'\)"):
        RewardVector(["fixture_wide"]).score([["x"]], [{"id": "r"}])


def test_same_module_name_in_two_config_folders_resolves_each(tmp_path, monkeypatch) -> None:
    """Two runs of one notebook each write api_rewards.py beside their config: the second run's dotted names must
    not resolve to the first file, which this process imported first (it failed in the full suite's order)."""
    rewards = registry
    monkeypatch.setattr(rewards, "_CONFIG_DIRS", [])
    monkeypatch.delitem(sys.modules, "api_rewards_pair", raising=False)
    for run, body in (("a", "def first(c, s):\n    return 0.25\n"), ("b", "def second(c, s):\n    return 0.75\n")):
        (tmp_path / run).mkdir()
        (tmp_path / run / "api_rewards_pair.py").write_text(body)
    rewards.add_config_dir(tmp_path / "a")
    assert rewards._import_dotted("api_rewards_pair.first")("x", {}) == 0.25
    rewards.add_config_dir(tmp_path / "b")
    assert rewards._import_dotted("api_rewards_pair.second")("x", {}) == 0.75
    monkeypatch.delitem(sys.modules, "api_rewards_pair", raising=False)
    for folder in (tmp_path / "a", tmp_path / "b"):
        if str(folder) in sys.path:
            sys.path.remove(str(folder))
