"""RolloutCallback: prompts per estimator, candidate parsing, reward tensor, advantages and metrics.

The engine is a scripted stand-in that returns fixed completions: these tests are about what the callback does with
generated text, not about generation (tests/test_module.py runs the real transformers engine).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import ScriptedEngine

from vpo_lightning.models import load_tokenizer
from vpo_lightning.rollout import RolloutCallback, derive_seed

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
    assert "Objective weights" in shown and "tool_name=" in shown
    cb = _callback([GOOD], estimator="random_weight_grpo")
    cb.rollout(module, _batch(1), step=3)
    assert "Objective weights" not in module.tokenizer.decode(cb.engine.prompts[0][0])


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
