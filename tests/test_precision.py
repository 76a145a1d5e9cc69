"""Every shipped config's precision trains fp32 master weights (issue 55): after Lightning's setup on the tiny debug
model, every trainable parameter and every rotary ``inv_freq`` is fp32, with the base in the config's dtype; and the
frozen weights PEFT's k-bit preparation upcasts go back to the dtype they were loaded in."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from vpo_lightning.launcher import main
from vpo_lightning.training.module import VPOModule

REPO = Path(__file__).resolve().parents[1]


def _shipped_precisions() -> list[tuple[str, str]]:
    """(trainer.precision, model.model.dtype) of every shipped config (Lightning's default is 32-true)."""
    found = set()
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text()) or {}
        precision = str((cfg.get("trainer") or {}).get("precision", "32-true"))
        dtype = str(((cfg.get("model") or {}).get("model") or {}).get("dtype", "auto"))
        found.add((precision, dtype))
    return sorted(found)


class _Stop(Exception):
    pass


def _dtypes_after_setup(tmp_path: Path, monkeypatch, precision: str, dtype: str) -> dict:
    """Run `vpo fit` on the debug config up to ``on_fit_start`` (after the precision plugin converted the module)."""
    seen: dict = {}

    def probe(self: VPOModule) -> None:
        VPOModule.__mro__[1].on_fit_start(self)  # PolicyModule's check (it logs)
        seen["trainable"] = {p.dtype for p in self.trainable_parameters()}
        seen["inv_freq"] = {n: b.dtype for n, b in self.policy.named_buffers() if n.endswith("inv_freq")}
        seen["frozen"] = {p.dtype for p in self.policy.parameters() if not p.requires_grad}
        raise _Stop

    monkeypatch.setattr(VPOModule, "on_fit_start", probe)
    monkeypatch.chdir(tmp_path)
    data = str(REPO / "data/tooluse/val.jsonl")
    with pytest.raises(_Stop):
        main(["fit", "--config", str(REPO / "configs/debug.yaml"), f"--data.train_files=[{data}]",
              "--data.val_files=null", "--trainer.limit_val_batches=0", f"--trainer.precision={precision}",
              f"--model.model.dtype={dtype}"])
    return seen


@pytest.mark.parametrize(("precision", "dtype"), _shipped_precisions())
def test_shipped_precisions_train_fp32_weights_and_rope(tmp_path, monkeypatch, precision, dtype):
    seen = _dtypes_after_setup(tmp_path, monkeypatch, precision, dtype)
    assert seen["trainable"] == {torch.float32}, seen
    assert seen["inv_freq"] and set(seen["inv_freq"].values()) == {torch.float32}, seen
    if dtype == "bf16":  # the frozen base stays in the config's dtype: its memory is what vpo plan counts
        assert seen["frozen"] == {torch.bfloat16}, seen


def test_bf16_true_is_reported(tmp_path, monkeypatch, caplog):
    """What the GPU configs had: the whole module in bf16, LoRA and RoPE included; the run says so."""
    with caplog.at_level(logging.WARNING):
        seen = _dtypes_after_setup(tmp_path, monkeypatch, "bf16-true", "bf16")
    assert seen["trainable"] == {torch.bfloat16}
    assert "trainer.precision=32-true" in caplog.text and "inv_freq" in caplog.text


def test_kbit_preparation_upcast_is_undone(tmp_path):
    """prepare_model_for_kbit_training casts embeddings, head and norms to fp32 (+2 GiB on a 7B model, and fp32
    activations after every norm); they go back to the loaded dtype, the LoRA weights stay fp32."""
    pytest.importorskip("bitsandbytes")
    from vpo_lightning.generation import models

    out = tmp_path / "tiny-llama-64"
    models.build_tiny_model(out, hidden_size=64)  # 64 wide: bitsandbytes' CPU 4-bit kernels take it
    policy, _ = models.load_policy(models.ModelSettings(name=str(out), load_in_4bit=True, dtype="bf16",
                                                        bnb_compute_dtype="bf16", lora=models.LoraSettings(r=2)))
    frozen = {n: p.dtype for n, p in policy.named_parameters() if not p.requires_grad and p.dtype.is_floating_point}
    assert any("embed_tokens" in n for n in frozen) and set(frozen.values()) == {torch.bfloat16}, frozen
    assert {p.dtype for p in policy.parameters() if p.requires_grad} == {torch.float32}
