"""Prompt-shared packing: the mask and row layout (exact values), and equality with the plain micro-batches on
the tiny model (log-probs, entropy, reference and gradients, with and without gradient checkpointing)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_module

from vpo_lightning.core.packing import pack_rows, packed_attention_mask, packed_micro_batches, prompt_groups
from vpo_lightning.core.protocol import build_rollout_tensors
from vpo_lightning.core.types import Generation, Rollout
from vpo_lightning.training.module import VPOModule, padded_micro_batches


def test_mask_prompt_causal_completions_see_prompt_and_themselves():
    allowed = packed_attention_mask(2, [2, 1], torch.bool)[0, 0].int()
    expected = torch.tensor([
        [1, 0, 0, 0, 0],  # prompt token 0
        [1, 1, 0, 0, 0],  # prompt token 1
        [1, 1, 1, 0, 0],  # completion 1, token 0
        [1, 1, 1, 1, 0],  # completion 1, token 1
        [1, 1, 0, 0, 1],  # completion 2, token 0: prompt + itself, not completion 1
    ])
    assert torch.equal(allowed, expected)
    additive = packed_attention_mask(2, [2, 1], torch.float32)[0, 0]
    assert torch.equal(additive == 0, expected.bool())
    assert torch.all(additive[~expected.bool()] == torch.finfo(torch.float32).min)


def _tensors(prompts, comps, group):
    gen = Generation(comps, [""] * len(comps), sum(map(len, comps)))
    return build_rollout_tensors(prompts, gen, group, pad_id=0)


def test_pack_rows_layout():
    ids, attn, comp, P = _tensors([[5, 6, 7]], [[11, 12], [], [13, 14, 15]], 3)
    mb = pack_rows(ids, attn, comp, P, [2, 0, 1])
    assert mb["input_ids"].tolist() == [[5, 6, 7, 13, 14, 15, 11, 12]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 3, 4]]
    # row 2 (13, 14, 15): predicted by the last prompt state (2), then 3, 4; row 0 (11, 12) by 2, then 6
    assert mb["gather"].tolist() == [[2, 3, 4], [2, 6, 0], [0, 0, 0]]
    assert mb["targets"].tolist() == [[13, 14, 15], [11, 12, 0], [0, 0, 0]]
    assert mb["completion_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]


def test_prompt_groups_by_tokens_not_by_position():
    # left padding differs (the other prompt is longer) but the real tokens match -> one group
    ids, attn, comp, P = _tensors([[5, 6], [1, 2, 3, 4], [5, 6]], [[9]] * 6, 2)
    assert prompt_groups(ids, attn, P) == [[0, 1, 4, 5], [2, 3]]
    mbs = packed_micro_batches(ids, attn, comp, P, size=3)
    assert [mb["index"].tolist() for mb in mbs] == [[0, 1, 4], [5], [2, 3]]


def _module(checkpointing=False, attn="sdpa") -> VPOModule:
    module = build_tiny_module(attn=attn, checkpointing=checkpointing, lora_b_seed=1)
    module.policy.train()
    return module


def _rollout(seed=0, n_prompts=3, group=4) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 1000, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_prompts)]
    prompts[2] = list(prompts[0])  # two groups with the same prompt: packed together
    comps = [torch.randint(10, 1000, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n_prompts * group)]
    comps[1] = []  # an empty completion
    ids, attn, comp, P = _tensors(prompts, comps, group)
    adv = torch.randn(len(comps), generator=g)
    return Rollout(ids, attn, comp, P, adv, torch.zeros(len(comps), 1, 1), torch.ones(len(comps), 1, dtype=torch.bool),
                   [""] * len(comps))


def _scatter(module, mbs, ro, fn):
    out = torch.zeros(ro.completion_mask.shape)
    for mb in mbs:
        lp = fn(mb)
        out[mb["index"], : lp.shape[1]] = lp * mb["completion_mask"]
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_entropy_and_reference_equal_plain(attn):
    module = _module(attn=attn)
    ro = _rollout()
    packed = packed_micro_batches(ro.input_ids, ro.attention_mask, ro.completion_mask, ro.prompt_length, 5,
                                  torch.bool if attn == "sdpa" else torch.float32)
    plain = padded_micro_batches(ro, 5)
    assert len(packed) == 3  # prompts 0 and 2 are identical: 8 chains -> rows of 5 + 3, prompt 1: 4
    with torch.no_grad():
        for which in (0, 1):  # log-probs, entropy
            def part(mb, w=which):
                return module.completion_logprobs(module.policy, mb, 0.7, True)[w]

            a, b = _scatter(module, packed, ro, part), _scatter(module, plain, ro, part)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        a = _scatter(module, packed, ro, lambda mb: module.reference_logprobs(mb, 1.0))
        b = _scatter(module, plain, ro, lambda mb: module.reference_logprobs(mb, 1.0))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _grads(module, ro, share_prompt, micro):
    module.optim_settings.share_prompt = share_prompt
    module.optim_settings.micro_batch_size = micro
    module.manual_backward = lambda loss: loss.backward()
    module.policy.zero_grad()
    module._backward_pass(ro, module._prepare(ro))
    return {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("checkpointing", "attn"), [(False, "sdpa"), (True, "sdpa"), (False, "eager")])
def test_packed_gradients_equal_plain(checkpointing, attn):
    module = _module(checkpointing=checkpointing, attn=attn)  # eager: the module builds an additive fp32 mask
    module.loss_settings.beta = 0.05
    ro = _rollout(seed=3)
    plain, packed = _grads(module, ro, False, 4), _grads(module, ro, True, 3)
    assert plain.keys() == packed.keys() and plain
    assert any(float(g.abs().sum()) > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(packed[name], plain[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_attention_equals_sdpa_under_the_block_mask(dtype):
    """The prompt once, then the completions against [prompt | themselves] (on CPU: ChainAttention, the prompt part
    for all completions in one call, merged with each completion's causal part): SDPA's values under the packed
    row's [T, T] mask (grouped heads, an empty completion included), and the same gradients; in bf16 up to bf16
    rounding."""
    import types

    from vpo_lightning.core.packing import packed_attention_mask
    from vpo_lightning.generation.attention import vpo_sdpa

    g = torch.Generator().manual_seed(0)
    p, lengths = 5, [4, 0, 3, 1]
    T = p + sum(lengths)
    q = torch.randn(1, 6, T, 8, generator=g).to(dtype).requires_grad_()  # [1, heads, T, d]
    k, v = (torch.randn(1, 2, T, 8, generator=g).to(dtype).requires_grad_() for _ in range(2))  # [1, kv_heads, T, d]
    layer = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    mask = packed_attention_mask(p, lengths, torch.bool)  # [1, 1, T, T]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    out, _ = vpo_sdpa(layer, q, k, v, mask, vpo_segments=(p, lengths))
    exact = dtype == torch.float32
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-6 if exact else 2e-2, atol=1e-6 if exact else 2e-2)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype)
    grads = torch.autograd.grad((out * weights).float().sum(), (q, k, v))
    refs = torch.autograd.grad((ref * weights).float().sum(), (q, k, v))
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5 if exact else 3e-2, atol=1e-5 if exact else 3e-2)
