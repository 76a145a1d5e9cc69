"""Wall time of ``vpo --help``: the light launcher against the Lightning-importing path it replaced.

``python benchmarks/bench_cli_help.py [--repeats N] [--out results.json]``. Each variant runs N times in a fresh
interpreter (``PYTHONPATH`` = this checkout); the median and the range are printed, with the CPU and the load:

- ``launcher``: ``python -m vpo_lightning --help``, what the ``vpo`` console script runs (vpo_lightning.launcher);
- ``vpo script``: the installed ``vpo`` beside this interpreter, when it exists (it points at the launcher once the
  package is reinstalled from this pyproject.toml);
- ``cli module``: ``vpo --help`` after importing ``vpo_lightning.training.cli`` (Lightning, torch and transformers),
  what ``vpo --help`` cost before the launcher: the same import chain (the old ``python -m vpo_lightning.cli``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def time_command(cmd: list[str], repeats: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0 or "fit" not in proc.stdout:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-500:]}")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    variants = {"launcher": [sys.executable, "-m", "vpo_lightning", "--help"]}
    script = shutil.which("vpo", path=str(Path(sys.executable).parent))
    if script:
        variants["vpo script"] = [script, "--help"]
    variants["cli module"] = [sys.executable, "-c", "import sys, vpo_lightning.training.cli; "
                              "from vpo_lightning.launcher import main; sys.exit(main(['--help']))"]
    load_before = os.getloadavg()[0]
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, load average (1 min) {load_before:.1f}, {args.repeats} runs each")
    results = {}
    for name, cmd in variants.items():
        times = time_command(cmd, args.repeats)
        results[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}
        print(f"  {name:<11} median {statistics.median(times):6.3f} s  (min {min(times):.3f}, max {max(times):.3f})")
    load_after = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load_after:.1f}")
    if args.out:
        machine = {"cpu": cpu_name(), "cpus": os.cpu_count(), "loadavg_1m_at_start": load_before,
                   "loadavg_1m_at_end": load_after}
        args.out.write_text(json.dumps({"machine": machine, "repeats": args.repeats, "results": results}, indent=2))


if __name__ == "__main__":
    main()
