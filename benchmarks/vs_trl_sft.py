"""``vpo sft`` (the supervised cold start) against TRL's ``SFTTrainer`` on the same CPU job, step for step (issue 56).

**Matched.** The job is read from a ``vpo sft`` config (default ``configs/tooluse_sft.yaml``) by ``vpo sft``'s own
parser, and both sides get it:

* the model: ``model.model`` of the config (``--model``/``--dtype`` override it), loaded on both sides by the same
  ``load_base_model`` (the embedded SmolLM2-135M alias, from its local GGUF), at the same dtype, with SDPA;
  no autocast on either side (TRL: ``bf16=False``), so a bf16 run computes in the weights' bf16;
* LoRA: the config's r, alpha, dropout and target modules, through PEFT on both sides (fp32 adapter weights: PEFT
  upcasts them), started from the same weights: :func:`seed_lora` redraws PEFT's own initialisation
  (kaiming-uniform A, zero B) from one seeded generator on each side, whose checksums the results compare;
* the data, token for token, in the same order: the first ``--steps`` batches of ``vpo sft``'s stream
  (:class:`~vpo_lightning.sft.data.SFTDataModule` built from the config: demonstrations, held-out split, length
  limits, seeded shuffle), tokenised once in this process. TRL gets them pre-tokenised (``input_ids`` +
  ``completion_mask``: prompt tokens carry no loss, ``completion_only_loss=True``), sequentially
  (``train_sampling_strategy="sequential"``, ``shuffle_dataset=False``), ``per_device_train_batch_size`` =
  ``data.batch_size`` demonstrations a step, gradient accumulation 1, no truncation (``max_length=None``);
* the loss: the mean NLL over all completion tokens of the step's batch (TRL: ``num_items_in_batch``). Both
  layouts compute the same loss: on the tooluse recipe's first batch (SmolLM2-135M, adapter at its zero start) ours
  gave 0.726712, TRL's flattened row 0.726706 and the 8 demonstrations one by one 0.726706 in fp32; in bf16, where
  every activation is rounded, 0.728058 / 0.726109 / 0.728255, so bf16 losses differ by a few 1e-3 from rounding;
* the optimiser: torch AdamW (TRL ``optim="adamw_torch"``, not the fused default), the config's lr, weight decay,
  betas/eps (torch's defaults), gradient clipping at ``optim.max_grad_norm``; the schedule is ours exactly
  (``lr_factor``: warm-up, then linear/cosine decay to ``min_lr_ratio`` at the config's ``trainer.max_steps``),
  installed in TRL's trainer by overriding ``create_scheduler``, so step k has the same lr on both sides;
* gradient checkpointing as the config says (non-reentrant on both sides), torch threads (``--threads``; default
  torch's, one per core, on both).

**TRL's mode: padding-free** (``padding_free=True, packing=False``): each step's demonstrations are flattened into one
row with restarting position ids (transformers builds the block-diagonal mask from them under SDPA), so no padded
token is computed and a step holds exactly our step's demonstrations. TRL's other fast mode, BFD packing, runs
the same padding-free path (its collator flattens the packed rows the same way) but regroups demonstrations into
``max_length`` bins, so a step would no longer hold our step's batch (per-step losses not comparable) and ``bfd``
truncates demonstrations longer than ``max_length`` (prompt + completion reach 1408 tokens here; ours never
truncates). ``--trl-mode padding`` (one padded row per demonstration) is there to check which of the two modes
that keep the batch is faster on a CPU: padding-free attends over the whole flattened row under a mask, padding
computes the pads.

**Not matched (each side's own design).** Row layout: ours packs a step's demonstrations first-fit into rows of at
most ``data.max_tokens_per_row`` with a block-diagonal mask and backpropagates row by row; TRL runs one flattened
row. The head: ours projects only the completion positions (chunked log-softmax); TRL 1.16's fused head projects
every position on CPU (its compact path is Triton-only) and also computes entropy and top-1 accuracy for its logs.
Malloc: ours tunes it as every ``vpo`` command does, TRL runs with glibc's defaults (``--env`` sets both). Lightning
vs the HF Trainer loop around the step.

Each side runs in its own subprocess (ours in ``.venv``, TRL in ``benchmarks/.venv-trl``: ``benchmarks/setup_trl.sh``),
in alternating runs (ours, TRL, TRL, ours, ...); the first step of each run is a warm-up, excluded. Per side: median
step time, trained tokens/s (prompt + completion tokens of the step / step time; the same tokens on both sides),
loss tokens/s, peak RSS of the subprocess, the training loss at step 1 (same weights and data: equal in fp32, within
rounding in bf16) and after ``--steps`` steps, and ratios ours / TRL; ``checks`` says whether both sides trained the
same tokens from the same adapter. Results: ``benchmarks/results_vs_trl_sft_<cpu kind>_<dtype>.json``
(``cpuload.results_label``: the kind is ``roofline.cpu_kind``, amx / avx512 / avx2; ``machine.cpu_kind_detail``
tells avx512_bf16 apart), with the commit, thread counts and the load average at each launch.

    bash benchmarks/setup_trl.sh                                       # once: TRL 1.16 in benchmarks/.venv-trl
    .venv/bin/python benchmarks/vs_trl_sft.py --dtype bf16             # the tooluse recipe, SmolLM2-135M, 2 x 5 steps
    .venv/bin/python benchmarks/vs_trl_sft.py --model tiny-llama --steps 2 --rounds 1 --out /tmp/x.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import vs_trl  # noqa: E402  (the workers' launcher, step clock and interpreters)

DEFAULT_CONFIG = ROOT / "configs" / "tooluse_sft.yaml"
TRL_MODES = ("padding_free", "padding")


# ----------------------------------------------------------------------------------------------- the job
def recipe(config: Path, model: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    """The job of ``vpo sft --config CONFIG`` as ``vpo sft``'s parser reads it: ``{"model", "optim", "data",
    "schedule_steps", "seed"}`` as plain dicts (``model``/``dtype`` override ``model.model``'s)."""
    from vpo_lightning.sft.cli import SFT

    args = ["--config", str(config)] + (["--model.model.name", model] if model else []) + (
        ["--model.model.dtype", dtype] if dtype else [])
    cfg = SFT.parser("fit").parse_args(args).as_dict()
    data = {**cfg["data"], "tokenizer": cfg["model"]["model"]["name"]}  # the CLI's link, which parsing alone skips
    return {"model": cfg["model"]["model"], "optim": cfg["model"]["optim"], "data": data,
            "schedule_steps": int(cfg["trainer"]["max_steps"]), "seed": int(cfg["seed_everything"] or 0)}


def sft_batches(data: dict[str, Any], steps: int) -> list[list[dict[str, Any]]]:
    """The first ``steps`` training batches ``vpo sft`` trains on with this data section, in its order: each a list
    of ``{"id", "prompt_ids", "completion_ids"}`` (completion with EOS)."""
    from vpo_lightning.sft.data import SFTDataModule

    dm = SFTDataModule(**data)
    dm.setup("fit")
    stream = iter(dm.train_stream)
    out = []
    for _ in range(steps):
        batch = next(stream, None)
        if batch is None:
            raise SystemExit(f"--steps {steps}: the data has only {len(out)} batches in an epoch")
        out.append([{k: e[k] for k in ("id", "prompt_ids", "completion_ids")} for e in batch["records"]])
    return out


def make_spec(config: Path, model: str | None = None, dtype: str | None = None, steps: int = 5,
              trl_mode: str = "padding_free", threads: int = 0, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """What both workers get: the config's job (:func:`recipe`; ``data`` overrides its data section) and the
    token ids of its first ``steps`` batches (:func:`sft_batches`)."""
    from vpo_lightning.generation.models import resolve_dtype

    spec = {**recipe(config, model, dtype), "steps": steps, "trl_mode": trl_mode, "threads": threads}
    spec["data"].update(data or {})
    spec["batches"] = sft_batches(spec["data"], steps)
    spec["dtype"] = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}.get(
        str(resolve_dtype(spec["model"]["dtype"])), spec["model"]["dtype"])
    return spec


def trl_rows(batches: list[list[dict[str, Any]]]) -> list[dict[str, list[int]]]:
    """TRL's pre-tokenised dataset, the batches one after another: ``input_ids`` = prompt + completion,
    ``completion_mask`` 1 on the completion (the tokens ``vpo sft`` learns)."""
    return [{"input_ids": e["prompt_ids"] + e["completion_ids"],
             "completion_mask": [0] * len(e["prompt_ids"]) + [1] * len(e["completion_ids"])}
            for batch in batches for e in batch]


def trl_config_args(spec: dict[str, Any]) -> dict[str, Any]:
    """SFTConfig's arguments that define the job (see the module docstring)."""
    o, model = spec["optim"], spec["model"]
    return {
        "per_device_train_batch_size": len(spec["batches"][0]), "gradient_accumulation_steps": 1,
        "max_steps": spec["steps"], "learning_rate": o["lr"], "weight_decay": o["weight_decay"],
        "max_grad_norm": o["max_grad_norm"], "optim": "adamw_torch",
        "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,  # torch.optim.AdamW's defaults: ours
        "lr_scheduler_type": "constant", "warmup_steps": 0,  # replaced by ours in create_scheduler
        "train_sampling_strategy": "sequential", "shuffle_dataset": False, "seed": spec["seed"],
        "padding_free": spec["trl_mode"] == "padding_free", "packing": False, "completion_only_loss": True,
        "max_length": None, "gradient_checkpointing": model["gradient_checkpointing"],
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
    }


def lr_lambda(spec: dict[str, Any]):
    """Our learning-rate factor per step (``SFTModule``'s schedule, over the config's ``trainer.max_steps``)."""
    from vpo_lightning.sft.module import SFTOptimSettings
    from vpo_lightning.training.policy import lr_factor, lr_shape

    o = SFTOptimSettings(**spec["optim"])
    shape, min_ratio = lr_shape(o)
    return lambda step: lr_factor(step, o.warmup_steps, spec["schedule_steps"], min_ratio, shape)


def seed_lora(model: Any, seed: int) -> float:
    """Redraw the LoRA weights as PEFT initialises them (A kaiming-uniform with a = sqrt(5), B zero) from one
    generator seeded with ``seed``, in parameter-name order, so that both sides start from the same adapter
    whatever random draws came before; returns sum |w| over them (equal on both sides = the same start)."""
    import torch

    gen, total = torch.Generator().manual_seed(seed), 0.0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if ".lora_A." in name:
                torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=gen)
            elif ".lora_B." in name:
                p.zero_()
            else:
                continue
            total += float(p.double().abs().sum())
    return total


