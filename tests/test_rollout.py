"""RolloutCallback: prompts per estimator, candidate parsing, reward tensor, advantages and metrics.

The engine is a scripted stand-in that returns fixed completions: these tests are about what the callback does with
generated text, not about generation (tests/test_module.py runs the real transformers engine).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import ScriptedEngine

from vpo_lightning.core.protocol import derive_seed
from vpo_lightning.generation.models import load_tokenizer
from vpo_lightning.training.rollout import RolloutCallback

GOLD = [{"get_weather": {"city": ["Paris"]}}]
TOOLS = [{"name": "get_weather", "description": "weather", "parameters": {"type": "dict", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}]
GOOD = '<think>ok</think>\n<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>'
WRONG = '<think>ok</think>\n<tool_call>\n{"name": "get_time", "parameters": {"zone": "CET"}}\n</tool_call>'


@pytest.fixture(scope="module")
def module():
    return SimpleNamespace(tokenizer=load_tokenizer("tiny-llama"), device=torch.device("cpu"))


def _batch(n=2):
    rec = {"id": "w", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
           "ground_truth": GOLD}
    return {"records": [dict(rec, id=f"w{i}") for i in range(n)], "indices": list(range(n)), "position": 0}


def _callback(texts, **kw):
    cb = RolloutCallback(rewards=["format", "tool_name", "arg_key", "arg_value"], group_size=4, **kw)
    cb.engine = ScriptedEngine(texts)
    return cb


def test_vpo_chain_rollout(module):
    chains = [f"<response_1>{GOOD}</response_1><response_2>{WRONG}</response_2>", "no tags at all",
              f"<response_3>{GOOD}</response_3>", f"<response_1>{WRONG}</response_1>"]
    cb = _callback(chains, estimator="vpo", num_candidates=3)
    ro = cb.rollout(module, _batch(), step=0)
    prompt_text = module.tokenizer.decode(cb.engine.prompts[0][0])
    assert "<response_1>" in prompt_text and "<response_3>" in prompt_text  # the m-answer instruction
    assert ro.rewards.shape == (8, 3, 4) and ro.candidate_mask.shape == (8, 3)
    assert ro.candidate_mask[0].tolist() == [True, True, False] and not ro.candidate_mask[1].any()
    torch.testing.assert_close(ro.rewards[0, 0], torch.ones(4))  # the gold call scores 1 on every dimension
    assert ro.rewards[0, 1, 1] == 0  # wrong tool name
    # chains 0 and 2 contain the gold answer -> the highest set reward -> the highest advantage in the group
    adv = ro.advantages.view(2, 4)
    assert adv[0, 0] > adv[0, 1] and adv[0, 2] > adv[0, 3] and adv[0, 0] == pytest.approx(adv[0, 2].item())
    assert ro.metrics["chains/parse_rate"] == pytest.approx(0.75)
    assert ro.metrics["reward/tool_name"] > 0 and "reward/set" in ro.metrics
    assert ro.completion_mask.sum() > 0 and ro.input_ids.shape[0] == 8


def test_grpo_uses_single_answers_and_no_instruction(module):
    cb = _callback([GOOD, WRONG], estimator="grpo", num_candidates=3)
    assert cb.m == 1
    ro = cb.rollout(module, _batch(), step=0)
    assert "<response_1>" not in module.tokenizer.decode(cb.engine.prompts[0][0])
    assert ro.rewards.shape == (8, 1, 4)
    adv = ro.advantages.view(2, 4)
    assert (adv[:, 0] > 0).all() and (adv[:, 1] < 0).all()


def test_goal_conditioned_shows_weights_and_random_weight_does_not(module):
    cb = _callback([GOOD], estimator="goal_conditioned_grpo")
    cb.rollout(module, _batch(1), step=3)
    shown = module.tokenizer.decode(cb.engine.prompts[0][0])
    w = cb.protocol.step_weights([0], step=3, records=_batch(1)["records"])[0, 0].tolist()
    # the reference's wording (vpo/augment.py) and objective phrases (vpo_tasks/tool.py), weights to 2 decimals
    suffix = ("Your objective weights (higher = more important to optimize):\n"
              f"- Producing a well-formed structured response: {w[0]:.2f}\n- Calling the right tools: {w[1]:.2f}\n"
              f"- Filling in the right argument keys: {w[2]:.2f}\n- Using the right argument values: {w[3]:.2f}\n\n"
              "Maximize your weighted score.")
    assert suffix in shown
    cb = _callback([GOOD], estimator="random_weight_grpo")
    cb.rollout(module, _batch(1), step=3)
    assert "objective weights" not in module.tokenizer.decode(cb.engine.prompts[0][0])


@pytest.mark.parametrize("estimator", ["random_weight_grpo", "goal_conditioned_grpo"])
def test_weighted_baselines_fix_w_per_training_row(module, estimator):
    """The reference keys these weights on (seed, row): the same row gets the same w at every step; VPO's differ."""
    cb = _callback([GOOD, WRONG], estimator=estimator)
    records = _batch(3)["records"]
    at_1, at_9 = cb.protocol.step_weights([0, 1, 2], 1, records), cb.protocol.step_weights([0, 1, 2], 9, records)
    assert at_1.shape == (3, 1, 4) and torch.equal(at_1, at_9)
    assert not torch.equal(at_1[0], at_1[1])  # different rows, different weights
    # keyed by record id: the same record at another position of another batch draws the same w
    torch.testing.assert_close(cb.protocol.step_weights([7], 5, [records[2]])[0], at_1[2])
    # and the rollout shows / uses them: the prompts of one row at two steps are identical
    cb.rollout(module, _batch(1), step=1)
    first = cb.engine.prompts[-1][0]
    cb.rollout(module, _batch(1), step=9)
    assert cb.engine.prompts[-1][0] == first
    assert not torch.equal(_callback([GOOD], estimator="vpo").protocol.step_weights([0], 1, records[:1]),
                           _callback([GOOD], estimator="vpo").protocol.step_weights([0], 9, records[:1]))


