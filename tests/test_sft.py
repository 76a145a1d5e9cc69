"""`vpo sft`: completion-only masking, packing, resume, the starting adapter as start and KL reference, and
demonstrations that never come from val/test."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vpo_lightning.core.chains import build_instruction, parse_chain
from vpo_lightning.generation.models import ModelSettings, load_base_model, load_tokenizer, prompt_token_ids, wrap_lora
from vpo_lightning.sft.data import pack_examples, tokenize_example
from vpo_lightning.sft.demos import FAMILIES, build_demos, check_training_file, held_out_prompts, prompt_key
from vpo_lightning.sft.module import row_nll
from vpo_lightning.training.policy import lr_factor

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]
TINY = {"name": "tiny-llama", "dtype": "fp32", "lora": {"r": 4, "alpha": 8}}


def _records(path: Path, n: int) -> list[dict]:
    with path.open() as fh:
        return [json.loads(next(fh)) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- masking, packing


def test_completion_only_masking_on_a_hand_built_example(tiny_model_dir):
    """Prompt tokens carry no loss: the loss is -log p of exactly the completion tokens, each predicted by the
    state before it; equal to a full-logits cross-entropy with the prompt labels masked out."""
    ex = {"prompt_ids": [5, 6, 7, 8], "completion_ids": [9, 10, 2]}
    (row,) = pack_examples([ex], max_tokens=64)
    assert row["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 2]]
    assert row["gather"].tolist() == [3, 4, 5]  # state of token t-1 predicts completion token t
    assert row["targets"].tolist() == [9, 10, 2]

    model = load_base_model(ModelSettings(**TINY))
    nll, n = row_nll(model, row)
    assert n == 3
    logits = model(input_ids=row["input_ids"]).logits[0]  # [7, V]
    labels = torch.tensor([-100, -100, -100, -100, 9, 10, 2])  # prompt positions masked
    expected = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
    torch.testing.assert_close(nll, expected, rtol=1e-5, atol=1e-5)

    # the prompt's own next-token terms are not in it: changing the prompt-only part of the labels changes nothing,
    # while dropping the mask (prompt tokens scored too) gives a different, larger sum
    unmasked = torch.nn.functional.cross_entropy(logits[:-1], row["input_ids"][0, 1:], reduction="sum")
    assert float(unmasked.detach()) > float(nll.detach()) + 1.0


def test_tokenisation_matches_the_rollout_prompt_and_chat_template(tiny_model_dir):
    tok = load_tokenizer("tiny-llama")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    ex = tokenize_example(tok, messages, "<think> ok </think>")
    assert ex["prompt_ids"] == prompt_token_ids(tok, messages)  # the rollout's prompt tokens, exactly
    assert ex["completion_ids"][-1] == tok.eos_token_id  # generation stops at EOS: the demo teaches it
    full = tok.apply_chat_template([*messages, {"role": "assistant", "content": "<think> ok </think>"}],
                                   tokenize=False)
    assert tok.decode(ex["prompt_ids"] + ex["completion_ids"]) == full.rstrip("\n")


def _loss_and_grads(model, rows):
    model.zero_grad(set_to_none=True)
    total = sum(int(r["targets"].numel()) for r in rows)
    loss = 0.0
    for r in rows:
        nll, _ = row_nll(model, r)
        (nll / total).backward()
        loss += float(nll.detach()) / total
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_and_gradients_equal_unpacked(tiny_model_dir, attn):
    tok = load_tokenizer("tiny-llama")
    examples = [tokenize_example(tok, [{"role": "user", "content": f"Question {i}: " + "word " * (3 * i)}],
                                 f"Answer {i} " + "x " * (2 + i)) for i in range(4)]
    model = wrap_lora(load_base_model(ModelSettings(**TINY, attn_implementation=attn)), ModelSettings(**TINY).lora)
    torch.manual_seed(0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.1)  # a non-trivial adapter, so adapter gradients are non-zero
    dtype = torch.bool if attn == "sdpa" else torch.float32
    packed = pack_examples(examples, max_tokens=4096, pack=True, mask_dtype=dtype)
    unpacked = pack_examples(examples, max_tokens=4096, pack=False, mask_dtype=dtype)
    assert len(packed) == 1 and len(unpacked) == 4
    assert packed[0]["attention_mask"].shape[-1] == sum(len(e["prompt_ids"]) + len(e["completion_ids"])
                                                        for e in examples)
    loss_p, grads_p = _loss_and_grads(model, packed)
    loss_u, grads_u = _loss_and_grads(model, unpacked)
    assert abs(loss_p - loss_u) < 1e-5
    assert grads_p.keys() == grads_u.keys() and grads_p
    for name in grads_p:
        torch.testing.assert_close(grads_p[name], grads_u[name], rtol=1e-4, atol=1e-6)


def test_packing_respects_the_row_budget():
    exs = [{"prompt_ids": [1] * 5, "completion_ids": [2] * 5} for _ in range(5)]  # 10 tokens each
    rows = pack_examples(exs, max_tokens=25)
    assert [r["input_ids"].shape[1] for r in rows] == [20, 20, 10]
    assert [r["position_ids"][0].tolist()[:12] for r in rows][0] == list(range(10)) + [0, 1]  # restart per example


def test_lr_schedule_exact_values():
    assert [lr_factor(s, 2, 10, 0.1) for s in (0, 1)] == pytest.approx([1 / 3, 2 / 3])
    assert lr_factor(2, 2, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(6, 2, 10, 0.1) == pytest.approx(0.55)
    assert lr_factor(10, 2, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(50, 2, 10, 0.1) == pytest.approx(0.1)


def test_cosine_schedule_exact_values():
    """Issue 53 (TRL's lr_scheduler_type="cosine"): after the warm-up, min + (1 - min) (1 + cos(pi t)) / 2."""
    assert lr_factor(1, 2, 10, 0.0, "cosine") == pytest.approx(2 / 3)  # the warm-up is linear either way
    assert lr_factor(2, 2, 10, 0.0, "cosine") == pytest.approx(1.0)
    assert lr_factor(4, 2, 10, 0.0, "cosine") == pytest.approx((1 + math.cos(math.pi / 4)) / 2)  # t = 2/8
    assert lr_factor(6, 2, 10, 0.1, "cosine") == pytest.approx(0.55)  # halfway: the mean of 1 and min
    assert lr_factor(10, 2, 10, 0.1, "cosine") == pytest.approx(0.1) == lr_factor(50, 2, 10, 0.1, "cosine")


def test_fit_schedules_default_constant_and_cosine_on_request():
    """`vpo fit`'s default stays constant after the warm-up; schedule: cosine decays to min_lr_ratio at max_steps."""
    from vpo_lightning.training.module import OptimSettings
    from vpo_lightning.training.policy import lr_shape

    assert lr_shape(OptimSettings()) == ("linear", 1.0)  # max(1.0, ...) = 1: constant
    assert [lr_factor(s, 0, 10, *lr_shape(OptimSettings())[::-1]) for s in (0, 5, 10)] == [1.0, 1.0, 1.0]
    shape, low = lr_shape(OptimSettings(schedule="cosine", min_lr_ratio=0.2))
    assert (shape, low) == ("cosine", 0.2) and lr_factor(10, 0, 10, low, shape) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        OptimSettings(min_lr_ratio=1.5)


# ---------------------------------------------------------------------------------------------- starting adapter


def _sft_adapter(tmp_path: Path) -> Path:
    """A non-trivial PEFT adapter on tiny-llama (random lora_B), as `vpo sft` would export it."""
    model = wrap_lora(load_base_model(ModelSettings(**TINY)), ModelSettings(**TINY).lora)
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.2)
    out = tmp_path / "sft_adapter"
    model.save_pretrained(out)
    return out


