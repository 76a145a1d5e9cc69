"""Rollout engine variants side by side in one process (issue 25): tokens/s of each, as a ratio to the first.

The policy is built as `vpo fit` builds it (``VPOModule``: the embedded SmolLM2-135M-Instruct, LoRA r=16 on all
linear layers), the prompts are the first B tool-use prompts of ``data/tooluse/train.jsonl`` under the chat template
(as ``benchmarks/vs_trl.py`` selects them), and every variant generates G chains per prompt with the same sampling
settings and the same seed, so each does the same work; the variants run interleaved (A, B, A, B, ...) so that a
busy machine slows all alike, and the script says whether every variant produced the same tokens as the first.
Sampled tokens agree only between variants that draw the same random numbers in the same order on the same
arithmetic: ``loop`` and ``default`` draw differently from ``generate`` (the same distribution), and ``no-share``,
``merged`` and ``default`` round differently; with ``--top-k 1`` (greedy) the comparison checks the arithmetic.

Variants (``--variants``, comma-separated; the first is the reference of the ratios):
    before       the engine as it was before issue 25's second pass: ``prealloc`` with the model on plain SDPA
                 attention (``set_attn_implementation("sdpa")`` for the call); only the prefill's skipped LM head is
                 new in it
    concat       ``prealloc`` with transformers' growing KV cache (torch.cat per step)
    prealloc     ``TransformersEngine(decode_loop=False, merge_lora=False, prepack_weights=False)``:
                 ``model.generate`` after the shared prefill, KV cache in buffers allocated once, unmerged LoRA, the
                 model's attention as ``vpo fit`` loads it (``vpo_sdpa``: a grouped-matmul decode in bf16)
    no-share     ``prealloc`` without the shared prefill: each chain prefills its own copy of the prompt
    packed       ``prealloc`` with ``prepack_weights=True``: oneDNN-prepacked linear weights for the call
    merged       ``prealloc`` with ``merge_lora=True``: the adapter merged into a copy of the base weights for the
                 call (one matmul per layer; the merged weights round once, so tokens may differ)
    loop         ``prealloc`` with ``decode_loop=True`` (through the model's forward): the engine's own decode loop
                 (inverse-CDF sampling); other random draws than ``generate``'s, so other tokens
    unfused      ``TransformersEngine(fused_decode=False)``: the decode loop through the model's forward with the merged
                 adapter and prepacked weights (the default of issue 25's second pass)
    default      ``TransformersEngine()``: the decode loop through the fused decoder (merged, fused and prepacked
                 weights, one prompt cache per group; ``vpo_lightning/fused_decode.py``), the default
    compiled     transformers' own compiled decode: ``generate(cache_implementation="static", compile_config=
                 CompileConfig(mode="default", _compile_all_devices=True))`` on the same padded B x G rows (no
                 shared prefill: a static cache is filled by ``generate``'s own prefill); ``torch.compile``
                 (inductor) traces the decode forward on the first call, which ``--warmup`` leaves out. A
                 measurement of whether compiling removes the per-operation cost of a small-batch decode, not an
                 engine option (the cache length, hence the compiled shapes, changes with the prompts)

Under a controlled load (``--load busy:1``: one process spinning on one core while the variants run;
``benchmarks/cpuload.py``) with ``--threads auto,2`` every variant runs under each thread setting
(``TransformersEngine(threads=...)``, applied before each run): ``auto`` sizes the team to the free cores, ``2`` is
the fixed team of torch's default on two cores.

    .venv/bin/python benchmarks/bench_rollout.py           # before vs default: B=2, G=8, 128 tokens, 2 rounds
    .venv/bin/python benchmarks/bench_rollout.py --variants default --threads auto,2 --load busy:1 --rounds 1
    .venv/bin/python benchmarks/bench_rollout.py --variants before,prealloc,packed,merged,loop,default --rounds 3
    .venv/bin/python benchmarks/bench_rollout.py --variants before,unfused,default --rounds 2 --warmup 1 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

GENERATE = {"decode_loop": False, "merge_lora": False, "prepack_weights": False}
VARIANTS = {
    "before": GENERATE,
    "concat": {**GENERATE, "preallocate_cache": False},
    "prealloc": GENERATE,
    "no-share": {**GENERATE, "share_prompt_prefix": False},
    "packed": {**GENERATE, "prepack_weights": True},
    "merged": {**GENERATE, "merge_lora": True},
    "loop": {**GENERATE, "decode_loop": True, "fused_decode": False},
    "unfused": {"fused_decode": False},
    "default": {},
    "compiled": GENERATE,
}


def generate_compiled(module, prompts: list[list[int]], group_size: int, sampling) -> object:
    """The ``compiled`` variant: ``TransformersEngine.generate``'s padding, rows and sampling settings, with
    transformers' static cache and its ``torch.compile`` of the decode forward instead of the shared prefill."""
    from transformers import CompileConfig

    from vpo_lightning.core.types import Generation
    from vpo_lightning.generation.engines import eos_token_ids, left_pad, trim_completion

    model, tok = module.policy, module.tokenizer
    eos = eos_token_ids(model, tok)
    compile_config = CompileConfig(mode="default")
    compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told (a class field)
    model.eval()
    with torch.inference_mode():
        ids, mask = left_pad(prompts, tok.pad_token_id, module.device)
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k or None, max_new_tokens=sampling.max_new_tokens,
            pad_token_id=tok.pad_token_id, eos_token_id=sorted(eos), cache_implementation="static",
            compile_config=compile_config)
    model.train()
    completions = [trim_completion(r, eos, tok.pad_token_id) for r in out[:, ids.shape[1]:].tolist()]
    return Generation(completions, tok.batch_decode(completions, skip_special_tokens=True),
                      sum(len(c) for c in completions))


