"""Engines: padding/trimming helpers, and the vLLM engine's pure parts (vLLM itself cannot be installed here)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vpo_lightning.generation.engines import (
    SamplingSettings,
    VLLMEngine,
    left_pad,
    outputs_to_generation,
    trim_completion,
)
from vpo_lightning.generation.models import LoraSettings, ModelSettings


def test_left_pad():
    ids, mask = left_pad([[1, 2], [3, 4, 5]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_trim_completion_keeps_first_eos_and_drops_padding():
    assert trim_completion([5, 6, 2, 9, 9], eos_ids={2}, pad_id=0) == [5, 6, 2]
    assert trim_completion([5, 6, 0, 0], eos_ids={2}, pad_id=0) == [5, 6]
    assert trim_completion([2, 2, 2], eos_ids={2}, pad_id=2) == [2]  # pad == eos (SmolLM2)
    assert trim_completion([], eos_ids={2}, pad_id=0) == []


@pytest.mark.parametrize("bad", [{"temperature": 0}, {"top_p": 0}, {"top_p": 1.5}, {"max_new_tokens": 0}])
def test_sampling_settings_validate(bad):
    with pytest.raises(ValueError, match="sampling"):
        SamplingSettings(**bad)


def _fake_module(name="tiny-llama", four_bit=False):
    settings = ModelSettings(name=name, load_in_4bit=four_bit, lora=LoraSettings(r=4))
    return SimpleNamespace(model_settings=settings)


def test_vllm_engine_kwargs_serve_the_base_with_lora():
    kwargs = VLLMEngine(gpu_memory_utilization=0.4, max_model_len=2048).engine_kwargs(_fake_module())
    assert kwargs["enable_lora"] is True and kwargs["gpu_memory_utilization"] == 0.4
    assert kwargs["max_model_len"] == 2048 and kwargs["enable_sleep_mode"] is True
    assert kwargs["model"].endswith("tiny-llama") and "quantization" not in kwargs
    four_bit = VLLMEngine().engine_kwargs(_fake_module(four_bit=True))
    assert four_bit["quantization"] == "bitsandbytes"  # the 4-bit base is served as is, never merged


def test_vllm_sampling_params_mirror_settings():
    params = VLLMEngine().sampling_params(8, SamplingSettings(temperature=0.7, top_p=0.9, max_new_tokens=64))
    assert params == {"n": 8, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 64, "logprobs": 0}


def test_vllm_outputs_map_to_generation():
    # shaped like vllm.RequestOutput: .outputs holds n CompletionOutput with token_ids, text and per-token logprobs
    def completion(tokens, text):
        steps = [{t: SimpleNamespace(logprob=-0.5 * (i + 1))} for i, t in enumerate(tokens)]
        return SimpleNamespace(token_ids=tokens, text=text, logprobs=steps)

    outputs = [SimpleNamespace(outputs=[completion([1, 2], "ab"), completion([3], "c")]),
               SimpleNamespace(outputs=[completion([4, 5, 6], "def"), completion([], "")])]
    gen = outputs_to_generation(outputs)
    assert gen.completion_ids == [[1, 2], [3], [4, 5, 6], []]
    assert gen.texts == ["ab", "c", "def", ""] and gen.num_tokens == 6
    assert gen.engine_logprobs == [[-0.5, -1.0], [-0.5], [-0.5, -1.0, -1.5], []]


def test_vllm_adapter_export_is_versioned_peft(tmp_path):
    from peft import PeftModel

    from vpo_lightning.generation.models import load_base_model, load_policy

    policy, _ = load_policy(ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(r=4)))
    engine = VLLMEngine(adapter_dir=str(tmp_path))
    module = SimpleNamespace(policy=policy, model_settings=ModelSettings(name="tiny-llama"))
    first = engine.export_adapter(module)
    second = engine.export_adapter(module)
    assert first.name == "v1" and second.name == "v2" and not first.exists()  # a new id per sync
    assert (second / "adapter_model.safetensors").is_file()
    PeftModel.from_pretrained(load_base_model(ModelSettings(name="tiny-llama", dtype="fp32")), str(second))


def test_vllm_adapter_export_includes_the_starting_adapter(tmp_path):
    """vLLM holds the raw base: after SFT -> RL, the adapter it gets must carry the SFT stage too (issue 39)."""
    from peft import PeftModel

    from vpo_lightning.generation.models import load_base_model, load_policy

    sft, _ = load_policy(ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(r=4)))
    with torch.no_grad():
        for name, p in sft.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    sft.save_pretrained(tmp_path / "sft")
    settings = ModelSettings(name="tiny-llama", dtype="fp32", adapter=str(tmp_path / "sft"), lora=LoraSettings(r=2))
    policy, _ = load_policy(settings)
    module = SimpleNamespace(policy=policy, model_settings=settings)
    out = VLLMEngine(adapter_dir=str(tmp_path / "vllm")).export_adapter(module)
    served = PeftModel.from_pretrained(load_base_model(ModelSettings(name="tiny-llama", dtype="fp32")), str(out))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-5, rtol=0)
    assert VLLMEngine(adapter_dir=str(tmp_path / "ok"), max_lora_rank=4).export_adapter(module)  # 4 -> 8 >= 6
    with pytest.raises(ValueError, match="max_lora_rank=1: raise it to at least 8"):  # 6 is no rank vLLM accepts
        VLLMEngine(adapter_dir=str(tmp_path / "low"), max_lora_rank=1).export_adapter(module)


def test_vllm_engine_without_vllm_says_how_to_fix():
    pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ImportError, match="TransformersEngine"):
        VLLMEngine().setup(_fake_module())


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_engine_generates_on_gpu():
    from vpo_lightning.training.module import VPOModule

    module = VPOModule(ModelSettings(name="tiny-llama", lora=LoraSettings(r=4)))
    module.configure_model()
    engine = VLLMEngine(gpu_memory_utilization=0.2, max_model_len=512, enable_sleep_mode=False)
    engine.setup(module)
    prompt = module.tokenizer("hello")["input_ids"]
    gen = engine.generate(module, [prompt], 2, SamplingSettings(max_new_tokens=8))
    assert len(gen.completion_ids) == 2 and len(gen.texts) == 2 and gen.engine_logprobs is not None
    assert all(1 <= len(c) <= 8 for c in gen.completion_ids)
    assert gen.num_tokens == sum(len(c) for c in gen.completion_ids)
    # one finite log-prob <= 0 per generated token (the train/inference gap metric reads them token by token)
    assert [len(lp) for lp in gen.engine_logprobs] == [len(c) for c in gen.completion_ids]
    assert all(math.isfinite(v) and v <= 0.0 for lp in gen.engine_logprobs for v in lp)


def _tiny_module_and_prompts():
    """The random tiny model with a LoRA adapter, and two prompts of different lengths."""
    from vpo_lightning.training.module import VPOModule

    module = VPOModule(ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(r=4)))
    module.configure_model()
    tok = module.tokenizer
    return module, [tok("hello there")["input_ids"], tok("a longer prompt with more tokens in it")["input_ids"]]


def test_shared_prefix_generation_equals_plain_generation():
    """Prefilling each prompt once and copying its KV cache to the G chains gives the same tokens (top_k = 1)."""
    from vpo_lightning.generation.engines import TransformersEngine

    module, prompts = _tiny_module_and_prompts()
    greedy = SamplingSettings(top_k=1, max_new_tokens=6)
    shared = TransformersEngine(share_prompt_prefix=True).generate(module, prompts, 3, greedy)
    plain = TransformersEngine(share_prompt_prefix=False).generate(module, prompts, 3, greedy)
    assert shared.completion_ids == plain.completion_ids
    assert len(shared.completion_ids) == 6 and all(shared.completion_ids)


def test_preallocated_kv_layer_returns_what_concatenation_returns():
    """Each update returns exactly the concatenated keys/values (as views of one buffer), also past capacity."""
    from transformers.cache_utils import DynamicLayer

    from vpo_lightning.generation.engines import preallocated_layer_class

    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)) for n in (5, 1, 1, 3)]
    ref, pre = DynamicLayer(), preallocated_layer_class()(capacity=7)  # 5 + 1 + 1 fit, the last 3 make it grow
    for k, v in chunks:
        rk, rv = ref.update(k, v)
        pk, pv = pre.update(k, v)
        assert torch.equal(rk, pk) and torch.equal(rv, pv)
        assert pre.get_seq_length() == ref.get_seq_length()
    assert pre.capacity >= 10 and pre._k.data_ptr() == pk.data_ptr()  # the returned keys are a view of the buffer
    pre.crop(-2)
    ref.crop(-2)
    assert torch.equal(ref.keys, pre.keys) and pre.get_seq_length() == 8
    idx = torch.tensor([1])
    pre.batch_select_indices(idx)
    ref.batch_select_indices(idx)
    assert torch.equal(ref.values, pre.values)
    pre.reset()
    assert pre.get_seq_length() == 0


def test_preallocated_kv_layer_from_a_filled_layer_repeats_rows_like_batch_repeat_interleave():
    from transformers.cache_utils import DynamicLayer

    from vpo_lightning.generation.engines import preallocated_layer_class

    k, v = torch.arange(24.0).reshape(2, 1, 3, 4), -torch.arange(24.0).reshape(2, 1, 3, 4)
    ref = DynamicLayer()
    ref.update(k, v)
    pre = preallocated_layer_class().from_layer(ref, repeats=3, capacity=10)
    ref.batch_repeat_interleave(3)
    assert torch.equal(pre.keys, ref.keys) and torch.equal(pre.values, ref.values)
    assert pre.keys.shape == (6, 1, 3, 4) and pre.capacity == 10
    new = torch.ones(6, 1, 1, 4)
    assert torch.equal(pre.update(new, new)[0], ref.update(new, new)[0])


def test_preallocated_cache_generation_equals_concatenating_cache():
    """The engine's preallocated KV cache gives the same tokens as transformers' growing cache (top_k = 1)."""
    from vpo_lightning.generation.engines import TransformersEngine, preallocated_layer_class

    module, prompts = _tiny_module_and_prompts()
    greedy = SamplingSettings(top_k=1, max_new_tokens=12)
    engine = TransformersEngine(preallocate_cache=True, fused_decode=False)  # the model-forward path
    seen = []
    prefill = engine._prefill_once

    def recording_prefill(*args, **kwargs):
        name, cache = prefill(*args, **kwargs)
        seen.append({type(layer) for layer in cache.layers})
        return name, cache

    engine._prefill_once = recording_prefill
    pre = engine.generate(module, prompts, 3, greedy)
    grown = TransformersEngine(preallocate_cache=False, fused_decode=False).generate(module, prompts, 3, greedy)
    assert seen == [{preallocated_layer_class()}]
    assert pre.completion_ids == grown.completion_ids
    assert len(pre.completion_ids) == 6 and all(pre.completion_ids)


@pytest.mark.parametrize("decode_loop", [True, False])
def test_prefill_skips_the_lm_head(decode_loop):
    """The shared prefill only needs the KV cache: it runs the decoder without the LM head, so every head call is a
    decode step's, on one position (tokens: the plain path's, test above)."""
    from vpo_lightning.generation.engines import TransformersEngine

    module, prompts = _tiny_module_and_prompts()
    assert len(prompts[1]) - 1 > 1  # the prefill covers more than one position
    head = module.policy.get_base_model().get_output_embeddings()
    widths = []
    handle = head.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
    try:
        gen = TransformersEngine(share_prompt_prefix=True, decode_loop=decode_loop, fused_decode=False).generate(
            module, prompts, 3, SamplingSettings(max_new_tokens=2, top_k=1))
    finally:
        handle.remove()
    assert widths == [1] * max(len(c) for c in gen.completion_ids)


@pytest.mark.parametrize("max_batch_size", [0, 3])  # one generate call, or one per prompt
def test_progress_reports_chains_and_tokens_during_generation(max_batch_size):
    """Issue 53: the engine reports (chains finished, chains, tokens so far) after every decoded token, counting on
    across generate calls, and ends with every chain finished and the rollout's token count."""
    from vpo_lightning.generation.engines import TransformersEngine

    module, prompts = _tiny_module_and_prompts()
    engine, calls = TransformersEngine(max_batch_size=max_batch_size), []
    engine.progress = lambda *args: calls.append(args)
    gen = engine.generate(module, prompts, 3, SamplingSettings(max_new_tokens=5))
    assert calls[-1] == (6, 6, gen.num_tokens)
    inside = calls[:-1]
    assert len(inside) >= 5 * (2 if max_batch_size else 1)  # one per token of each call
    assert all(total == 6 and 0 <= done <= 6 for done, total, _ in inside)
    tokens = [t for _, _, t in inside]
    first_call_rows = 3 if max_batch_size else 6  # every row of the first call writes its first token
    assert tokens == sorted(tokens) and tokens[0] == first_call_rows and tokens[-1] <= gen.num_tokens
