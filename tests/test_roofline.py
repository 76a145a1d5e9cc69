"""benchmarks/roofline.py: the bound arithmetic on hand-worked shapes (exact values), the config reader, and the
per-step fractions from a recorded vs_trl result."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import roofline

# 1 layer, 1 head of dim 2, 10 linear parameters, a 6-parameter LM head
SHAPE = roofline.Shape(layers=1, heads=1, kv_heads=1, head_dim=2, linear_params=10, head_params=6)


def test_shape_from_config_counts_linear_and_head_parameters():
    cfg = SimpleNamespace(hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=2, intermediate_size=8, vocab_size=10)
    shape = roofline.Shape.from_config(cfg)
    # per layer: q 4x4 + k, v 4x2 each + o 4x4 + gate/up/down 3 x 4x8 = 16 + 16 + 16 + 96 = 144
    assert shape == roofline.Shape(layers=2, heads=2, kv_heads=1, head_dim=2, linear_params=288, head_params=40)


def test_shape_from_config_defaults_head_dim_and_kv_heads():
    cfg = SimpleNamespace(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, intermediate_size=1,
                          vocab_size=1)
    shape = roofline.Shape.from_config(cfg)
    assert (shape.kv_heads, shape.head_dim) == (2, 2)


def test_rollout_bound_memory_limited_decode():
    # prefill: 2*10*2 linear + 8 flops/pair * 4/2 pairs = 40 + 16 = 56 flops
    # decode t=1, 2 rows, context 3: flops 2 * (2*16 + 8*3) = 112; bytes 16 weights * 4 + (1 prompt * 2 + 2 rows *
    # 1) cache tokens * 16 = 64 + 64 = 128 (the prompt's cache once: its two chains share it)
    assert roofline.rollout_bound_s(SHAPE, 1, 2, 2, 1, 4, bandwidth=1.0, peak=1.0) == pytest.approx(56 + 128)


def test_rollout_bound_compute_limited_decode():
    # the same step with 10x the bandwidth: bytes take 16 s, flops 112 s
    assert roofline.rollout_bound_s(SHAPE, 1, 2, 2, 1, 4, bandwidth=10.0, peak=1.0) == pytest.approx(56 + 112)


def test_rollout_bound_sums_decode_steps_with_growing_context():
    # t=1: max(128, 112); t=2, context 4: flops 2 * (32 + 32) = 128, bytes 64 + (2 + 2*2) * 16 = 160
    assert roofline.rollout_bound_s(SHAPE, 1, 2, 2, 2, 4, bandwidth=1.0, peak=1.0) == pytest.approx(56 + 128 + 160)


def test_decode_step_bound_at_a_fractional_mean_step():
    # decode_step.py asks for the mean step of a rollout: t = 1.5, context 3.5: flops 2 * (32 + 8 * 3.5) = 120,
    # bytes 64 + (2 + 2 * 1.5) * 16 = 144
    assert roofline.decode_step_bound_s(SHAPE, 1, 2, 2, 1.5, 4, bandwidth=1.0, peak=1.0) == pytest.approx(144)
    assert roofline.decode_step_bound_s(SHAPE, 1, 2, 2, 1.5, 4, bandwidth=10.0, peak=1.0) == pytest.approx(120)


def test_train_bound_counts_reference_pass_only_with_reference():
    # 1 prompt of 2 tokens + 4 completion tokens (G=2, mean length 2): tokens 6, pairs 4/2 + 4 * (2 + 1) = 14
    # one pass: 2*10*6 + 2*6*4 + 8*14 = 120 + 48 + 112 = 280 flops
    assert roofline.train_bound_s(SHAPE, 1, 2, 4, 2, reference=True, peak=1.0) == pytest.approx(3 * 280)
    assert roofline.train_bound_s(SHAPE, 1, 2, 4, 2, reference=False, peak=2.0) == pytest.approx(2 * 280 / 2)


def test_fractions_from_a_recorded_run():
    result = {"settings": {"prompts_per_step": 1, "group_size": 2, "beta": 0.001},
              "runs": {"ours": [{"step_s": [9.0, 1000.0], "gen_s": [1.0, 216.0], "gen_tokens": [3, 4],
                                 "gen_longest": [2, 1], "prompt_tokens": [4, 4]}]}}
    bounds = {"matmul_fp32_gflops": 1e-9, "read_bandwidth_gbs": 1e-9}  # 1 flop/s, 1 byte/s
    (row,) = roofline.fractions(result, SHAPE, bounds, "fp32")  # the first step is the warm-up
    assert row["prompt_len"] == 2  # 4 prompt tokens over 1 x 2 chains
    assert row["rollout_fraction"] == pytest.approx(184 / 216)  # the bound of the memory-limited test above
    assert row["train_fraction"] == pytest.approx(840 / 784)
    assert row["rollout_tokens_per_s"] == pytest.approx(4 / 216)


def test_bounds_are_positive_on_this_machine():
    assert roofline.measure_bandwidth(mib=8, repeats=1) > 0
    assert roofline.measure_matmul(roofline.torch.float32, n=64, repeats=1) > 0


@pytest.mark.parametrize(("flags", "native"), [(["avx2"], False), (["avx2", "avx512f"], False),
                                               (["avx2", "avx512f", "avx512_bf16"], True), (["amx_bf16"], True)])
def test_native_bf16_only_with_avx512_bf16_or_amx(flags, native):
    assert roofline.native_bf16({"model": "x", "flags": flags, "cpus": 2}) is native


@pytest.mark.parametrize(("flags", "kind"), [([], "other"), (["avx2"], "avx2"), (["avx2", "avx512f"], "avx512"),
                                             (["avx2", "avx512f", "avx512_bf16"], "avx512"),
                                             (["avx2", "avx512f", "avx512_bf16", "amx_bf16"], "amx")])
def test_cpu_kind_names_the_results_file(flags, kind):
    assert roofline.cpu_kind({"model": "x", "flags": flags, "cpus": 2}) == kind
