"""Would int8 products make the rollout faster, and at what log-prob gap? (issue 43: "an opt-in weight-only int8 path
for rollouts, with its engine/trainer log-prob gap reported").

Not a product option: this script measures the question in one run, and docs/SPEED.md reports the answer (on the
AVX-512 EPYC, neither int8 product paid: see there). It builds the policy as ``vpo fit`` does (SmolLM2-135M, LoRA r=16
on all linear layers, small random B matrices so the merged adapter matters), prefills B tool-use prompts into two
:class:`~vpo_lightning.generation.fused_decode.FusedDecoder` s with G chains each, the product's (bf16 or float32,
prepacked) and a copy whose products are int8, and prints:

1. each product alone at R = B x G rows (layer 0's four fused projections and the LM head): the prepacked float
   product, torch's weight-only int8 product (``aten._weight_int8pack_mm``: int8 weights, one scale per output row,
   activations in the model dtype) and fbgemm's dynamically quantized product (int8 weights per row; activations
   quantized per call to 7 bits, one scale for the whole call; VNNI int8 dot products where the CPU has them);
2. a whole decode step, the float decoder against the int8 ones, over the same fed tokens (interleaved rounds, so a
   busy machine slows both alike);
3. the log-prob gap each decoder makes against the trainer's forward (the model's own forward over [prompt |
   tokens], the LoRA adapter unmerged: what ``train/engine_logprob_gap`` measures), for int8 in every product and
   in subsets of them.

    .venv/bin/python benchmarks/int8_decode.py --dtype bf16 --out benchmarks/results_int8_decode_avx512_bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

PRODUCTS = ("qkv", "out", "gate_up", "down", "head")


def row_scales(weight: Tensor) -> Tensor:
    """Symmetric int8 scales, one per output row: ``max |w_row| / 127`` [out] (float32)."""
    return (weight.detach().float().abs().amax(1) / 127).clamp(min=1e-12)


class DynamicInt8Linear:
    """``x @ W.T + b`` by fbgemm's dynamically quantized product: W int8 per output row, x quantized to 7 bits per
    call (``reduce_range``: CPUs without VNNI would saturate 16-bit sums of 8-bit products); results in x's dtype.
    Same interface as ``FusedLinear`` (``__call__``, ``add``)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        w = weight.detach().float()  # [out, in]
        scales = row_scales(w).double()
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensor creation deprecated
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())

    def _float(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)  # [..., out] float32

    def __call__(self, x: Tensor) -> Tensor:
        return self._float(x).to(x.dtype)

    def add(self, x: Tensor, other: Tensor) -> Tensor:
        return (self._float(x) + other.float()).to(other.dtype)


