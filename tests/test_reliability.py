"""Reliability: numerical guards, zero-signal and empty rollouts (default tier); kill -9 and resume (slow).

Slow tier. ``vpo fit`` runs in a subprocess on the tiny model with short prompts and a checkpoint every step; the
``VPO_TEST_PAUSE_AT=<point>@<step>`` hook (``checkpointing.pause_point``) parks it at a known point (during
generation, after ``opt.step()`` before the scheduler step, after a checkpoint's temp file is written but before it
is renamed into place) and the test SIGKILLs it there, then resumes with ``--ckpt_path last``. Checked after each
kill: ``last.ckpt`` loads, holds the step and data position of the last complete checkpoint, any stray ``.tmp`` is
ignored and cleaned; and the per-step loss, mean reward, KL and gradient norm of all the interrupted runs equal
those of an uninterrupted run (``RESUME_ABS``, ``RESUME_REL``).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ScriptedEngine, build_tiny_module

from vpo_lightning.core.protocol import build_rollout_tensors
from vpo_lightning.core.types import Generation, Rollout
from vpo_lightning.generation.models import ModelSettings
from vpo_lightning.training.module import VPOModule
from vpo_lightning.training.rollout import RolloutCallback

REPO = Path(__file__).resolve().parents[1]
# Per-step train/loss, reward/all/mean, kl and grad_norm of a resumed run vs an uninterrupted one may differ by at most
# RESUME_ABS + RESUME_REL * |reference|. Measured on CPU (one thread): 0.0, bitwise identical.
RESUME_ABS, RESUME_REL = 1e-9, 1e-6


# ------------------------------------------------------------------------------------------- helpers (unit tier)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread



def _module(beta: float = 0.0, lora_b_std: float = 0.1, **optim) -> VPOModule:
    """The tiny model with a non-zero adapter, wired to a stand-in trainer (the pieces training_step touches)."""
    module = build_tiny_module(beta=beta, lora_b_std=lora_b_std, **{"lr": 1e-2, **optim})
    opt = module.configure_optimizers()
    module.trainer = SimpleNamespace(world_size=1)
    module.optimizers = lambda: opt["optimizer"]
    module.lr_schedulers = lambda: opt["lr_scheduler"]["scheduler"]
    module.manual_backward = lambda loss: loss.backward()
    module.logged = []
    module.log_dict = lambda values, **kw: module.logged.append(dict(values)) if "train/loss" in values else None
    return module


def _rollout(module: VPOModule, advantages: torch.Tensor, lengths=(3, 5, 1, 4), seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    comps = [torch.randint(10, 1000, (k,), generator=g).tolist() for k in lengths]
    gen = Generation(comps, [""] * n, sum(lengths))
    ids, attn, comp, P = build_rollout_tensors([[5, 6, 7, 8]], gen, n, module.tokenizer.pad_token_id)
    return Rollout(ids, attn, comp, P, advantages, torch.zeros(n, 1, 1), torch.ones(n, 1, dtype=torch.bool), [""] * n)


def _lora(module: VPOModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


def _changed(module: VPOModule, before: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(p, before[n]) for n, p in module.policy.named_parameters() if p.requires_grad)


# ----------------------------------------------------------------------------------------------- numerical guards


def test_non_finite_loss_skips_the_step_logs_it_and_does_not_poison_the_next(caplog):
    module = _module(mini_batches=1)  # one update per rollout: the NaN reaches the step's only update
    before = _lora(module)
    bad = _rollout(module, torch.tensor([1.0, float("nan"), -1.0, 0.5]))
    with caplog.at_level(logging.WARNING, logger="vpo_lightning.training.module"):
        module.training_step({"rollout": bad, "records": []}, 0)
    assert not _changed(module, before), "a non-finite step must not touch the weights"
    assert module.logged[-1]["train/skipped_steps"] == 1.0 and math.isnan(module.logged[-1]["train/grad_norm"])
    assert "non-finite loss or gradient" in caplog.text and module._bad_steps == 1
    assert all(p.grad is None for p in module.policy.parameters()), "gradients of a skipped step must be cleared"

    good = _rollout(module, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    module.training_step({"rollout": good, "records": []}, 1)  # the NaN gradients must not leak into this step
    assert module.logged[-1]["train/skipped_steps"] == 0.0 and module._bad_steps == 0
    assert _changed(module, before)
    assert all(bool(torch.isfinite(p).all()) for p in module.policy.parameters())


def test_with_two_mini_batches_only_the_non_finite_update_is_dropped():
    """The NaN chain sits in the first half: that update is dropped, the second half's still applies; the rollout
    counts as one bad step (max_bad_steps counts rollouts, not updates)."""
    module = _module()  # the default: 2 updates per rollout
    before = _lora(module)
    module.training_step({"rollout": _rollout(module, torch.tensor([1.0, float("nan"), -1.0, 0.5])), "records": []}, 0)
    last = module.logged[-1]
    assert last["train/updates"] == 2.0 and last["train/skipped_updates"] == 1.0 and last["train/skipped_steps"] == 1.0
    assert module._bad_steps == 1 and _changed(module, before)
    assert all(bool(torch.isfinite(p).all()) for p in module.policy.parameters())


def test_non_finite_gradient_with_a_finite_loss_skips_the_step():
    module = _module()
    before = _lora(module)
    name, param = next((n, p) for n, p in module.policy.named_parameters() if "lora_A" in n)
    handle = param.register_hook(lambda grad: grad * float("inf"))
    module.training_step({"rollout": _rollout(module, torch.tensor([1.0, -1.0, 0.5, -0.5])), "records": []}, 0)
    handle.remove()
    assert math.isfinite(module.logged[-1]["train/loss"]), "the loss itself was finite"
    assert module.logged[-1]["train/skipped_steps"] == 1.0 and module._bad_steps == 1
    assert not _changed(module, before) and all(p.grad is None for p in module.policy.parameters())


def test_max_bad_steps_in_a_row_stop_with_a_clear_error():
    module = _module(max_bad_steps=3)
    nan = torch.full((4,), float("nan"))
    good = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for adv in (nan, nan, good, nan, nan):  # a good step resets the count
        module.training_step({"rollout": _rollout(module, adv), "records": []}, 0)
    assert module._bad_steps == 2
    with pytest.raises(FloatingPointError, match=r"3 non-finite steps in a row \(optim.max_bad_steps\).*last"):
        module.training_step({"rollout": _rollout(module, nan), "records": []}, 0)


# ------------------------------------------------------------------------------- zero-signal and empty rollouts


def _records(n: int = 2) -> list[dict]:
    lines = (REPO / "data" / "tooluse" / "val.jsonl").read_text().splitlines()[:n]
    out = []
    for line in lines:
        r = json.loads(line)
        r["messages"] = [{"role": "user", "content": r["messages"][-1]["content"][:100]}]
        out.append(r)
    return out


def _scripted_rollout(module, estimator: str, texts: list[str], lengths: list[int], G: int = 4) -> Rollout:
    cb = RolloutCallback(rewards=["format", "tool_name", "arg_key", "arg_value"], estimator=estimator,
                         num_candidates=3, group_size=G, num_weights=16, engine=ScriptedEngine(texts, lengths))
    records = _records(len(texts) // G)
    return cb.rollout(module, {"records": records, "indices": list(range(len(records))), "position": 0}, step=0)


CHAIN = ("<response_1><think>t</think><tool_call>{{\"name\": \"{name}\", \"parameters\": {{}}}}</tool_call>"
         "</response_1><response_2>no</response_2>")


@pytest.mark.parametrize("estimator", ["vpo", "grpo", "multi_rlvr", "random_weight_grpo", "goal_conditioned_grpo",
                                       "max_at_k", "gdpo"])
def test_constant_reward_groups_give_zero_advantages(estimator):
    """Every chain of a group scores the same -> zero-std group -> zero advantage, for every estimator."""
    module = _tokenizer_holder()  # the rollout needs only the tokenizer when the engine is scripted
    names = [next(iter(r["ground_truth"][0])) if r["ground_truth"] else "x" for r in _records(2)]
    texts = [CHAIN.format(name=names[0])] * 4 + [CHAIN.format(name=names[1])] * 4  # identical within each group
    ro = _scripted_rollout(module, estimator, texts, [6, 3, 5, 2, 4, 4, 1, 7])
    assert bool((ro.advantages == 0).all()), ro.advantages
    assert ro.metrics["frac_zero_std_groups"] == 1.0


def _tokenizer_holder() -> SimpleNamespace:
    from vpo_lightning.generation.models import load_tokenizer

    if not hasattr(_tokenizer_holder, "tok"):
        _tokenizer_holder.tok = load_tokenizer("tiny-llama")
    return SimpleNamespace(tokenizer=_tokenizer_holder.tok)


def test_zero_std_groups_give_exactly_zero_policy_gradient():
    """Constant rewards within every group: with beta = 0 the LoRA gradients are exactly zero (nothing to learn);
    with beta > 0 only the KL term pulls (the policy-gradient part of the loss is exactly zero)."""
    module = _module(beta=0.0)
    names = [next(iter(r["ground_truth"][0])) if r["ground_truth"] else "x" for r in _records(2)]
    texts = [CHAIN.format(name=names[0])] * 4 + ["no answer at all"] * 4
    ro = _scripted_rollout(module, "vpo", texts, [6, 3, 5, 2, 4, 4, 1, 7])
    assert bool((ro.advantages == 0).all())
    module.policy.zero_grad(set_to_none=True)
    stats = module._backward_pass(ro, module._prepare(ro))
    grads = [p.grad for p in module.policy.parameters() if p.requires_grad]
    assert all(g is None or bool((g == 0).all()) for g in grads), "zero-std groups must not move the policy"
    assert stats["pg_loss"] == 0.0 and stats["loss"] == 0.0

    module = _module(beta=0.1)
    module.policy.zero_grad(set_to_none=True)
    stats = module._backward_pass(ro, module._prepare(ro))
    assert stats["pg_loss"] == 0.0 and stats["kl"] > 0.0
    assert any(p.grad is not None and bool((p.grad != 0).any()) for p in module.policy.parameters())


@pytest.mark.parametrize("lengths", [[0] * 8, [0, 3, 0, 0, 5, 0, 0, 1]], ids=["all-empty", "some-empty"])
def test_empty_generations_are_handled(lengths):
    """Chains with no generated token (EOS at once, or nothing): no crash, a finite loss, never a skipped step."""
    module = _module(beta=0.05)
    texts = ["" if k == 0 else "<response_1>x</response_1>" for k in lengths]
    ro = _scripted_rollout(module, "vpo", texts, lengths)
    assert ro.completion_mask.shape[0] == 8 and float(ro.completion_mask.sum()) == sum(lengths)
    assert bool(torch.isfinite(ro.advantages).all())
    module.training_step({"rollout": ro, "records": []}, 0)
    logged = module.logged[-1]
    assert logged["train/skipped_steps"] == 0.0 and math.isfinite(logged["train/loss"]) and module._bad_steps == 0
    assert all(bool(torch.isfinite(p).all()) for p in module.policy.parameters())


def test_setup_cleans_up_after_a_kill_during_a_checkpoint_write(tmp_path):
    """Stray temp files are removed at start; an adapter caught between its two renames is put back."""
    from vpo_lightning.training.checkpointing import AdapterCheckpoint

    (tmp_path / "last.ckpt").write_bytes(b"complete")
    (tmp_path / "last.ckpt.tmp").write_bytes(b"torn")
    (tmp_path / "step=4.ckpt.tmp").write_bytes(b"torn")
    (tmp_path / "adapters" / "last.tmp").mkdir(parents=True)  # killed during save_pretrained
    (tmp_path / "adapters" / "step=3.old").mkdir()  # killed after "step=3 -> step=3.old", before "tmp -> step=3"
    (tmp_path / "adapters" / "step=3.old" / "adapter_config.json").write_text("{}")
    (tmp_path / "adapters" / "step=2").mkdir()
    (tmp_path / "adapters" / "step=2.old").mkdir()  # killed before removing the old copy
    trainer = SimpleNamespace(strategy=SimpleNamespace(broadcast=lambda x: x), is_global_zero=True)
    AdapterCheckpoint(dirpath=str(tmp_path)).setup(trainer, None, "fit")
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["adapters", "adapters/step=2", "adapters/step=3", "adapters/step=3/adapter_config.json",
                    "last.ckpt"], left


# --------------------------------------------------------------------------------------- kill -9 and resume (slow)


def _short_data(path: Path, n: int = 8) -> Path:
    """Tool-use records with short prompts (the tiny model's step time is dominated by prompt length)."""
    with path.open("w") as fh:
        for line in (REPO / "data" / "tooluse" / "val.jsonl").read_text().splitlines()[:n]:
            r = json.loads(line)
            user = r["messages"][-1]["content"][:160]
            r["messages"] = [{"role": "system", "content": "Answer with a tool call."},
                             {"role": "user", "content": user}]
            fh.write(json.dumps(r) + "\n")
    return path


# A random model never writes <response_i> tags, so its chains would all score 0 (zero loss, zero gradient: a resume
# test with nothing to compare). This engine cuts the model's own samples into 3 tagged answers, and two rewards
# that vary with any text score them; the training tokens stay the model's. Imported by ``vpo`` from its cwd.
HELPERS = """
from vpo_lightning.generation.engines import TransformersEngine


class TaggingEngine(TransformersEngine):
    def generate(self, module, prompt_ids, group_size, sampling, *args, **kwargs):
        gen = super().generate(module, prompt_ids, group_size, sampling, *args, **kwargs)
        cut = [max(1, len(t) // 3) for t in gen.texts]
        gen.texts = ["".join(f"<response_{i + 1}>{t[i * k:(i + 1) * k] or '-'}</response_{i + 1}>" for i in range(3))
                     for t, k in zip(gen.texts, cut)]
        return gen


def length(candidate, sample):
    return min(1.0, len(candidate) / 24)


def letters(candidate, sample):
    return sum(c.isalpha() for c in candidate) / max(1, len(candidate))
"""


def _fit_args(data: Path, max_steps: int, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "debug.yaml"), f"--data.train_files=[{data}]",
            f"--data.val_files=[{data}]", "--trainer.limit_val_batches=0", f"--trainer.max_steps={max_steps}",
            "--rollout.sampling.max_new_tokens=16", "--rollout.log_samples_every=0", "--model.optim.lr=1e-3",
            "--rollout.engine=rel_helpers.TaggingEngine", "--rollout.rewards=[rel_helpers.length,rel_helpers.letters]",
            *extra]