def test_adapter_is_the_start_and_the_kl_reference(tiny_model_dir, tmp_path):
    """With model.adapter, the RL policy starts at the SFT policy and the reference (adapter disabled) is the SFT
    policy, not the raw base; there is one copy of the base (reference is None)."""
    from peft import PeftModel

    from vpo_lightning.training.module import VPOModule

    adapter = _sft_adapter(tmp_path)
    sft = PeftModel.from_pretrained(load_base_model(ModelSettings(**TINY)), str(adapter)).eval()
    raw = load_base_model(ModelSettings(**TINY)).eval()
    module = VPOModule(model=ModelSettings(**TINY, adapter=str(adapter)))
    module.configure_model()
    assert module.reference is None  # no second copy

    ids = torch.tensor([[1, 5, 9, 14, 20, 33, 41, 7, 2]])
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": torch.ones(1, 5),
          "prompt_length": 4}
    with torch.no_grad():
        want = module.completion_logprobs(sft, mb, 1.0)
        base = module.completion_logprobs(raw, mb, 1.0)
        ref = module.reference_logprobs(mb, 1.0)
        start = module.completion_logprobs(module.policy, mb, 1.0)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)  # reference = SFT policy
    torch.testing.assert_close(start, want, rtol=1e-5, atol=1e-5)  # RL starts there (new LoRA B = 0)
    assert (ref - base).abs().max() > 1e-3  # and that is not the raw base

    # a step of the RL adapter moves the policy but not the reference
    for n, p in module.policy.named_parameters():
        if "lora_B" in n:
            p.data.add_(0.05)
    with torch.no_grad():
        moved = module.completion_logprobs(module.policy, mb, 1.0)
        ref2 = module.reference_logprobs(mb, 1.0)
    assert (moved - want).abs().max() > 1e-4
    torch.testing.assert_close(ref2, want, rtol=1e-5, atol=1e-5)


