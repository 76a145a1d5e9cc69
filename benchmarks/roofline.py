"""This machine's bounds, and how close vpo-lightning's rollouts and training steps get to them (issue 25).

Two parts, one run:

1. **Bounds**, measured with torch on this machine at its thread count: memory read bandwidth (``x.sum()`` over a
   512 MiB fp32 tensor, best of ``--repeats``) and matmul throughput in fp32 and bf16 (``a @ b``, square n = 2048,
   best of ``--repeats``). On CPUs without native bf16 (AVX2 only) torch emulates bf16 matmul (single-threaded,
   minutes for one n = 2048 product), so there one n = 256 product is timed; that figure is reported, not used.
2. **This project's throughput**: the GRPO step of ``benchmarks/vs_trl.py`` (``--only ours``: tool-use prompts,
   B prompts x G chains, max new tokens, LoRA r=16 on all linear layers, beta 1e-3, the real ``VPOModule`` +
   ``RolloutCallback`` + ``TransformersEngine``), run in its own subprocess; per measured step its rollout time
   (inside ``generate``) and training time (the rest of the step) are divided into the time the bound allows.

The arithmetic (per step; P = mean prompt length, R = B x G rows, L = the step's longest completion, which a
batched decode must run to; N_lin = the model's linear-layer parameters, N_head = the LM head, l layers, H query
heads, K key/value heads, d head dim, s bytes per parameter of the model's dtype; the LoRA adapter's own work,
r = 16 on 4.9M parameters, is left out of the bound: an ideal engine merges it):

- prefill, once per prompt (the engine shares a prompt's KV cache with its G chains):
  ``F = B * (2 * N_lin * P + 2 * l * H * d * P**2)`` flops (the attention term: QK^T and AV over P**2 / 2 pairs,
  2 flops each), bound ``F / matmul_peak``.
- decode step t = 1..L over all R rows (the cache holds P + t tokens): flops
  ``R * (2 * (N_lin + N_head) + 4 * l * H * d * (P + t))``, bytes ``(N_lin + N_head) * s + (B * P + R * t) * 2 * l *
  K * d * s`` (the weights once, each prompt's K and V cache once: its G chains share it, and each row's own t
  tokens; before issue 25's third pass, whose engine reads a prompt's cache once for its G chains, the bound
  charged ``R * (P + t)`` cache tokens per step, a looser bound); the step's bound is ``max(bytes / bandwidth, flops /
  matmul_peak)``: below R ~ peak * s / (2 * bandwidth) rows a decode step is limited by memory, above by compute.
- rollout bound = prefill + sum of decode steps; ``rollout fraction = bound / measured time in generate``.
- training: one packed row per group (the prompt once, then its G completions, C completion tokens in all), each
  token through a policy forward, a backward to the inputs (the base weights are frozen: one matmul per linear,
  no weight gradient) and a reference forward (adapter off; beta > 0): ``3 * 2 * N_lin`` flops per token, plus
  ``3 * 2 * N_head`` per completion token (log-probs are taken on completion positions only) and the attention
  (``3 * 4 * l * H * d`` per attended pair: each completion token attends to the prompt and its own prefix);
  ``training fraction = (flops / matmul_peak) / (step time - generate time)``.

The bound is a roofline, not a promise: at hidden size 576 a decode matmul is far from the square-matmul peak, and
sampling, the LM head's softmax and Python overhead are not in it. Results go to
``benchmarks/results_roofline_<cpu kind>_<dtype>.json`` (cpu kind: ``avx2``, ``avx512`` or ``amx``, see
:func:`cpu_kind`) with the CPU model, its flags (avx2 / avx512f / avx512_bf16 / amx), thread count and dtype.

    .venv/bin/python benchmarks/roofline.py                          # bounds + 1 run x 4 steps (5-15 min on 2 cores)
    .venv/bin/python benchmarks/roofline.py --bounds-only            # the bounds alone (~30 s)
    .venv/bin/python benchmarks/roofline.py --dtype bf16 --steps 4   # bf16 rollouts and training (native-bf16 CPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BYTES_PER_PARAM = {"fp32": 4, "bf16": 2}


# ----------------------------------------------------------------------------------------------- machine bounds
def measure_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s: the best of ``repeats`` full reductions of a ``mib`` MiB fp32 tensor."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()  # touch every page once
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def measure_matmul(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Square matmul throughput in GFLOP/s (2 n^3 flops per product), the best of ``repeats``."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    a @ b  # warm-up (thread pool, kernel selection)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def cpu_description() -> dict:
    """CPU model name and the flags that decide the fast paths (from /proc/cpuinfo; empty where it is missing)."""
    name, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("unknown", "", "x86_64"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": name, "flags": [f for f in wanted if f in flags], "cpus": os.cpu_count()}


def cpu_kind(cpu: dict) -> str:
    """A short name for the CPU kind, from :func:`cpu_description`: ``amx``, ``avx512`` (with or without native
    bf16: the flags in the results say which), ``avx2`` or ``other``."""
    flags = cpu["flags"]
    if "amx_bf16" in flags or "amx_tile" in flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "other"


def native_bf16(cpu: dict) -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), from :func:`cpu_description`."""
    return any(f in cpu["flags"] for f in ("avx512_bf16", "amx_bf16"))


