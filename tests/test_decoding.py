"""The transformers engine's decode loop and its pieces (vpo_lightning/decoding.py): the sampler draws from the
distribution transformers' warpers define, the decode attention equals SDPA, merging and prepacking change the
arithmetic only by rounding and leave the model as it was, and the engine gives the reference engine's tokens
under greedy decoding with log-probs that match the trainer's."""

from __future__ import annotations

import math
import types

import pytest
import torch

from vpo_lightning.generation.attention import vpo_sdpa
from vpo_lightning.generation.decoding import (
    filter_logits,
    merged_lora,
    prepacked_linears,
    prepacking_works,
    sample_next,
)
from vpo_lightning.generation.engines import SamplingSettings, TransformersEngine

REFERENCE = {"decode_loop": False, "merge_lora": False, "prepack_weights": False}  # model.generate, as before #25


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                               (1.0, 20, 0.5), (1.0, 1, 1.0)])
def test_filter_logits_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    torch.testing.assert_close(filter_logits(logits, temperature, top_k, top_p), ref, rtol=0, atol=0)


def test_sample_next_draws_from_the_filtered_distribution():
    """20,000 draws from one row: frequencies within 5 standard errors of the probabilities, filtered tokens never
    drawn, and the reported log-probs are log_softmax(logits / T) at the drawn tokens (the trainer's)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.8, 4, 1.0), (1.0, 0, 0.9)]:
        probs = filter_logits(logits[None], temperature, top_k, top_p).softmax(-1)[0]
        rows = logits.expand(20_000, -1)
        tokens, logprobs = sample_next(rows, temperature, top_k, top_p, generator=torch.Generator().manual_seed(0))
        freq = torch.bincount(tokens, minlength=len(logits)).double() / len(tokens)
        se = (probs.double() * (1 - probs.double()) / len(tokens)).sqrt()
        assert bool(((freq - probs.double()).abs() <= 5 * se + 1e-12).all()), (freq, probs)
        assert bool((freq[probs == 0] == 0).all())
        expected = (logits / temperature).log_softmax(-1)[tokens]
        torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)


def test_sample_next_is_reproducible_and_handles_a_one_hot_row():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    a = sample_next(logits, generator=torch.Generator().manual_seed(7))[0]
    b = sample_next(logits, generator=torch.Generator().manual_seed(7))[0]
    assert torch.equal(a, b)
    one_hot = torch.full((3, 10), -math.inf)
    one_hot[:, 9] = 0.0  # all mass on the last token: the clamp at the end of the CDF must not move it
    tokens, logprobs = sample_next(one_hot)
    assert tokens.tolist() == [9, 9, 9] and logprobs.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_sdpa_with_left_padding(dtype):
    """One query per row against a grouped (GQA) KV cache held as a view of a larger buffer, rows left-padded."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 6, 1, 16, generator=g).to(dtype)  # [b, heads, 1, d]
    buf_k, buf_v = (torch.randn(4, 2, 40, 16, generator=g).to(dtype) for _ in range(2))  # [b, kv_heads, cap, d]
    k, v = buf_k[:, :, :25], buf_v[:, :, :25]
    mask = torch.ones(4, 1, 1, 25, dtype=torch.bool)
    mask[1, ..., :7] = False  # row 1's prompt was left-padded by 7
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                           enable_gqa=True).transpose(1, 2)  # [b, 1, heads, d]
    layer = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)  # what SDPA's path reads of the layer
    out, _ = vpo_sdpa(layer, q, k, v, mask, scaling=16**-0.5)
    assert out.shape == (4, 1, 6, 16) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=1e-5 if dtype == torch.float32 else 3e-2)


def test_models_loaded_with_sdpa_run_vpo_sdpa_and_others_are_left_alone(tiny_module):
    from vpo_lightning.generation.attention import use_vpo_attention, uses_vpo_attention

    module = tiny_module()
    assert uses_vpo_attention(module.policy.get_base_model())  # vpo fit's models: SDPA plus the two shortcuts
    eager = tiny_module(attn="eager").policy.get_base_model()
    assert not use_vpo_attention(eager) and not uses_vpo_attention(eager)
    assert eager.config._attn_implementation == "eager"