def _env(cwd: Path, pause: str = "") -> dict[str, str]:
    # One intra-op thread: on a small shared CPU, torch's thread pool makes the tiny model ~10x slower.
    # PYTHONPATH: this checkout's package, also where the venv's editable install points at another checkout
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "VPO_TEST_PAUSE_AT": pause, "VPO_TEST_PAUSE_FILE": str(cwd / "paused"),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}


def _vpo(cwd: Path, args: list[str], pause: str = "", timeout: float = 420.0) -> None:
    """Run ``vpo`` in a subprocess. With ``pause``, wait until it parks at that point and SIGKILL it there."""
    marker = cwd / "paused"
    marker.unlink(missing_ok=True)
    (cwd / "rel_helpers.py").write_text(HELPERS)
    log = (cwd / "vpo.log").open("a")
    log.write(f"\n===== {pause or 'to the end'}: {' '.join(args)}\n")
    log.flush()
    proc = subprocess.Popen([sys.executable, "-m", "vpo_lightning", *args], cwd=cwd, env=_env(cwd, pause),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while pause and not marker.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vpo never reached {pause} (exit {proc.returncode}):\n{_tail(cwd)}")
            time.sleep(0.1)
        if pause:
            assert marker.read_text().strip() == pause
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
        else:
            assert proc.wait(timeout=timeout) == 0, _tail(cwd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _tail(cwd: Path, n: int = 4000) -> str:
    return (cwd / "vpo.log").read_text()[-n:]


def _ckpt(run: Path, name: str = "last.ckpt") -> dict:
    return torch.load(run / name, weights_only=False, map_location="cpu")


def _scalars(run: Path, tag: str) -> dict[int, list[float]]:
    """Every value logged for ``tag`` per step, over all event files (killed runs included)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, list[float]] = {}
    for f in sorted(glob.glob(str(run / "events.out.tfevents.*"))):
        ea = EventAccumulator(f)
        ea.Reload()
        if tag in ea.Tags()["scalars"]:
            for e in ea.Scalars(tag):
                out.setdefault(e.step, []).append(e.value)
    return out


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted 6-step run (the reference for resume determinism): (its run dir, the data file)."""
    cwd = tmp_path_factory.mktemp("straight")
    data = _short_data(cwd / "short.jsonl")
    _vpo(cwd, _fit_args(data, 6))
    return cwd / "checkpoints" / "debug", data


def _assert_same_per_step(run: Path, reference: Path, steps: range) -> float:
    worst = 0.0
    for tag in ("train/loss", "train/reward/all/mean", "train/kl", "train/grad_norm"):
        ref, got = _scalars(reference, tag), _scalars(run, tag)
        assert len({round(ref[s][0], 9) for s in steps}) > 1, f"{tag} is constant: nothing to compare"
        for step in steps:
            assert step in got, f"{tag} step {step} not logged: {sorted(got)}"
            for value in got[step]:
                worst = max(worst, abs(value - ref[step][0]))
                assert abs(value - ref[step][0]) <= RESUME_ABS + RESUME_REL * abs(ref[step][0]), (tag, step, value,
                                                                                                 ref[step])
    return worst


@pytest.mark.slow
def test_resume_is_deterministic(straight_run, tmp_path):
    """Resume the uninterrupted run's step-3 checkpoint and train to 6: steps 3..5 log the same loss, reward, KL and
    gradient norm, and end with the same weights (3 steps + resume 3 == 6 straight)."""
    reference, data = straight_run
    run = tmp_path / "checkpoints" / "debug"
    run.mkdir(parents=True)
    shutil.copy(reference / "step=3.ckpt", run / "last.ckpt")
    _vpo(tmp_path, _fit_args(data, 6, "--ckpt_path=last"))
    ckpt = _ckpt(run)
    assert ckpt["global_step"] == 6 and ckpt["PromptDataModule"]["position"] == 6
    assert sorted(_scalars(run, "train/loss")) == [3, 4, 5]  # only the resumed steps ran
    worst = _assert_same_per_step(run, reference, range(3, 6))
    print(f"resume determinism: max |difference| over steps 3-5 = {worst:.3g} "
          f"(tolerance {RESUME_ABS} + {RESUME_REL} * |value|)")
    a, b = ckpt["state_dict"], _ckpt(reference)["state_dict"]
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-7, rtol=1e-6) for k in a)
    ref_ckpt = _ckpt(reference)
    opt, ref_opt = ckpt["optimizer_states"][0]["state"], ref_ckpt["optimizer_states"][0]["state"]
    assert opt.keys() == ref_opt.keys()
    for i in opt:  # AdamW step count and moments line up too
        assert all(torch.allclose(opt[i][k].float(), ref_opt[i][k].float(), atol=1e-9, rtol=1e-6) for k in opt[i])
    assert ckpt["lr_schedulers"][0]["last_epoch"] == ref_ckpt["lr_schedulers"][0]["last_epoch"] == 6


