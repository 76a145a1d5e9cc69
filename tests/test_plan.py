"""``vpo plan``: every shipped config parses, estimates are positive and grow with the batch and the length, and a card
that is too small fails with a message naming the knob to change."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vpo_lightning.commands import plan as vplan

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
GiB = 2**30


def _plan(path: Path, **overrides) -> tuple[vplan.Plan, vplan.Arch]:
    p = vplan.plan_from_config(vplan.load_config(path), for_gpu=True)
    arch, _ = vplan.model_arch(p.model)
    return replace(p, **overrides), arch


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_gives_a_positive_estimate(config: Path) -> None:
    p, arch = _plan(config)
    est = vplan.finalize(vplan.estimate(p, arch), 24 * GiB)
    assert est["peak"] > est["resident_total"] > 0
    assert all(v >= 0 for part in ("resident", "train", "rollout") for v in est[part].values())
    assert est["train_total"] > 0 and est["rollout_total"] > 0


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_estimate_is_monotone_in_micro_batch_and_length(config: Path) -> None:
    p, arch = _plan(config, gradient_checkpointing=False)
    by_mb = [vplan.peak_bytes(replace(p, micro_batch_size=mb), arch) for mb in (1, 2, 4, 8, 16)]
    assert by_mb == sorted(by_mb) and by_mb[-1] > by_mb[0]
    by_len = [vplan.peak_bytes(replace(p, max_new_tokens=n), arch) for n in (64, 128, 256, 512, 1024)]
    assert by_len == sorted(by_len) and by_len[-1] > by_len[0]
    with_gc = vplan.peak_bytes(replace(p, gradient_checkpointing=True, micro_batch_size=16), arch)
    assert with_gc < vplan.peak_bytes(replace(p, micro_batch_size=16), arch)


def test_shared_prompt_counts_the_prompt_once() -> None:
    p, arch = _plan(ROOT / "configs" / "tooluse.yaml", gradient_checkpointing=False, micro_batch_size=8, dtype="fp32",
                    prompt_tokens=500, max_new_tokens=192, group_size=8)
    full_layer = 4 * (vplan.ACT_VALUES_PER_H * arch.hidden + vplan.ACT_VALUES_PER_I * arch.intermediate)
    packed = vplan.estimate(replace(p, share_prompt=True), arch)["train"]
    plain = vplan.estimate(replace(p, share_prompt=False), arch)["train"]
    assert packed["activations (1 packed row of 500 + 8 x 192 tokens, 30 layers)"] == (500 + 8 * 192) * 30 * full_layer
    assert plain["activations (8 x 692 tokens, 30 layers)"] == 8 * 692 * 30 * full_layer
    # a micro-batch larger than G adds nothing when rows hold one group's chains
    assert vplan.peak_bytes(replace(p, micro_batch_size=16), arch) == vplan.peak_bytes(p, arch)


def test_four_bit_is_smaller_than_bf16() -> None:
    p, arch = _plan(ROOT / "configs" / "tooluse_qwen7b_qlora.yaml")
    assert vplan.peak_bytes(p, arch) < vplan.peak_bytes(replace(p, load_in_4bit=False, dtype="bf16"), arch)


def test_cli_fits_and_suggests(capsys: pytest.CaptureFixture) -> None:
    assert vplan.main(["--config", str(ROOT / "configs" / "tooluse.yaml"), "--gpu-mem", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "estimated peak" in out and "model.optim.micro_batch_size=" in out


def test_too_small_card_names_the_knob(capsys: pytest.CaptureFixture) -> None:
    code = vplan.main(["--config", str(ROOT / "configs" / "tooluse.yaml"), "--gpu-mem", "0.5GB"])
    err = capsys.readouterr().err
    assert code == 1
    assert "does not fit" in err and "model.model.load_in_4bit" in err and "rollout.group_size" in err


def test_config_that_fits_only_with_smaller_micro_batch_says_which(capsys: pytest.CaptureFixture) -> None:
    config = str(ROOT / "configs" / "tooluse.yaml")
    args = ["--config", config, "--set", "model.optim.micro_batch_size=16", "--set",
            "model.model.gradient_checkpointing=false"]
    need = vplan.peak_bytes(*_plan(Path(config), micro_batch_size=16, gradient_checkpointing=False))
    code = vplan.main([*args, "--gpu-mem", f"{need * 0.7 / GiB:.2f}GB"])
    captured = capsys.readouterr()
    assert code == 1
    assert "does NOT fit as configured" in captured.out and "model.optim.micro_batch_size=" in captured.out


def test_unknown_hub_model_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  model:\n    name: nobody/unknown-model\n")
    assert vplan.main(["--config", str(cfg), "--gpu-mem", "24GB"]) == 2
    assert "nobody/unknown-model" in capsys.readouterr().err


def test_parse_size() -> None:
    assert vplan.parse_size("24GB") == 24 * GiB == vplan.parse_size("24GiB") == vplan.parse_size("24g")
    assert vplan.parse_size("1500MB") == 1500 * 2**20
    with pytest.raises(ValueError):
        vplan.parse_size("lots")
