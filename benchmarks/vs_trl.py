"""vpo-lightning (estimator grpo, m = 1) against TRL's ``GRPOTrainer`` on the same CPU job, step for step.

Both sides get the same model (the embedded SmolLM2-135M-Instruct, loaded by the same ``load_base_model`` at the same
dtype), the same prompts in the same order (tool-use prompts from ``data/tooluse/train.jsonl`` of at most
``--max-prompt-tokens`` tokens, rendered with the chat template), G chains per prompt, ``--max-new-tokens``, LoRA r=16
alpha=32 on all linear layers, beta, lr, clip 0.2, one optimizer step per rollout batch (TRL:
``per_device_train_batch_size = generation_batch_size = B * G``, gradient accumulation 1, ``num_iterations`` 1) and
the same reward (our four tool-use rewards averaged to a scalar; TRL gets them wrapped as one reward function).

Each side runs ``--steps`` optimizer steps in its own subprocess (ours in ``.venv``, TRL in ``benchmarks/.venv-trl``,
built by ``benchmarks/setup_trl.sh``); runs alternate (ours, TRL, TRL, ours, ...) so a busy machine slows both
alike. The first step of each run is a warm-up and is excluded. Per side it reports the median step wall time, rollout
tokens/s (generated tokens / time inside ``generate``), trained tokens/s (completion tokens / the rest of the step:
rewards, reference and policy passes, optimizer), and the peak RSS of the subprocess (``os.wait4``'s ``ru_maxrss``),
with the ratio ours / TRL. Results go to ``benchmarks/results_vs_trl.json``.

    bash benchmarks/setup_trl.sh                      # once (~4 min): TRL 1.16 in benchmarks/.venv-trl
    .venv/bin/python benchmarks/vs_trl.py             # 2 rounds x 5 steps per side (~20-40 min on 2 CPU cores)
    .venv/bin/python benchmarks/vs_trl.py --rounds 1 --steps 3 --only ours     # quick look at one side

Under a controlled load (``--load busy:1``: one process spinning on one core for the whole run, started and stopped
by the script, its pid and core in the results; ``benchmarks/cpuload.py``) both sides run under the same load; ours
sizes its intra-op threads with ``--threads`` (default ``auto``: the cores other processes leave free), TRL keeps
torch's default (one thread per core), as each would run for a user. ``--timeout`` bounds each worker: a run that
is cut off reports the steps it finished and, as a lower bound, the time its unfinished step had taken.

    .venv/bin/python benchmarks/vs_trl.py --rounds 1 --steps 3 --prompts 6 --dtype bf16 --load busy:1 --timeout 600

Step times depend on how long the sampled completions are (a batched ``generate`` runs until its longest chain
stops), so the table also lists the mean completion length of each side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
# the two sides' interpreters; the environment can point elsewhere (e.g. a worktree without its own .venv)
OURS_PYTHON = Path(os.environ.get("VPO_BENCH_PYTHON", ROOT / ".venv" / "bin" / "python"))
TRL_PYTHON = Path(os.environ.get("VPO_TRL_PYTHON", ROOT / "benchmarks" / ".venv-trl" / "bin" / "python"))
REWARDS = ["format", "tool_name", "arg_key", "arg_value"]


# ----------------------------------------------------------------------------------------------- shared helpers
def _rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def select_prompts(data: Path, count: int, max_tokens: int, model: str) -> list[dict]:
    """The first ``count`` records of ``data`` whose chat-templated prompt has at most ``max_tokens`` tokens."""
    from vpo_lightning.generation.models import load_tokenizer, prompt_token_ids

    tok = load_tokenizer(model)
    out = []
    with data.open(encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            if len(prompt_token_ids(tok, record["messages"])) <= max_tokens:
                out.append(record)
                if len(out) == count:
                    break
    if len(out) < count:
        raise SystemExit(f"only {len(out)} prompts of <= {max_tokens} tokens in {data}; lower --prompts")
    return out


def tooluse_policy(model: str, dtype: str, count: int, max_tokens: int) -> tuple[object, list[list[int]]]:
    """The rollout benchmarks' set-up: malloc tuned as ``vpo fit`` tunes it, the policy as ``vpo fit`` builds it
    (``VPOModule``, LoRA r=16 on all linear layers) and the token ids of the first ``count`` tool-use prompts of at
    most ``max_tokens`` tokens (:func:`select_prompts`) under the chat template."""
    from vpo_lightning.generation.models import LoraSettings, ModelSettings, prompt_token_ids
    from vpo_lightning.training.module import VPOModule
    from vpo_lightning.training.runtime import tune_malloc

    tune_malloc()  # as `vpo fit` does: freed cache-sized buffers stay in the heap
    records = select_prompts(ROOT / "data" / "tooluse" / "train.jsonl", count, max_tokens, model)
    module = VPOModule(model=ModelSettings(name=model, dtype=dtype,
                                           lora=LoraSettings(r=16, alpha=32, target_modules="all-linear")))
    module.configure_model()
    return module, [prompt_token_ids(module.tokenizer, r["messages"]) for r in records]


def mean_reward_fn(names: list[str]):
    """Our tool-use rewards averaged to one scalar per completion, as a TRL reward function."""
    from vpo_lightning.rewards import RewardVector

    vector = RewardVector(names)

    def tooluse_mean(prompts: list, completions: list[str], record: list[str], **_: Any) -> list[float]:
        candidates = [[c if c.strip() else None] for c in completions]
        scores = vector.score(candidates, [json.loads(r) for r in record])
        return scores.rewards[:, 0, :].mean(-1).tolist()  # [N]

    return tooluse_mean


class _Clock:
    """Step boundaries and generate() time / tokens, filled in by the side-specific hooks."""

    def __init__(self, partial: Path | None = None) -> None:
        self.partial = partial  # rewritten after every step, so that a worker cut off by --timeout leaves its steps
        self.context: tuple[dict, int, float] | None = None  # (spec, baseline RSS, setup s) once set up
        self.start = 0.0
        self.ends: list[float] = []
        self.gen_time: list[float] = []
        self.gen_tokens: list[int] = []
        self.gen_longest: list[int] = []  # the longest completion of each call: the decode steps it had to run
        self.prompt_tokens: list[int] = []

    def timed_generate(self, fn, lengths):
        """Wrap ``fn`` (a generate call) to record its time, its generated tokens and its longest completion;
        ``lengths(out)`` gives the completion lengths of its output."""
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.gen_time.append(time.perf_counter() - t0)
            n = lengths(out)
            self.gen_tokens.append(sum(n))
            self.gen_longest.append(max(n, default=0))
            return out

        return wrapper

    def begin(self) -> None:
        self.start = time.perf_counter()
        self._flush()

    def step_end(self) -> None:
        self.ends.append(time.perf_counter())
        self._flush()

    def _flush(self) -> None:
        if self.partial is not None and self.context is not None:
            report = {**self.report(*self.context), "complete": False, "last_step_end_unix": time.time()}
            self.partial.write_text(json.dumps(report))

    def report(self, spec: dict, baseline_rss: int, setup_s: float) -> dict:
        import torch

        bounds = [self.start, *self.ends]
        steps = [b - a for a, b in zip(bounds, bounds[1:])]
        n = len(steps)  # a partial report: only the finished steps' generate calls
        return {
            "step_s": steps, "gen_s": self.gen_time[:n], "gen_tokens": self.gen_tokens[:n],
            "gen_longest": self.gen_longest[:n], "prompt_tokens": self.prompt_tokens[:n], "setup_s": setup_s,
            "rss_after_setup_bytes": baseline_rss, "torch_threads": torch.get_num_threads(),
            "threads_decisions": _thread_decisions(), "versions": _versions(), "dtype": spec["dtype"],
            "train_start_unix": time.time() - (time.perf_counter() - self.start),
        }


def _thread_decisions() -> list:
    """Ours: what the engine's thread policy measured and chose before each rollout (empty for TRL)."""
    threads = sys.modules.get("vpo_lightning.generation.threads")
    policies = getattr(threads, "_POLICIES", {}) if threads else {}
    return [h for p in policies.values() for h in p.history]


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "peft", "accelerate", "lightning", "trl"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