@pytest.mark.slow
def test_kill_9_anywhere_then_resume(straight_run, tmp_path):
    """SIGKILL twice in each phase (generation, optimizer step, checkpoint write), resuming each time."""
    reference, data = straight_run
    run = tmp_path / "checkpoints" / "debug"

    def resume(pause: str, expect_step: int) -> dict:
        extra = ("--ckpt_path=last",) if (run / "last.ckpt").exists() else ()
        _vpo(tmp_path, _fit_args(data, 6, *extra), pause)
        ckpt = _ckpt(run)  # loads: never half-written
        assert ckpt["global_step"] == expect_step, (pause, ckpt["global_step"])
        assert ckpt["PromptDataModule"]["position"] == expect_step  # one batch a step
        return ckpt

    resume("generate@1", 1)  # during the rollout of step 1: step 0 is checkpointed
    resume("optimizer_step@2", 2)  # weights updated in memory, never saved: resumes from step 2
    resume("checkpoint:step=3.ckpt@3", 2)  # killed between writing step=3.ckpt.tmp and renaming it
    stray = run / "step=3.ckpt.tmp"
    assert stray.is_file() and not (run / "step=3.ckpt").exists()
    with stray.open("r+b") as fh:  # as if killed halfway through the write
        fh.truncate(stray.stat().st_size // 2)
    resume("checkpoint:last.ckpt@3", 2)  # step=3.ckpt now complete; last.ckpt.tmp written, not yet renamed
    assert not stray.exists(), "the torn temp file of the previous kill must be cleaned up"
    assert (run / "last.ckpt.tmp").is_file() and _ckpt(run, "step=3.ckpt")["global_step"] == 3
    resume("generate@4", 4)
    resume("optimizer_step@4", 4)  # the same step again, killed in another phase

    _vpo(tmp_path, _fit_args(data, 6, "--ckpt_path=last"))
    ckpt = _ckpt(run)
    assert ckpt["global_step"] == 6 and ckpt["PromptDataModule"]["position"] == 6
    assert not list(run.glob("*.tmp")) and not list(run.glob("adapters/*.tmp")) and not list(run.glob("adapters/*.old"))
    assert sorted(p.name for p in run.glob("step=*.ckpt")) == [f"step={i}.ckpt" for i in range(1, 7)]
    # Every value logged by any of the runs (the killed ones too) equals the uninterrupted run's.
    worst = _assert_same_per_step(run, reference, range(6))
    print(f"kill/resume determinism: max |difference| = {worst:.3g} (tolerance {RESUME_ABS} + {RESUME_REL} * |value|)")

    from peft import PeftModel

    from vpo_lightning.generation.models import load_base_model

    base = load_base_model(ModelSettings(name="tiny-llama", dtype="fp32"))
    PeftModel.from_pretrained(base, str(run / "adapters" / "last"))  # the exported adapter is whole too


@pytest.mark.slow
def test_non_finite_steps_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    """From step 2 on every loss is NaN: steps are skipped, the run stops after max_bad_steps with ``vpo: error``,
    and last.ckpt still holds step 2 and loads."""
    from vpo_lightning.launcher import main

    original = VPOModule._backward_pass

    def poisoned(self, ro, mbs, *args):
        stats = original(self, ro, mbs, *args)
        return {**stats, "loss": float("nan")} if self.global_step >= 2 else stats

    monkeypatch.setattr(VPOModule, "_backward_pass", poisoned)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel_helpers.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        main(_fit_args(_short_data(tmp_path / "short.jsonl"), 6, "--model.optim.max_bad_steps=3"))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert "vpo: error: 3 non-finite steps in a row (optim.max_bad_steps)" in err
    run = tmp_path / "checkpoints" / "debug"
    ckpt = _ckpt(run)
    assert ckpt["global_step"] == 2 and ckpt["PromptDataModule"]["position"] == 2 and ckpt["vpo_bad_steps"] == 0
    assert not list(run.glob("*.tmp"))
    skipped = _scalars(run, "train/skipped_steps")
    # The first two skipped steps are logged as such; the third ends the run with the error above instead.
    assert sum(v for values in skipped.values() for v in values) == 2.0


def _sigterm_at(cwd: Path, args: list[str], pause: str) -> str:
    """Run ``vpo`` until it parks at ``pause`` (for 1 s), send SIGTERM, expect exit code 143; its output."""
    (cwd / "rel_helpers.py").write_text(HELPERS)
    marker = cwd / "paused"
    marker.unlink(missing_ok=True)
    env = {**_env(cwd, pause), "VPO_TEST_PAUSE_S": "1"}  # parked 1 s, then it goes on with the signal pending
    with (cwd / "vpo.log").open("a") as log:
        log.write(f"\n===== SIGTERM at {pause}\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", "vpo_lightning", *args], cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not marker.exists():
                assert proc.poll() is None and time.monotonic() < deadline, _tail(cwd)
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=300) == 143, _tail(cwd)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return _tail(cwd)


