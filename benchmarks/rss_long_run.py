"""Resident memory over a long RL run (issue 56 item 4): RSS and what holds it, recorded after every step.

Ours runs the real ``vpo fit`` path (``configs/tooluse.yaml``: datamodule, rollout callback, TensorBoard logger,
sample tables, checkpoints) in a subprocess, with one extra callback that records, after each optimizer step:

* ``rss``: the resident set size (``/proc/self/statm``), and ``step_peak_rss``: the step's peak (``VmHWM`` of
  ``/proc/self/status``, reset at the step's start by writing 5 to ``/proc/self/clear_refs``);
* glibc's own accounting (``mallinfo2``): ``heap_in_use`` (bytes malloc handed out and not yet freed, the
  program's live memory) and ``heap_free`` (bytes malloc keeps free inside its heaps). RSS growing while
  ``heap_in_use`` stays flat is the allocator keeping freed memory, not a leak;
* ``gc_objects`` and ``tensors``: Python objects the garbage collector tracks and how many of them are tensors (a
  leak of samples, logged tables or autograd graphs shows here); with ``--tracemalloc``, the top growths of
  Python-side allocations since the first step (slower: every allocation is traced).

TRL's ``GRPOTrainer`` runs the same tool-use job through ``benchmarks/vs_trl.py``'s ``run_trl`` (same model, same
prompts, B, G, new tokens, LoRA) with the same recorder as a ``TrainerCallback``; it needs
``benchmarks/.venv-trl`` (``bash benchmarks/setup_trl.sh``), and is skipped with a note when that is missing.

    .venv/bin/python benchmarks/rss_long_run.py --steps 200 --label after          # ours, tiny model, 200 steps
    .venv/bin/python benchmarks/rss_long_run.py --steps 60 --label arena2 --env MALLOC_ARENA_MAX=2
    .venv/bin/python benchmarks/rss_long_run.py --steps 200 --label before -- --rollout.trim_memory false
    .venv/bin/python benchmarks/rss_long_run.py --side trl --steps 200             # TRL's GRPOTrainer

Arguments after ``--`` go to ``vpo fit`` unchanged. Results: ``benchmarks/results_rss_long_run_<label>.json`` (the
per-step records and a summary: RSS at the first step, at step 20, at the end, the peak, growth from step 20) and a
CSV of the per-step records beside it. Only memory is reported; step times are recorded but are not a claim on a
loaded machine.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# this checkout's package, not the one an editable install in a shared .venv points at (e.g. from a git worktree)
sys.path.insert(0, str(ROOT))
OURS_PYTHON = Path(os.environ.get("VPO_BENCH_PYTHON", ROOT / ".venv" / "bin" / "python"))
TRL_PYTHON = Path(os.environ.get("VPO_TRL_PYTHON", ROOT / "benchmarks" / ".venv-trl" / "bin" / "python"))
PAGE = os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------------------------- what is recorded
class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    """glibc's ``mallinfo2`` (2.33+), or None on other libcs."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).mallinfo2 if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.restype = _Mallinfo2
    return fn


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


def reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM); Linux >= 4.0."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Recorder:
    """One record per step, appended as a JSON line to ``path`` (a worker cut off keeps what it wrote)."""

    def __init__(self, path: Path, objects: bool = True, tracemalloc_top: int = 0) -> None:
        self.path, self.objects, self.top = path, objects, tracemalloc_top
        self.mallinfo = _mallinfo2()
        self.t0 = time.perf_counter()
        self.step = 0
        self.snapshot0 = None
        if tracemalloc_top:
            import tracemalloc

            tracemalloc.start()

    def step_start(self) -> None:
        reset_peak()

    def step_end(self) -> None:
        self.step += 1
        rec: dict[str, Any] = {"step": self.step, "t_s": round(time.perf_counter() - self.t0, 2),
                               "rss": rss_bytes(), "step_peak_rss": peak_bytes()}
        if self.mallinfo is not None:
            info = self.mallinfo()
            # arena: bytes the main heap (brk) and thread heaps span; hblkhd: mmapped blocks
            rec.update(heap_in_use=info.uordblks + info.hblkhd, heap_free=info.fordblks, heap_arena=info.arena,
                       heap_mmapped=info.hblkhd)
        if self.objects:
            import torch

            objs = gc.get_objects()
            rec["gc_objects"] = len(objs)
            rec["tensors"] = sum(1 for o in objs if isinstance(o, torch.Tensor))
            del objs
        if self.top:
            rec["tracemalloc_top"] = self._top_growth()
        with self.path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def _top_growth(self) -> list[str]:
        import tracemalloc

        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        if self.snapshot0 is None:
            self.snapshot0 = snap
            return []
        return [str(s) for s in snap.compare_to(self.snapshot0, "lineno")[: self.top]]


