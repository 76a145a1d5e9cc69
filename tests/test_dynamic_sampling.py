"""Dynamic sampling (DAPO filter groups) and the beta = 0 zero-advantage skip: the pure logic with exact values, the
rollout hook (a batch with zero-spread groups is refilled, the token count includes the extra rounds) and the
module hook (zero-advantage chains skipped only when beta is 0, with the same gradient)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from vpo_lightning.core.dynamic_sampling import (
    DynamicSamplingSettings,
    Round,
    concat_groups,
    fill_batch,
    groups_with_signal,
    refill_indices,
    rows_to_train,
    select_groups,
)
from vpo_lightning.core.types import Generation
from vpo_lightning.generation.engines import Engine
from vpo_lightning.generation.models import load_tokenizer
from vpo_lightning.tasks.maze import Maze, make_record
from vpo_lightning.training.rollout import RolloutCallback

G = 2


def _round(advantages: list[list[float]], indices: list[int], tokens_per_chain: int = 3) -> Round:
    B = len(advantages)
    comp = [[100 * i + b + 1] * tokens_per_chain for i in indices for b in range(G)]
    return Round(records=[{"id": f"r{i}"} for i in indices], indices=list(indices), prompts=[[i] for i in indices],
                 completion_ids=comp, texts=[f"t{i}.{b}" for i in indices for b in range(G)],
                 rewards=torch.arange(B * G, dtype=torch.float32).view(B, G, 1, 1),
                 mask=torch.ones(B, G, 1, dtype=torch.bool), advantages=torch.tensor(advantages),
                 weights=torch.tensor([[[float(i)]] for i in indices]), num_tokens=B * G * tokens_per_chain,
                 extra={"gen_time": 1.0, "errors": 1})


def test_groups_with_signal_and_selection() -> None:
    adv = torch.tensor([[0.0, 0.0], [1.0, -1.0], [0.0, 0.0], [-0.5, 0.5]])
    assert groups_with_signal(adv).tolist() == [False, True, False, True]
    signals = [torch.tensor([False, True, False]), torch.tensor([True, True, False])]
    assert select_groups(signals, 2) == [(0, 1), (1, 0)]
    assert select_groups(signals, 5) == [(0, 1), (1, 0), (1, 1)]
    assert select_groups([torch.tensor([False, False])], 2) == [(0, 0), (0, 1)]  # no signal: round 0 as it is


def test_refill_indices_are_seeded_and_exclude_drawn_prompts() -> None:
    a = refill_indices(10, [0, 1, 2], 4, seed=7)
    assert a == refill_indices(10, [0, 1, 2], 4, seed=7) and len(set(a)) == 4 and not set(a) & {0, 1, 2}
    assert sorted(refill_indices(5, [0, 1, 2], 4, seed=7)) == [3, 4]  # only two left
    assert refill_indices(3, [0, 1, 2], 4, seed=7) == []


def test_fill_batch_refills_flat_groups_and_counts_every_token() -> None:
    first = _round([[0, 0], [1, -1], [0, 0]], [0, 1, 2])  # one group of three has signal
    calls: list[tuple[list[int], int]] = []
    later = {1: [[0, 0], [0, 0], [2, -2]], 2: [[3, -3], [4, -4], [0, 0]]}

    def draw(indices: list[int], r: int) -> Round:
        calls.append((indices, r))
        return _round(later[r], indices, tokens_per_chain=5)

    out, stats = fill_batch(first, draw, num_records=100, batch_size=3, max_extra_rounds=3, seed=1)
    assert [r for _, r in calls] == [1, 2]  # stops once 3 groups with signal are in hand
    assert all(len(idx) == 3 and not set(idx) & {0, 1, 2} for idx, _ in calls)
    assert not set(calls[0][0]) & set(calls[1][0])
    kept = [1, calls[0][0][2], calls[1][0][0]]  # (0, 1), (1, 2), (2, 0) in draw order
    assert out.indices == kept and [r["id"] for r in out.records] == [f"r{i}" for i in kept]
    assert out.advantages.tolist() == [[1, -1], [2, -2], [3, -3]]
    assert out.texts == [f"t{i}.{b}" for i in kept for b in range(G)]
    assert out.weights.flatten().tolist() == [float(i) for i in kept] and out.rewards.shape == (3, G, 1, 1)
    assert out.num_tokens == 2 * 3 + 4 * 5  # kept chains only: one group of round 0, two of later rounds
    assert stats == {"dynamic/extra_rounds": 2.0, "dynamic/groups_drawn": 9.0,
                     "dynamic/frac_zero_spread": pytest.approx(5 / 9), "dynamic/frac_dropped": pytest.approx(6 / 9),
                     "dynamic/extra_tokens": 60.0, "dynamic/total_tokens": 18.0 + 60.0}
    assert out.extra == {"gen_time": 3.0, "errors": 3}


def test_fill_batch_stops_at_max_rounds_and_keeps_round_zero_without_signal() -> None:
    first = _round([[0, 0], [0, 0]], [0, 1])
    out, stats = fill_batch(first, lambda idx, r: _round([[0, 0]] * len(idx), idx), 50, 2, 2, seed=0)
    assert stats["dynamic/extra_rounds"] == 2 and stats["dynamic/frac_zero_spread"] == 1.0
    assert out.indices == [0, 1] and stats["dynamic/frac_dropped"] == pytest.approx(4 / 6)
    out, stats = fill_batch(first, lambda idx, r: pytest.fail("no extra round allowed"), 50, 2, 0, seed=0)
    assert out.indices == [0, 1] and stats["dynamic/extra_tokens"] == 0.0


def test_concat_groups_slices_group_rows() -> None:
    a, b = _round([[1, -1], [0, 0]], [4, 5]), _round([[0, 0], [2, -2]], [6, 7])
    out = concat_groups([a, b], [(1, 1), (0, 0)], G)
    assert out.indices == [7, 4] and out.completion_ids == [[701] * 3, [702] * 3, [401] * 3, [402] * 3]
    assert out.rewards[:, :, 0, 0].tolist() == [[2.0, 3.0], [0.0, 1.0]]


def test_rows_to_train_skips_zero_advantage_only_without_kl() -> None:
    adv = torch.tensor([0.0, 1.5, 0.0, -0.5])
    assert rows_to_train(adv, beta=0.0).tolist() == [1, 3]
    assert rows_to_train(adv, beta=1e-3).tolist() == [0, 1, 2, 3]


# ---- the rollout hook ----------------------------------------------------------------------------------------

# A 5x5 maze (tests/test_maze.py's HAND): "R R R R D D D D" scores [1, 1, 0, 1]; "U" scores 0.
HAND = Maze(grid=(".....", ".#.#.", ".#.#.", ".#...", "....."), start=(0, 0), exit=(4, 4),
            gold=((0, 3), (0, 4), (1, 4)), diamond=((3, 0), (4, 0), (4, 1)), lava=((1, 2), (4, 3)), budget=10)
GOOD, BAD = "<route>R R R R D D D D</route>", "<route>U</route>"


class PromptKeyedEngine(Engine):
    """Flat prompts (their text says FLAT) get G copies of one answer; the others alternate a good and a bad one."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def generate(self, module, prompt_ids, group_size, sampling, seeds=None):
        self.calls.append(len(prompt_ids))
        texts = []
        for p in prompt_ids:
            flat = "FLAT" in module.tokenizer.decode(p)
            texts += [GOOD if flat or g % 2 == 0 else BAD for g in range(group_size)]
        ids = [module.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return Generation(ids, texts, sum(map(len, ids)))


def _record(i: int, flat: bool) -> dict:
    record = make_record(HAND, "train", i)
    record["messages"][-1]["content"] += " FLAT" if flat else " VARY"
    return record


@pytest.fixture(scope="module")
def module():
    return SimpleNamespace(tokenizer=load_tokenizer("tiny-llama"), device=torch.device("cpu"))


def _callback(enabled: bool, rounds: int = 2) -> RolloutCallback:
    cb = RolloutCallback(rewards=["maze"], estimator="grpo", group_size=4, log_samples_every=0,
                         dynamic_sampling=DynamicSamplingSettings(enabled=enabled, max_extra_rounds=rounds))
    cb.engine = PromptKeyedEngine()
    return cb


def test_rollout_refills_zero_spread_groups_and_counts_extra_tokens(module) -> None:
    pool = [_record(i, flat=i < 4) for i in range(12)]  # records 0..3 flat, 4..11 with spread
    batch = {"records": [pool[0], pool[1]], "indices": [0, 1], "position": 0}
    cb = _callback(enabled=True)
    trainer = SimpleNamespace(global_step=0, global_rank=0, world_size=1, should_stop=False,
                              datamodule=SimpleNamespace(train_stream=SimpleNamespace(records=pool)))
    cb.on_train_batch_start(trainer, module, batch, 0)
    ro = batch["rollout"]
    assert len(cb.engine.calls) >= 2 and cb.engine.calls[0] == 2  # the flat batch was refilled
    assert len(batch["indices"]) == 2 and all(i >= 4 for i in batch["indices"])  # only groups with signal kept
    assert ro.advantages.shape == (8,) and (ro.advantages.view(2, 4) != 0).any(1).all()
    tokens_per_chain = len(module.tokenizer(GOOD, add_special_tokens=False)["input_ids"])
    bad_tokens = len(module.tokenizer(BAD, add_special_tokens=False)["input_ids"])
    # round 0: 2 flat prompts x 4 GOOD; each extra round: 2 prompts, flat or alternating GOOD/BAD
    assert ro.metrics["rollout/tokens"] == ro.metrics["dynamic/total_tokens"] == cb.generated_tokens
    assert ro.metrics["dynamic/extra_tokens"] == cb.generated_tokens - 8 * tokens_per_chain
    assert cb.generated_tokens > 8 * tokens_per_chain + 4 * (tokens_per_chain + bad_tokens) - 1
    assert ro.metrics["dynamic/frac_dropped"] == pytest.approx(1 - 2 / ro.metrics["dynamic/groups_drawn"])
    assert ro.metrics["frac_zero_std_groups"] == 0.0
    cb.max_generated_tokens = cb.generated_tokens  # the budget counts the extra rounds: this step exhausts it
    cb.engine.sync = lambda m: None
    cb.on_train_batch_end(trainer, module, None, batch, 0)
    assert trainer.should_stop


def test_rollout_without_the_option_or_in_validation_is_unchanged(module) -> None:
    pool = [_record(i, flat=i < 4) for i in range(12)]
    for cb, step in ((_callback(enabled=False), 0), (_callback(enabled=True), -1)):
        batch = {"records": [pool[0], pool[1]], "indices": [0, 1], "position": 0}
        ro = cb.rollout(module, batch, step=step, pool=pool)
        assert cb.engine.calls == [2] and batch["indices"] == [0, 1] and torch.all(ro.advantages == 0)
        assert "dynamic/extra_rounds" not in ro.metrics


def test_dynamic_sampling_refuses_several_processes() -> None:
    cb = _callback(enabled=True)
    with pytest.raises(ValueError, match="several processes"):
        cb.setup(SimpleNamespace(world_size=2), SimpleNamespace(), "fit")
    with pytest.raises(ValueError, match="max_extra_rounds"):
        RolloutCallback(rewards=["maze"], dynamic_sampling=DynamicSamplingSettings(True, -1))


# ---- the module hook -----------------------------------------------------------------------------------------


def _tiny_module(beta: float):
    from test_module import _module

    module = _module()
    module.loss_settings = replace(module.loss_settings, beta=beta)  # a copy: the default instance is shared
    module.manual_backward = lambda loss: loss.backward()
    return module


def _step_grads(module, ro, skip: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
    seen: list[int] = []
    forward = type(module).completion_logprobs

    def counting(self_model, mb, temperature, entropy=False):
        if entropy:  # the training forward (the reference pass has entropy=False)
            seen.append(int(mb["completion_mask"].shape[0]) if "gather" not in mb else int(mb["targets"].shape[0]))
        return forward(module, self_model, mb, temperature, entropy)

    module.completion_logprobs = counting
    module.policy.zero_grad(set_to_none=True)
    trained = module._rows_with_gradient(ro) if skip else ro
    module._backward_pass(ro, module._prepare(trained))
    del module.completion_logprobs
    return {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}, seen


@pytest.mark.parametrize("beta", [0.0, 1e-3])
def test_zero_advantage_chains_are_skipped_only_when_beta_is_zero(beta: float) -> None:
    from test_module import _rollout

    module = _tiny_module(beta)
    ro = _rollout(module, n_prompts=2, group=4, seed=3)
    ro.advantages[torch.tensor([0, 2, 3, 6])] = 0.0  # 4 of 8 chains without advantage
    skipped, seen = _step_grads(module, ro, skip=True)
    assert sum(seen) == (4 if beta == 0 else 8)
    full, seen_full = _step_grads(module, ro, skip=False)
    assert sum(seen_full) == 8 and skipped.keys() == full.keys() and full
    for name in full:  # the same update: skipped chains have exactly zero loss when beta = 0
        torch.testing.assert_close(skipped[name], full[name], rtol=1e-4, atol=1e-6)  # as micro-batching


def test_all_zero_advantage_step_without_kl_runs_no_forward_and_gives_zero_gradients() -> None:
    from test_module import _rollout

    module = _tiny_module(0.0)
    ro = _rollout(module, n_prompts=1, group=3)
    ro.advantages.zero_()
    grads, seen = _step_grads(module, ro, skip=True)
    assert seen == [] and grads and all(torch.count_nonzero(g) == 0 for g in grads.values())
