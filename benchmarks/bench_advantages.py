"""How expensive is the VPO estimator next to the model? Times ``vpo_advantages`` at B=64, G=16, m=4, K=1000, D=16
(weights sampled inside, as in training) against one forward pass of a tiny random Llama on 64 x 128 tokens.

Run: ``python benchmarks/bench_advantages.py [--repeats 20] [--device cpu]``. Prints medians after warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vpo_lightning.core.advantages import vpo_advantages


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3,
                        device: str = "cpu") -> dict[str, float]:
    """Median wall time of each ``fn()`` over ``repeats`` rounds after ``warmup`` rounds (synchronising CUDA).

    The functions take turns within each round, so a busy machine slows them alike and the ratio stays fair.
    """
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def vpo_call(device: str) -> Callable[[], object]:
    b, g, m, k, d = 64, 16, 4, 1000, 16
    rewards = torch.rand(b, g, m, d, generator=torch.Generator().manual_seed(0)).to(device)  # [B, G, m, D]
    generator = torch.Generator(device=device).manual_seed(0)
    return lambda: vpo_advantages(rewards, num_weights=k, generator=generator)


def llama_call(device: str) -> Callable[[], object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(device).eval()
    input_ids = torch.randint(0, 1024, (64, 128), device=device)  # [64, 128]

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=input_ids)

    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    medians = interleaved_medians({"vpo": vpo_call(args.device), "llama": llama_call(args.device)}, args.repeats,
                                  device=args.device)
    vpo, llama = medians["vpo"], medians["llama"]
    print(f"vpo_advantages  B=64 G=16 m=4 K=1000 D=16 : {vpo * 1e3:8.2f} ms (median of {args.repeats})")
    print(f"tiny Llama forward, 64 x 128 tokens        : {llama * 1e3:8.2f} ms (median of {args.repeats})")
    print(f"ratio estimator / forward                  : {vpo / llama:8.3f}")


if __name__ == "__main__":
    main()
