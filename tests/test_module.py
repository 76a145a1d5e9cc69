"""VPOModule on the tiny model: log-probs, the training step, micro-batch accumulation, the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_module

from vpo_lightning.core.protocol import build_rollout_tensors
from vpo_lightning.core.types import Generation, Rollout
from vpo_lightning.generation.engines import SamplingSettings, TransformersEngine
from vpo_lightning.training.module import VPOModule, padded_micro_batches


def _module(**optim) -> VPOModule:
    torch.manual_seed(0)  # LoRA init and the adapter noise: the same weights whatever ran before
    return build_tiny_module(**optim)


def _rollout(module: VPOModule, n_prompts=2, group=3, seed=0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 1000, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_prompts)]
    comps = [torch.randint(10, 1000, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n_prompts * group)]
    gen = Generation(comps, [""] * len(comps), sum(map(len, comps)))
    ids, attn, comp, P = build_rollout_tensors(prompts, gen, group, module.tokenizer.pad_token_id)
    adv = torch.randn(n_prompts * group, generator=g)
    return Rollout(ids, attn, comp, P, adv, torch.zeros(len(comps), 1, 1), torch.ones(len(comps), 1, dtype=torch.bool),
                   [""] * len(comps))


def test_completion_logprobs_match_plain_forward():
    module = _module()
    ro = _rollout(module)
    [mb] = padded_micro_batches(ro, 100)
    lp = module.completion_logprobs(module.policy, mb, temperature=1.0)  # [N, L]
    attn = mb["attention_mask"]
    logits = module.policy(input_ids=mb["input_ids"], attention_mask=attn,
                           position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    P = mb["prompt_length"]
    plain = torch.log_softmax(logits[:, P - 1 : -1].float(), -1).gather(-1, mb["input_ids"][:, P:, None])[..., 0]
    m = mb["completion_mask"].bool()
    torch.testing.assert_close(lp[m], plain[m], rtol=1e-5, atol=1e-5)


def test_left_padding_does_not_change_logprobs():
    """The same chain scored alone and beside a longer prompt gets the same log-probs (position ids handled)."""
    module = _module()
    gen = Generation([[11, 12, 13], [11, 12, 13]], ["", ""], 6)
    ids, attn, comp, P = build_rollout_tensors([[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]], gen, 1, 2)
    ro = Rollout(ids, attn, comp, P, torch.zeros(2), torch.zeros(2, 1, 1), torch.ones(2, 1, dtype=torch.bool), [""] * 2)
    lp_pair = module.completion_logprobs(module.policy, padded_micro_batches(ro, 8)[0], 1.0)
    alone_gen = Generation([[11, 12, 13]], [""], 3)
    alone_ids, alone_attn, alone_comp, Pa = build_rollout_tensors([[5, 6, 7]], alone_gen, 1, 2)
    alone = Rollout(alone_ids, alone_attn, alone_comp, Pa, torch.zeros(1), torch.zeros(1, 1, 1),
                    torch.ones(1, 1, dtype=torch.bool), [""])
    lp_alone = module.completion_logprobs(module.policy, padded_micro_batches(alone, 8)[0], 1.0)
    mb = padded_micro_batches(ro, 8)[0]
    row = int((mb["index"] == 0).nonzero())
    torch.testing.assert_close(lp_pair[row], lp_alone[0], rtol=1e-4, atol=1e-5)


def test_reference_is_policy_with_adapters_disabled():
    module = _module()
    ro = _rollout(module)
    [mb] = padded_micro_batches(ro, 100)
    ref = module.reference_logprobs(mb, 1.0)
    with module.policy.disable_adapter():
        base = module.completion_logprobs(module.policy, mb, 1.0)
    policy = module.completion_logprobs(module.policy, mb, 1.0)
    torch.testing.assert_close(ref, base)
    assert not torch.allclose(ref, policy)


def _grads(module: VPOModule, ro: Rollout, micro: int) -> dict[str, torch.Tensor]:
    module.optim_settings.micro_batch_size = micro
    module.manual_backward = lambda loss: loss.backward()
    module.policy.zero_grad()
    mbs = module._prepare(ro)
    module._backward_pass(ro, mbs)
    return {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(aggregation):
    module = _module()
    module.loss_settings.aggregation = aggregation
    ro = _rollout(module, n_prompts=2, group=4)
    full, split = _grads(module, ro, 100), _grads(module, ro, 3)
    assert full.keys() == split.keys() and full
    for name in full:
        torch.testing.assert_close(split[name], full[name], rtol=1e-4, atol=1e-6)


def test_training_step_updates_lora_only():
    module = _module(lr=1e-2)
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    opt = module.configure_optimizers()
    module.trainer = SimpleNamespace(world_size=1)  # the pieces of the trainer the step touches
    module.optimizers = lambda: opt["optimizer"]
    module.lr_schedulers = lambda: opt["lr_scheduler"]["scheduler"]
    module.manual_backward = lambda loss: loss.backward()
    module.log_dict = lambda *a, **k: None
    ro = _rollout(module)
    module.training_step({"rollout": ro, "records": []}, 0)
    changed = {n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_A" in n for n in changed)


def _trainable(module: VPOModule, logged: dict) -> None:
    opt = module.configure_optimizers()
    module.trainer = SimpleNamespace(world_size=1)  # the pieces of the trainer the step touches
    module.optimizers = lambda: opt["optimizer"]
    module.lr_schedulers = lambda: opt["lr_scheduler"]["scheduler"]
    module.manual_backward = lambda loss: loss.backward()
    module.log_dict = lambda values, **k: logged.update(values)


def test_defaults_follow_the_reference():
    """verl as the paper ran it (PAPER_REPRO.md section 2): dual-clip c = 3, AdamW weight decay 0.01, 2 mini-batch
    updates per rollout (train batch 128 x 8 with mini-batch 64)."""
    from vpo_lightning.training.module import LossSettings, OptimSettings

    assert LossSettings().dual_clip == 3.0
    assert OptimSettings().weight_decay == 0.01 and OptimSettings().mini_batches == 2
    module = _module(lr=1e-3)
    assert module.configure_optimizers()["optimizer"].param_groups[0]["weight_decay"] == 0.01
    with pytest.raises(ValueError, match="optim.mini_batches must be a positive int"):
        OptimSettings(mini_batches=0)


def test_second_mini_batch_update_sees_a_ratio_against_the_pre_update_policy(monkeypatch):
    """With 2 updates per rollout the second half's old log-probs are the policy's before the first update, so its
    PPO ratio differs from 1 (and the clip can act); with 1 update the ratio is exactly 1."""
    import vpo_lightning.training.module as module_mod

    calls = []
    real = module_mod.policy_loss

    def recording(logp, old, adv, mask, *args, **kwargs):
        calls.append((logp.detach().clone(), old.detach().clone(), mask.clone()))
        return real(logp, old, adv, mask, *args, **kwargs)

    monkeypatch.setattr(module_mod, "policy_loss", recording)
    logged: dict = {}
    module = _module(lr=5e-2, mini_batches=2, micro_batch_size=100)
    ro = _rollout(module, n_prompts=2, group=3)  # 6 chains -> parts of chains 0..2 and 3..5
    [mb] = padded_micro_batches(ro, 100)
    with torch.no_grad():
        before = module.completion_logprobs(module.policy, mb, 1.0)  # [6, L] the policy that sampled
    _trainable(module, logged)
    module.training_step({"rollout": ro, "records": []}, 0)
    assert len(calls) == 2 and logged["train/updates"] == 2.0
    (logp1, old1, m1), (logp2, old2, m2) = calls
    torch.testing.assert_close(old1[m1.bool()], logp1[m1.bool()])  # first update: ratio exactly 1
    second = module._mini_batch_parts(ro)[1][0]  # chains 3..5
    [mb2] = padded_micro_batches(second, 100)
    rows = [int(r) for r in (torch.arange(6)[3:])[mb2["index"]]]  # the second part's chains in ro's numbering
    row_of = {int(i): n for n, i in enumerate(mb["index"])}
    expected = torch.stack([before[row_of[r], : old2.shape[1]] for r in rows])
    on = m2.bool()
    torch.testing.assert_close(old2[on], expected[on], rtol=1e-5, atol=1e-5)  # old = the pre-update policy
    assert (logp2[on] - old2[on]).abs().max() > 1e-4  # the first update moved them: ratio != 1
    logged.clear()
    single = _module(lr=5e-2, mini_batches=1)
    _trainable(single, logged)
    single.training_step({"rollout": _rollout(single, n_prompts=2, group=3), "records": []}, 0)
    assert logged["train/updates"] == 1.0 and logged["train/ratio_min"] == logged["train/ratio_max"] == 1.0


def test_transformers_engine_generates_group_contiguous_chains():
    """Chains n = 0..G-1 continue prompt 0 and G..2G-1 prompt 1: with greedy sampling (top_k = 1) every chain equals
    its own prompt's continuation generated alone, and the two prompts' continuations differ."""
    module = _module()
    tok = module.tokenizer
    prompts = [tok("hello")["input_ids"], tok("a longer prompt here")["input_ids"]]
    greedy = SamplingSettings(max_new_tokens=5, top_k=1)
    gen = TransformersEngine().generate(module, prompts, 3, greedy)
    assert len(gen.completion_ids) == 6 and len(gen.texts) == 6
    assert all(1 <= len(c) <= 5 for c in gen.completion_ids)
    assert gen.num_tokens == sum(len(c) for c in gen.completion_ids)
    alone = [TransformersEngine().generate(module, [p], 1, greedy).completion_ids[0] for p in prompts]
    assert alone[0] != alone[1]  # otherwise the order check below would prove nothing
    assert gen.completion_ids == [alone[0]] * 3 + [alone[1]] * 3