# ----------------------------------------------------------------------------------------------- the two sides
def run_ours(result: Path, vpo_args: list[str], objects: bool, tracemalloc_top: int) -> None:
    """``vpo fit`` as the console script runs it, with the recorder appended to the trainer's callbacks."""
    import lightning as L

    from vpo_lightning import launcher
    from vpo_lightning.training import cli

    recorder = Recorder(result, objects, tracemalloc_top)

    class RecordRSS(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            recorder.step_start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            recorder.step_end()

    instantiate = cli.VPOCLI.instantiate_trainer

    def with_recorder(self, **kwargs):
        trainer = instantiate(self, **kwargs)
        trainer.callbacks.append(RecordRSS())  # after the rollout callback: its step-end work is inside the record
        return trainer

    cli.VPOCLI.instantiate_trainer = with_recorder  # type: ignore[method-assign]
    launcher.main(["fit", *vpo_args])


def run_trl(result: Path, spec: dict, objects: bool, tracemalloc_top: int) -> None:
    """TRL's GRPOTrainer on vs_trl.py's job, the recorder as a TrainerCallback."""
    import transformers

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vs_trl

    recorder = Recorder(result, objects, tracemalloc_top)

    class RecordRSS(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            recorder.step_start()

        def on_step_end(self, args, state, control, **kwargs):
            recorder.step_end()

    original = transformers.Trainer.__init__

    def init(self, *args, callbacks=None, **kwargs):
        original(self, *args, callbacks=[*(callbacks or []), RecordRSS()], **kwargs)

    transformers.Trainer.__init__ = init  # type: ignore[method-assign]
    vs_trl.run_trl(spec)


def trl_spec(args: argparse.Namespace) -> dict:
    """vs_trl.py's job at this benchmark's sizes: the same prompts (<= --max-prompt-tokens), B, G, new tokens."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vs_trl

    records = vs_trl.select_prompts(ROOT / "data" / "tooluse" / "train.jsonl", args.prompts_per_step * args.steps,
                                    args.max_prompt_tokens, args.model)
    return {"records": records, "steps": args.steps, "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size, "max_new_tokens": args.max_new_tokens, "model": args.model,
            "dtype": args.dtype, "gradient_checkpointing": True, "micro_batch_size": 8, "logprob_chunk_size": 1024,
            "beta": 1e-3, "lr": 1e-4, "seed": 0, "chains_per_step": args.prompts_per_step * args.group_size}


def ours_args(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """``vpo fit`` on configs/tooluse.yaml at this benchmark's sizes; validation off, checkpoints as configured."""
    return ["--config", "configs/tooluse.yaml", "--model.model.name", args.model, "--model.model.dtype", args.dtype,
            "--trainer.accelerator", "cpu", "--trainer.max_steps", str(args.steps),
            "--trainer.val_check_interval", str(args.steps + 1), "--data.batch_size", str(args.prompts_per_step),
            "--data.max_prompt_tokens", str(args.max_prompt_tokens), "--rollout.group_size", str(args.group_size),
            "--rollout.sampling.max_new_tokens", str(args.max_new_tokens), "--run_name", f"rss-{args.label}",
            "--overwrite", *extra]


# ----------------------------------------------------------------------------------------------- parent
def summarise(records: list[dict], warmup: int = 20) -> dict:
    """RSS (GiB) at the first step, after ``warmup`` steps and at the end, the highest step peak, and the growth
    from ``warmup`` to the end; the same ends for glibc's in-use bytes and the object counts."""
    if not records:
        return {}
    gib = 2**30
    base = records[min(warmup, len(records)) - 1]
    last = records[-1]
    out: dict[str, Any] = {
        "steps": len(records), "rss_first_gb": records[0]["rss"] / gib, f"rss_step{base['step']}_gb": base["rss"] / gib,
        "rss_end_gb": last["rss"] / gib, "rss_max_gb": max(r["rss"] for r in records) / gib,
        "step_peak_max_gb": max(r["step_peak_rss"] for r in records) / gib,
        f"rss_growth_from_step{base['step']}": last["rss"] / base["rss"] - 1,
    }
    for key in ("heap_in_use", "heap_free", "gc_objects", "tensors"):
        if key in last:
            scale = gib if key.startswith("heap") else 1
            out[f"{key}_first"], out[f"{key}_step{base['step']}"], out[f"{key}_end"] = (
                records[0][key] / scale, base[key] / scale, last[key] / scale)
    return out


def launch(args: argparse.Namespace, extra: list[str]) -> dict:
    fd, tmp = tempfile.mkstemp(suffix=".jsonl", prefix="rss-long-run-")
    os.close(fd)
    python = OURS_PYTHON if args.side == "ours" else TRL_PYTHON
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.update(kv.split("=", 1) for kv in args.env)
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", "--result", tmp, *sys.argv[1:]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    text = Path(tmp).read_text()
    os.unlink(tmp)
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {"exit_code": proc.returncode, "wall_s": time.perf_counter() - t0, "records": records}


def write(out: Path, report: dict) -> None:
    out.write_text(json.dumps(report, indent=1) + "\n")
    rows = report["records"]
    if rows:
        keys = [k for k in rows[0] if k != "tracemalloc_top"]
        with out.with_suffix(".csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, keys, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", choices=["ours", "trl"], default="ours")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--label", default="ours", help="names the run folder and the results file")
    p.add_argument("--model", default="tiny-llama", help="tiny-llama (random, 2 layers) or smollm2-135m")
    p.add_argument("--dtype", default="bf16", choices=["auto", "fp32", "bf16"])
    p.add_argument("--prompts-per-step", type=int, default=2, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra worker environment")
    p.add_argument("--no-objects", action="store_true", help="skip the per-step gc object and tensor counts")
    p.add_argument("--tracemalloc", type=int, default=0, metavar="N", help="record the top N Python growths")
    p.add_argument("--out", type=Path, help="default: benchmarks/results_rss_long_run_<label>.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(own)
    if args.worker:
        if args.side == "ours":
            run_ours(args.result, ours_args(args, extra), not args.no_objects, args.tracemalloc)
        else:
            run_trl(args.result, trl_spec(args), not args.no_objects, args.tracemalloc)
        return 0
    if args.side == "trl" and not TRL_PYTHON.exists():
        print(f"rss_long_run: {TRL_PYTHON} missing: run `bash benchmarks/setup_trl.sh` first", file=sys.stderr)
        return 2
    result = launch(args, extra)
    report = {"label": args.label, "side": args.side, "command": " ".join(sys.argv), "env": args.env,
              "vpo_args": extra, "cpu": platform.processor() or platform.machine(), "cpu_model": _cpu_model(),
              "affinity": sorted(os.sched_getaffinity(0)), "summary": summarise(result["records"]), **result}
    out = args.out or ROOT / "benchmarks" / f"results_rss_long_run_{args.label}.json"
    write(out, report)
    print(json.dumps(report["summary"], indent=1))
    return result["exit_code"]


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as fh:
        return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")


if __name__ == "__main__":
    sys.exit(main())
