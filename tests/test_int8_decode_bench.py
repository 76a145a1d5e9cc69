"""benchmarks/int8_decode.py measures int8 products against the product's float ones (issue 43). Its two int8
products must be what it says: exact where int8 can represent the operands, so the gap it reports is rounding of
real weights and activations, not a bug in the quantization."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from int8_decode import DynamicInt8Linear, WeightOnlyInt8Linear


def _operands():
    """Integer weights whose rows reach 127 (row scale 1: stored exactly) and integer activations in [0, 127]
    including 127 (7-bit dynamic quantization: scale 1, offset 0)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (5, 8), generator=g).float()  # [out, in]
    w[:, 0] = 127.0
    x = torch.randint(0, 128, (3, 8), generator=g).float()  # [rows, in]
    x[0, 0] = 127.0
    return w, x, torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0])


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm (x86 only)")
def test_dynamic_int8_product_is_exact_on_representable_operands():
    w, x, bias = _operands()
    lin = DynamicInt8Linear(w, bias)
    torch.testing.assert_close(lin(x), x @ w.T + bias, rtol=0, atol=0)
    torch.testing.assert_close(lin.add(x, torch.ones(3, 5)), x @ w.T + bias + 1, rtol=0, atol=0)
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_weight_only_int8_product_is_exact_on_representable_operands():
    w, x, bias = _operands()
    lin = WeightOnlyInt8Linear(w, bias)
    torch.testing.assert_close(lin(x), x @ w.T + bias, rtol=0, atol=0)
    torch.testing.assert_close(lin(x[None]), (x @ w.T + bias)[None], rtol=0, atol=0)  # leading dims kept
    torch.testing.assert_close(lin.add(x, torch.ones(3, 5)), x @ w.T + bias + 1, rtol=0, atol=0)