class WeightOnlyInt8Linear:
    """``x @ W.T + b`` by torch's weight-only int8 product (``aten._weight_int8pack_mm``): W int8 per output row,
    x in its own dtype, results in x's dtype."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        scales = row_scales(weight)  # [out]
        self.qweight = torch.round(weight.detach().float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales, self.bias = scales.to(weight.dtype), None if bias is None else bias.detach()

    def __call__(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # the kernel takes [rows, in]
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales.to(x.dtype))
        out = out.view(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias

    def add(self, x: Tensor, other: Tensor) -> Tensor:
        return self(x) + other


KINDS = {"dynamic": DynamicInt8Linear, "weight-only": WeightOnlyInt8Linear}


def int8_decoder(model, rows: int, kind: str, products: set[str]):
    """The product's fused decoder with the ``products`` (names from PRODUCTS) replaced by int8 ones of ``kind``;
    built unpacked, so each product still holds its merged weight to quantize."""
    from vpo_lightning.generation.fused_decode import FusedDecoder

    decoder = FusedDecoder.build(model, rows, prepack=False)
    cls = KINDS[kind]
    for layer in decoder.layers:
        for name in ("qkv", "out", "gate_up", "down"):
            if name in products:
                old = getattr(layer, name)
                setattr(layer, name, cls(old.weight, old.bias))
    if "head" in products:
        decoder.head = cls(decoder.head.weight, decoder.head.bias)
    return decoder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--prompts-per-step", type=int, default=2, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--steps", type=int, default=64, help="decode steps fed and timed")
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds per decoder")
    p.add_argument("--lora-b-std", type=float, default=0.02)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", default="auto", help="intra-op threads: auto (the engine's default: the cores others "
                   "leave free, decided once at the start) or a count")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    from decode_step import time_us
    from roofline import cpu_description
    from vs_trl import tooluse_policy

    from vpo_lightning.generation.engines import left_pad
    from vpo_lightning.generation.fused_decode import FusedDecoder
    from vpo_lightning.generation.threads import adapt_threads, parse_threads

    adapt_threads(parse_threads(args.threads))
    torch.manual_seed(0)
    module, prompts = tooluse_policy(args.model, args.dtype, args.prompts_per_step, 400)
    model = module.policy.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * args.lora_b_std)
    dtype_t = next(model.parameters()).dtype
    B, G, L = len(prompts), args.group_size, args.steps
    rows = B * G
    ids, mask = left_pad(prompts, module.tokenizer.pad_token_id, torch.device("cpu"))  # [B, P]
    cpu = cpu_description()
    ref_decoder = FusedDecoder.build(model, rows)

    # the fed tokens: sampled from the float decoder (temperature 1), so the gap is measured on text it would write
    ref_decoder.prefill(ids, mask, G, L)
    token, fed = ids[:, -1].repeat_interleave(G), []
    gen = torch.Generator().manual_seed(1)
    for t in range(L):
        probs = ref_decoder.step(token, t).float().softmax(-1)  # [R, V]
        token = torch.multinomial(probs, 1, generator=gen)[:, 0]
        fed.append(token)
    fed = torch.stack(fed, 1)  # [R, L]

    def decoder_logprobs(decoder) -> tuple[Tensor, list[float]]:
        """Log-probs of the fed tokens [R, L] and each step's seconds."""
        decoder.prefill(ids, mask, G, L)
        token, out, secs = ids[:, -1].repeat_interleave(G), [], []
        for t in range(L):
            t0 = time.perf_counter()
            logits = decoder.step(token, t)
            secs.append(time.perf_counter() - t0)
            out.append(logits.float().log_softmax(-1).gather(1, fed[:, t : t + 1])[:, 0])
            token = fed[:, t]
        return torch.stack(out, 1), secs

    # the trainer's log-probs: the model's forward (adapter unmerged) over [prompt | fed tokens]
    full_ids = torch.cat([ids.repeat_interleave(G, 0), fed], 1)  # [R, P + L]
    full_mask = torch.cat([mask.repeat_interleave(G, 0), mask.new_ones(rows, L)], 1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full_ids[:, :-1], attention_mask=full_mask[:, :-1],
                       position_ids=positions[:, :-1]).logits  # [R, P + L - 1, V]
    trainer_lp = logits[:, ids.shape[1] - 1 :].float().log_softmax(-1).gather(2, fed[..., None])[..., 0]  # [R, L]

    # 1. products alone
    unpacked = FusedDecoder.build(model, rows, prepack=False)  # the same products holding their float weights
    pairs = {name: (getattr(ref_decoder.layers[0], name), getattr(unpacked.layers[0], name))
             for name in PRODUCTS[:-1]} | {"head": (ref_decoder.head, unpacked.head)}
    product_rows = []
    for name, (packed, plain) in pairs.items():
        n_in = plain.weight.shape[1]
        x = torch.randn(rows, n_in, dtype=dtype_t)
        timings = {"float": time_us(lambda packed=packed, x=x: packed(x), 100)}
        for kind, cls in KINDS.items():
            q = cls(plain.weight, plain.bias)
            timings[kind] = time_us(lambda q=q, x=x: q(x), 100)
        product_rows.append({"product": name, "in": n_in, "out": plain.weight.shape[0], "us": timings})

    # 2 and 3. whole steps, interleaved, and the gaps
    variants = {"float (product)": ref_decoder,
                "dynamic int8, all products": int8_decoder(model, rows, "dynamic", set(PRODUCTS)),
                "weight-only int8, all products": int8_decoder(model, rows, "weight-only", set(PRODUCTS))}
    step_s: dict[str, list[float]] = {k: [] for k in variants}
    gaps: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            lp, secs = decoder_logprobs(variants[name])
            step_s[name] += secs
            diff = (lp - trainer_lp).abs()
            gaps[name] = {"mean": float(diff.mean()), "max": float(diff.max())}
    for subset in (("gate_up",), ("head",), ("gate_up", "down"), ("qkv", "out", "gate_up", "down")):
        lp, _ = decoder_logprobs(int8_decoder(model, rows, "dynamic", set(subset)))
        diff = (lp - trainer_lp).abs()
        gaps[f"dynamic int8, {'+'.join(subset)}"] = {"mean": float(diff.mean()), "max": float(diff.max())}

    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype_t]
    load = round(os.getloadavg()[0], 2)
    print(f"\n[int8_decode] {cpu['model']} ({', '.join(cpu['flags'])}), {torch.get_num_threads()} threads, {dtype}; "
          f"B={B} G={G}: {rows} rows, {L} fed steps; load average (1 min) at the end {load}")
    print("\n| product (R rows) | in x out | float prepacked us | weight-only int8 us | dynamic int8 us |\n"
          "|---|---|---|---|---|")
    for q in product_rows:
        u = q["us"]
        print(f"| {q['product']} | {q['in']} x {q['out']} | {u['float']:.0f} | {u['weight-only']:.0f} "
              f"({u['float'] / u['weight-only']:.2f}x) | {u['dynamic']:.0f} ({u['float'] / u['dynamic']:.2f}x) |")
    base = statistics.median(step_s["float (product)"])
    print("\n| decoder | median step ms | speed vs float | mean |lp - trainer| | max |\n|---|---|---|---|---|")
    for name, gap in gaps.items():
        if name in step_s:
            med = statistics.median(step_s[name])
            print(f"| {name} | {med * 1e3:.1f} | {base / med:.2f}x | {gap['mean']:.3f} | {gap['max']:.2f} |")
        else:
            print(f"| {name} | | | {gap['mean']:.3f} | {gap['max']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({
            "machine": {**cpu, "torch_threads": torch.get_num_threads()}, "dtype": dtype, "load_1min_end": load,
            "settings": {k: str(v) for k, v in vars(args).items()}, "products": product_rows,
            "step_ms_median": {k: statistics.median(v) * 1e3 for k, v in step_s.items()}, "logprob_gap": gaps},
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
