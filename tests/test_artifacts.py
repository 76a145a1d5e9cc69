"""What a run leaves behind (issue 39): adapters that plain PEFT loads as the trained policy (also after SFT -> RL),
with tokenizer and model card; merged exports; run folders that never clobber each other; evaluations that never
share a file; no validation without val_files; the README's "Where things go" and its PEFT/vLLM recipes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from vpo_lightning.commands import runs
from vpo_lightning.generation.models import LoraSettings, ModelSettings, load_policy, resolve_model_path
from vpo_lightning.launcher import main as vpo

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]
DATA = str(REPO / "data/tooluse/val.jsonl")
IDS = torch.tensor([[1, 17, 230, 4011, 9, 77, 512, 3]])


def _fit(*extra: str) -> None:
    vpo(["fit", "--config", str(REPO / "configs/debug.yaml"), f"--data.train_files=[{DATA}]",
         f"--data.val_files=[{DATA}]", *extra])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def _plain_peft(adapter: Path) -> torch.nn.Module:
    """What a PEFT user does: the base named in adapter_config.json, then the adapter. Nothing from vpo_lightning."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter))


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _randomize_lora_b(model: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture(scope="module")
def two_stage(tmp_path_factory, tiny_model_dir) -> Path:
    """`vpo sft` (LoRA on q/v only, r 4, alpha 16) then `vpo fit` from its adapter (all-linear, r 2, alpha 8),
    both at a large learning rate so that each stage moves the logits; returns the working directory."""
    cwd = tmp_path_factory.mktemp("two_stage")
    rows = (REPO / "data/tooluse/train.jsonl").read_text().splitlines()[:40]
    (cwd / "train.jsonl").write_text("\n".join(rows) + "\n")
    sft = {"run_name": "sft", "seed_everything": 0,
           "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "val_check_interval": 2},
           "model": {"model": {"name": "tiny-llama", "dtype": "fp32",
                               "lora": {"r": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
                     "optim": {"lr": 5e-2, "warmup_steps": 0}},
           "data": {"train_files": [str(cwd / "train.jsonl")], "builder": "tooluse", "formats": [1], "batch_size": 2,
                    "val_fraction": 0.1, "max_tokens_per_row": 1024, "max_prompt_tokens": 600},
           "checkpoint": {"every_n_train_steps": 2}}
    (cwd / "sft.yaml").write_text(yaml.safe_dump(sft))
    old = os.getcwd()
    os.chdir(cwd)
    try:
        vpo(["sft", "--config", "sft.yaml"])
        _fit("--run_name=rl", "--model.model.adapter=checkpoints/sft/adapters/last", "--model.model.lora.r=2",
             "--model.model.lora.alpha=8", "--model.optim.lr=5e-2")
    finally:
        os.chdir(old)
    return cwd


# ---------------------------------------------------------------------------------------------- adapters
def test_two_stage_adapter_is_the_trained_policy_under_plain_peft(two_stage):
    """Plain PEFT on adapters/last of an SFT -> RL run gives the trained policy (the checkpoint loaded the way
    `vpo eval --ckpt` does: SFT merged, then the RL LoRA) within 1e-5; it used to drop the SFT stage."""
    run = two_stage / "checkpoints" / "rl"
    cfg = runs.load_config(run / "config.yaml")
    old = os.getcwd()
    os.chdir(two_stage)
    try:
        trained, _, _ = runs.load_model(cfg, torch.device("cpu"), ckpt=str(run / "last.ckpt"))
        base, _, _ = runs.load_model({"model": {"model": {"name": "tiny-llama", "dtype": "fp32"}}},
                                     torch.device("cpu"))
    finally:
        os.chdir(old)
    want = _logits(trained)
    assert (want - _logits(base)).abs().max() > 1e-2  # the stages moved the policy: the check below can fail
    torch.testing.assert_close(_logits(_plain_peft(run / "adapters" / "last")), want, atol=1e-5, rtol=0)


def test_adapter_folder_has_tokenizer_card_and_metadata(two_stage):
    from transformers import AutoTokenizer

    adapter = two_stage / "checkpoints" / "rl" / "adapters" / "last"
    tok = AutoTokenizer.from_pretrained(adapter)
    shipped = AutoTokenizer.from_pretrained(resolve_model_path("tiny-llama"))
    assert tok.chat_template and tok.chat_template == shipped.chat_template
    assert tok("hello world")["input_ids"] == shipped("hello world")["input_ids"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 4 + 2  # stacked: SFT rank + RL rank, scale 1
    assert Path(config["base_model_name_or_path"]) == Path(resolve_model_path("tiny-llama"))
    card = (adapter / "README.md").read_text()
    for fact in ("base_model:", "estimator `vpo`", "format, tool_name, arg_key, arg_value", "| optimizer steps | 2 |",
                 "4 prompts", "generated", "checkpoints/sft/adapters/last", "rank 6 = starting rank + 2"):
        assert fact in card, (fact, card)
    sft_card = (two_stage / "checkpoints" / "sft" / "adapters" / "last" / "README.md").read_text()
    assert "supervised (vpo sft)" in sft_card and "none (trained from the base)" in sft_card


def test_stacking_is_exact_with_other_targets_ranks_and_rslora(tmp_path, tiny_model_dir):
    """Stage 1 rsLoRA on q/v (r 4, alpha 16: scale 8), stage 2 all-linear (r 2, alpha 8: scale 4), both B random."""
    from peft import LoraConfig, get_peft_model

    from vpo_lightning.generation.adapters import write_adapter_folder
    from vpo_lightning.generation.models import load_base_model

    first = get_peft_model(load_base_model(ModelSettings(name="tiny-llama", dtype="fp32")),
                           LoraConfig(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"]))
    _randomize_lora_b(first, seed=1)
    first.save_pretrained(tmp_path / "sft")
    with first.disable_adapter():
        raw = _logits(first)
    settings = ModelSettings(name="tiny-llama", dtype="fp32", adapter=str(tmp_path / "sft"),
                             lora=LoraSettings(r=2, alpha=8))
    policy, _ = load_policy(settings)
    _randomize_lora_b(policy, seed=2)
    write_adapter_folder(policy, tmp_path / "out", settings)
    with policy.disable_adapter():
        sft_only = _logits(policy)
    want = _logits(policy)
    assert (want - sft_only).abs().max() > 1e-2 and (sft_only - raw).abs().max() > 1e-2
    torch.testing.assert_close(_logits(_plain_peft(tmp_path / "out")), want, atol=1e-5, rtol=0)
    # `vpo eval/serve/search --adapter` put the self-contained adapter on the raw base (no second SFT)
    cfg = {"model": {"model": {"name": "tiny-llama", "dtype": "fp32", "adapter": str(tmp_path / "sft")}}}
    model, _, info = runs.load_model(cfg, torch.device("cpu"), adapter=str(tmp_path / "out"))
    torch.testing.assert_close(_logits(model), want, atol=1e-5, rtol=0)
    assert info["start_adapter"] == str(tmp_path / "sft")
    # the config's starting adapter alone is the SFT policy: merged once, never applied a second time
    model, _, _ = runs.load_model(cfg, torch.device("cpu"))
    torch.testing.assert_close(_logits(model), sft_only, atol=1e-5, rtol=0)


def test_base_model_id_names_the_hub_id_of_aliases_and_local_paths(tmp_path, tiny_model_dir):
    from vpo_lightning.generation.adapters import base_model_id

    assert base_model_id("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_id("tiny-llama") == str(tiny_model_dir)
    assert base_model_id("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    local = tmp_path / "my-model"
    local.mkdir()
    assert base_model_id(str(local)) == str(local.resolve())


def test_vpo_export_writes_merged_weights(two_stage, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = two_stage / "checkpoints" / "rl" / "adapters" / "last"
    out = tmp_path / "merged"
    assert vpo(["export", "--adapter", str(adapter), "--out", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not hasattr(merged, "peft_config") and AutoTokenizer.from_pretrained(out).chat_template
    card = (out / "README.md").read_text()  # issue 53: merged exports had no card
    assert card.startswith("---\nbase_model: ") and f"merged by `vpo export` from `{adapter}`" in card
    assert "| reward dimensions |" in card  # the adapter card's table: what was trained
    torch.testing.assert_close(_logits(merged), _logits(_plain_peft(adapter)), atol=1e-5, rtol=0)
    with pytest.raises(SystemExit) as err:
        vpo(["export", "--adapter", str(adapter), "--out", str(out)])
    assert err.value.code == 2 and "--overwrite" in capsys.readouterr().err
    old = os.getcwd()
    os.chdir(two_stage)  # the run's config.yaml names the SFT adapter relative to it
    try:  # from the Lightning checkpoint: the same policy
        vpo(["export", "--ckpt", "checkpoints/rl/last.ckpt", "--out", str(tmp_path / "from_ckpt")])
    finally:
        os.chdir(old)
    from_ckpt = AutoModelForCausalLM.from_pretrained(tmp_path / "from_ckpt", dtype=torch.float32)
    torch.testing.assert_close(_logits(from_ckpt), _logits(merged), atol=1e-5, rtol=0)


def test_push_to_hub_up_to_the_network_call(two_stage, tmp_path, monkeypatch):
    """`vpo export --push_to_hub` and `checkpoint.push_to_hub` create the repo and upload the folder; the two
    HfApi network calls are recorded instead of made."""
    from huggingface_hub import HfApi

    calls = []
    for module in ("vpo_lightning.generation.adapters", "vpo_lightning.commands.export"):  # the up-front check: as
        monkeypatch.setattr(f"{module}.hub_push_problem", lambda *a, **k: None)       # if logged in and online
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: calls.append(("upload", kw)))
    adapter = two_stage / "checkpoints" / "rl" / "adapters" / "last"
    vpo(["export", "--adapter", str(adapter), "--out", str(tmp_path / "m"), "--push_to_hub", "--hub_model_id",
         "me/tiny-merged", "--private"])
    assert calls[0] == ("create", "me/tiny-merged", {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[1][1]["folder_path"] == str(tmp_path / "m") and calls[1][1]["repo_id"] == "me/tiny-merged"
    monkeypatch.chdir(tmp_path)
    _fit("--checkpoint.push_to_hub=true", "--checkpoint.hub_model_id=me/tiny-adapter")
    assert Path(calls[-1][1]["folder_path"]) == (tmp_path / "checkpoints/debug/adapters/last")
    assert calls[-1][1]["repo_id"] == "me/tiny-adapter"
    with pytest.raises(SystemExit, match="2"):
        _fit("--run_name=x", "--checkpoint.push_to_hub=true")  # no hub_model_id: refused before anything runs
    assert not (tmp_path / "checkpoints" / "x").exists()


# ---------------------------------------------------------------------------------------------- run folders
def test_rerun_of_a_saved_config_under_a_new_name_leaves_the_old_folder_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fit("--run_name=A")
    _fit("--run_name=A", "--trainer.max_steps=3", "--ckpt_path=last")  # a resume
    saved = yaml.safe_load((tmp_path / "checkpoints" / "A" / "config.yaml").read_text())
    assert saved["ckpt_path"] is None and saved["checkpoint"]["dirpath"] is None and saved["overwrite"] is False
    assert saved["trainer"]["default_root_dir"] is None and saved["trainer"]["logger"]["init_args"]["name"] == ""
    before = _snapshot(tmp_path / "checkpoints" / "A")
    vpo(["fit", "--config", "checkpoints/A/config.yaml", "--run_name=B", "--trainer.max_steps=2"])
    assert _snapshot(tmp_path / "checkpoints" / "A") == before
    assert {"last.ckpt", "config.yaml", "adapters/last/adapter_model.safetensors"} <= set(
        _snapshot(tmp_path / "checkpoints" / "B"))
    assert torch.load(tmp_path / "checkpoints" / "B" / "last.ckpt", weights_only=False)["global_step"] == 2


def test_a_non_empty_run_folder_is_refused_unless_resuming_or_overwriting(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _fit()
    run = tmp_path / "checkpoints" / "debug"
    before = _snapshot(run)
    with pytest.raises(SystemExit) as err:
        _fit()
    assert err.value.code == 2 and "--ckpt_path last" in capsys.readouterr().err and _snapshot(run) == before
    _fit("--overwrite", "--trainer.max_steps=1")
    assert len(list(run.glob("events.out.tfevents.*"))) == 1  # replaced whole: no stale event files
    assert not (run / "step=2.ckpt").exists() and (run / "step=1.ckpt").is_file()
    assert not list((tmp_path / "checkpoints").glob(".*"))  # the replaced run is gone after the first step


def test_a_run_failing_before_its_first_step_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        _fit("--data.train_files=[missing.jsonl]")
    assert not (tmp_path / "checkpoints").exists()
    _fit()
    before = _snapshot(tmp_path / "checkpoints" / "debug")
    with pytest.raises(SystemExit):  # an --overwrite that fails gives the replaced run back
        _fit("--overwrite", "--data.train_files=[missing.jsonl]")
    assert _snapshot(tmp_path / "checkpoints" / "debug") == before
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["debug"]


def test_validate_never_writes_the_run_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fit()
    config = tmp_path / "checkpoints" / "debug" / "config.yaml"
    before = config.read_bytes()
    vpo(["validate", "--config", str(config), "--ckpt_path", "last"])
    vpo(["validate", "--config", str(config), "--ckpt_path", "last"])
    assert config.read_bytes() == before
    logs = sorted(p.name for p in (tmp_path / "checkpoints" / "debug" / "validate").iterdir())
    assert logs == ["version_0", "version_1"]  # each validation its own folder
    vpo(["fit", "--config", str(config), "--run_name=again"])  # the config still trains


def test_no_val_files_trains_without_validation_and_says_so_once(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="vpo_lightning.training.cli"):
        _fit("--data.val_files=null", "--trainer.val_check_interval=1")
    said = [r for r in caplog.records if "val_files" in r.getMessage()]
    assert len(said) == 1 and "no validation" in said[0].getMessage()
    assert torch.load(tmp_path / "checkpoints/debug/last.ckpt", weights_only=False)["global_step"] == 2
    assert not any(k.startswith("val/") for k in runs.read_scalars(tmp_path / "checkpoints" / "debug"))


# ---------------------------------------------------------------------------------------------- evaluations
def test_two_evaluations_never_share_a_file(tmp_path, monkeypatch, script_generation, capsys, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    script_generation(["<response>x</response>"])
    cfg = yaml.safe_load((REPO / "configs/debug.yaml").read_text())
    cfg["data"]["train_files"] = [str(REPO / "data/tooluse/train.jsonl")]
    Path("c.yaml").write_text(yaml.safe_dump(cfg))
    common = ["eval", "--config", "c.yaml", "--n", "3", "--max_prompts", "1", "--max_prompt_tokens", "0"]
    vpo([*common, "--estimator", "vpo"])
    vpo([*common, "--estimator", "grpo"])
    reports = sorted(Path("checkpoints").glob("eval-*/eval.json"))
    assert [p.parent.name for p in reports] == ["eval-c-grpo", "eval-c-vpo"]
    before = _snapshot(Path("checkpoints"))
    with pytest.raises(SystemExit) as err:
        vpo([*common, "--estimator", "grpo"])
    assert err.value.code == 2 and "--overwrite" in capsys.readouterr().err and _snapshot(Path("checkpoints")) == before
    vpo([*common, "--estimator", "grpo", "--overwrite"])
    assert json.loads(Path("checkpoints/eval-c-grpo/eval.json").read_text())["timestamp"]


def test_eval_of_an_adapter_fills_its_card(two_stage, tmp_path, script_generation):
    script_generation(["<response>x</response>"])
    adapter = two_stage / "checkpoints" / "rl" / "adapters" / "last"
    old = os.getcwd()
    os.chdir(two_stage)
    try:
        vpo(["eval", "--adapter", str(adapter), "--n", "3", "--max_prompts", "1", "--max_prompt_tokens", "0",
             "--data_file", DATA, "--out", str(adapter.parent / "eval-last")])
    finally:
        os.chdir(old)
    card = (adapter / "README.md").read_text()
    assert "| last evaluation | `" in card and "best@1 0.000" in card


# ---------------------------------------------------------------------------------------------- README
def _readme_block(marker: str) -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```\w*\n(.*?)```", text, re.S)
    assert match, f"README.md has no block after <!-- {marker} -->"
    return match.group(1)


def test_readme_where_things_go_and_the_peft_and_vllm_recipes(two_stage):
    """Every path of "Where things go" exists after `vpo sft` + `vpo fit`; the PEFT recipe runs as written (with
    the run's folder) and gives the trained policy; the vLLM recipe's shell lines run, and what they hand to `vllm
    serve` is a base directory with config.json, a PEFT adapter and a rank >= the adapter's. (vLLM itself is not
    installed here: `vllm serve` is the one line not run.)"""
    run = two_stage / "checkpoints" / "rl"
    where = _readme_block("where-things-go")
    for path in re.findall(r"checkpoints/<run_name>/(\S+)", where):
        found = list(run.glob(path.rstrip("/").replace("<N>", "*")))
        assert found, f"README says checkpoints/<run_name>/{path}; not in {sorted(_snapshot(run))}"
    recipe = _readme_block("peft-recipe").replace("checkpoints/tooluse-vpo", str(run))
    scope: dict = {}
    exec(compile(recipe, "README.md:peft-recipe", "exec"), scope)
    assert scope["tokenizer"].chat_template
    torch.testing.assert_close(_logits(scope["model"]), _logits(_plain_peft(run / "adapters" / "last")))
    shell = _readme_block("vllm-recipe").replace("checkpoints/tooluse-vpo", str(run))
    lines = [line for line in shell.splitlines() if line.strip() and not line.startswith(("vllm ", "  "))]
    serve = " ".join(line.rstrip("\\").strip() for line in shell.splitlines() if line.startswith(("vllm", "  ")))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = "\n".join([*lines, 'echo "BASE=$BASE"; echo "RANK=$RANK"'])
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, cwd=two_stage, check=True)
    values = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert (Path(values["BASE"]) / "config.json").is_file()
    adapter_dir = re.search(r"--lora-modules \S+=(\S+)", serve).group(1)
    adapter_dir = adapter_dir.replace("$ADAPTER", str(run / "adapters" / "last"))
    assert (Path(adapter_dir) / "adapter_config.json").is_file()
    rank = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["r"]
    assert int(values["RANK"]) >= rank and "--max-lora-rank" in serve


def test_the_model_card_counts_in_the_singular_for_one(tmp_path):
    """Issue 53: the card said "1 prompts"."""
    from types import SimpleNamespace

    from vpo_lightning.generation.adapters import _eval_lines, run_facts

    stream = SimpleNamespace(position=1, batch_size=1, world_size=1)
    trainer = SimpleNamespace(global_step=1, callbacks=[], datamodule=SimpleNamespace(train_stream=stream))
    assert run_facts(trainer, object(), "x")["prompts_trained"] == "1 demonstration"
    stream.batch_size = 3
    assert run_facts(trainer, object(), "x")["prompts_trained"] == "3 demonstrations"
    report = {"folder": "eval", "num_prompts": 1, "n": 2, "aggregate": {
        "best_at_k": [0.5, 1.0], "pass_at_k": [0.0, 1.0], "pairwise_l1_diversity": 0.1, "expected_best_weighted": 0.7}}
    assert ": 1 test prompt, n = 2" in _eval_lines(report)[0]


def test_an_adapter_kept_as_its_trained_stage_rebuilds_byte_equal(two_stage, tmp_path):
    """benchmarks/adapter_delta.py (how experiment commits keep RL adapters without repeating the cold start): the
    trained stage alone is smaller, rebuilds the saved file bit for bit on its start adapter, and a wrong start
    adapter is refused at split and at rebuild."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import adapter_delta
    from safetensors.torch import load_file

    full = two_stage / "checkpoints" / "rl" / "adapters" / "last"
    start = two_stage / "checkpoints" / "sft" / "adapters" / "last"
    delta, rebuilt = tmp_path / "delta", tmp_path / "rebuilt"
    assert adapter_delta.split(full, start, delta) == 0
    trained = load_file(str(delta / "trained_lora.safetensors"))
    stacked = load_file(str(full / "adapter_model.safetensors"))
    assert {k: v.shape[0 if "lora_A" in k else 1] for k, v in trained.items()} == dict.fromkeys(stacked, 2)
    assert adapter_delta.rebuild(delta, rebuilt) == 0
    assert (rebuilt / "adapter_model.safetensors").read_bytes() == (full / "adapter_model.safetensors").read_bytes()
    assert json.loads((rebuilt / "adapter_config.json").read_text())["r"] == 6
    other = tmp_path / "other-start"  # the same start adapter with one weight changed
    other.mkdir()
    for f in start.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(start / "adapter_model.safetensors"))
    key = sorted(weights)[0]
    weights[key] = weights[key] + 1e-3
    from safetensors.torch import save_file
    save_file(weights, str(other / "adapter_model.safetensors"))
    assert adapter_delta.split(full, other, tmp_path / "refused") == 2
    assert not (tmp_path / "refused").exists()
    assert adapter_delta.rebuild(delta, tmp_path / "refused", start=other) == 2
    assert not (tmp_path / "refused").exists()
