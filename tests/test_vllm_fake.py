"""VLLMEngine against a fake ``vllm`` module (put in ``sys.modules``): the arguments it builds vLLM with and the order
of its calls (empty_cache before wake_up, sleep after generate), as TRL's colocate mode drives vLLM. vLLM itself
cannot be installed on this project's machines; these are the parts of the GPU path that can be checked without it."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import logging
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from vpo_lightning.generation import engines
from vpo_lightning.generation.engines import RolloutShape, SamplingSettings, VLLMEngine, vllm_lora_rank
from vpo_lightning.generation.models import LoraSettings, ModelSettings, load_policy


class FakeLLM:
    """Records its constructor arguments and every call; generates tokens from (seed, adapter id, chain)."""

    calls: list = []
    kv_blocks: int | None = 1000
    block_size = 16

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        FakeLLM.calls.append(("LLM", kwargs))
        cache = SimpleNamespace(num_gpu_blocks=FakeLLM.kv_blocks, block_size=FakeLLM.block_size)
        self.llm_engine = SimpleNamespace(cache_config=cache)

    def sleep(self, level: int = 1) -> None:
        FakeLLM.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        FakeLLM.calls.append(("wake_up", tags))

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        FakeLLM.calls.append(("generate", lora_request.lora_int_id))
        outs = []
        for p, sp in zip(prompts, params):
            chains = []
            for i in range(sp.kwargs["n"]):
                key = sp.kwargs.get("seed", 0) * 7 + lora_request.lora_int_id * 13 + i + len(p["prompt_token_ids"])
                tokens = [key % 97 + 3] * 2
                chains.append(SimpleNamespace(token_ids=tokens, text="x",
                                              logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in tokens]))
            outs.append(SimpleNamespace(outputs=chains))
        return outs


class FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


@dataclasses.dataclass
class EngineArgsWithLogprobsMode:
    model: str = ""
    logprobs_mode: str = "raw_logprobs"


@dataclasses.dataclass
class EngineArgsOld:
    model: str = ""


def _install_fake_vllm(monkeypatch, engine_args=EngineArgsWithLogprobsMode) -> list:
    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.LLM, vllm.SamplingParams = FakeLLM, FakeSamplingParams
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, int_id, path: SimpleNamespace(lora_name=name, lora_int_id=int_id, path=path)
    engine, arg_utils = types.ModuleType("vllm.engine"), types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = engine_args
    for name, mod in {"vllm": vllm, "vllm.lora": lora, "vllm.lora.request": request, "vllm.engine": engine,
                      "vllm.engine.arg_utils": arg_utils}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    FakeLLM.calls = []
    monkeypatch.setattr(FakeLLM, "kv_blocks", 1000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: FakeLLM.calls.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: FakeLLM.calls.append(("set_device", str(d))))
    monkeypatch.setattr(engines.gc, "collect", lambda: FakeLLM.calls.append(("gc_collect",)) or 0)
    return FakeLLM.calls


@pytest.fixture(scope="module")
def tiny_policy():
    policy, _ = load_policy(ModelSettings(name="tiny-llama", dtype="fp32", lora=LoraSettings(r=4)))
    return policy


def _module(policy, device="cuda:1"):
    settings = ModelSettings(name="tiny-llama", dtype="bf16", lora=LoraSettings(r=4))
    return SimpleNamespace(policy=policy, model_settings=settings, device=torch.device(device))


SHAPE = RolloutShape(batch_size=4, group_size=8, max_prompt_tokens=256, max_new_tokens=256)


def _engine(tmp_path, **kwargs) -> VLLMEngine:
    engine = VLLMEngine(adapter_dir=str(tmp_path), max_model_len=kwargs.pop("max_model_len", 512), **kwargs)
    engine.prepare(SHAPE)
    return engine


def test_engine_arguments_follow_trl_colocate(monkeypatch, tmp_path, tiny_policy):
    calls = _install_fake_vllm(monkeypatch)
    engine = _engine(tmp_path, max_lora_rank=48)
    engine.setup(_module(tiny_policy))
    kwargs = next(c[1] for c in calls if c[0] == "LLM")
    assert kwargs["max_num_batched_tokens"] == 4096  # as TRL: vLLM's default profiles a larger activation peak
    assert kwargs["max_num_seqs"] == 32  # B x G: the whole rollout at once
    assert kwargs["logprobs_mode"] == "processed_logprobs"  # after temperature, as the trainer's log-probs
    assert kwargs["max_lora_rank"] == 64  # 48 is not a rank vLLM accepts
    assert "distributed_executor_backend" not in kwargs  # one process
    # this rank's device is made current before vLLM is built, and the trainer's cache is emptied first
    names = [c[0] for c in calls]
    assert names.index("set_device") < names.index("LLM") and calls[names.index("set_device")][1] == "cuda:1"
    assert names.index("empty_cache") < names.index("LLM")


def test_empty_cache_before_every_wake_up_and_sleep_after_generate(monkeypatch, tmp_path, tiny_policy):
    calls = _install_fake_vllm(monkeypatch)
    engine, module = _engine(tmp_path), _module(tiny_policy)
    engine.setup(module)
    del calls[:]
    sampling = SamplingSettings(max_new_tokens=8)
    for _ in range(2):
        engine.generate(module, [[1, 2, 3]], 2, sampling, seeds=[5])
        engine.sync(module)
    names = [c[0] for c in calls]
    # the first rollout finds vLLM awake (just built): no wake_up; the second wakes it after emptying the cache
    assert names == ["generate", "sleep", "gc_collect", "empty_cache", "wake_up", "generate", "sleep"], names
    assert [c[1] for c in calls if c[0] == "sleep"] == [1, 1]
    assert [c[1] for c in calls if c[0] == "generate"] == [1, 2]  # a new adapter id after each sync


def test_processed_logprobs_missing_drops_the_gap_at_other_temperatures(monkeypatch, tmp_path, tiny_policy, caplog):
    calls = _install_fake_vllm(monkeypatch, engine_args=EngineArgsOld)
    engine, module = _engine(tmp_path), _module(tiny_policy)
    with caplog.at_level(logging.WARNING):
        engine.setup(module)
    assert "logprobs_mode" not in next(c[1] for c in calls if c[0] == "LLM")
    assert "before temperature" in caplog.text
    assert engine.generate(module, [[1, 2]], 2, SamplingSettings(temperature=0.7)).engine_logprobs is None
    assert engine.generate(module, [[1, 2]], 2, SamplingSettings(temperature=1.0)).engine_logprobs is not None


@pytest.mark.parametrize(("prompt", "new", "max_len"), [(1024, 2048, 2048), (1536, 4096, 3584), (0, 512, 512)])
def test_setup_refuses_budgets_longer_than_max_model_len(monkeypatch, tmp_path, tiny_policy, prompt, new, max_len):
    calls = _install_fake_vllm(monkeypatch)
    engine = VLLMEngine(adapter_dir=str(tmp_path), max_model_len=max_len)
    engine.prepare(RolloutShape(4, 8, prompt, new))
    with pytest.raises(ValueError, match=r"max_model_len.*Raise max_model_len to at least"):
        engine.setup(_module(tiny_policy))
    assert not any(c[0] == "LLM" for c in calls)  # refused before vLLM reserves memory


def test_kv_cache_is_logged_and_must_hold_one_sequence(monkeypatch, tmp_path, tiny_policy, caplog):
    _install_fake_vllm(monkeypatch)
    with caplog.at_level(logging.INFO):
        _engine(tmp_path).setup(_module(tiny_policy))
    assert "vLLM KV cache: 16000 tokens = 31.2 full sequences of 512 tokens" in caplog.text
    monkeypatch.setattr(FakeLLM, "kv_blocks", 31)  # 496 tokens < 256 + 256
    with pytest.raises(ValueError, match="less than one full sequence.*gpu_memory_utilization"):
        _engine(tmp_path).setup(_module(tiny_policy))


def test_one_engine_per_rank_under_ddp(monkeypatch, tmp_path, tiny_policy):
    calls = _install_fake_vllm(monkeypatch)
    monkeypatch.setattr(engines, "_rank_and_world", lambda: (1, 2))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "unset")  # restored after the test
    _engine(tmp_path).setup(_module(tiny_policy, device="cuda:1"))
    kwargs = next(c[1] for c in calls if c[0] == "LLM")
    assert kwargs["distributed_executor_backend"] == "external_launcher" and kwargs["seed"] == 1
    assert ("set_device", "cuda:1") in calls
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("1", "1", "2")


def test_lora_rank_rounds_up_to_what_vllm_accepts(tmp_path):
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 48, 64, 300, 321)] == [1, 8, 8, 16, 64, 64, 320, 512]
    with pytest.raises(ValueError, match="lower model.lora.r"):
        vllm_lora_rank(513)
    assert VLLMEngine(max_lora_rank=48).max_lora_rank == 64
