"""The `vpo` command line as one tool: a fast top-level help listing every command, no dead subcommands or options,
TRL's names and dtype spellings answered with ours, `vpo plan` sizes with units, library noise dropped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vpo_lightning.launcher import COMMANDS, main

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.yaml")


def _run(*code_or_args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-P", *code_or_args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_top_level_help_lists_every_command_without_importing_torch():
    proc = _run("-c", "import sys; from vpo_lightning.launcher import main; main(['--help']); "
                      "print('heavy:', sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    for name in COMMANDS:
        assert f"\n  {name} " in proc.stdout, name
    for name in ("fit", "validate", "sft", "eval", "compare", "replicates", "plan", "serve", "search", "export"):
        assert f"\n  {name} " in proc.stdout
    assert "heavy: []" in proc.stdout
    assert "test" not in COMMANDS and "predict" not in COMMANDS


@pytest.mark.parametrize("name", ["test", "predict"])
def test_lightning_test_and_predict_point_to_eval(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--config", DEBUG])
    assert exit_info.value.code == 2
    assert f"there is no 'vpo {name}': use 'vpo eval'" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--optimizer=Adam", "--lr_scheduler=StepLR"])
def test_optimizer_and_scheduler_options_are_gone(option, capsys):
    """They used to be accepted (--lr_scheduler silently ignored): now an unknown key, like any other."""
    with pytest.raises(SystemExit):
        main(["fit", "--config", DEBUG, option])
    assert f"unknown key '{option[2:].split('=')[0]}'" in capsys.readouterr().err


def test_sft_help_names_vpo_sft():
    proc = _run("-m", "vpo_lightning", "sft", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: vpo sft "), proc.stdout[:200]


@pytest.mark.parametrize(("trl", "ours"), [
    ("learning_rate", "model.optim.lr"), ("num_generations", "rollout.group_size"),
    ("max_completion_length", "rollout.sampling.max_new_tokens"), ("per_device_train_batch_size", "data.batch_size"),
    ("beta", "model.loss.beta"), ("bf16", "model.model.dtype"),
])
def test_trl_names_point_to_ours(trl, ours, capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["fit", "--config", DEBUG, f"--{trl}", "1"])
    err = capsys.readouterr().err
    assert f"unknown key '{trl}' in the command line. Did you mean '{ours}'? ({trl} is TRL's name" in err
    cfg = tmp_path / "trl.yaml"
    cfg.write_text(f"model:\n  {trl}: 1\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", DEBUG, "--config", str(cfg)])
    assert f"unknown key 'model.{trl}' in {cfg}. Did you mean '{ours}'?" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "ours"), [("bfloat16", "bf16"), ("float32", "fp32"), ("float16", "fp16")])
def test_torch_dtype_spellings_name_file_line_and_ours(value, ours, capsys, tmp_path):
    cfg = tmp_path / "dtype.yaml"
    cfg.write_text(f"model:\n  model:\n    name: tiny-llama\n    dtype: {value}\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", DEBUG, "--config", str(cfg)])
    err = capsys.readouterr().err
    assert f"{cfg}, line 4: model.model.dtype: '{value}' is not one of 'auto', 'bf16', 'fp32', 'fp16'. " \
           f"Did you mean '{ours}'?" in err


@pytest.mark.parametrize(("gpu_mem", "expected"), [
    ("banana", "--gpu-mem 'banana': expected a size with a unit"),
    ("24", "--gpu-mem '24': give a unit, e.g. --gpu-mem 24GB"),
])
def test_plan_gpu_mem_needs_a_size_with_a_unit(gpu_mem, expected, capsys):
    from vpo_lightning.commands import plan

    assert plan.main(["--config", str(REPO / "configs/tooluse.yaml"), "--gpu-mem", gpu_mem]) == 2
    assert expected in capsys.readouterr().err


def test_plan_without_gpu_asks_for_the_card_size(capsys, monkeypatch):
    from vpo_lightning.commands import plan

    monkeypatch.setattr(plan, "_default_capacity", lambda: (24.0 * 2**30, "cpu"))  # a CPU-only machine
    assert plan.main(["--config", str(REPO / "configs/tooluse_qwen7b_qlora.yaml")]) == 2
    err = capsys.readouterr().err
    assert "this machine has no GPU, and the config needs one" in err and "--gpu-mem 24GB" in err
    assert plan.main(["--config", DEBUG]) == 0  # a CPU run is planned against RAM, and says so
    assert "no GPU here: planning against this machine's RAM" in capsys.readouterr().err


def test_one_flag_style_for_argparse_commands(capsys):
    """--gpu_mem = --gpu-mem, and --section.key VALUE = --set section.key=VALUE, as in `vpo fit`."""
    from vpo_lightning.commands import plan

    args = ["--config", str(REPO / "configs/tooluse.yaml")]
    assert plan.main([*args, "--gpu-mem", "24GB", "--set", "model.optim.micro_batch_size=2"]) == 0
    dashed = capsys.readouterr().out
    assert plan.main([*args, "--gpu_mem", "24GB", "--model.optim.micro_batch_size", "2"]) == 0
    assert capsys.readouterr().out == dashed


@pytest.mark.slow  # importing bitsandbytes takes ~15 s on a busy 2-core machine
def test_bitsandbytes_kernel_hub_warning_is_dropped():
    proc = _run("-c", "from vpo_lightning.training.runtime import prepare_process; prepare_process(); "
                      "import bitsandbytes")
    assert proc.returncode == 0, proc.stderr
    assert "kernels-community" not in proc.stderr