def agreement(reference: list[list[int]], chains: list[list[int]]) -> tuple[float, float]:
    """The fraction of chains equal to the reference's, and the mean number of leading tokens they share with it."""
    shared = []
    for ref, got in zip(reference, chains):
        n = 0
        while n < min(len(ref), len(got)) and ref[n] == got[n]:
            n += 1
        shared.append(n)
    equal = sum(r == c for r, c in zip(reference, chains)) / max(len(chains), 1)
    return equal, sum(shared) / max(len(shared), 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="before,default", help=f"comma-separated, from {sorted(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=0, help="rounds run first and left out (compile time)")
    p.add_argument("--prompts-per-step", type=int, default=2, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top-k", type=int, default=0, help="1 = greedy: then every variant should give the same tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", default="auto", help="comma-separated thread settings (auto or a count); every "
                   "variant runs under each, labelled variant@tSETTING when there are several")
    p.add_argument("--load", default="none", metavar="none|busy:N[@CORES]",
                   help="background load while the variants run (benchmarks/cpuload.py): busy:1 = one core kept busy")
    p.add_argument("--out", type=Path, help="write the raw timings as JSON here")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")

    from cpuload import BusyLoad, results_label
    from roofline import cpu_description, cpu_kind
    from vs_trl import tooluse_policy

    from vpo_lightning.generation.threads import adapt_threads, parse_threads

    try:
        settings = [parse_threads(t) for t in args.threads.split(",")]
        load_run = BusyLoad.from_spec(args.load)
    except ValueError as err:
        raise SystemExit(f"bench_rollout: {err}") from None
    runs = [(n, t) for n in names for t in settings]
    labels = [n if len(settings) == 1 else f"{n}@t{t}" for n, t in runs]

    from vpo_lightning.generation.attention import NAME
    from vpo_lightning.generation.engines import SamplingSettings, TransformersEngine

    module, prompts = tooluse_policy(args.model, args.dtype, args.prompts_per_step, args.max_prompt_tokens)
    base = module.policy.get_base_model()
    attention = base.config._attn_implementation
    assert attention == NAME, attention
    sampling = SamplingSettings(max_new_tokens=args.max_new_tokens, top_k=args.top_k)
    dtype = str(next(module.policy.parameters()).dtype).removeprefix("torch.")
    cpu = cpu_description()
    print(f"[bench_rollout] {cpu['model']} ({', '.join(cpu['flags'])}), {torch.get_num_threads()} threads, {dtype}, "
          f"B={len(prompts)} G={args.group_size} max_new_tokens={args.max_new_tokens}, prompt tokens "
          f"{[len(x) for x in prompts]}", file=sys.stderr, flush=True)

    times: dict[str, list[float]] = {n: [] for n in labels}
    tokens: dict[str, list[int]] = {n: [] for n in labels}
    threads_used: dict[str, list[int]] = {n: [] for n in labels}
    reference, same, agree = None, {}, {}
    with load_run:  # the busy processes stop however the loop ends
        for rnd in range(-args.warmup, args.rounds):
            for label, (name, setting) in (list(zip(labels, runs)) if rnd % 2 == 0 else list(zip(labels, runs))[::-1]):
                engine = TransformersEngine(**VARIANTS[name], threads=setting)
                adapt_threads(setting)  # also for the variants that do not go through the engine's generate
                torch.manual_seed(args.seed)
                t0 = time.perf_counter()
                if name == "before":
                    base.set_attn_implementation("sdpa")
                try:
                    gen = (generate_compiled(module, prompts, args.group_size, sampling) if name == "compiled"
                           else engine.generate(module, prompts, args.group_size, sampling))
                finally:
                    base.set_attn_implementation(attention)
                elapsed = time.perf_counter() - t0
                print(f"[bench_rollout] round {rnd + 1}{' (warm-up)' if rnd < 0 else ''}: {label} {elapsed:.2f} s, "
                      f"{gen.num_tokens} tokens, {torch.get_num_threads()} threads", file=sys.stderr, flush=True)
                if rnd < 0:
                    continue
                times[label].append(elapsed)
                tokens[label].append(gen.num_tokens)
                threads_used[label].append(torch.get_num_threads())
                if reference is None:
                    reference = gen.completion_ids
                same[label] = same.get(label, True) and gen.completion_ids == reference
                agree[label] = agreement(reference, gen.completion_ids)

    first = statistics.median(times[labels[0]])
    print(f"\n| variant | median generate (s) | tokens/s | ratio to {labels[0]} | same tokens as {labels[0]} "
          "(chains equal, mean shared prefix) |\n|---|---|---|---|---|")
    for name in labels:
        med = statistics.median(times[name])
        rate = statistics.median(n / t for n, t in zip(tokens[name], times[name]))
        equal, prefix = agree[name]
        print(f"| {name} | {med:.2f} | {rate:.1f} | {first / med:.2f}x | {'yes' if same[name] else 'NO'} "
              f"({equal:.0%}, {prefix:.1f} tokens) |")
    label = results_label(cpu, {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype), args.load)
    print(f"\n{label}: load {args.load}; load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    if args.out:
        args.out.write_text(json.dumps({
            "label": label, "load": load_run.record(),
            "machine": {**cpu, "cpu_kind": cpu_kind(cpu), "torch_threads": torch.get_num_threads(),
                        "platform": platform.platform(), "loadavg_1m_at_end": os.getloadavg()[0]},
            "settings": {k: str(v) for k, v in vars(args).items()}, "dtype": dtype, "times_s": times,
            "threads_used": threads_used,
            "tokens": tokens, "same_tokens_as_first": same,
            "agreement_with_first": {n: {"chains_equal": a[0], "mean_shared_prefix": a[1]} for n, a in agree.items()}},
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
