"""VPOModule on the tiny model: log-probs, the training step, micro-batch accumulation, the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_module

from vpo_lightning.engines import Generation, SamplingSettings, TransformersEngine
from vpo_lightning.module import VPOModule, _micro_batches
from vpo_lightning.protocol import Rollout, build_rollout_tensors


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
    [mb] = _micro_batches(ro, 100)
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
    lp_pair = module.completion_logprobs(module.policy, _micro_batches(ro, 8)[0], 1.0)
    alone_gen = Generation([[11, 12, 13]], [""], 3)
    alone_ids, alone_attn, alone_comp, Pa = build_rollout_tensors([[5, 6, 7]], alone_gen, 1, 2)
    alone = Rollout(alone_ids, alone_attn, alone_comp, Pa, torch.zeros(1), torch.zeros(1, 1, 1),
                    torch.ones(1, 1, dtype=torch.bool), [""])
    lp_alone = module.completion_logprobs(module.policy, _micro_batches(alone, 8)[0], 1.0)
    mb = _micro_batches(ro, 8)[0]
    row = int((mb["index"] == 0).nonzero())
    torch.testing.assert_close(lp_pair[row], lp_alone[0], rtol=1e-4, atol=1e-5)


def test_reference_is_policy_with_adapters_disabled():
    module = _module()
    ro = _rollout(module)
    [mb] = _micro_batches(ro, 100)
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
