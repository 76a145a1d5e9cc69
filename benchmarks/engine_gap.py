"""The train/inference log-prob gap of the transformers engine's decode loop (issue 25), per engine option.

For each variant the engine samples B x G chains from the tool-use prompts (as ``bench_rollout.py`` selects them),
reports each token's log-prob, and the trainer scores the same chains the way a training step does (packed rows,
``VPOModule.completion_logprobs``); printed: the mean and max of |engine - trainer| over generated tokens, the number
``train/engine_logprob_gap`` logs. The adapter gets small random B matrices (a fresh LoRA adapter has B = 0, which
would hide what merging does).

Variants: ``default`` (the fused decoder: merged, fused and prepacked weights, the prompt cache shared by a group's
chains), ``unfused`` (decode loop through the model's forward, merged and prepacked adapter, grouped-matmul decode
attention in bf16), ``sdpa-decode`` (``unfused`` with SDPA for the decode query), ``unmerged`` (decode loop through
the model's forward only: no merge, no packing).

    .venv/bin/python benchmarks/engine_gap.py --dtype bf16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--prompts-per-step", type=int, default=2, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--lora-b-std", type=float, default=0.02)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from vs_trl import tooluse_policy

    import vpo_lightning.generation.attention as attention
    from vpo_lightning.core.protocol import build_rollout_tensors, engine_logprob_tensor
    from vpo_lightning.core.types import Rollout
    from vpo_lightning.generation.engines import SamplingSettings, TransformersEngine

    torch.manual_seed(args.seed)
    module, prompts = tooluse_policy(args.model, args.dtype, args.prompts_per_step, 400)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in module.policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * args.lora_b_std)
    G, sampling = args.group_size, SamplingSettings(max_new_tokens=args.max_new_tokens)

    def gap(engine: TransformersEngine) -> tuple[float, float, int]:
        torch.manual_seed(args.seed)
        gen = engine.generate(module, prompts, G, sampling)
        ids, attn, comp, P = build_rollout_tensors(prompts, gen, G, module.tokenizer.pad_token_id)
        engine_lp = engine_logprob_tensor(gen, comp)  # [N, L]
        n = len(gen.completion_ids)
        ro = Rollout(ids, attn, comp, P, torch.zeros(n), torch.zeros(n, 1, 1), torch.ones(n, 1, dtype=torch.bool),
                     gen.texts, engine_logprobs=engine_lp)
        total = count = worst = 0.0
        with torch.no_grad():
            for mb in module._micro_batches(ro):
                lp = module.completion_logprobs(module.policy, mb, sampling.temperature)  # [n, L]
                diff = (engine_lp[mb["index"], : lp.shape[1]] - lp).abs() * mb["completion_mask"]
                total, count = total + float(diff.sum()), count + float(mb["completion_mask"].sum())
                worst = max(worst, float(diff.max()))
        return total / max(count, 1.0), worst, int(count)

    def sdpa_decode(query, key, value, mask, scaling):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2)  # [b, 1, heads, d]

    dtype = str(next(module.policy.parameters()).dtype).removeprefix("torch.")
    print(f"| {args.model}, {dtype}, B={len(prompts)} G={G}, {args.max_new_tokens} new tokens | mean gap | max gap | "
          "tokens |\n|---|---|---|---|")
    rows = {"default": TransformersEngine(), "unfused": TransformersEngine(fused_decode=False),
            "unmerged": TransformersEngine(merge_lora=False, prepack_weights=False)}
    for name, engine in rows.items():
        mean, worst, count = gap(engine)
        print(f"| {name} | {mean:.2e} | {worst:.2e} | {count} |")
    keep = attention.decode_attention
    attention.decode_attention = sdpa_decode
    try:
        mean, worst, count = gap(TransformersEngine(fused_decode=False))  # the fused decoder has its own attention
    finally:
        attention.decode_attention = keep
    print(f"| sdpa-decode | {mean:.2e} | {worst:.2e} | {count} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