def test_adapter_full_finetune_reference_is_sft(tiny_model_dir, tmp_path):
    from vpo_lightning.generation.models import load_policy

    adapter = _sft_adapter(tmp_path)
    policy, ref = load_policy(ModelSettings(**{**TINY, "lora": {"enabled": False}}, adapter=str(adapter)))
    for (n, a), (_, b) in zip(policy.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a, b, msg=n)


def test_bad_adapter_settings_fail_clearly(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="model.adapter=.*no such directory"):
        load_base_model(ModelSettings(**TINY, adapter=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        load_base_model(ModelSettings(**TINY, adapter=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="4-bit"):
        ModelSettings(**TINY, adapter=str(tmp_path), load_in_4bit=True)


# ---------------------------------------------------------------------------------------------- demonstrations


@functools.cache
def _built(task: str) -> tuple[dict, ...]:
    return tuple(build_demos([REPO / "data" / task / "train.jsonl"], task, [1, 3])[0])


@pytest.mark.parametrize("task", ["tooluse", "maze"])
def test_demonstrations_never_come_from_val_or_test(task):
    train = REPO / "data" / task / "train.jsonl"
    demos = _built(task)
    held = held_out_prompts(train)
    assert len(held) > 50, "the val/test files beside train.jsonl were not read"
    train_rows = [json.loads(line) for line in train.open()]
    train_keys = {prompt_key(r) for r in train_rows}
    val_test_ids = {json.loads(line)["id"] for s in ("val", "test") for line in (train.parent / f"{s}.jsonl").open()}
    assert not {d["source_id"] for d in demos} & val_test_ids
    family = FAMILIES[task]
    for d in demos:
        prompt = d["messages"][-1]["content"]
        if d["m"] > 1:
            prompt = prompt.removesuffix(build_instruction(d["m"], family))
        assert prompt.strip() in train_keys and prompt.strip() not in held
    for split in ("val", "test"):
        with pytest.raises(ValueError, match="held-out split"):
            build_demos([train.parent / f"{split}.jsonl"], task, [1])


def test_records_seen_in_val_or_marked_held_out_are_refused(tmp_path):
    rows = _records(REPO / "data" / "maze" / "train.jsonl", 3)
    val_row = _records(REPO / "data" / "maze" / "val.jsonl", 1)[0]
    leaked = dict(val_row, id="copied-into-train", meta={"split": "train"})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, leaked]))
    (tmp_path / "val.jsonl").write_text(json.dumps(val_row) + "\n")
    demos, skipped = build_demos([tmp_path / "train.jsonl"], "maze", [1])
    assert skipped == 1 and {d["source_id"] for d in demos} == {r["id"] for r in rows}
    with pytest.raises(ValueError, match="meta.split='val'"):
        check_training_file(tmp_path / "mine.jsonl", [val_row])