def ours_optim_args(spec: dict) -> dict:
    """Our OptimSettings for TRL's job: one update per rollout (our default since issue 37 is the reference's two
    mini-batch updates, which adds an old-log-prob pass and a second update), no weight decay, TRL's clipping."""
    return {"lr": spec["lr"], "micro_batch_size": spec["micro_batch_size"], "max_grad_norm": 1.0,
            "logprob_chunk_size": spec["logprob_chunk_size"], "mini_batches": 1, "num_iterations": 1,
            "weight_decay": 0.0}


def trl_config_args(spec: dict) -> dict:
    """GRPOConfig's arguments that define the job (one optimizer update per B * G generations)."""
    B, G = spec["prompts_per_step"], spec["group_size"]
    return {"per_device_train_batch_size": B * G, "gradient_accumulation_steps": 1, "generation_batch_size": B * G,
            "num_generations": G, "num_iterations": 1, "learning_rate": spec["lr"], "weight_decay": 0.0,
            "max_grad_norm": 1.0, "beta": spec["beta"], "max_completion_length": spec["max_new_tokens"]}


def _model_settings(spec: dict):
    from vpo_lightning.generation.models import LoraSettings, ModelSettings

    return ModelSettings(name=spec["model"], dtype=spec["dtype"], gradient_checkpointing=spec["gradient_checkpointing"],
                         lora=LoraSettings(r=16, alpha=32, target_modules="all-linear"))


