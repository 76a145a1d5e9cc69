"""`vpo serve` throughput: generated tokens/s with C concurrent clients against one sequential client.

    .venv/bin/python benchmarks/bench_serve.py                          # smollm2-135m, 8 clients x 4 x 64 tokens
    .venv/bin/python benchmarks/bench_serve.py --threads 1 --set model.model.dtype=fp32   # tuned for a busy CPU

Starts ``vpo serve`` (a subprocess on 127.0.0.1, free port) with the config's model, warms it up, then measures
(1) one client sending ``--baseline-requests`` requests one after another and (2) ``--clients`` threads each
sending ``--requests`` requests back to back, every request asking for exactly ``--tokens`` tokens (``ignore_eos``)
at temperature 1. Throughput = completion tokens (from the responses' usage) / wall time. The server's /stats
gives how many generate calls the concurrent phase took (its batching). Prints the load average, because on a
shared machine it moves the numbers more than anything else.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openevolve_code import REPO, ServeProcess

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a hash map is in two sentences.",
           "List three uses of the Python standard library module itertools.",
           "Write a haiku about gradient descent."]


def run_clients(url: str, model: str, clients: int, requests: int, tokens: int) -> tuple[int, float, int]:
    """(completion tokens, wall seconds, failed requests) for ``clients`` threads x ``requests`` each."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", timeout=3600, max_retries=0)
    counts, failures = [0] * clients, [0]
    barrier = threading.Barrier(clients + 1)

    def worker(i: int) -> None:
        barrier.wait()
        for j in range(requests):
            try:
                r = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": PROMPTS[(i + j) % len(PROMPTS)]}],
                    max_tokens=tokens, temperature=1.0, extra_body={"ignore_eos": True})
                counts[i] += r.usage.completion_tokens
            except Exception as err:  # noqa: BLE001 - counted and reported
                failures[0] += 1
                print(f"client {i}: {type(err).__name__}: {err}", file=sys.stderr)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - t0, failures[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs/tooluse.yaml"), help="config whose model is served")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    p.add_argument("--baseline-requests", type=int, default=2, help="sequential requests of the 1-client baseline")
    p.add_argument("--batch-wait-ms", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads of the server (0 = torch's default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--log", default=str(REPO / "checkpoints/bench_serve.log"))
    args = p.parse_args()
    extra = ["--batch-wait-ms", str(args.batch_wait_ms), "--max-batch-size", str(max(64, args.clients)),
             "--threads", str(args.threads)]
    for o in args.overrides:
        extra += ["--set", o]
    print(f"cpus {os.cpu_count()}, load average before {os.getloadavg()[0]:.2f}", flush=True)
    with ServeProcess(Path(args.config), None, "", Path(args.log), args.tokens, extra=extra) as server:
        model = server.models[0]
        run_clients(server.url, model, 1, 1, 8)  # warm-up
        results = {}
        if args.baseline_requests:
            tokens, wall, failed = run_clients(server.url, model, 1, args.baseline_requests, args.tokens)
            results["1 client"] = tokens / wall
            print(f"1 client x {args.baseline_requests} x {args.tokens} tokens: {tokens} tokens in {wall:.1f}s = "
                  f"{tokens / wall:.1f} tokens/s ({failed} failed)", flush=True)
        before = server.stats()
        tokens, wall, failed = run_clients(server.url, model, args.clients, args.requests, args.tokens)
        after = server.stats()
        batches = after["batches"] - before["batches"]
        rows = after["rows"] - before["rows"]
        print(f"{args.clients} clients x {args.requests} x {args.tokens} tokens: {tokens} tokens in {wall:.1f}s = "
              f"{tokens / wall:.1f} tokens/s ({failed} failed); {batches} generate calls, "
              f"{rows / max(1, batches):.1f} sequences per call on average, max {after['max_batch_rows']}", flush=True)
        if "1 client" in results:
            print(f"speed-up over one client: {tokens / wall / results['1 client']:.2f}x")
    print(f"load average after {os.getloadavg()[0]:.2f} (model {model}, config {args.config}, overrides "
          f"{args.overrides or 'none'}, threads {args.threads or 'torch default'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