# ----------------------------------------------------------------------------------------------- the workers
class _SFTClock(vs_trl._Clock):
    """vs_trl's step clock, with each step's training loss and token counts and the adapter's start."""

    def __init__(self, partial: Path | None = None) -> None:
        super().__init__(partial)
        self.losses: list[float] = []
        self.tokens: list[int] = []  # prompt + completion tokens (no padding)
        self.loss_tokens: list[int] = []
        self.batch_tokens: list[int] = []  # positions the model ran, padding included
        self.adapter: dict[str, Any] = {}  # the adapter at the start (_prepare)

    def record(self, loss: float, tokens: int, loss_tokens: int, batch_tokens: int) -> None:
        self.losses.append(loss)
        self.tokens.append(tokens)
        self.loss_tokens.append(loss_tokens)
        self.batch_tokens.append(batch_tokens)

    def report(self, spec: dict, baseline_rss: int, setup_s: float) -> dict:
        return {**super().report(spec, baseline_rss, setup_s), "losses": self.losses, "tokens": self.tokens,
                "loss_tokens": self.loss_tokens, "batch_tokens": self.batch_tokens, **self.adapter}


def _prepare(spec: dict, model: Any, clock: _SFTClock) -> None:
    """Same adapter start on both sides; what the results say about it."""
    params = [p for p in model.parameters() if p.requires_grad]
    clock.adapter = {"lora_checksum": seed_lora(model, spec["seed"]),
                     "trainable_params": sum(p.numel() for p in params),
                     "trainable_dtypes": sorted({str(p.dtype) for p in params})}


