"""The fused decoder (vpo_lightning/fused_decode.py): another implementation of a Llama-family forward, so every
test compares it with the model's own forward (transformers' code, the LoRA adapter unmerged): its logits over a
prefill and several decode steps, with left padding and grouped-query heads; Qwen2's projection biases and
Mistral; which models it declines; and that building it leaves the policy untouched."""

from __future__ import annotations

import pytest
import torch

from vpo_lightning.generation.decoding import prepacking_works
from vpo_lightning.generation.engines import SamplingSettings, TransformersEngine, left_pad
from vpo_lightning.generation.fused_decode import FusedDecoder, supports


def _reference_logits(model, ids, mask, group_size, steps):
    """The model's forward over ``[prompt | steps]`` for each chain (row ``b * G + r``): logits [n, T, V] at the
    positions the decoder predicts from (the last prompt token and each fed token)."""
    ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # [n, P]
    full_ids = torch.cat([ids, steps[:, :-1]], 1)  # [n, P + T - 1]: step t feeds steps[:, t - 1]
    full_mask = torch.cat([mask, mask.new_ones(steps.shape[0], steps.shape[1] - 1)], 1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits
    return logits[:, ids.shape[1] - 1 :]  # [n, T, V]


def _fused_logits(decoder, ids, mask, group_size, steps):
    decoder.prefill(ids, mask, group_size, budget=steps.shape[1])
    token = ids.repeat_interleave(group_size, 0)[:, -1]  # [n]
    out = []
    for t in range(steps.shape[1]):
        out.append(decoder.step(token, t).float())  # [n, V]
        token = steps[:, t]
    return torch.stack(out, 1)  # [n, T, V]


def _check(model, prompts, pad_id, group_size=3, steps=6, prepack=True, atol=2e-4):
    decoder = FusedDecoder.build(model, rows=len(prompts) * group_size, prepack=prepack)
    assert decoder is not None, supports(model)
    ids, mask = left_pad(prompts, pad_id, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    fed = torch.randint(3, 200, (len(prompts) * group_size, steps), generator=g)  # [n, T] any tokens will do
    ref = _reference_logits(model, ids, mask, group_size, fed)
    got = _fused_logits(decoder, ids, mask, group_size, fed)
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=atol)


@pytest.mark.parametrize("prepack", [True, False])
def test_fused_logits_equal_the_lora_policys_forward(tiny_module, prepack):
    """The tiny Llama (grouped-query heads) with a non-zero LoRA adapter, merged by the decoder, unmerged in the
    reference; two prompts of different lengths (left padding), three chains each, six decode steps."""
    if prepack and not prepacking_works(torch.float32):
        pytest.skip("this torch/CPU has no oneDNN prepacked float32 products")
    module = tiny_module()
    cfg = module.policy.get_base_model().config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention is exercised
    tok = module.tokenizer
    prompts = [tok("hello there")["input_ids"], tok("a longer prompt with more tokens in it")["input_ids"]]
    module.policy.eval()
    _check(module.policy, prompts, tok.pad_token_id, prepack=prepack)


def _random_model(kind: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # random biases (from_config zeroes them), so that a dropped bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.5)
    return model


@pytest.mark.parametrize(("kind", "overrides"), [("qwen2", {}), ("mistral", {"sliding_window": None}),
                                                 ("llama", {"attention_bias": True, "tie_word_embeddings": False})])
def test_fused_logits_for_other_llama_family_models(kind, overrides):
    model = _random_model(kind, **overrides)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # the fused q/k/v bias is exercised
    _check(model, [[5, 6, 7, 8, 9], [10, 11, 12]], pad_id=0, group_size=2, steps=4)


@pytest.mark.parametrize(("kind", "overrides", "why"), [
    ("llama", {"hidden_act": "gelu"}, "SiLU"),
    ("llama", {"mlp_bias": True}, "SiLU"),
    ("mistral", {"sliding_window": 16}, "sliding"),
    ("gpt2", {}, "model_type"),
])
def test_unsupported_models_are_declined(kind, overrides, why):
    from transformers import AutoConfig, AutoModelForCausalLM

    if kind == "gpt2":
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2,
                                                                      vocab_size=64))
    else:
        model = _random_model(kind, **overrides)
    assert why in supports(model)
    assert FusedDecoder.build(model, rows=4) is None


def test_dora_and_unmerged_lora_fall_back_to_the_models_forward(tiny_module):
    """A DoRA adapter cannot be merged exactly, and ``merge_lora=False`` asks for the unmerged products: the
    decoder declines both (the engine then decodes through the model's forward: test_decoding's greedy test runs
    ``merge_lora=False``)."""
    from peft import LoraConfig, get_peft_model

    module = tiny_module()
    assert FusedDecoder.build(module.policy, rows=4, merge=False) is None
    base = _random_model("llama")
    dora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], use_dora=True))
    assert FusedDecoder.build(dora, rows=4) is None


def test_engine_with_the_fused_decoder_leaves_the_policy_untouched(tiny_module):
    module = tiny_module()
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    tok = module.tokenizer
    prompts = [tok("hello there")["input_ids"], tok("a longer prompt")["input_ids"]]
    gen = TransformersEngine().generate(module, prompts, 2, SamplingSettings(max_new_tokens=5))
    assert len(gen.completion_ids) == 4 and gen.engine_logprobs is not None
    after = module.policy.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert module.policy.training  # restored