def _logits(module, ids):
    return module.policy(input_ids=ids).logits


def test_merged_lora_computes_the_adapted_model_and_restores_the_base_exactly(tiny_module):
    module = tiny_module()  # a non-zero adapter: merging changes the weights
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    base_weights = {n: (p, p.detach().clone()) for n, p in module.policy.named_parameters() if "base_layer" in n}
    with torch.no_grad():
        adapted = _logits(module, ids)
        with module.policy.disable_adapter():
            plain = _logits(module, ids)
        with merged_lora(module.policy) as merged:
            assert merged
            inside = _logits(module, ids)
            current = dict(module.policy.named_parameters())
            assert all(current[n] is not p for n, (p, _) in base_weights.items())  # merged copies in use ...
            assert all(torch.equal(p, clone) for p, clone in base_weights.values())  # ... the originals untouched
        after = _logits(module, ids)
    assert not torch.allclose(adapted, plain)  # the adapter matters here
    torch.testing.assert_close(inside, adapted, rtol=1e-4, atol=1e-5)  # float32: rounding only
    assert torch.equal(after, adapted)  # the adapter is back on, the base bitwise as it was
    for name, (param, clone) in base_weights.items():
        assert dict(module.policy.named_parameters())[name] is param and torch.equal(param, clone), name


def test_merged_lora_leaves_a_model_without_lora_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with merged_lora(model) as merged:
        assert not merged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_match_linear_and_are_removed_after(dtype):
    if not prepacking_works(dtype):
        pytest.skip(f"this torch/CPU has no oneDNN prepacked {dtype} products")
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32, bias=False)).to(dtype)
    x = torch.randn(16, 1, 64, generator=g).to(dtype)
    with torch.no_grad():
        ref = model(x)
        with prepacked_linears(model, rows=16) as switched:
            assert switched == 2 and all("forward" in vars(m) for m in model if isinstance(m, torch.nn.Linear))
            out = model(x)
            wide = model(torch.randn(2, 30, 64, generator=g).to(dtype))  # a prefill-shaped input works too
    assert not any("forward" in vars(m) for m in model)
    assert wide.shape == (2, 30, 32)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-3 if dtype == torch.float32 else 2e-2,
                               atol=1e-4 if dtype == torch.float32 else 2e-2)


def _prompts(module):
    tok = module.tokenizer
    return [tok("hello there")["input_ids"], tok("a longer prompt with more tokens in it")["input_ids"]]


def test_decode_loop_gives_the_reference_engines_tokens_under_greedy_decoding(tiny_module):
    """The default engine (own decode loop through the fused decoder: merged adapter, prepacked weights) against
    ``model.generate`` on the unmerged policy, float32, top_k = 1: the same tokens; each option alone too."""
    module = tiny_module()
    prompts, greedy = _prompts(module), SamplingSettings(top_k=1, max_new_tokens=12)
    ref = TransformersEngine(**REFERENCE).generate(module, prompts, 3, greedy)
    assert ref.engine_logprobs is None and len(set(map(tuple, ref.completion_ids))) > 1
    for options in [{}, {"fused_decode": False}, {"merge_lora": False, "prepack_weights": False},
                    {"decode_loop": False}, {"decode_loop": False, "merge_lora": False}]:
        out = TransformersEngine(**options).generate(module, prompts, 3, greedy)
        assert out.completion_ids == ref.completion_ids, options
        assert out.texts == ref.texts