def _threads(spec: dict) -> None:
    if spec["threads"]:
        import torch

        torch.set_num_threads(spec["threads"])


def _settings(spec: dict):
    from vpo_lightning.generation.models import ModelSettings

    return ModelSettings(**spec["model"])


def run_ours(spec: dict, partial: Path | None = None) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from vpo_lightning.sft.module import SFTModule, SFTOptimSettings
    from vpo_lightning.training.runtime import tune_malloc

    tune_malloc()  # as every `vpo` command does
    _threads(spec)
    clock = _SFTClock(partial)

    class Batches(L.LightningDataModule):  # the precomputed stream, with the two settings SFTModule.rows reads
        max_tokens_per_row, pack = spec["data"]["max_tokens_per_row"], spec["data"]["pack"]

        def train_dataloader(self) -> DataLoader:
            items = [{"records": b, "position": i} for i, b in enumerate(spec["batches"])]
            return DataLoader(items, batch_size=None, collate_fn=lambda b: b)

    class Timer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            clock.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.step_end()

    module = SFTModule(model=_settings(spec), optim=SFTOptimSettings(**spec["optim"]))
    batch_loss = module.batch_loss

    def recorded(examples: list[dict], backward: bool = False) -> tuple[float, int]:
        loss, loss_tokens = batch_loss(examples, backward)
        if backward:  # the training pass
            tokens = sum(len(e["prompt_ids"]) + len(e["completion_ids"]) for e in examples)
            clock.record(loss, tokens, loss_tokens, tokens)
        return loss, loss_tokens

    module.batch_loss = recorded  # type: ignore[method-assign]
    L.seed_everything(spec["seed"], verbose=False)
    t0 = time.perf_counter()
    module.configure_model()
    _prepare(spec, module.policy, clock)
    setup_s = time.perf_counter() - t0
    baseline = vs_trl._rss_bytes()
    clock.context = (spec, baseline, setup_s)
    # max_steps sets the schedule's length (the config's); the loader's one epoch of --steps batches ends the run
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=spec["schedule_steps"], max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()])
    trainer.fit(module, datamodule=Batches())
    return clock.report(spec, baseline, setup_s)


