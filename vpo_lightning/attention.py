"""One attention function for transformers models, registered as ``vpo_sdpa``: SDPA, except in two cases where the
shape of this project's work lets it do less (issue 25).

- **Decode** (one query per row, bf16 on CPU): a grouped matmul against the KV cache. torch's CPU flash kernel
  took ~3 ms per layer for 16 rows x 400 cached tokens in bf16, the matmuls ~0.4 ms (AVX-512 CPU, measured).
- **Packed training rows** (``vpo_segments=(p, lengths)`` passed through the model's forward): a row is
  ``[prompt (p) | completion_1 | ... | completion_n]`` where each completion sees the prompt and its own prefix
  (``vpo_lightning.packing``). SDPA with the [T, T] block mask computes every pair of the row; here the prompt
  attends causally to itself once and each completion to ``[prompt | itself]``: p^2 / 2 + sum_i l_i (p + l_i)
  pairs instead of T^2 (~3x fewer for a tool-use group). The same values up to summation order, the same gradients.

Everything else goes to transformers' ``sdpa_attention_forward`` unchanged. ``vpo fit`` switches a model loaded with
SDPA to this function (:func:`use_vpo_attention`, called by ``load_base_model``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

NAME = "vpo_sdpa"


def _sdpa(*args: Any, **kwargs: Any) -> tuple[Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def decode_attention(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     scaling: float | None = None) -> Tensor:
    """Attention for one query per row as a grouped matmul (no ``repeat_kv``).

    Args:
        query: [b, heads, 1, d]; key, value: [b, kv_heads, n, d]; attention_mask: boolean [b, 1, 1, n] (True =
            attend) or None.

    Returns the output [b, 1, heads, d] (transformers' layout).
    """
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(b, kv_heads, heads // kv_heads, d)  # [b, kv_heads, groups, d]
    # k @ q^T rather than q @ k^T: torch's CPU bf16 matmul copies a transposed strided key first (3x slower)
    scores = torch.matmul(key, grouped.transpose(-1, -2))  # [b, kv_heads, n, groups]
    scores = scores.transpose(-1, -2).to(torch.float32, memory_format=torch.contiguous_format)  # [b, kv, groups, n]
    scores *= d**-0.5 if scaling is None else scaling
    if attention_mask is not None:
        scores.masked_fill_(~attention_mask[:, :, -1:, :], -math.inf)  # mask [b, 1, 1, n] broadcast
    weights = scores.softmax(-1).to(value.dtype)  # [b, kv_heads, groups, n]
    out = torch.matmul(weights, value)  # [b, kv_heads, groups, d]
    return out.reshape(b, 1, heads, d)


def segment_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, prompt_length: int,
                      lengths: Sequence[int], scaling: float | None = None) -> Tensor:
    """Attention of one packed row ``[prompt | completion_1 | ... | completion_n]``: the prompt causal over itself,
    completion i over ``[prompt | completion i]`` (all of the prompt, its own prefix causally).

    Args:
        query: [1, heads, T, d]; key, value: [1, kv_heads, T, d], T = prompt_length + sum(lengths).

    Returns the output [1, T, heads, d] (transformers' layout).
    """
    p = prompt_length
    outs = [_sdpa(module, query[:, :, :p], key[:, :, :p], value[:, :, :p], None, scaling=scaling, is_causal=True)[0]]
    start = p
    for n in lengths:
        if n == 0:
            continue
        keys = torch.cat([key[:, :, :p], key[:, :, start : start + n]], 2)  # [1, kv_heads, p + n, d]
        values = torch.cat([value[:, :, :p], value[:, :, start : start + n]], 2)  # [1, kv_heads, p + n, d]
        mask = torch.ones(n, p + n, dtype=torch.bool, device=query.device)  # [n, p + n]
        mask[:, p:] = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        outs.append(_sdpa(module, query[:, :, start : start + n], keys, values, mask[None, None], scaling=scaling,
                          is_causal=False)[0])  # [1, n, heads, d]
        start += n
    return torch.cat(outs, 1)  # [1, T, heads, d]


def vpo_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
             dropout: float = 0.0, scaling: float | None = None, vpo_segments: tuple[int, Sequence[int]] | None = None,
             **kwargs: Any) -> tuple[Tensor, None]:
    """transformers attention function (``AttentionInterface``): see the module docstring for when it does what.

    Args:
        query: [b, heads, q, d]; key, value: [b, kv_heads, n, d]; attention_mask: SDPA's boolean mask or None.
        vpo_segments: ``(prompt_length, completion lengths)`` of a packed row (b = 1, n = q = T).
    """
    if vpo_segments is not None and not dropout and query.shape[0] == 1 and key.shape[2] == query.shape[2]:
        return segment_attention(module, query, key, value, vpo_segments[0], vpo_segments[1], scaling), None
    decode = (query.shape[2] == 1 and not dropout and query.device.type == "cpu" and query.dtype != torch.float32
              and (attention_mask is None or attention_mask.dtype == torch.bool))
    if decode:  # float32 SDPA on CPU is as fast as the matmuls (measured), and GPUs have their own kernels
        return decode_attention(query, key, value, attention_mask, scaling), None
    return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@functools.cache
def register() -> str:
    """Register :func:`vpo_sdpa` (with SDPA's mask builder) in transformers' attention interfaces; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, vpo_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_vpo_attention(model: nn.Module) -> bool:
    """Switch a model loaded with ``attn_implementation="sdpa"`` to :func:`vpo_sdpa` (transformers'
    ``set_attn_implementation``); returns whether it did. SDPA computes everything :func:`vpo_sdpa` does not do
    itself, so outputs stay SDPA's up to summation order."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(register())
    return True


def uses_vpo_attention(model: nn.Module) -> bool:
    """Whether ``model`` (or the model it wraps) runs :func:`vpo_sdpa`."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME
