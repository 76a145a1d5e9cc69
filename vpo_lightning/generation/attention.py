"""One attention function for transformers models, registered as ``vpo_sdpa``: SDPA, except in two cases where the
shape of this project's work lets it do less (issue 25).

- **Decode** (one query per row, bf16 on CPU): a grouped matmul against the KV cache. torch's CPU flash kernel
  took ~3 ms per layer for 16 rows x 400 cached tokens in bf16, the matmuls ~0.4 ms (AVX-512 CPU, measured).
- **Packed training rows** (``vpo_segments=(p, lengths)`` passed through the model's forward): a row is
  ``[prompt (p) | completion_1 | ... | completion_n]`` where each completion sees the prompt and its own prefix
  (``vpo_lightning.core.packing``). SDPA with the [T, T] block mask computes every pair of the row; here the prompt
  attends causally to itself once and each completion to ``[prompt | itself]``: p^2 / 2 + sum_i l_i (p + l_i)
  pairs instead of T^2 (~3x fewer for a tool-use group). On CPU the completions' part is :class:`ChainAttention`
  (the prompt's keys in one flash call for all completions, merged with each completion's causal part). The same
  values up to summation order, the same gradients.

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

from vpo_lightning.generation import HFModel

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


class ChainAttention(torch.autograd.Function):
    """The completions of a packed row against ``[prompt | themselves]`` on CPU, as two flash-attention calls per
    row instead of one masked call per completion: every completion query against the prompt's keys in one call
    (no mask; the prompt's keys are read once for all completions), each completion causally against its own keys,
    then the two partial results merged by their log-sum-exps (float32). The backward calls the flash backward of
    each part with the merged output and log-sum-exp, which gives each part's exact share of the gradient (the
    split-KV scheme of FlashAttention). Measured on a 2-core AVX-512 CPU, 8 completions of 120 tokens after a
    480-token prompt, 9 query / 3 kv heads: forward + backward 69.7 -> 50.9 ms in bf16, 54.0 -> 44.5 ms in float32
    per layer (without the merge).

    ``forward(q [1, H, C, d], prompt_k, prompt_v [1, K, p, d], own_k, own_v [1, K, C, d], lengths, scale)`` with
    ``C = sum(lengths)``; returns [1, H, C, d].
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, prompt_k: Tensor, prompt_v: Tensor, own_k: Tensor, own_v: Tensor,
                lengths: tuple[int, ...], scale: float | None) -> Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_p, lse_p = flash(q, prompt_k, prompt_v, 0.0, False, scale=scale)  # [1, H, C, d], [1, H, C] float32
        out_o, lse_o = torch.empty_like(out_p), torch.empty_like(lse_p)
        for s, n in _spans(lengths):
            out_o[:, :, s : s + n], lse_o[:, :, s : s + n] = flash(q[:, :, s : s + n], own_k[:, :, s : s + n],
                                                                   own_v[:, :, s : s + n], 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_p, lse_o)  # [1, H, C]
        out = (out_p.float() * (lse_p - lse).exp().unsqueeze(-1)
               + out_o.float() * (lse_o - lse).exp().unsqueeze(-1)).to(q.dtype)  # [1, H, C, d]
        ctx.save_for_backward(q, prompt_k, prompt_v, own_k, own_v, out, lse)
        ctx.lengths, ctx.scale = lengths, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, prompt_k, prompt_v, own_k, own_v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk_p, dv_p = backward(grad, q, prompt_k, prompt_v, out, lse, 0.0, False, scale=ctx.scale)
        dk_o, dv_o = torch.zeros_like(own_k), torch.zeros_like(own_v)
        for s, n in _spans(ctx.lengths):
            part = slice(s, s + n)
            dq_o, dk_o[:, :, part], dv_o[:, :, part] = backward(
                grad[:, :, part], q[:, :, part], own_k[:, :, part], own_v[:, :, part], out[:, :, part],
                lse[:, :, part], 0.0, True, scale=ctx.scale)
            dq[:, :, part] += dq_o
        return dq, dk_p, dv_p, dk_o, dv_o, None, None


def _spans(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each non-empty completion within the completions' part of a packed row."""
    spans, start = [], 0
    for n in lengths:
        if n:
            spans.append((start, n))
        start += n
    return spans


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
    if query.device.type == "cpu" and p > 0 and sum(lengths) > 0:  # the completions: ChainAttention
        chains = ChainAttention.apply(query[:, :, p:], key[:, :, :p], value[:, :, :p], key[:, :, p:], value[:, :, p:],
                                      tuple(lengths), scaling)  # [1, H, C, d]
        return torch.cat([outs[0], chains.transpose(1, 2)], 1)  # [1, T, heads, d]
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


def use_vpo_attention(model: HFModel) -> bool:
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
