"""One decode step of the fused decoder at a given intra-op thread count, to see what a busy core does to it (issue 43).

Prefills B tool-use prompts into :class:`~vpo_lightning.generation.fused_decode.FusedDecoder` (as
``decode_step.py``) and prints the median of ``--steps`` greedy decode steps with
``torch.set_num_threads(--threads)``, the wait policy from the environment (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``)
and the process's CPU share. Pin it to one core beside other work (``taskset -c 1``) to see contention.
``--spin-as-cpus 2`` re-runs the script with a small preloaded shim (compiled with ``cc``) that makes libgomp see
that many CPUs at start-up, so that it spins as on a machine of that size (300,000 iterations at each barrier with
``OMP_WAIT_POLICY`` unset) while its threads share the pinned core: the worst case of a descheduled peer. An
experiment, not a product path.

    taskset -c 1 .venv/bin/python benchmarks/threads_contended.py --threads 1
    taskset -c 1 .venv/bin/python benchmarks/threads_contended.py --threads 2 --spin-as-cpus 2
    OMP_WAIT_POLICY=PASSIVE taskset -c 1 .venv/bin/python benchmarks/threads_contended.py --threads 2 --spin-as-cpus 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

SHIM = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
int pthread_getaffinity_np(pthread_t t, size_t size, cpu_set_t *set) {
  (void)t; memset(set, 0, size);
  int n = atoi(getenv("SPIN_AS_CPUS") ? getenv("SPIN_AS_CPUS") : "2");
  for (int i = 0; i < n; i++) CPU_SET_S(i, size, set);
  return 0;
}
"""


def _reexec_with_shim(cpus: int) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="spin-shim-"))
    (tmp / "shim.c").write_text(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(tmp / "shim.so"), str(tmp / "shim.c")], check=True)
    env = {**os.environ, "LD_PRELOAD": str(tmp / "shim.so"), "SPIN_AS_CPUS": str(cpus)}
    argv = list(sys.argv[1:])
    i = argv.index("--spin-as-cpus")
    del argv[i : i + 2]
    return subprocess.run([sys.executable, __file__, *argv], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="decode steps; the first 2 are left out")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--spin-as-cpus", type=int, help="preload the shim: libgomp sees this many CPUs")
    args = p.parse_args(argv)
    if args.spin_as_cpus:
        return _reexec_with_shim(args.spin_as_cpus)

    import torch
    from vs_trl import tooluse_policy

    from vpo_lightning.generation.engines import left_pad
    from vpo_lightning.generation.fused_decode import FusedDecoder

    module, prompts = tooluse_policy("smollm2-135m", args.dtype, 2, 400)
    model = module.policy.eval()
    ids, mask = left_pad(prompts, module.tokenizer.pad_token_id, "cpu")  # [B, P]
    torch.set_num_threads(args.threads)
    decoder = FusedDecoder.build(model, 16)
    times = []
    with torch.inference_mode():
        decoder.prefill(ids, mask, 8, args.steps + 4)
        token = ids[:, -1].repeat_interleave(8)  # [16]
        cpu0 = time.process_time()
        for t in range(args.steps):
            t0 = time.perf_counter()
            token = decoder.step(token, t).argmax(-1)
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
    kept = sorted(times[2:])
    print(f"threads={args.threads} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')} "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')} spin_as_cpus={os.environ.get('SPIN_AS_CPUS', '-')} "
          f"median_step_ms={statistics.median(kept) * 1e3:.1f} p90_ms={kept[int(0.9 * len(kept))] * 1e3:.1f} "
          f"cpu_per_wall={cpu / sum(times):.2f} loadavg={os.getloadavg()[0]:.1f} "
          f"affinity={sorted(os.sched_getaffinity(0))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