def test_tooluse_demonstrations_are_well_formed():
    from vpo_lightning.tasks.tooluse.reward import format_reward, tooluse_rewards

    records = _records(REPO / "data" / "tooluse" / "train.jsonl", 150)
    by_id = {r["id"]: r for r in records}
    demos = [d for d in _built("tooluse") if d["source_id"] in by_id]
    assert {d["m"] for d in demos} == {1, 3}
    for d in demos:
        rec = by_id[d["source_id"]]
        if d["m"] == 1:
            assert tooluse_rewards(d["completion"], rec)[:3] == [1.0, 1.0, 1.0]
            continue
        attempts = parse_chain(d["completion"], 3, "response")
        assert all(a is not None for a in attempts) and len(set(attempts)) == 3  # parse, and no copies
        scores = [tooluse_rewards(a, rec) for a in attempts]
        assert max(s[1] for s in scores) == 1.0  # the gold call is one of them
        assert sum(format_reward(a, rec) for a in attempts) >= 2 or not rec["ground_truth"]
        assert d["messages"][-1]["content"].endswith("answer format the task asks for a single answer.")


def test_maze_demonstrations_are_valid_random_walks():
    from vpo_lightning.tasks.maze import maze_reward

    records = _records(REPO / "data" / "maze" / "train.jsonl", 40)
    by_id = {r["id"]: r for r in records}
    demos = [d for d in _built("maze") if d["source_id"] in by_id]
    gold = diamond = 0.0
    for d in demos:
        routes = [d["completion"]] if d["m"] == 1 else parse_chain(d["completion"], 3, "route")
        assert all(r is not None for r in routes) and len(set(routes)) == len(routes)
        for r in routes:
            score = maze_reward(r, by_id[d["source_id"]])
            assert score[0] == 1.0  # reaches the exit within the budget, never into a wall
            gold, diamond = gold + score[1], diamond + score[2]
    n = sum(d["m"] for d in demos)
    assert 0.0 < gold / n < 0.5 and 0.0 < diamond / n < 0.5  # zones by chance, neither side favoured


def _maze_demo_routes(demo: dict) -> list[str | None]:
    """The routes of one maze demonstration: its ``<route>`` content (m = 1) or its chain's routes."""
    if demo["m"] == 1:
        return [demo["completion"][len("<route>"):-len("</route>")]]
    return parse_chain(demo["completion"], demo["m"], "route")


def _shortest_moves(record: dict) -> int:
    from vpo_lightning.tasks.maze import Maze
    from vpo_lightning.tasks.maze.demos import distances_to_exit

    return distances_to_exit(Maze.from_dict(record["ground_truth"]))[tuple(record["ground_truth"]["start"])]


def test_maze_shortest_demonstrations_are_shortest_routes_blind_to_the_zones():
    from vpo_lightning.tasks.maze import maze_reward

    train = REPO / "data" / "maze" / "5x5" / "train.jsonl"
    by_id = {r["id"]: r for r in _records(train, 60)}
    demos = [d for d in build_demos([train], "maze_shortest", [1, 3])[0] if d["source_id"] in by_id]
    assert {d["m"] for d in demos} == {1, 3}
    gold = diamond = 0.0
    for d in demos:
        record = by_id[d["source_id"]]
        routes = _maze_demo_routes(d)
        assert all(r is not None for r in routes) and len(set(routes)) == len(routes)
        assert len(routes[0].split()) == _shortest_moves(record)  # the first (or only) route is a shortest one
        assert [len(r.split()) for r in routes] == sorted(len(r.split()) for r in routes)  # shortest first
        for r in routes:
            score = maze_reward(r, record)
            assert score[0] == 1.0  # reaches the exit within the budget, never into a wall
            gold, diamond = gold + score[1], diamond + score[2]
    n = sum(d["m"] for d in demos)
    assert 0.0 < gold / n < 0.6 and 0.0 < diamond / n < 0.6  # zones by chance, neither side favoured