def test_max_at_k_group_size_and_k_are_checked_and_k_is_used(module):
    with pytest.raises(ValueError, match=r"default k = max\(2, G // 2\) = 2 with group_size=2"):
        RolloutCallback(rewards=["format"], estimator="max_at_k", group_size=2)
    with pytest.raises(ValueError, match=r"rollout.max_at_k_k=4 with group_size=4"):
        RolloutCallback(rewards=["format"], estimator="max_at_k", group_size=4, max_at_k_k=4)
    with pytest.raises(ValueError, match="max_at_k_k must be null or a positive int"):
        RolloutCallback(rewards=["format"], estimator="max_at_k", group_size=4, max_at_k_k=0)
    from vpo_lightning.core.advantages import max_at_k

    partial = '<think>ok</think>\n<tool_call>\n{"name": "get_weather", "parameters": {"city": "Rome"}}\n</tool_call>'
    cb = _callback([GOOD, WRONG, partial, "nothing"], estimator="max_at_k", max_at_k_k=3)
    ro = cb.rollout(module, _batch(1), step=0)
    expected = max_at_k(ro.rewards.view(1, 4, 1, 4), ro.candidate_mask.view(1, 4, 1), k=3).view(-1)
    torch.testing.assert_close(ro.advantages, expected)
    assert not torch.allclose(expected, max_at_k(ro.rewards.view(1, 4, 1, 4), ro.candidate_mask.view(1, 4, 1)).view(-1))


def test_gdpo_rollout_whitens_by_generated_tokens(module):
    from vpo_lightning.core.advantages import gdpo

    cb = _callback([GOOD, WRONG + " and a much longer tail of text " * 3, "x", GOOD + " ok"], estimator="gdpo")
    ro = cb.rollout(module, _batch(2), step=0)
    counts = ro.completion_mask.sum(1).view(2, 4)  # generated tokens per chain
    assert len(set(counts.flatten().tolist())) > 1
    expected = gdpo(ro.rewards.view(2, 4, 1, 4), ro.candidate_mask.view(2, 4, 1), token_counts=counts).view(-1)
    torch.testing.assert_close(ro.advantages, expected)
    assert not torch.allclose(expected, gdpo(ro.rewards.view(2, 4, 1, 4), ro.candidate_mask.view(2, 4, 1)).view(-1))


def test_weights_are_keyed_by_step_and_prompt_not_by_batch_layout():
    cb = RolloutCallback(rewards=["format", "tool_name"], estimator="vpo", num_weights=5)
    both = cb.protocol.step_weights([10, 11], step=7)  # [2, 5, 2]
    alone = cb.protocol.step_weights([11], step=7)
    torch.testing.assert_close(both[1], alone[0])  # prompt 11 draws the same weights wherever it lands
    assert not torch.equal(cb.protocol.step_weights([11], step=8), alone)
    assert both.shape == (2, 5, 2) and torch.allclose(both.sum(-1), torch.ones(2, 5))
    assert derive_seed(1, 2) == derive_seed(1, 2) != derive_seed(2, 1)


def test_constant_group_has_zero_advantage_and_is_counted(module):
    cb = _callback([GOOD], estimator="vpo")
    ro = cb.rollout(module, _batch(), step=0)
    assert torch.all(ro.advantages == 0) and ro.metrics["frac_zero_std_groups"] == 1.0


def test_bad_settings_fail_fast():
    for kw, match in (({"group_size": 1}, "group_size"), ({"num_candidates": 0}, "num_candidates"),
                      ({"num_weights": 0}, "num_weights"), ({"alpha": 0.0}, "alpha"),
                      ({"estimator": "ppo"}, "estimator")):
        with pytest.raises(ValueError, match=match):
            RolloutCallback(rewards=["format"], **kw)
    with pytest.raises(ValueError, match="Registered rewards"):
        RolloutCallback(rewards=["no_such_reward"])


@pytest.mark.parametrize("trim_memory", [True, False])
def test_every_step_end_trims_the_heap_unless_turned_off(monkeypatch, trim_memory):
    # the fix for resident memory growing over a long run (issue 56): malloc_trim once per optimizer step
    calls = []
    monkeypatch.setattr("vpo_lightning.training.rollout.trim_malloc", lambda: calls.append(1) or True)
    cb = _callback(["x"], trim_memory=trim_memory)
    trainer = SimpleNamespace(should_stop=False, global_step=0)
    for step in range(3):
        cb.on_train_batch_end(trainer, SimpleNamespace(), None, {}, step)
    assert len(calls) == (3 if trim_memory else 0)
