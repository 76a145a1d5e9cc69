"""The ratios of ``speed_suite.sh``'s results files against issue 43's targets, printed and written as JSON.

Targets, with one of two cores busy (``--load busy:1``): our step time <= 2.5x our quiet step time, and our ratio
to TRL <= 1.5x the quiet ratio. Step times are ``vs_trl.py``'s medians over the measured steps; where a side was cut
off by its ``--timeout`` its step is a lower bound, and the ratio says so. When nothing past the warm-up step
finished, the first (warm-up) steps are compared instead, and the line says that too.

    .venv/bin/python benchmarks/speed_summary.py --kind avx512
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BENCH = Path(__file__).resolve().parent
STEP_TARGET, RATIO_TARGET = 2.5, 1.5


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def verdict(value: float, target: float, bound: str) -> bool | None:
    """Met (True), missed (False) or undecided (None) for ``value <= target`` when ``value`` is exact or a bound."""
    if bound == "exact":
        return value <= target
    if bound == "lower":  # the true value is at least this
        return False if value > target else None
    if bound == "upper":  # the true value is at most this
        return True if value <= target else None
    return None


def step_of(summary: dict) -> tuple[float | None, str, bool]:
    """(seconds, which step, lower bound?) of one side's summary: the median measured step, else the first step."""
    if summary.get("median_step_s") is not None:
        return summary["median_step_s"], "median step", bool(summary.get("median_step_is_lower_bound"))
    return summary.get("first_step_s"), "first step", bool(summary.get("timed_out_runs"))


def trl_targets(quiet: dict, loaded: dict) -> list[dict]:
    """The two step-time targets from a quiet and a loaded ``vs_trl.py`` result."""
    rows = []
    q_ours, q_what, q_low = step_of(quiet["summary"]["ours"])
    l_ours, l_what, l_low = step_of(loaded["summary"]["ours"])
    if q_what != l_what:  # compare like with like
        q_ours = quiet["summary"]["ours"]["first_step_s"]
        l_ours, l_what, l_low = loaded["summary"]["ours"]["first_step_s"], "first step", l_low
    if q_ours and l_ours:
        slow = l_ours / q_ours
        rows.append({"target": f"ours: loaded {l_what} / quiet <= {STEP_TARGET}", "value": slow,
                     "bound": "lower" if l_low else "exact",
                     "met": verdict(slow, STEP_TARGET, "lower" if l_low else "exact"),
                     "quiet_s": q_ours, "loaded_s": l_ours})
    if "trl" in quiet["summary"] and "trl" in loaded["summary"]:
        q_trl, _, q_trl_low = step_of(quiet["summary"]["trl"])
        l_trl, l_trl_what, l_trl_low = step_of(loaded["summary"]["trl"])
        if l_trl_what != l_what:  # TRL finished less than ours: compare both sides' first steps
            q_ours, l_ours = quiet["summary"]["ours"]["first_step_s"], loaded["summary"]["ours"]["first_step_s"]
            q_trl, l_trl = quiet["summary"]["trl"]["first_step_s"], loaded["summary"]["trl"]["first_step_s"]
            l_what = "first step"
        if q_ours and l_ours and q_trl and l_trl:
            q_ratio, l_ratio = q_ours / q_trl, l_ours / l_trl
            growth = l_ratio / q_ratio
            # a lower bound on TRL's loaded step makes the loaded ratio, hence its growth, an upper bound
            bound = "upper" if l_trl_low and not l_low else "lower" if l_low and not l_trl_low else \
                "exact" if not (l_low or l_trl_low or q_trl_low) else "unknown"
            met = verdict(growth, RATIO_TARGET, bound)
            rows.append({"target": f"ours/TRL ({l_what}): loaded / quiet <= {RATIO_TARGET}", "value": growth,
                         "bound": bound, "met": met, "quiet_ratio": q_ratio, "loaded_ratio": l_ratio,
                         "trl_quiet_s": q_trl, "trl_loaded_s": l_trl})
    return rows


def rollout_rows(kind: str, bench: Path = BENCH) -> list[dict]:
    """Median generate time of the default engine per thread setting, quiet and under busy:1."""
    rows = []
    for name, path in (("quiet", f"results_rollout_{kind}_bf16_quiet_threads.json"),
                       ("quiet, OMP_WAIT_POLICY=PASSIVE", f"results_rollout_{kind}_bf16_passive.json"),
                       ("busy:1", f"results_rollout_{kind}_bf16_busy1.json"),
                       ("busy:1, OMP_WAIT_POLICY=PASSIVE", f"results_rollout_{kind}_bf16_busy1_passive.json")):
        data = _load(bench / path)
        for variant, times in (data or {}).get("times_s", {}).items():
            if times:
                rows.append({"run": name, "variant": variant, "median_generate_s": statistics.median(times),
                             "threads_used": data.get("threads_used", {}).get(variant)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", required=True, help="the CPU kind in the results files' names (avx512, amx, avx2)")
    p.add_argument("--dir", type=Path, default=BENCH, help="where the results files are (default: benchmarks/)")
    args = p.parse_args(argv)
    bench = args.dir
    out: dict = {"kind": args.kind, "targets": [], "rollout": rollout_rows(args.kind, bench), "llamacpp": None}
    quiet = _load(bench / f"results_vs_trl_{args.kind}_bf16.json")
    loaded = _load(bench / f"results_vs_trl_{args.kind}_bf16_busy1.json")
    if quiet and loaded:
        out["targets"] = trl_targets(quiet, loaded)
    print(f"\n## speed suite summary ({args.kind}, bf16)\n")
    for row in out["targets"]:
        verdict = {True: "MET", False: "NOT MET", None: "undecided (bounds)"}[row["met"]]
        print(f"- {row['target']}: {row['value']:.2f} ({row['bound']}) -> {verdict}; "
              + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith(("_s", "_ratio"))))
    if not out["targets"]:
        print("- vs_trl quiet and loaded results missing: no step targets")
    quiet_rollout = {r["variant"]: r["median_generate_s"] for r in out["rollout"] if r["run"] == "quiet"}
    base = next(iter(quiet_rollout.values()), None)
    for r in out["rollout"]:
        rel = f", {r['median_generate_s'] / base:.2f}x quiet" if base else ""
        print(f"- rollout {r['run']}: {r['variant']} {r['median_generate_s']:.2f} s (threads {r['threads_used']}){rel}")
    llama = _load(bench / f"results_llamacpp_{args.kind}_bf16.json")
    if llama:
        out["llamacpp"] = llama["ours_over_side_tokens_per_s"]
        for key, r in llama["results"].items():
            print(f"- {key}: {r['tokens_per_s']:.1f} tok/s"
                  + (f" (ours / it: {llama['ours_over_side_tokens_per_s'][key]:.2f}x)"
                     if key in llama["ours_over_side_tokens_per_s"] else ""))
    path = bench / f"results_speed_suite_{args.kind}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