def _trl_trainer(spec: dict, clock: _SFTClock) -> Any:
    """TRL's SFTTrainer over the job, with our schedule and a hook that records each step's loss and tokens."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from vpo_lightning.generation.models import load_base_model, load_tokenizer

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.step_end()

    class Trainer(SFTTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lr_lambda(spec))
                self._created_lr_scheduler = True
            return self.lr_scheduler

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                ids, labels = inputs["input_ids"], inputs["labels"]
                real = int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else ids.numel()
                clock.record(float(loss.detach()), real, int((labels[:, 1:] != -100).sum()), ids.numel())
            return loss

    settings = _settings(spec)
    torch.manual_seed(spec["seed"])
    model = load_base_model(settings)  # the same loader and dtype as ours
    lora = settings.lora
    peft = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
                      task_type="CAUSAL_LM")
    config = SFTConfig(output_dir=tempfile.mkdtemp(prefix="vs-trl-sft-"), use_cpu=True, bf16=False, fp16=False,
                       **trl_config_args(spec), logging_steps=1, save_strategy="no", report_to=[],
                       dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=config, train_dataset=Dataset.from_list(trl_rows(spec["batches"])),
                      processing_class=load_tokenizer(settings.name), peft_config=peft, callbacks=[Timer()])
    _prepare(spec, trainer.model, clock)
    return trainer


def run_trl(spec: dict, partial: Path | None = None) -> dict:
    _threads(spec)
    clock = _SFTClock(partial)
    t0 = time.perf_counter()
    trainer = _trl_trainer(spec, clock)
    setup_s = time.perf_counter() - t0
    baseline = vs_trl._rss_bytes()
    clock.context = (spec, baseline, setup_s)
    trainer.train()
    return clock.report(spec, baseline, setup_s)


def check_trl(spec: dict) -> dict:
    """What TRL's trainer would train on, without training (tests/test_vs_trl_sft.py): the loss tokens of its
    first batch in order, its learning rate at every step of the schedule, and the adapter's start."""
    clock = _SFTClock()
    trainer = _trl_trainer(spec, clock)
    labels = next(iter(trainer.get_train_dataloader()))["labels"][:, 1:]  # the token each position predicts
    trainer.create_optimizer_and_scheduler(num_training_steps=spec["steps"])
    lrs = []
    for _ in range(spec["schedule_steps"]):
        lrs.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()  # no gradients: a no-op that keeps the scheduler's order warning away
        trainer.lr_scheduler.step()
    return {"targets": labels[labels != -100].tolist(), "lrs": lrs, **clock.adapter}