def test_decode_loop_logprobs_are_the_trainers(tiny_module):
    """The engine's per-token log-probs against the trainer's for the same chains: the gap that the module logs as
    ``train/engine_logprob_gap`` (float32: ~1e-6); and the module's gap is that mean, read without a second pass."""
    from vpo_lightning.core.protocol import build_rollout_tensors, engine_logprob_tensor
    from vpo_lightning.core.types import Rollout

    module = tiny_module()
    module.trainer = types.SimpleNamespace(world_size=1)  # the pieces of the trainer a backward pass touches
    module.manual_backward = lambda loss: loss.backward()
    prompts = _prompts(module)
    torch.manual_seed(0)
    gen = TransformersEngine().generate(module, prompts, 3, SamplingSettings(max_new_tokens=10))
    assert [len(lp) for lp in gen.engine_logprobs] == [len(c) for c in gen.completion_ids]
    ids, attn, comp, P = build_rollout_tensors(prompts, gen, 3, module.tokenizer.pad_token_id)
    engine_lp = engine_logprob_tensor(gen, comp)  # [N, L]
    n = len(gen.completion_ids)
    ro = Rollout(ids, attn, comp, P, torch.randn(n), torch.zeros(n, 1, 1), torch.ones(n, 1, dtype=torch.bool),
                 gen.texts, engine_logprobs=engine_lp)
    mbs = module._prepare(ro)
    stats = module._backward_pass(ro, mbs, ro.engine_logprobs)
    assert 0.0 <= stats["engine_logprob_gap"] < 1e-4
    shifted = module._backward_pass(ro, mbs, ro.engine_logprobs - 0.25 * comp)  # 0.25 off on every token
    assert shifted["engine_logprob_gap"] == pytest.approx(0.25, abs=1e-4)


def test_decode_loop_seeds_make_a_prompts_samples_reproducible(tiny_module):
    module = tiny_module()
    prompts, sampling = _prompts(module), SamplingSettings(max_new_tokens=8)
    engine = TransformersEngine(per_prompt_seed=True)
    a = engine.generate(module, prompts, 4, sampling, seeds=[11, 12])
    b = engine.generate(module, prompts, 4, sampling, seeds=[11, 12])
    c = engine.generate(module, prompts, 4, sampling, seeds=[13, 12])
    assert a.completion_ids == b.completion_ids and a.engine_logprobs == b.engine_logprobs
    assert a.completion_ids[:4] != c.completion_ids[:4] and a.completion_ids[4:] == c.completion_ids[4:]


def test_bf16_decode_loop_stays_close_to_the_trainer(tiny_module):
    """In bf16 the merged weights and the decode attention round differently from the trainer's unmerged SDPA
    forward: the engine's greedy tokens may differ, so this bounds the log-prob gap on the engine's own tokens."""
    module = tiny_module()
    module.policy.to(torch.bfloat16)
    prompts = _prompts(module)
    gen = TransformersEngine().generate(module, prompts, 2, SamplingSettings(top_k=1, max_new_tokens=8))
    from vpo_lightning.core.protocol import build_rollout_tensors, engine_logprob_tensor

    ids, attn, comp, P = build_rollout_tensors(prompts, gen, 2, module.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = module.policy(input_ids=ids, attention_mask=attn,
                               position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits.float()
    trainer = logits[:, P - 1 : -1].log_softmax(-1).gather(-1, ids[:, P:, None])[..., 0]  # [N, L]
    engine = engine_logprob_tensor(gen, comp)  # [N, L]
    gap = float(((engine - trainer).abs() * comp).sum() / comp.sum())
    assert gap < 0.05, gap


def test_fast_linears_packs_the_merged_weights_and_leaves_the_model_as_it_was(tiny_module):
    """merge + pack: the base layers multiply with packed merged weights (the adapters' own layers are not packed,
    they are disabled), the outputs are the merged model's, and afterwards the model is the adapted one again."""
    from vpo_lightning.generation.decoding import fast_linears

    if not prepacking_works(torch.float32):
        pytest.skip("this torch/CPU has no oneDNN prepacked float32 products")
    module = tiny_module()
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    linears = [m for m in module.policy.modules() if type(m) is torch.nn.Linear]
    adapters = [m for n, m in module.policy.named_modules() if type(m) is torch.nn.Linear and ".lora_" in n]
    with torch.no_grad():
        adapted = _logits(module, ids)
        with merged_lora(module.policy):
            merged = _logits(module, ids)
        with fast_linears(module.policy, rows=1):
            packed = [m for m in linears if "forward" in vars(m)]
            fast = _logits(module, ids)
        after = _logits(module, ids)
    assert adapters and not any(m in packed for m in adapters)
    assert len(packed) == len(linears) - len(adapters)  # every base layer and the LM head
    torch.testing.assert_close(fast, merged, rtol=1e-4, atol=1e-4)
    assert torch.equal(after, adapted) and not any("forward" in vars(m) for m in linears)
