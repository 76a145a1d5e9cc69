"""The settings that issue 37 aligns with the paper's reference run (PAPER_REPRO.md, vpo/augment.py, verl's
core_algos.py), as every shipped RL config resolves them: an explicit value in the YAML, else the class default."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from vpo_lightning.evaluate import build_engine
from vpo_lightning.module import LossSettings, OptimSettings

CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")
                 if "_sft" not in p.name)  # SFT configs train no policy loss
TOP_P_095 = ("tooluse", "eureqa")  # the reference samples tool use and EUREQA at top-p 0.95 at evaluation


def _resolved(cfg: dict, section: str, cls: type) -> dict:
    given = ((cfg.get("model") or {}).get(section) or {})
    return {f.name: given.get(f.name, f.default) for f in fields(cls)}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_resolves_the_reference_loss_optimiser_and_eval_settings(path):
    cfg = yaml.safe_load(path.read_text())
    loss, optim = _resolved(cfg, "loss", LossSettings), _resolved(cfg, "optim", OptimSettings)
    assert loss["dual_clip"] == 3.0 and loss["clip_low"] == loss["clip_high"] == 0.2 and loss["beta"] == 1e-3
    assert loss["aggregation"] == "token_mean"
    assert optim["weight_decay"] == 0.01 and optim["mini_batches"] == 2 and optim["num_iterations"] == 1
    assert optim["max_grad_norm"] == 1.0
    _, sampling = build_engine(cfg)
    assert sampling.temperature == 0.7
    assert sampling.top_p == (0.95 if path.stem.startswith(TOP_P_095) else 1.0)
    training = cfg["rollout"].get("sampling") or {}
    assert training.get("temperature", 1.0) == 1.0 and training.get("top_p", 1.0) == 1.0  # training: 1.0 / 1.0