# ----------------------------------------------------------------------------------------------- the parent
def summarise(runs: list[dict], warmup: int = 1) -> dict:
    """Medians over the measured steps (after ``warmup``) of all runs of one side."""
    steps, tps, ltps = [], [], []
    for r in runs:
        for s, n, k in list(zip(r["step_s"], r.get("tokens", []), r.get("loss_tokens", [])))[warmup:]:
            steps.append(s)
            tps.append(n / s)
            ltps.append(k / s)
    med = vs_trl._median
    return {
        "median_step_s": med(steps), "first_step_s": med([r["step_s"][0] for r in runs if r["step_s"]]),
        "trained_tokens_per_s": med(tps), "loss_tokens_per_s": med(ltps),
        "peak_rss_gb": max(r["peak_rss_bytes"] for r in runs) / 2**30,
        "rss_after_setup_gb": max(r["rss_after_setup_bytes"] for r in runs) / 2**30,
        "loss_step1": med([r["losses"][0] for r in runs if r.get("losses")]),
        "loss_after_n": med([r["losses"][-1] for r in runs if r.get("losses")]),  # a cut-off run: its last step
        "steps_measured": len(steps), "timed_out_runs": sum(bool(r.get("timed_out")) for r in runs),
        "torch_threads": [r.get("torch_threads") for r in runs],
    }


def _kind_detail(cpu: dict) -> str:
    """amx, avx512_bf16, avx512, avx2 or other: ``roofline.cpu_kind`` with AVX-512's native bf16 told apart."""
    from roofline import cpu_kind

    kind = cpu_kind(cpu)
    return "avx512_bf16" if kind == "avx512" and "avx512_bf16" in cpu["flags"] else kind


