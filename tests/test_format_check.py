"""The format check (issue 53): a run that cannot learn (no answer parses, no reward spread) is told so, once, with
the cause and the fixes, and the progress bar shows it; the first rollout reports its parse rate per position."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vpo_lightning.core.format_check import FormatCheck, answer_layout
from vpo_lightning.launcher import main

REPO = Path(__file__).resolve().parents[1]


def test_first_rollout_reports_the_parse_rate_per_position():
    check = FormatCheck("vpo", 3, "response")
    mask = torch.tensor([[True, False, False], [True, True, False], [False, False, False], [True, False, False]])
    line = check.first_rollout(mask)  # 4 chains: position 1 parsed 3 times, position 2 once, position 3 never
    assert "<response_1> 3/4, <response_2> 1/4, <response_3> 0/4" in line and "(33%)" in line
    assert "none parsed" not in line
    assert check.first_rollout(mask) is None  # the first rollout only


def test_first_rollout_without_a_parsed_answer_names_the_tags():
    line = FormatCheck("vpo", 2, "route").first_rollout(torch.zeros(4, 2, dtype=torch.bool))
    assert "none parsed yet" in line and "<route_1>...</route_1> <route_2>...</route_2>" in line


def test_three_unparsed_steps_warn_once_with_the_cause_and_the_fixes():
    check = FormatCheck("vpo", 3, "response")
    assert check.update(0.0, 1.0, 0.0) is None and check.update(0.0, 1.0, 0.0) is None and check.note is None
    warning = check.update(0.0, 1.0, 0.0)
    assert warning is not None and check.note == "no parse"
    for fix in ("vpo sft", "--rollout.estimator grpo", "<response_1>...</response_1>", "<response_3>...</response_3>"):
        assert fix in warning, fix
    assert check.update(0.0, 1.0, 0.0) is None and check.note == "no parse"  # one warning per run
    assert check.update(0.1, 0.5, 0.05) is None and check.note is None  # the model learned the format


def test_a_step_that_parses_restarts_the_count():
    check = FormatCheck("vpo", 3, "fence")
    for rate in (0.0, 0.0, 0.2, 0.0, 0.0):
        assert check.update(rate, 0.5, 0.1) is None
    assert "```python fenced code blocks" in check.update(0.0, 0.5, 0.0)


def test_flat_groups_that_parse_get_the_spread_warning():
    check = FormatCheck("grpo", 1, "response")
    for _ in range(2):
        assert check.update(1.0, 1.0, 0.0) is None
    warning = check.update(1.0, 1.0, 0.0)
    assert "no reward spread" in warning and "every answer scored 0" in warning and check.note == "no spread"
    assert "<response_1>" not in warning  # grpo parses no tags: the tag format is not the cause


def test_answer_layout_matches_what_the_parser_reads():
    from vpo_lightning.core.chains import parse_chain

    text = answer_layout(2, "response").replace("...", "x")
    assert parse_chain(text, 2, "response") == ["x", "x"]


def test_a_run_whose_output_never_parses_is_told_so_in_its_first_steps(tmp_path, monkeypatch, capfd, caplog):
    """The tiny random model never writes <response_i> tags: the first rollout says none parsed, the third step
    warns with the fixes, the progress bar shows it, and the warning is repeated after the run."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="vpo_lightning")
    data = str(REPO / "data/tooluse/val.jsonl")
    main(["fit", "--config", str(REPO / "configs/debug.yaml"), f"--data.train_files=[{data}]",
          "--data.val_files=null", "--trainer.max_steps=3", "--rollout.log_samples_every=0"])
    printed = "".join(capfd.readouterr()) + caplog.text
    assert "first rollout: answers parsed per position: <response_1> 0/8, <response_2> 0/8, <response_3> 0/8" in printed
    assert printed.count("no answer parsed in 3 training steps in a row") == 2, printed  # logged, then repeated last
    assert "--rollout.estimator grpo" in printed and "`vpo sft`" in printed
    assert "check: no parse" in printed  # the progress bar