def test_maze_direct_chains_are_completed_with_one_detour_routes():
    from vpo_lightning.tasks.maze import maze_reward

    train = REPO / "data" / "maze" / "5x5" / "train.jsonl"
    by_id = {r["id"]: r for r in _records(train, 60)}
    direct = [d for d in build_demos([train], "maze_direct", [1, 3])[0] if d["source_id"] in by_id]
    shortest = [d for d in build_demos([train], "maze_shortest", [1])[0] if d["source_id"] in by_id]
    assert [d for d in direct if d["m"] == 1] == shortest  # the same single answers as maze_shortest
    lengths = []
    for d in (d for d in direct if d["m"] == 3):
        record = by_id[d["source_id"]]
        best = _shortest_moves(record)
        routes = _maze_demo_routes(d)
        assert len(set(routes)) == 3 and all(maze_reward(r, record)[0] == 1.0 for r in routes)
        lengths += [len(r.split()) - best for r in routes]
    assert set(lengths) <= {0, 2, 4, 6} and lengths.count(0) + lengths.count(2) >= 0.95 * len(lengths)


# ---------------------------------------------------------------------------------------------- CLI, resume


def _write_config(tmp_path: Path, run_name: str, max_steps: int) -> Path:
    rows = _records(REPO / "data" / "tooluse" / "train.jsonl", 40)
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "run_name": run_name, "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": max_steps, "val_check_interval": 2},
        "model": {"model": TINY, "optim": {"lr": 1e-2, "warmup_steps": 0}},
        "data": {"train_files": [str(data)], "builder": "tooluse", "formats": [1, 3], "batch_size": 3,
                 "val_fraction": 0.1, "max_tokens_per_row": 1024, "max_prompt_tokens": 600},
        "checkpoint": {"every_n_train_steps": 1},
    }
    path = tmp_path / f"{run_name}-{max_steps}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return path


def _adapter_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapters" / "last" / "adapter_model.safetensors"))


def test_sft_configs_parse(in_repo):
    from vpo_lightning.sft.cli import make_cli
    from vpo_lightning.sft.data import SFTDataModule
    from vpo_lightning.sft.module import SFTModule

    names = sorted(p.name for p in Path("configs").glob("*_sft.yaml"))  # every shipped SFT config
    assert {"tooluse_sft.yaml", "maze_sft.yaml", "maze5_sft.yaml"} <= set(names)
    for name in names:
        cli = make_cli(["--config", f"configs/{name}", "--trainer.accelerator=cpu"], run=False)
        assert isinstance(cli.model, SFTModule) and cli.model.policy is None
        assert isinstance(cli.datamodule, SFTDataModule) and cli.datamodule.formats == [1, 3]


