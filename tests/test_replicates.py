"""Seed-replicated comparison: per-prompt alignment, the hierarchical bootstrap on hand-checkable inputs, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from vpo_lightning.commands.evaluate import FORMAT
from vpo_lightning.commands.replicates import bootstrap_interval, main, paired_difference, parse_group, prompt_values


def _report(label: str, best: dict[str, list[float]], estimator: str = "vpo", tokens: int | None = 100) -> dict:
    prompts = [{"id": pid, "best_at_k": curve, "pass_at_k": [0.0] * len(curve), "pairwise_l1_diversity": None
                if pid == "b" else 1.0, "within_chain_diversity": None, "expected_best_weighted": curve[-1],
                "pareto_fraction": 0.5} for pid, curve in best.items()]
    return {"format": FORMAT, "label": label, "n": 3, "estimator": estimator, "m": 3 if estimator == "vpo" else 1,
            "num_prompts": len(prompts), "data_file": "d.jsonl", "prompts": prompts,
            "training": None if tokens is None else {"generated_tokens": tokens}}


def test_prompt_values_align_on_ids_and_mark_undefined_as_nan() -> None:
    a = _report("a", {"x": [0.1, 0.2, 0.3], "b": [0.4, 0.5, 0.6]})
    b = _report("b", {"b": [0.7, 0.8, 0.9], "x": [0.0, 0.0, 1.0]})  # other order
    v = prompt_values([a, b], "best_at_k", 2)
    assert v.tolist() == [[0.2, 0.5], [0.0, 0.8]]
    assert prompt_values([a, b], "best_at_k", 5).isnan().all()  # k beyond the pool
    d = prompt_values([a], "pairwise_l1_diversity")
    assert d[0, 0] == 1.0 and math.isnan(d[0, 1])
    with pytest.raises(ValueError, match="other prompts"):
        prompt_values([a, _report("c", {"x": [0.0] * 3})], "best_at_k", 1)


def test_bootstrap_interval_on_hand_checkable_inputs() -> None:
    assert bootstrap_interval(torch.full((3, 4), 0.25, dtype=torch.float64)) == (0.25, 0.25, 0.25)
    mean, low, high = bootstrap_interval(torch.tensor([[0.0, 1.0]], dtype=torch.float64))
    assert (mean, low, high) == (0.5, 0.0, 1.0)  # draws are means of 2 of {0, 1}: 0, 0.5 or 1
    mean, low, high = bootstrap_interval(torch.tensor([[math.nan, 1.0]], dtype=torch.float64))
    assert (mean, low, high) == (1.0, 1.0, 1.0)  # NaN prompts ignored; all-NaN draws dropped
    vals = torch.tensor([[0.2, 0.4, 0.6], [0.3, 0.5, 0.7]], dtype=torch.float64)
    mean, low, high = bootstrap_interval(vals, seed=3)
    assert mean == pytest.approx(0.45) and 0.2 <= low < mean < high <= 0.7
    assert bootstrap_interval(vals, seed=3) == (mean, low, high)  # seeded
    assert all(math.isnan(x) for x in bootstrap_interval(torch.full((1, 2), math.nan, dtype=torch.float64)))
    with pytest.raises(ValueError, match="seeds, prompts"):
        bootstrap_interval(torch.zeros(3))


def test_paired_difference_pairs_the_prompts() -> None:
    """Prompts vary a lot (0 to 0.9) but a is b + 0.1 on every prompt: the paired interval is exactly [0.1, 0.1],
    where two separate intervals would overlap widely."""
    b = torch.tensor([[0.0, 0.3, 0.6, 0.9], [0.0, 0.3, 0.6, 0.9]], dtype=torch.float64)
    diff, low, high = paired_difference(b + 0.1, b[:1])
    assert (diff, low, high) == pytest.approx((0.1, 0.1, 0.1))
    a_mean, a_low, a_high = bootstrap_interval(b + 0.1)
    assert a_low < b.mean() < a_high  # unpaired: the two methods' intervals overlap
    # seeds resampled per side: a's two seeds differ by 0.2 on every prompt, b's one seed sits between them
    a = torch.stack([b[0], b[0] + 0.2])
    diff, low, high = paired_difference(a, b[:1], seed=1)
    assert diff == pytest.approx(0.1) and (low, high) == pytest.approx((0.0, 0.2))  # seed draws: 0, .1 or .2
    assert paired_difference(a, b[:1], seed=1) == (diff, low, high)  # seeded
    nan = torch.tensor([[math.nan, 1.0]], dtype=torch.float64)  # NaN prompts ignored on each side
    assert paired_difference(nan, torch.tensor([[0.5, 0.5]], dtype=torch.float64)) == pytest.approx((0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference(torch.zeros(1, 3), torch.zeros(1, 4))


def test_cli_writes_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = {}
    for name, curves, est in (("vpo0", [0.2, 0.6, 0.9], "vpo"), ("vpo1", [0.3, 0.7, 0.8], "vpo"),
                              ("grpo0", [0.5, 0.5, 0.5], "grpo")):
        paths[name] = tmp_path / name / "eval.json"
        paths[name].parent.mkdir()
        paths[name].write_text(json.dumps(_report(name, {"x": curves, "b": curves}, est)))
    out = tmp_path / "res.md"
    code = main(["--group", f"VPO={paths['vpo0'].parent},{paths['vpo1']}", "--group", f"GRPO={paths['grpo0']}",
                 "--out", str(out), "--ks", "1,3", "--draws", "200"])
    assert code == 0, capsys.readouterr().err
    text = out.read_text()
    assert "| VPO | vpo | 3 | 2 | 2 | 0.250 [" in text and "| GRPO | grpo | 1 | 1 | 2 | 0.500 [0.500, 0.500] |" in text
    assert (tmp_path / "res_best_at_k.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["--group", "nolabel", "--out", str(out)]) == 2 and "LABEL=eval1" in capsys.readouterr().err
    assert parse_group("A = x, y") == ("A", ["x", "y"])
