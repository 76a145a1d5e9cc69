"""Where one decode step of the fused decoder goes, against this machine's bound (issue 25).

The rollout's decode steps are most of a rollout (bf16, B = 2, G = 8, 128 tokens: ~4.7 of ~5.8 s). This script
builds the policy as ``vpo fit`` does (SmolLM2-135M, LoRA r=16 on all linear layers), prefills B tool-use prompts
(as ``bench_rollout.py`` selects them) into :class:`~vpo_lightning.generation.fused_decode.FusedDecoder` with G
chains each, and prints, in one run:

1. the bound of one step over R = B x G rows at the mean context of ``--steps`` steps, as ``roofline.py`` computes
   it (``max(bytes / bandwidth, flops / matmul peak)``, the peak and bandwidth measured here after the steps);
2. the measured step (greedy, median over ``--steps`` steps) and, from ``torch.profiler`` over 8 more steps, its
   self CPU time split into the linear layers' products (``mkldnn::_linear_pointwise``, ``aten::linear``/``mm``/
   ``addmm``), the attention products (``aten::bmm``/``baddbmm``) and everything else (norms, rotary, softmax,
   casts, cache writes, Python: the operations that a compiled step could fuse);
3. each linear product alone (layer 0's four fused projections and the LM head, R rows, weights prepacked as the
   decoder packs them, timed back to back so the weights stay in cache), with its GFLOP/s as a share of the
   matmul peak: what the products can reach at R rows on this CPU, and the step's product time if every one did.

    .venv/bin/python benchmarks/decode_step.py --dtype bf16
    .venv/bin/python benchmarks/decode_step.py --dtype fp32 --out benchmarks/results_decode_step_avx512_fp32.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

LINEAR_OPS = ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm")
ATTENTION_OPS = ("aten::bmm", "aten::baddbmm")


def time_us(fn, repeats: int = 200) -> float:
    """Mean microseconds of ``fn()`` over ``repeats`` calls after 20 warm-up calls."""
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--prompts-per-step", type=int, default=2, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed (the chains' budget)")
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args(argv)

    from roofline import BYTES_PER_PARAM, Shape, cpu_description, decode_step_bound_s, measure_bandwidth, measure_matmul
    from vs_trl import tooluse_policy

    from vpo_lightning.generation.engines import left_pad
    from vpo_lightning.generation.fused_decode import FusedDecoder

    module, prompts = tooluse_policy(args.model, args.dtype, args.prompts_per_step, args.max_prompt_tokens)
    model = module.policy.eval()
    dtype_t = next(model.parameters()).dtype
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype_t]
    cpu = cpu_description()
    ids, mask = left_pad(prompts, module.tokenizer.pad_token_id, "cpu")  # [B, P]
    B, G, L = len(prompts), args.group_size, args.steps
    rows = B * G
    decoder = FusedDecoder.build(model, rows)
    if decoder is None:
        raise SystemExit(f"{args.model}: the fused decoder does not support this model")

    # 1. measured steps (greedy), then 8 profiled steps feeding the same tokens (the arithmetic does not depend on
    # the token values); the cache has room for both
    decoder.prefill(ids, mask, G, L + 8)
    token = ids[:, -1].repeat_interleave(G)  # [R]
    step_s = []
    for t in range(L):
        t0 = time.perf_counter()
        logits = decoder.step(token, t)  # [R, V]
        step_s.append(time.perf_counter() - t0)
        token = logits.argmax(-1)
    from torch.profiler import profile

    with profile() as prof:
        for t in range(L, L + 8):
            decoder.step(token, t)
    parts: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        kind = "linear" if event.key in LINEAR_OPS else "attention" if event.key in ATTENTION_OPS else "other"
        parts[kind] += event.self_cpu_time_total / 8 / 1e3  # ms per step
    step_ms = statistics.median(step_s) * 1e3
    # the bounds after the steps: measured first, they slowed the steps (bf16: 42.4 and 45.6 ms against 37.9 ms)
    bandwidth, peak = measure_bandwidth() * 1e9, measure_matmul(dtype_t) * 1e9  # bytes/s, flop/s

    # 2. the bound of a step at the mean context (roofline.py's arithmetic)
    shape = Shape.from_config(model.get_base_model().config)
    prompt_len = float(mask.sum(1).float().mean()) - 1
    t_mean = (L + 1) / 2
    bound_ms = decode_step_bound_s(shape, B, G, prompt_len, t_mean, BYTES_PER_PARAM[dtype], bandwidth, peak) * 1e3

    # 3. each product alone, R rows
    layer, products = decoder.layers[0], []
    hidden, attn = decoder.embed.shape[1], decoder.heads * decoder.head_dim
    for name, linear, n_in, count in (("qkv", layer.qkv, hidden, shape.layers), ("out", layer.out, attn, shape.layers),
                                      ("gate_up", layer.gate_up, hidden, shape.layers),
                                      ("down", layer.down, decoder.inter, shape.layers),
                                      ("lm_head", decoder.head, hidden, 1)):
        x = torch.randn(rows, n_in, dtype=dtype_t)
        n_out = linear(x).shape[-1]
        us = time_us(lambda linear=linear, x=x: linear(x))
        gflops = 2 * rows * n_in * n_out / us / 1e3
        products.append({"product": name, "in": n_in, "out": n_out, "count": count, "us": us, "gflops": gflops,
                         "share_of_peak": gflops * 1e9 / peak})
    alone_ms = sum(q["us"] * q["count"] for q in products) / 1e3
    at_peak_ms = sum(2 * rows * q["in"] * q["out"] * q["count"] for q in products) / peak * 1e3

    print(f"\n[decode_step] {cpu['model']} ({', '.join(cpu['flags'])}), {torch.get_num_threads()} threads, {dtype}; "
          f"B={B} G={G}: {rows} rows, prompt tokens {[len(x) for x in prompts]}, {L} steps; memory read "
          f"{bandwidth / 1e9:.1f} GB/s, matmul peak {peak / 1e9:.0f} GFLOP/s")
    print(f"\n| | ms per step | share of the measured step |\n|---|---|---|\n"
          f"| bound (roofline.py's arithmetic, mean context {prompt_len + t_mean:.0f}) | {bound_ms:.1f} | "
          f"{bound_ms / step_ms:.0%} |\n| measured step (median) | {step_ms:.1f} | 100% |")
    profiled = sum(parts.values())
    for kind, label in (("linear", "linear products"), ("attention", "attention products (bmm)"),
                        ("other", "everything else (small ops, Python)")):
        print(f"| - {label}, profiled | {parts[kind]:.1f} | {parts[kind] / profiled:.0%} of profiled |")
    print(f"| linear products alone, back to back | {alone_ms:.1f} | |\n"
          f"| linear products at the matmul peak | {at_peak_ms:.1f} | |")
    print("\n| product | in x out | x per step | us alone | GFLOP/s | share of peak |\n|---|---|---|---|---|---|")
    for q in products:
        print(f"| {q['product']} | {q['in']} x {q['out']} | {q['count']} | {q['us']:.0f} | {q['gflops']:.0f} | "
              f"{q['share_of_peak']:.0%} |")
    if args.out:
        args.out.write_text(json.dumps({
            "machine": {**cpu, "torch_threads": torch.get_num_threads()}, "dtype": dtype,
            "settings": {k: str(v) for k, v in vars(args).items()}, "bandwidth_gb_s": bandwidth / 1e9,
            "matmul_peak_gflop_s": peak / 1e9, "bound_ms": bound_ms, "step_ms_median": step_ms,
            "profiled_ms": dict(parts), "products": products, "products_alone_ms": alone_ms,
            "products_at_peak_ms": at_peak_ms}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