def test_resume_continues_where_it_stopped(tiny_model_dir, tmp_path, monkeypatch):
    """2 steps straight == 1 step, then --ckpt_path last for the second: same data position, same adapter."""
    from vpo_lightning.sft.cli import make_cli

    monkeypatch.chdir(tmp_path)
    make_cli(["--config", str(_write_config(tmp_path, "straight", 2))])
    make_cli(["--config", str(_write_config(tmp_path, "resumed", 1))])
    first = _adapter_weights(tmp_path / "checkpoints" / "resumed")
    ckpt = torch.load(tmp_path / "checkpoints" / "resumed" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 1 and any(k.endswith("lora_A.default.weight") for k in ckpt["state_dict"])
    assert all("lora" in k for k in ckpt["state_dict"])  # only the adapter is checkpointed
    make_cli(["--config", str(_write_config(tmp_path, "resumed", 2)), "--ckpt_path", "last"])
    straight = _adapter_weights(tmp_path / "checkpoints" / "straight")
    resumed = _adapter_weights(tmp_path / "checkpoints" / "resumed")
    assert straight.keys() == resumed.keys()
    assert any((first[k] - resumed[k]).abs().max() > 0 for k in first)  # the second step did train
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_vpo_sft_end_to_end(tiny_model_dir, tmp_path):
    """`vpo sft` as a user runs it: 2 steps, validation loss logged, adapter exported, then `vpo fit`'s model
    loads it as model.adapter."""
    cfg = _write_config(tmp_path, "e2e", 2)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "vpo_lightning", "sft", "--config", str(cfg)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "checkpoints" / "e2e"
    assert (run / "last.ckpt").is_file() and (run / "adapters" / "last" / "adapter_config.json").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(run.glob("events.out.tfevents.*"))))
    events.Reload()
    assert {"train/loss", "val/loss"} <= set(events.Tags()["scalars"])
    model = load_base_model(ModelSettings(**TINY, adapter=str(run / "adapters" / "last")))
    assert not hasattr(model, "peft_config")  # merged: a plain model


def test_fit_cli_takes_a_starting_adapter(in_repo):
    """`vpo fit --model.model.adapter DIR` (what `make fit` runs) parses into ModelSettings.adapter."""
    from vpo_lightning.training.cli import VPOCLI
    from vpo_lightning.training.datamodule import PromptDataModule
    from vpo_lightning.training.module import VPOModule

    cli = VPOCLI(VPOModule, PromptDataModule, run=False,
                 args=["--config", "configs/tooluse.yaml", "--trainer.accelerator=cpu",
                       "--model.model.adapter", "checkpoints/tooluse-sft/adapters/last"],
                 parser_kwargs={"parser_mode": "omegaconf", "default_env": False})
    assert cli.model.model_settings.adapter == "checkpoints/tooluse-sft/adapters/last"


# ------------------------------------------------------------------------------------ TRL's SFT formats (issue 53)

TRL_STANDARD = [{"prompt": f"What is {i} + {i}?", "completion": f"It is {2 * i}."} for i in range(6)]
TRL_PROMPT_COMPLETION = [{"prompt": [{"role": "user", "content": f"Double {i}."}],
                          "completion": [{"role": "assistant", "content": str(2 * i)}]} for i in range(6)]
TRL_MESSAGES = [{"messages": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": f"Name {i}?"},
                              {"role": "assistant", "content": f"Bot {i}."},
                              {"role": "user", "content": "And twice that?"},
                              {"role": "assistant", "content": f"{2 * i}."}]} for i in range(3)]


def test_trl_sft_formats_become_completion_only_demonstrations():
    from vpo_lightning.sft.data import sft_examples

    [std] = sft_examples(TRL_STANDARD[1], "f:1", "f-1")
    assert std["messages"] == [{"role": "user", "content": "What is 1 + 1?"}] and std["completion"] == "It is 2."
    [conv] = sft_examples(TRL_PROMPT_COMPLETION[2], "f:2", "f-2")
    assert conv["messages"] == TRL_PROMPT_COMPLETION[2]["prompt"] and conv["completion"] == "4"
    first, second = sft_examples(TRL_MESSAGES[1], "f:3", "f-3")  # one demonstration per assistant turn
    assert first["messages"] == TRL_MESSAGES[1]["messages"][:2] and first["completion"] == "Bot 1."
    assert second["messages"] == TRL_MESSAGES[1]["messages"][:4] and second["completion"] == "2."
    assert first["source_id"] == second["source_id"] == "f-3"  # held out together
    ours = {"messages": [{"role": "user", "content": "Hi"}], "completion": "Hello", "id": "x"}
    assert sft_examples(ours, "f:4", "f-4")[0]["completion"] == "Hello"


