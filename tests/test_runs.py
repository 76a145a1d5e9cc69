"""Run plumbing: one config loader (OmegaConf interpolation, as `vpo fit`), settings instantiated with the code's
defaults, and the shared --config/--ckpt/--adapter/--set argument group."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from vpo_lightning.commands import plan as vplan
from vpo_lightning.commands import runs
from vpo_lightning.generation.engines import SamplingSettings
from vpo_lightning.generation.models import ModelSettings
from vpo_lightning.training.datamodule import PromptDataModule
from vpo_lightning.training.module import OptimSettings
from vpo_lightning.training.rollout import RolloutCallback

CONFIG = """\
run_name: interp
budget: 40
model:
  model:
    name: tiny-llama
    lora: {r: 4}
  optim:
    micro_batch_size: ${rollout.group_size}
rollout:
  rewards: [format]
  group_size: 6
  sampling:
    max_new_tokens: ${budget}
"""


def _write(tmp_path: Path, text: str = CONFIG) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_load_config_resolves_interpolation_and_overrides(tmp_path):
    cfg = runs.load_config(_write(tmp_path), ["budget=64", "rollout.group_size=3"], require=("rollout",))
    assert cfg["rollout"]["sampling"]["max_new_tokens"] == 64 and cfg["model"]["optim"]["micro_batch_size"] == 3
    wrapped = runs.load_config(_write(tmp_path, "fit:\n  rollout:\n    group_size: 5\n"), ["rollout.group_size=7"])
    assert wrapped == {"rollout": {"group_size": 7}}  # a `fit:` wrapper is unwrapped before the overrides


def test_load_config_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        runs.load_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        runs.load_config(_write(tmp_path), ["budget"])
    with pytest.raises(ValueError, match="has no data: section"):
        runs.load_config(_write(tmp_path), require=("data",))
    with pytest.raises(ValueError, match="c.yaml"):
        runs.load_config(_write(tmp_path, "a: ${nowhere}\n"))


def test_run_settings_fill_the_code_defaults(tmp_path):
    s = runs.run_settings(runs.load_config(_write(tmp_path)))
    assert isinstance(s.model, ModelSettings) and s.model.name == "tiny-llama" and s.model.lora.r == 4
    assert s.model.lora.alpha == ModelSettings().lora.alpha and s.model.dtype == ModelSettings().dtype
    assert s.optim.micro_batch_size == 6 and s.optim.lr == OptimSettings().lr
    assert s.sampling == SamplingSettings(max_new_tokens=40)
    assert s.batch_size == runs.default_of(PromptDataModule, "batch_size") == 2
    assert s.group_size == 6 and runs.default_of(RolloutCallback, "group_size") == 8
    assert s.engine == "TransformersEngine"
    vllm = runs.run_settings({"rollout": {"engine": {"class_path": "vpo_lightning.generation.engines.VLLMEngine",
                                                     "init_args": {"max_model_len": 2048}}}})
    assert vllm.engine == "VLLMEngine" and vllm.engine_args["max_model_len"] == 2048
    assert vllm.engine_args["gpu_memory_utilization"] == 0.3  # VLLMEngine's own default


def test_plan_reads_the_interpolated_settings(tmp_path):
    p = vplan.plan_from_config(vplan.load_config(_write(tmp_path), ["budget=96"]), for_gpu=True)
    assert p.max_new_tokens == 96 and p.micro_batch_size == 6 and p.group_size == 6 and p.lora_r == 4
    assert p.batch_size == 2 and p.dtype == "bf16" and p.engine == "TransformersEngine"


def test_shared_argument_group(tmp_path):
    parser = argparse.ArgumentParser()
    runs.add_run_args(parser)
    args = parser.parse_args(["--ckpt", "x.ckpt", "--set", "a=1", "--set", "b=2"])
    assert (args.config, args.ckpt, args.adapter, args.overrides) == (None, "x.ckpt", None, ["a=1", "b=2"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--ckpt", "x.ckpt", "--adapter", "a"])  # mutually exclusive
    run = tmp_path / "run"
    (run / "adapters" / "last").mkdir(parents=True)
    (run / "config.yaml").write_text(CONFIG)
    assert runs.find_config(None, adapter=str(run / "adapters" / "last")) == run / "config.yaml"
    assert runs.find_config(None, ckpt=str(run / "last.ckpt")) == run / "config.yaml"
    with pytest.raises(ValueError, match="give --config"):
        runs.find_config(None)