# ----------------------------------------------------------------------------------------------- ours
def run_ours(spec: dict, partial: Path | None = None) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from vpo_lightning.generation.engines import SamplingSettings, TransformersEngine
    from vpo_lightning.training.module import LossSettings, OptimSettings, VPOModule
    from vpo_lightning.training.rollout import RolloutCallback
    from vpo_lightning.training.runtime import tune_malloc

    tune_malloc()  # as `vpo fit` does (a no-op when --env sets MALLOC_* for both sides)
    clock = _Clock(partial)
    records = spec["records"]
    B, G = spec["prompts_per_step"], spec["group_size"]
    batches = [{"records": records[i : i + B], "indices": list(range(i, i + B)), "position": i // B}
               for i in range(0, B * spec["steps"], B)]

    class Timer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            clock.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.prompt_tokens.append(int(batch["rollout"].attention_mask[:, : batch["rollout"].prompt_length].sum()))
            clock.step_end()

    engine = TransformersEngine(threads=spec.get("threads", "auto"))
    engine.generate = clock.timed_generate(engine.generate, lambda gen: [len(c) for c in gen.completion_ids])
    rollout = RolloutCallback(rewards=REWARDS, estimator="grpo", num_candidates=1, group_size=G, seed=spec["seed"],
                              sampling=SamplingSettings(max_new_tokens=spec["max_new_tokens"]), engine=engine,
                              log_samples_every=0)
    module = VPOModule(
        model=_model_settings(spec), loss=LossSettings(beta=spec["beta"]),
        optim=OptimSettings(**ours_optim_args(spec)),  # TRL's job (ours_optim_args)
    )
    L.seed_everything(spec["seed"], verbose=False)
    t0 = time.perf_counter()
    module.configure_model()
    setup_s = time.perf_counter() - t0
    baseline = _rss_bytes()
    clock.context = (spec, baseline, setup_s)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=spec["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer(), rollout])
    loader = DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
    trainer.fit(module, train_dataloaders=loader)
    return clock.report(spec, baseline, setup_s)


# ----------------------------------------------------------------------------------------------- TRL
def run_trl(spec: dict, partial: Path | None = None) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from vpo_lightning.generation.models import load_base_model, load_tokenizer

    clock = _Clock(partial)
    B = spec["prompts_per_step"]
    tok = load_tokenizer(spec["model"])
    rows = [{"prompt": tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False),
             "record": json.dumps(r)} for r in spec["records"][: B * spec["steps"]]]

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.step_end()

    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    model = load_base_model(_model_settings(spec))  # the same loader and dtype as ours
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs-trl-"), use_cpu=True, bf16=False, fp16=False,  # precision = the model's
        **trl_config_args(spec), temperature=1.0, top_p=1.0, top_k=0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", lr_scheduler_type="constant", warmup_steps=0, max_steps=spec["steps"],
        shuffle_dataset=False, seed=spec["seed"], logging_steps=1, save_strategy="no",
        report_to=[], disable_dropout=True, gradient_checkpointing=spec["gradient_checkpointing"],
        dataloader_num_workers=0, log_completions=False,
    )
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[mean_reward_fn(REWARDS)], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=peft,
                          callbacks=[Timer()])
    setup_s = time.perf_counter() - t0
    baseline = _rss_bytes()
    clock.context = (spec, baseline, setup_s)
    turn = trainer._generate_single_turn

    def generate(prompt_ids, *args, **kwargs):
        clock.prompt_tokens.append(sum(len(p) for p in prompt_ids))
        return turn(prompt_ids, *args, **kwargs)

    trainer._generate_single_turn = clock.timed_generate(generate, lambda out: [len(c) for c in out[0]])
    trainer.train()
    return clock.report(spec, baseline, setup_s)