@pytest.mark.parametrize(("row", "message"), [
    ({"text": "Once upon a time"}, r"f\.jsonl:7: a 'text' record \(TRL's language-modelling format\) has no prompt"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, r"f\.jsonl:7: 'messages' has no assistant turn to learn"),
    ({"prompt": "Hi", "completion": [{"role": "user", "content": "x"}]},
     r"f\.jsonl:7: a conversational 'completion' must be one assistant message"),
    ({"question": "Hi"}, r"f\.jsonl:7: not a demonstration \(fields \['question'\]\); give one of: TRL prompt-compl"),
])
def test_rows_that_are_not_demonstrations_are_refused_naming_the_line(row, message):
    from vpo_lightning.sft.data import sft_examples

    with pytest.raises(ValueError, match=message):
        sft_examples(row, "f.jsonl:7", "f-7")


def test_sft_reads_trl_data_from_parquet_jsonl_and_saved_datasets(tiny_model_dir, tmp_path):
    """The same loaders as `vpo fit`; each demonstration is tokenised as the rollout's prompt + completion + EOS,
    and a later turn's prompt holds the earlier reply as context (no loss on it)."""
    import datasets

    from vpo_lightning.sft.data import SFTDataModule

    datasets.Dataset.from_list(TRL_STANDARD).to_parquet(str(tmp_path / "std.parquet"))
    (tmp_path / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRL_PROMPT_COMPLETION))
    datasets.Dataset.from_list(TRL_MESSAGES).save_to_disk(str(tmp_path / "chats"))
    dm = SFTDataModule([str(tmp_path / "std.parquet"), str(tmp_path / "conv.jsonl"), str(tmp_path / "chats")],
                       val_fraction=0.0, batch_size=2, tokenizer="tiny-llama")
    dm.setup("fit")
    assert len(dm.train_examples) == 6 + 6 + 3 * 2
    tok = load_tokenizer("tiny-llama")
    by_id = {ex["id"]: ex for ex in dm.train_examples}
    turn2 = by_id["chats-2-turn2"]
    assert turn2["prompt_ids"] == prompt_token_ids(tok, TRL_MESSAGES[1]["messages"][:4])
    assert turn2["completion_ids"] == tok("2.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert by_id["std-1"]["prompt_ids"] == prompt_token_ids(tok, [{"role": "user", "content": "What is 0 + 0?"}])


def test_vpo_sft_trains_on_trl_conversational_data(tiny_model_dir, tmp_path, monkeypatch, capfd):
    """`vpo sft` on a TRL `messages` file (builder: none): it trains, validates and exports the adapter."""
    import yaml

    from vpo_lightning.sft.cli import make_cli

    monkeypatch.chdir(tmp_path)
    rows = [dict(r, id=f"c{i}-{j}") for j in range(4) for i, r in enumerate(TRL_MESSAGES)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"run_name": "trl-sft", "seed_everything": 0,
           "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "val_check_interval": 2},
           "model": {"model": TINY, "optim": {"lr": 1e-2}},
           "data": {"train_files": ["chats.jsonl"], "batch_size": 4, "val_fraction": 0.25},
           "checkpoint": {"every_n_train_steps": 2}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg))
    make_cli(["--config", "sft.yaml"])
    assert "configuration: checkpoints/trl-sft/config.yaml (vpo sft ... --print_config" in capfd.readouterr().out
    run = tmp_path / "checkpoints" / "trl-sft"
    assert torch.load(run / "last.ckpt", weights_only=False)["global_step"] == 2
    assert (run / "adapters" / "last" / "adapter_config.json").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = run.glob("events.out.tfevents.*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert set(tags) == {"val/loss"} | {f"train/{k}" for k in (  # docs/TRAINING.md, Logged metrics; no epoch
        "loss", "completion_tokens", "grad_norm", "tokens_per_s", "step_time_s", "skipped_steps", "peak_rss_gb", "lr")}