@pytest.mark.slow
def test_sigterm_saves_last_exits_143_and_resumes(straight_run, tmp_path):
    """Preemption (issue 53): SIGTERM during a rollout stops it at the next token and writes last.ckpt as of the
    step before; during the update, the step finishes and last.ckpt holds it. Each time the exit code is 143, not 0;
    the same command with --ckpt_path last resumes in the same folder (no --overwrite), and every logged value of
    the interrupted runs equals the uninterrupted run's."""
    reference, data = straight_run
    run = tmp_path / "checkpoints" / "debug"
    args = [*_fit_args(data, 6), "--checkpoint.every_n_train_steps=50"]  # no periodic checkpoint: only SIGTERM's
    assert "before the first step finished; nothing was saved" in _sigterm_at(tmp_path, args, "generate@0")
    assert not run.exists()  # nothing left behind: the next run needs no --overwrite
    out = _sigterm_at(tmp_path, args, "generate@2")  # in step 2's rollout: steps 0 and 1 are done
    ckpt = _ckpt(run)
    assert ckpt["global_step"] == 2 and ckpt["PromptDataModule"]["position"] == 2
    assert "during the rollout of step 2: writing last.ckpt as of the end of step 1" in out
    assert "resume with the same command and --ckpt_path last" in out
    assert not list(run.glob("*.tmp")) and (run / "adapters" / "last").is_dir()
    _sigterm_at(tmp_path, [*args, "--ckpt_path=last"], "optimizer_step@3")  # in step 3's update: it finishes
    ckpt = _ckpt(run)
    assert ckpt["global_step"] == 4 and ckpt["PromptDataModule"]["position"] == 4
    _vpo(tmp_path, [*args, "--ckpt_path=last"])  # exits 0
    assert _ckpt(run)["global_step"] == 6
    assert {s: len(v) for s, v in _scalars(run, "train/loss").items()} == dict.fromkeys(range(6), 1)  # each once
    worst = _assert_same_per_step(run, reference, range(6))
    print(f"SIGTERM/resume determinism: max |difference| = {worst:.3g}")


@pytest.mark.slow
def test_sigterm_during_validation_saves_the_step_before_and_resumes(straight_run, tmp_path):
    """SIGTERM during the in-loop validation after step 1 (its rollout stops at the next token): last.ckpt holds
    step 2, the exit code is 143, and the resumed run trains as the uninterrupted one."""
    reference, data = straight_run
    run = tmp_path / "checkpoints" / "debug"
    args = [*_fit_args(data, 6), "--checkpoint.every_n_train_steps=50", "--trainer.limit_val_batches=1",
            "--trainer.val_check_interval=2"]
    out = _sigterm_at(tmp_path, args, "generate@-1")  # the first validation rollout: after steps 0 and 1
    assert "SIGTERM received during validation: writing last.ckpt as of step 2" in out
    ckpt = _ckpt(run)
    assert ckpt["global_step"] == 2 and ckpt["PromptDataModule"]["position"] == 2
    _vpo(tmp_path, [*args, "--ckpt_path=last"])
    assert _ckpt(run)["global_step"] == 6
    assert {s: len(v) for s, v in _scalars(run, "train/loss").items()} == dict.fromkeys(range(6), 1)
    _assert_same_per_step(run, reference, range(6))