# ----------------------------------------------------------------------------------------------- parent
def alternate_rounds(spec: dict, sides: list[str], rounds: int, env_extra: dict[str, str], timeout: float,
                     script: Path, tag: str,
                     record: Callable[[str, dict], None]) -> tuple[dict[str, list[dict]], list[float]]:
    """Each side's worker ``rounds`` times, in alternating order (ours, TRL; then TRL, ours; ...), one subprocess a
    run, from one spec file; ``record(side, run)`` sees each run as it ends. Returns the runs per side and the
    1-minute load average at each launch."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    spec_path = Path(fh.name)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    load = []
    try:
        for rnd in range(rounds):
            for side in sides if rnd % 2 == 0 else sides[::-1]:
                load.append(os.getloadavg()[0])
                print(f"{tag} round {rnd + 1}/{rounds}: {side} ...", file=sys.stderr, flush=True)
                runs[side].append(_launch(side, spec_path, env_extra, timeout, script))
                record(side, runs[side][-1])
    finally:
        spec_path.unlink()
    return runs, load


def _launch(side: str, spec_path: Path, env_extra: dict[str, str], timeout: float = 0,
            script: Path | None = None) -> dict:
    """Run one side's worker (``script --worker SIDE``: this file unless given, e.g. ``vs_trl_sft.py``); with
    ``timeout`` (s) > 0 a worker still running then is killed and its steps so far (rewritten after every step) are
    returned with ``timed_out`` and the unfinished step's time so far."""
    python = OURS_PYTHON if side == "ours" else TRL_PYTHON
    fd, out = tempfile.mkstemp(suffix=".json", prefix=f"vs-trl-{side}-")
    os.close(fd)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **env_extra}
    cmd = [str(python), str((script or Path(__file__)).resolve()), "--worker", side, "--spec", str(spec_path),
           "--result", out]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    deadline, timed_out = (time.monotonic() + timeout) if timeout else None, False
    while True:  # os.wait4 (not Popen.wait) so that the child's rusage, hence its peak RSS, is ours to read
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if deadline is not None and time.monotonic() > deadline:
            timed_out = True
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    text = Path(out).read_text()
    os.unlink(out)
    if timed_out:
        result = json.loads(text) if text else {"step_s": [], "gen_s": [], "gen_tokens": [], "versions": {},
                                                "rss_after_setup_bytes": 0}
        started = result.get("last_step_end_unix") or result.get("train_start_unix")
        result["unfinished_step_s_at_least"] = time.time() - started if started else None
        print(f"[vs_trl]   {side}: cut off after {timeout:.0f} s with {len(result['step_s'])} step(s) done",
              file=sys.stderr, flush=True)
    elif proc.returncode != 0:
        raise SystemExit(f"{side} worker failed (exit {proc.returncode}); command: {' '.join(cmd)}")
    else:
        result = json.loads(text)
    result["timed_out"] = timed_out
    result["peak_rss_bytes"] = usage.ru_maxrss * 1024  # KiB on Linux; this child (and its waited-for children)
    result["wall_s"] = time.perf_counter() - t0
    return result


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(runs: list[dict], warmup: int) -> dict:
    """Medians over the measured steps (after ``warmup``) of all runs. A run cut off by ``--timeout`` adds its
    unfinished step's time so far as one more step when that step is a measured one: the median is then a lower
    bound (``median_step_is_lower_bound``), and so is ``first_step_s`` when the cut fell in the first step."""
    steps, gen_s, gen_tok, train_tps, lengths, first, lower = [], [], [], [], [], [], False
    for r in runs:
        for i, (s, g, n) in enumerate(zip(r["step_s"], r["gen_s"], r["gen_tokens"])):
            if i == 0:
                first.append(s)
            if i < warmup:
                continue
            steps.append(s)
            gen_s.append(g)
            gen_tok.append(n)
            train_tps.append(n / max(s - g, 1e-9))
            lengths.append(n)
        unfinished = r.get("unfinished_step_s_at_least") if r.get("timed_out") else None
        if unfinished is not None:
            lower = True
            (steps if len(r["step_s"]) >= warmup else first).append(unfinished)
    per_step_chains = runs[0]["chains_per_step"]
    return {
        "median_step_s": _median(steps),
        "median_step_is_lower_bound": lower and bool(steps),
        "first_step_s": _median(first),  # the warm-up step: compare loaded with quiet when nothing else finished
        "rollout_tokens_per_s": _median([n / g for n, g in zip(gen_tok, gen_s)]),
        "trained_tokens_per_s": _median(train_tps),
        "median_generate_s": _median(gen_s),
        "mean_completion_tokens": statistics.mean(lengths) / per_step_chains if lengths else None,
        "peak_rss_gb": max(r["peak_rss_bytes"] for r in runs) / 2**30,
        "rss_after_setup_gb": max(r["rss_after_setup_bytes"] for r in runs) / 2**30,
        "steps_measured": len(gen_s),
        "timed_out_runs": sum(bool(r.get("timed_out")) for r in runs),
        "torch_threads_at_end": [r.get("torch_threads") for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is a warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    p.add_argument("--prompts", type=int, default=16, help="prompts selected from the data file")
    p.add_argument("--prompts-per-step", type=int, default=2, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="both sides")
    p.add_argument("--gradient-checkpointing", action="store_true", help="both sides (default off on both)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="ours: chains per forward/backward")
    p.add_argument("--logprob-chunk-size", type=int, default=1024, help="ours")
    p.add_argument("--beta", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", type=Path, default=ROOT / "data" / "tooluse" / "train.jsonl")
    p.add_argument("--only", choices=["ours", "trl"], help="run one side only (no ratios)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for both workers (e.g. MALLOC_ARENA_MAX=2); repeatable")
    p.add_argument("--load", default="none", metavar="none|busy:N[@CORES]",
                   help="background load for the whole run (benchmarks/cpuload.py): busy:1 = one core kept busy")
    p.add_argument("--threads", default="auto", help="ours: TransformersEngine(threads=...): auto or a count")
    p.add_argument("--timeout", type=float, default=0, help="seconds per worker run (0 = none); see the docstring")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results_vs_trl.json")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:  # a child process: run one side, write its raw timings
        spec = json.loads(args.spec.read_text())
        result = run_ours(spec, args.result) if args.worker == "ours" else run_trl(spec, args.result)
        result["chains_per_step"] = spec["prompts_per_step"] * spec["group_size"]
        args.result.write_text(json.dumps(result))
        return 0

    sides = [args.only] if args.only else ["ours", "trl"]
    if "trl" in sides and not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `bash benchmarks/setup_trl.sh` first")
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is a warm-up)")
    if args.prompts < args.prompts_per_step * args.steps:
        raise SystemExit("--prompts must be >= --prompts-per-step * --steps (every step sees fresh prompts)")
    from cpuload import BusyLoad, results_label
    from roofline import cpu_description, cpu_kind

    from vpo_lightning.generation.models import resolve_dtype

    load_run = BusyLoad.from_spec(args.load)  # a bad --load fails here, before anything runs
    records = select_prompts(args.data, args.prompts, args.max_prompt_tokens, args.model)
    spec = {
        "records": records, "model": args.model, "steps": args.steps, "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size, "max_new_tokens": args.max_new_tokens, "beta": args.beta, "lr": args.lr,
        "seed": args.seed, "micro_batch_size": args.micro_batch_size, "logprob_chunk_size": args.logprob_chunk_size,
        "gradient_checkpointing": args.gradient_checkpointing, "threads": args.threads,
        "dtype": {"fp32": "fp32", "bf16": "bf16"}.get(args.dtype, str(resolve_dtype("auto")).split(".")[-1]
                                                      .replace("float32", "fp32").replace("bfloat16", "bf16")),
    }
    env_extra = dict(kv.split("=", 1) for kv in args.env)

    def record(side: str, run: dict) -> None:
        run["chains_per_step"] = spec["prompts_per_step"] * spec["group_size"]
        _print_run(side, run)

    with load_run:
        runs, load = alternate_rounds(spec, sides, args.rounds, env_extra, args.timeout, Path(__file__),
                                      f"[vs_trl] (load {args.load})", record)
    summary = {s: summarise(runs[s], warmup=1) for s in sides}
    ratios = {}
    if len(sides) == 2:
        for key in ("median_step_s", "first_step_s", "rollout_tokens_per_s", "trained_tokens_per_s", "peak_rss_gb"):
            if summary["ours"][key] is not None and summary["trl"][key]:
                ratios[key] = summary["ours"][key] / summary["trl"][key]
        # a lower bound on TRL's step makes ours/TRL an upper bound (and the reverse)
        ratios["median_step_s_bound"] = ("upper" if summary["trl"]["median_step_is_lower_bound"] else
                                         "lower" if summary["ours"]["median_step_is_lower_bound"] else "exact")
    settings = {k: v for k, v in spec.items() if k != "records"}
    settings.update(prompts=args.prompts, rounds=args.rounds, env=env_extra, timeout_s=args.timeout,
                    data=str(args.data.relative_to(ROOT)) if args.data.is_relative_to(ROOT) else str(args.data))
    cpu = cpu_description()
    out = {
        "label": results_label(cpu, spec["dtype"], args.load), "settings": settings, "summary": summary,
        "ratios_ours_over_trl": ratios, "load": load_run.record(),
        "machine": {"cpus": os.cpu_count(), "cpu": cpu, "cpu_kind": cpu_kind(cpu), "platform": platform.platform(),
                    "loadavg_1m_at_each_launch": load},
        "versions": {s: runs[s][0]["versions"] for s in sides}, "runs": runs,
    }
    args.out.write_text(json.dumps(out, indent=1))
    _print_table(summary, ratios, sides)
    print(f"{out['label']}: load {args.load}; load average (1 min) at launches: {', '.join(f'{x:.1f}' for x in load)};"
          f" written {args.out}")
    return 0


def _print_run(side: str, r: dict) -> None:
    print(f"[vs_trl]   {side}: steps {[round(s, 1) for s in r['step_s']]} s, generate "
          f"{[round(s, 1) for s in r['gen_s']]} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
          f"threads {r.get('torch_threads')}", file=sys.stderr, flush=True)


STEP_ROWS = [("median step time (s)", "median_step_s", "{:.2f}"),
             ("first step (warm-up) (s)", "first_step_s", "{:.2f}"),
             ("rollout tokens/s", "rollout_tokens_per_s", "{:.1f}"),
             ("trained tokens/s", "trained_tokens_per_s", "{:.1f}"),
             ("peak RSS (GiB)", "peak_rss_gb", "{:.2f}"),
             ("RSS after model load (GiB)", "rss_after_setup_gb", "{:.2f}"),
             ("median generate (s)", "median_generate_s", "{:.2f}"),
             ("mean completion tokens", "mean_completion_tokens", "{:.1f}")]


def print_table(summary: dict, ratios: dict, sides: list[str], rows: list[tuple[str, str, str]]) -> None:
    """One markdown table: a row per (label, summary key, format), a column per side, then ours/TRL where measured.

    Shared by this script and vs_trl_sft.py; a missing value or ratio prints as ``-``.
    """
    print(f"| {'metric':<28} | " + " | ".join(f"{s:>10}" for s in sides) + (" | ours/TRL |" if ratios else " |"))
    print("|" + "---|" * (len(sides) + 1 + bool(ratios)))
    for label, key, fmt in rows:
        cells = " | ".join(f"{'-' if summary[s][key] is None else fmt.format(summary[s][key]):>10}" for s in sides)
        ratio = f" | {ratios[key]:8.2f} |" if key in ratios else (" |        - |" if ratios else " |")
        print(f"| {label:<28} | {cells}{ratio}")


def _print_table(summary: dict, ratios: dict, sides: list[str]) -> None:
    print_table(summary, ratios, sides, STEP_ROWS)
    bounded = [s for s in sides if summary[s]["timed_out_runs"]]
    if bounded:
        print(f"cut off by --timeout: {', '.join(bounded)} (their step times above are lower bounds; "
              f"ours/TRL median step: {ratios.get('median_step_s_bound', '-')} bound)")

if __name__ == "__main__":
    sys.exit(main())
