"""benchmarks/speed_summary.py, cpuload.py and vs_trl.summarise (issue 43): the target arithmetic with bounds, the load
spec and the summary of a run cut off by --timeout, on hand-made results (exact values; nothing is timed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cpuload
import speed_summary
import vs_trl


def _side(median, first, lower=False, timed_out=0):
    return {"median_step_s": median, "first_step_s": first, "median_step_is_lower_bound": lower,
            "timed_out_runs": timed_out}


def test_targets_exact_when_every_step_finished():
    quiet = {"summary": {"ours": _side(20.0, 25.0), "trl": _side(80.0, 120.0)}}
    loaded = {"summary": {"ours": _side(40.0, 50.0), "trl": _side(240.0, 300.0)}}
    step, ratio = speed_summary.trl_targets(quiet, loaded)
    assert step["value"] == 2.0 and step["bound"] == "exact" and step["met"] is True  # 40 / 20 <= 2.5
    # quiet 20/80 = 0.25, loaded 40/240 = 1/6: the ratio shrank to 2/3 of the quiet one
    assert ratio["value"] == pytest.approx(2 / 3) and ratio["bound"] == "exact" and ratio["met"] is True


def test_a_trl_side_cut_off_makes_the_ratio_an_upper_bound():
    quiet = {"summary": {"ours": _side(20.0, 25.0), "trl": _side(80.0, 120.0)}}
    loaded = {"summary": {"ours": _side(60.0, 70.0), "trl": _side(100.0, 150.0, lower=True, timed_out=1)}}
    step, ratio = speed_summary.trl_targets(quiet, loaded)
    assert step["value"] == 3.0 and step["met"] is False  # 60 / 20 > 2.5
    # loaded 60/100 = 0.6 (at most: TRL's 100 s is a lower bound), quiet 0.25: 2.4x, above 1.5 -> undecided
    assert ratio["value"] == pytest.approx(2.4) and ratio["bound"] == "upper" and ratio["met"] is None


def test_first_steps_compared_when_trl_never_passed_its_warm_up():
    quiet = {"summary": {"ours": _side(20.0, 25.0), "trl": _side(80.0, 120.0)}}
    loaded = {"summary": {"ours": _side(30.0, 40.0), "trl": _side(None, 300.0, timed_out=1)}}
    _, ratio = speed_summary.trl_targets(quiet, loaded)
    # first steps: quiet 25/120, loaded 40/300 (TRL's at least): (40/300) / (25/120) = 0.64, an upper bound <= 1.5
    assert ratio["target"].startswith("ours/TRL (first step)")
    assert ratio["value"] == pytest.approx(0.64) and ratio["bound"] == "upper" and ratio["met"] is True


def test_verdict_with_bounds():
    assert speed_summary.verdict(2.0, 2.5, "exact") is True
    assert speed_summary.verdict(3.0, 2.5, "lower") is False  # at least 3.0
    assert speed_summary.verdict(2.0, 2.5, "lower") is None  # at least 2.0: could be either
    assert speed_summary.verdict(2.0, 2.5, "upper") is True
    assert speed_summary.verdict(3.0, 2.5, "upper") is None


def test_parse_load():
    assert cpuload.parse_load("none", [0, 1]) == []
    assert cpuload.parse_load("busy:1", [0, 1]) == [1]  # the last allowed core
    assert cpuload.parse_load("busy:2", [0, 1]) == [0, 1]
    assert cpuload.parse_load("busy:1@0", [0, 1]) == [0]
    for bad, message in (("busy:3", "only 2 core"), ("busy:1@5", r"core\(s\) \[5\]"), ("idle:1", "expected"),
                         ("busy:2@1", "exactly 2 distinct")):
        with pytest.raises(ValueError, match=message):
            cpuload.parse_load(bad, [0, 1])


def test_results_label_names_kind_dtype_and_load():
    cpu = {"model": "x", "flags": ["avx2", "avx512f", "avx512_bf16"], "cpus": 2}
    assert cpuload.results_label(cpu, "bf16", "none") == "avx512_bf16"
    assert cpuload.results_label(cpu, "bf16", "busy:1") == "avx512_bf16_busy1"
    assert cpuload.results_label({**cpu, "flags": ["amx_bf16", "avx512f"]}, "fp32", "busy:1@0") == "amx_fp32_busy1at0"


def test_summarise_counts_the_unfinished_step_of_a_cut_off_run_as_a_lower_bound():
    done = {"step_s": [30.0, 10.0, 12.0], "gen_s": [5.0, 4.0, 4.0], "gen_tokens": [100, 80, 120], "chains_per_step": 4,
            "peak_rss_bytes": 2**30, "rss_after_setup_bytes": 2**29}
    cut = {**done, "step_s": [40.0, 20.0], "gen_s": [6.0, 5.0], "gen_tokens": [90, 100], "timed_out": True,
           "unfinished_step_s_at_least": 50.0}
    s = vs_trl.summarise([done, cut], warmup=1)
    # measured steps 10, 12 (done), 20 (cut) and the unfinished >= 50: median (12 + 20) / 2 = 16, a lower bound
    assert s["median_step_s"] == 16.0 and s["median_step_is_lower_bound"] is True
    assert s["first_step_s"] == 35.0 and s["steps_measured"] == 3 and s["timed_out_runs"] == 1
    cut_in_warm_up = {**done, "step_s": [], "gen_s": [], "gen_tokens": [], "timed_out": True,
                      "unfinished_step_s_at_least": 200.0}
    s = vs_trl.summarise([cut_in_warm_up], warmup=1)
    assert s["median_step_s"] is None and s["first_step_s"] == 200.0
