"""The shipped GPU recipes against what would break their first run (issue 55): budgets longer than vLLM's context,
vLLM's memory beside the trainer's on a 24 GB card, and the README's planned numbers against `vpo plan`'s."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vpo_lightning.commands import plan as P
from vpo_lightning.commands.runs import run_settings
from vpo_lightning.generation.engines import VLLMEngine

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# the context of each hub model a GPU recipe names (max_position_embeddings of its config.json)
CONTEXT = {"Qwen/Qwen2.5-7B-Instruct": 32768, "Qwen/Qwen2.5-Coder-7B-Instruct": 32768, "Qwen/Qwen3-1.7B": 40960,
           "Qwen/Qwen3-4B": 40960}
RECIPES_24GB = ("tooluse_qwen7b_qlora", "musique", "eureqa", "livecodebench")
GiB = 2**30


def _vllm_configs() -> list[Path]:
    return [c for c in CONFIGS if issubclass(run_settings(P.load_config(c)).engine_class, VLLMEngine)]


@pytest.fixture(scope="module")
def vllm_configs() -> list[Path]:
    return _vllm_configs()


def test_budgets_fit_vllm_context(vllm_configs: list[Path]) -> None:
    """vLLM caps a chain at max_model_len silently: prompt budget + generation budget must fit in it, and it in the
    model's context."""
    assert {c.stem for c in vllm_configs} >= set(RECIPES_24GB)
    for config in vllm_configs:
        run = run_settings(P.load_config(config))
        prompt, new = run.max_prompt_tokens, run.sampling.max_new_tokens
        max_len = int(run.engine_args["max_model_len"])
        assert prompt > 0, f"{config.name}: data.max_prompt_tokens must bound prompts for vLLM"
        assert prompt + new <= max_len, f"{config.name}: {prompt} + {new} > max_model_len {max_len}"
        assert max_len <= CONTEXT[run.model.name], f"{config.name}: max_model_len over {run.model.name}'s context"


def _estimate(config: Path, **changes: object) -> dict:
    plan = P.plan_from_config(P.load_config(config), for_gpu=True)
    for key, value in changes.items():
        setattr(plan, key, value)
    arch, _ = P.model_arch(plan.model)
    return P.finalize(P.estimate(plan, arch, "cuda"), 24 * GiB)


def _readme_planned(stem: str) -> float:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    pattern = re.escape(stem) + r"[^\n]*?\((\d+\.\d) GiB planned\)"
    found = re.search(pattern, text)
    assert found, f"README.md quotes no planned GiB for {stem}"
    return float(found.group(1))


@pytest.mark.parametrize("stem", RECIPES_24GB)
def test_24gb_recipes_fit_by_the_planners_own_numbers(stem: str) -> None:
    est = _estimate(REPO / "configs" / f"{stem}.yaml")
    plan = est["plan"]
    assert est["peak"] <= 0.9 * 24 * GiB, f"{stem}: {est['peak'] / GiB:.2f} GiB"
    assert P.vllm_kv_check(est) == ""
    # the KV cache left inside vLLM's reservation holds more than one full sequence
    assert est["vllm_kv_tokens"] >= plan.prompt_tokens + plan.max_new_tokens
    assert _readme_planned(stem) == pytest.approx(est["peak"] / GiB, abs=0.051), stem


def test_trainer_and_vllm_add_up_without_empty_cache() -> None:
    """The caching allocator keeps the training step's blocks unless emptied before vLLM wakes: then the two add."""
    config = REPO / "configs" / "tooluse_qwen7b_qlora.yaml"
    freed, kept = _estimate(config), _estimate(config, trainer_cache_freed=False)
    assert kept["peak"] == pytest.approx(freed["peak"] + freed["train_total"])
    # the old recipe (0.35 of the card): ~22.3 GiB of 24 without empty_cache, not the 15.4 the planner said
    old = _estimate(config, vllm_utilization=0.35, trainer_cache_freed=False)
    assert 21.5 * GiB < old["peak"] < 23.5 * GiB


def test_planner_checks_vllm_kv_cache_holds_a_sequence(capsys: pytest.CaptureFixture) -> None:
    # vLLM's old defaults (8192 batched tokens, 256 sequences) at 0.35 of the card: ~0.45 GiB of KV cache is left
    old = _estimate(REPO / "configs" / "tooluse_qwen7b_qlora.yaml", vllm_utilization=0.35, vllm_batched_tokens=8192,
                    vllm_max_seqs=256)
    assert 0.3 * GiB < old["vllm_kv_bytes"] < 0.7 * GiB
    rc = P.main(["--config", "configs/tooluse_qwen7b_qlora.yaml", "--gpu-mem", "24GB",
                 "--set", "rollout.engine.init_args.gpu_memory_utilization=0.25"])
    err = capsys.readouterr().err
    assert rc == 1 and "less than one full sequence" in err and "gpu_memory_utilization" in err


def test_fit_refuses_the_old_eureqa_budget_before_loading(tmp_path, monkeypatch, capsys) -> None:
    """1024 prompt + 2048 new tokens against max_model_len 2048 (EUREQA as it was): refused by `vpo fit` up front,
    naming the keys, on any machine (before the model loads)."""
    from vpo_lightning.launcher import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises((SystemExit, ValueError)) as err:
        main(["fit", "--config", str(REPO / "configs" / "eureqa.yaml"),
              "--rollout.engine.init_args.max_model_len=2048"])
    text = str(err.value) + capsys.readouterr().err
    assert "= 3072 tokens do not fit in rollout.engine.init_args.max_model_len=2048" in text
    assert "--rollout.engine.init_args.max_model_len to at least 3072" in text
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").rglob("*.ckpt"))
