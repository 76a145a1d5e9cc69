"""Sandbox throughput: candidate-test executions per second of the code reward, and bare runs per second.

``python benchmarks/bench_sandbox.py [--workers N] [--repeats R]``. Scores every HumanEval reference solution
(164 problems, 1111 tests after splitting) through :func:`vpo_lightning.tasks.code.score_candidates` with N
parallel sandboxes (default: the CPU count), then times ``run_python("pass")``. Two sandbox processes per
candidate: the candidate's program and the checker that runs its tests; the parent relays calls between them.

Measured on the shared 2-core dev machine (load average 14-15 from other jobs, so absolute numbers are low; the two
runs were back to back): before the kernel isolation (unshare namespaces, tests checked in the trainer) 63
candidate-test executions/s and 12.2 bare runs/s; after (bubblewrap, tests in a sandboxed checker started side by
side with the candidate) 32 and 7.1: about half the throughput, the price of the second process per candidate.

Issue 41 (seccomp filter, read-only /proc, a cgroup per run; same machine, AMD EPYC, 2 cores, load average 4-6
from other jobs, everything under ``nice -n 19``; runs back to back: old, new, old): code reward 86 / 67 / 87
candidate-test executions/s, bare runs 20.3 / 21.0 / 28.5 per second (bare runs vary that much between identical
runs here). The code-reward cost (-22%) is the cgroup cpu controller: joining only the run's memory cgroup 84, only
pids 81, only cpu 67, none 84; the seccomp filter costs little (filter off 72 against 65-67 with every layer).
Group scheduling delays the many wake-ups of the candidate -> trainer -> checker relay; it is also what keeps an
honest run at its pace beside CPU spinners.

Issue 54 (bubblewrap's init as PID 1, the seccomp allow-list; same machine, load average 5-8, ``taskset -c 1 nice -n
5``, ``--workers 2``, runs alternating old, new, old, new): code reward 31 / 34 / 46 / 45 candidate-test executions/s
(new/old 1.10 and 0.98), bare runs 11.5 / 9.2 / 13.3 / 18.3 per second (0.80 and 1.38): no difference beyond the
noise of the loaded machine; every reference solution still passes under the allow-list.
"""

from __future__ import annotations

import argparse
import os
import time

from vpo_lightning.sandbox import isolation_info, run_many
from vpo_lightning.tasks.code import load_humaneval, make_record, score_candidates


def bench_tests(workers: int, repeats: int) -> tuple[float, float, int]:
    """(test executions per second, candidates per second, failures) over ``repeats`` passes of HumanEval."""
    problems = load_humaneval()
    records = [make_record(p, "bench") for p in problems]
    candidates = [p["canonical_solution"] for p in problems]
    start, tests, failures = time.perf_counter(), 0, 0
    for _ in range(repeats):
        results = score_candidates(candidates, records, max_workers=workers)
        tests += sum(len(r) for r in results)
        failures += sum(not all(r) for r in results)
    elapsed = time.perf_counter() - start
    return tests / elapsed, repeats * len(candidates) / elapsed, failures


def bench_runs(workers: int, n: int = 64) -> float:
    """Bare ``run_python("pass")`` runs per second."""
    start = time.perf_counter()
    results = run_many(["pass"] * n, max_workers=workers)
    assert all(r.ok for r in results)
    return n / (time.perf_counter() - start)


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print(f"isolation: {isolation_info()}, workers: {args.workers}, cpus: {os.cpu_count()}")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    per_test, per_candidate, failures = bench_tests(args.workers, args.repeats)
    print(f"code reward: {per_test:.0f} candidate-test executions/s ({per_candidate:.1f} candidates/s), "
          f"{failures} reference solutions failing")
    print(f"bare run_python('pass'): {bench_runs(args.workers):.1f} runs/s")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