# ----------------------------------------------------------------------------------------------- the arithmetic
@dataclass(frozen=True)
class Shape:
    """What the roofline needs of a decoder-only transformer (from its ``config.json``)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_params: int  # q, k, v, o and the MLP's projections, all layers
    head_params: int  # the LM head (vocab x hidden), tied to the embedding or not

    @classmethod
    def from_config(cls, cfg: object) -> Shape:
        hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        hd = getattr(cfg, "head_dim", None) or hidden // heads
        inter = cfg.intermediate_size
        per_layer = hidden * heads * hd + 2 * hidden * kv * hd + heads * hd * hidden + 3 * hidden * inter
        return cls(layers, heads, kv, hd, layers * per_layer, cfg.vocab_size * hidden)


def decode_step_bound_s(shape: Shape, prompts: int, group: int, prompt_len: float, t: float, bytes_per: int,
                        bandwidth: float, peak: float) -> float:
    """Seconds the hardware needs for decode step ``t`` over ``prompts * group`` rows (module docstring): the larger
    of reading the weights and the caches and computing the step's products; ``bandwidth`` in bytes/s, ``peak`` in
    flop/s."""
    pair = 4 * shape.layers * shape.heads * shape.head_dim  # flops per (query, key) pair: QK^T and AV, 2d each
    rows, weights = prompts * group, shape.linear_params + shape.head_params
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * bytes_per
    flops = rows * (2 * weights + pair * (prompt_len + t))
    # the prompt's cache once per prompt (its G chains share it), each row's own tokens once per row
    nbytes = weights * bytes_per + (prompts * prompt_len + rows * t) * kv_per_token
    return max(nbytes / bandwidth, flops / peak)


def rollout_bound_s(shape: Shape, prompts: int, group: int, prompt_len: float, longest: int, bytes_per: int,
                    bandwidth: float, peak: float) -> float:
    """Seconds the hardware needs for one batched rollout (docstring of this module: prefill once per prompt, then
    ``longest`` decode steps over ``prompts * group`` rows); ``bandwidth`` in bytes/s, ``peak`` in flop/s."""
    pair = 4 * shape.layers * shape.heads * shape.head_dim  # flops per (query, key) pair: QK^T and AV, 2d each
    prefill = prompts * (2 * shape.linear_params * prompt_len + pair * prompt_len**2 / 2) / peak
    return prefill + sum(decode_step_bound_s(shape, prompts, group, prompt_len, t, bytes_per, bandwidth, peak)
                         for t in range(1, longest + 1))


def train_bound_s(shape: Shape, prompts: int, prompt_len: float, completion_tokens: int, group: int,
                  reference: bool, peak: float) -> float:
    """Seconds the hardware needs for one training step on packed groups (module docstring): every token through
    forward + backward-to-inputs (+ a reference forward), the LM head on completion positions only."""
    passes = 3 if reference else 2
    tokens = prompts * prompt_len + completion_tokens
    mean_len = completion_tokens / max(prompts * group, 1)
    # attended pairs: the prompt's causal triangle per group, then each completion token sees the prompt + its prefix
    pairs = prompts * prompt_len**2 / 2 + completion_tokens * (prompt_len + mean_len / 2)
    flops = passes * (2 * shape.linear_params * tokens + 2 * shape.head_params * completion_tokens
                      + 4 * shape.layers * shape.heads * shape.head_dim * pairs)
    return flops / peak


# ----------------------------------------------------------------------------------------------- this project
def run_steps(args: argparse.Namespace) -> dict:
    """``vs_trl.py --only ours`` in a subprocess (its own timing, JSON written to a temporary file)."""
    fd, out = tempfile.mkstemp(suffix=".json", prefix="roofline-")
    os.close(fd)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--only", "ours", "--rounds", "1",
           "--steps", str(args.steps), "--prompts", str(args.prompts_per_step * args.steps),
           "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
           "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype, "--model", args.model,
           "--out", out]
    subprocess.run(cmd, cwd=ROOT, check=True)
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def fractions(result: dict, shape: Shape, bounds: dict, dtype: str, warmup: int = 1) -> list[dict]:
    """Per measured step: time in generate and in training, the bounds' times, and the fractions."""
    run = result["runs"]["ours"][0]
    s = result["settings"]
    B, G, bytes_per = s["prompts_per_step"], s["group_size"], BYTES_PER_PARAM[dtype]
    peak, bw = bounds[f"matmul_{dtype}_gflops"] * 1e9, bounds["read_bandwidth_gbs"] * 1e9
    rows = []
    for i, (step, gen, tokens, longest, ptok) in enumerate(zip(run["step_s"], run["gen_s"], run["gen_tokens"],
                                                               run["gen_longest"], run["prompt_tokens"])):
        if i < warmup:
            continue
        prompt_len = ptok / (B * G)  # prompt_tokens counts the prompt once per chain
        r_bound = rollout_bound_s(shape, B, G, prompt_len, longest, bytes_per, bw, peak)
        t_bound = train_bound_s(shape, B, prompt_len, tokens, G, s["beta"] > 0, peak)
        rows.append({
            "step_s": step, "generate_s": gen, "train_s": step - gen, "generated_tokens": tokens,
            "longest": longest, "prompt_len": prompt_len, "rollout_tokens_per_s": tokens / gen,
            "rollout_bound_s": r_bound, "rollout_fraction": r_bound / gen,
            "trained_tokens_per_s": tokens / (step - gen), "train_bound_s": t_bound,
            "train_fraction": t_bound / (step - gen),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bounds-only", action="store_true", help="measure the machine's bounds only")
    p.add_argument("--repeats", type=int, default=5, help="bound measurements: best of this many")
    p.add_argument("--steps", type=int, default=4, help="training steps (the first is a warm-up, left out)")
    p.add_argument("--prompts-per-step", type=int, default=2, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="the model's dtype in the run (auto: bf16 where the CPU has it natively, else fp32)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", type=Path,
                   help="results JSON (default: benchmarks/results_roofline_<cpu kind>_<dtype>.json)")
    args = p.parse_args(argv)
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is a warm-up)")

    from transformers import AutoConfig

    from vpo_lightning.generation.models import resolve_dtype, resolve_model_path

    dtype = args.dtype if args.dtype != "auto" else ("bf16" if resolve_dtype("auto") == torch.bfloat16 else "fp32")
    cpu = cpu_description()
    print(f"[roofline] {cpu['model']} ({', '.join(cpu['flags']) or 'no avx2'}), {torch.get_num_threads()} threads",
          file=sys.stderr, flush=True)
    bounds = {
        "read_bandwidth_gbs": measure_bandwidth(repeats=args.repeats),
        "matmul_fp32_gflops": measure_matmul(torch.float32, repeats=args.repeats),
        # Without avx512_bf16/AMX torch emulates bf16 matmul, single-threaded and ~100x slower than fp32: a 2048
        # product then takes minutes, so those CPUs get one small product (the figure is reported, never used).
        "matmul_bf16_gflops": (measure_matmul(torch.bfloat16, repeats=args.repeats) if native_bf16(cpu)
                               else measure_matmul(torch.bfloat16, n=256, repeats=1)),
    }
    print(f"| bound | value |\n|---|---|\n| memory read | {bounds['read_bandwidth_gbs']:.1f} GB/s |\n"
          f"| matmul fp32 | {bounds['matmul_fp32_gflops']:.1f} GFLOP/s |\n"
          f"| matmul bf16 | {bounds['matmul_bf16_gflops']:.1f} GFLOP/s |")
    out: dict = {"machine": {**cpu, "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                             "loadavg_1m_at_start": os.getloadavg()[0]},
                 "dtype": dtype, "bounds": bounds}
    if not args.bounds_only:
        shape = Shape.from_config(AutoConfig.from_pretrained(resolve_model_path(args.model)))
        result = run_steps(args)
        steps = fractions(result, shape, bounds, dtype)
        med = {k: statistics.median(r[k] for r in steps) for k in steps[0]}
        out.update(settings=result["settings"], shape=asdict(shape), steps=steps, median=med,
                   peak_rss_gb=result["summary"]["ours"]["peak_rss_gb"])
        print(f"\n{args.model}, {dtype}, B={args.prompts_per_step} G={args.group_size} "
              f"max_new_tokens={args.max_new_tokens}, median of {len(steps)} steps (first left out):\n"
              f"| half | measured | tokens/s | the bound's time | fraction of the bound |\n|---|---|---|---|---|\n"
              f"| rollout (generate) | {med['generate_s']:.2f} s | {med['rollout_tokens_per_s']:.1f} | "
              f"{med['rollout_bound_s']:.2f} s | {med['rollout_fraction']:.1%} |\n"
              f"| training (the rest of the step) | {med['train_s']:.2f} s | {med['trained_tokens_per_s']:.1f} | "
              f"{med['train_bound_s']:.2f} s | {med['train_fraction']:.1%} |")
    out["machine"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    args.out = args.out or ROOT / "benchmarks" / f"results_roofline_{cpu_kind(cpu)}_{dtype}.json"
    args.out.write_text(json.dumps(out, indent=1))
    print(f"written {args.out} (load average 1 min: {out['machine']['loadavg_1m_at_start']:.1f} at the start, "
          f"{out['machine']['loadavg_1m_at_end']:.1f} at the end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