def _commit() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    code = ["vpo_lightning", "benchmarks/vs_trl_sft.py", "benchmarks/vs_trl.py"]
    return {"commit": git("rev-parse", "HEAD"), "code_dirty": bool(git("status", "--porcelain", "--", *code))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a `vpo sft` config: the job")
    p.add_argument("--model", help="model.model.name (default: the config's); tiny-llama for a smoke run")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], help="model.model.dtype (default: the config's)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is a warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    p.add_argument("--trl-mode", choices=TRL_MODES, default="padding_free", help="TRL's batching (see the docstring)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads on both sides (0 = torch's default)")
    p.add_argument("--only", choices=["ours", "trl"], help="run one side only (no ratios)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment, both sides")
    p.add_argument("--load", default="none", metavar="none|busy:N[@CORES]", help="background load (cpuload.py)")
    p.add_argument("--timeout", type=float, default=0, help="seconds per worker run (0 = none)")
    p.add_argument("--out", type=Path, help="results JSON (default benchmarks/results_vs_trl_sft_<cpu>_<dtype>.json)")
    p.add_argument("--worker", choices=["ours", "trl", "trl-check"], help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:  # a child process: run one side, write its raw numbers
        spec = json.loads(args.spec.read_text())
        run = {"ours": run_ours, "trl": run_trl}.get(args.worker)
        result = run(spec, args.result) if run else check_trl(spec)
        args.result.write_text(json.dumps(result))
        return 0

    sides = [args.only] if args.only else ["ours", "trl"]
    if "trl" in sides and not vs_trl.TRL_PYTHON.exists():
        raise SystemExit(f"{vs_trl.TRL_PYTHON} is missing: run `bash benchmarks/setup_trl.sh` first")
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is a warm-up)")
    from cpuload import BusyLoad, results_label
    from roofline import cpu_description, cpu_kind, native_bf16

    load_run = BusyLoad.from_spec(args.load)  # a bad --load fails here, before anything runs
    spec = make_spec(args.config, args.model, args.dtype, args.steps, args.trl_mode, args.threads)
    cpu = cpu_description()
    label = results_label(cpu, spec["dtype"], args.load)
    out_path = args.out or ROOT / "benchmarks" / f"results_vs_trl_sft_{label}.json"
    env_extra = dict(kv.split("=", 1) for kv in args.env)
    with load_run:
        runs, load = vs_trl.alternate_rounds(spec, sides, args.rounds, env_extra, args.timeout, Path(__file__),
                                             "[vs_trl_sft]", _print_run)
    summary = {s: summarise(runs[s]) for s in sides}
    ratios, checks = {}, {}
    if len(sides) == 2:
        for key in ("median_step_s", "first_step_s", "trained_tokens_per_s", "loss_tokens_per_s", "peak_rss_gb",
                    "loss_step1", "loss_after_n"):
            if summary["ours"][key] is not None and summary["trl"][key]:
                ratios[key] = summary["ours"][key] / summary["trl"][key]
        first = {s: runs[s][0] for s in sides}
        checks = {"same_loss_tokens": first["ours"].get("loss_tokens") == first["trl"].get("loss_tokens"),
                  "same_tokens": first["ours"].get("tokens") == first["trl"].get("tokens"),
                  "same_lora_start": math.isclose(first["ours"].get("lora_checksum", 0.0),
                                                  first["trl"].get("lora_checksum", -1.0), rel_tol=1e-9)}
    settings = {k: v for k, v in spec.items() if k != "batches"}
    settings.update(config=str(args.config), rounds=args.rounds, env=env_extra, timeout_s=args.timeout,
                    demo_ids=[[e["id"] for e in b] for b in spec["batches"]],
                    tokens_per_step=[sum(len(e["prompt_ids"]) + len(e["completion_ids"]) for e in b)
                                     for b in spec["batches"]])
    result = {
        "label": label, "settings": settings, "summary": summary, "ratios_ours_over_trl": ratios, "checks": checks,
        "trl_mode": args.trl_mode, "load": load_run.record(), **_commit(),
        "machine": {"cpus": os.cpu_count(), "cpu": cpu, "cpu_kind": cpu_kind(cpu), "native_bf16": native_bf16(cpu),
                    "cpu_kind_detail": _kind_detail(cpu),
                    "platform": platform.platform(), "loadavg_1m_at_each_launch": load},
        "versions": {s: runs[s][0]["versions"] for s in sides}, "runs": runs,
    }
    out_path.write_text(json.dumps(result, indent=1))
    vs_trl.print_table(summary, ratios, sides, SFT_ROWS)
    print(f"{label} ({cpu['model']}, flags {' '.join(cpu['flags'])}), TRL mode {args.trl_mode}, checks {checks}; "
          f"load average (1 min) at launches: {', '.join(f'{x:.1f}' for x in load)}; written {out_path}")
    return 0


def _print_run(side: str, r: dict) -> None:
    print(f"[vs_trl_sft]   {side}: steps {[round(s, 2) for s in r['step_s']]} s, losses "
          f"{[round(x, 4) for x in r.get('losses', [])]}, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
          f"threads {r.get('torch_threads')}", file=sys.stderr, flush=True)


SFT_ROWS = [("median step time (s)", "median_step_s", "{:.2f}"), ("first step (warm-up) (s)", "first_step_s", "{:.2f}"),
            ("trained tokens/s", "trained_tokens_per_s", "{:.1f}"), ("loss tokens/s", "loss_tokens_per_s", "{:.1f}"),
            ("peak RSS (GiB)", "peak_rss_gb", "{:.2f}"), ("RSS after model load (GiB)", "rss_after_setup_gb", "{:.2f}"),
            ("training loss, step 1", "loss_step1", "{:.4f}"), ("training loss, last step", "loss_after_n", "{:.4f}")]

if __name__ == "__main__":
    sys.exit(main())
