"""Pieces of the transformers engine's own decode loop (``TransformersEngine(decode_loop=True)``, issue 25).

A profile of one bf16 rollout on a 2-core AVX-512 CPU (B = 2, G = 8, 64 tokens, ``model.generate``) put 14% of the
time in ``torch.multinomial`` (on CPU it draws an exponential variate for every vocabulary entry: ~16 ms per step
at 16 x 49,152), 18% in ``scaled_dot_product_attention`` for a single query (~0.75 ms per layer and step in bf16,
4x a plain grouped matmul), and most of the remaining copies in the unmerged LoRA layers' dtype casts. Each piece
here removes one of these without changing what is sampled:

- :func:`sample_next`: temperature, top-k and top-p as transformers applies them, then one uniform variate per
  row through the cumulative distribution (the same distribution; other draws than ``multinomial``'s for the same
  seed). It also returns the token's log-probability under ``softmax(logits / T)``, which is what the trainer
  computes, so the engine can report it.
- :func:`vpo_lightning.generation.attention.decode_attention`: attention for one query per row as a grouped matmul
  (bf16 on CPU), ``scaled_dot_product_attention`` for anything else.
- :func:`merged_lora`: the adapter's ``B @ A * scale`` added to fresh copies of the base weights for the duration of
  a rollout, with the adapter disabled; the original weight tensors are put back untouched afterwards.
- :func:`prepacked_linears`: oneDNN-prepacked weights for the small-row products of a decode step (CPU);
  :func:`fast_linears` combines the two with one extra copy of the weights.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from vpo_lightning.generation import HFModel


def filter_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """``logits / temperature`` with the tokens outside top-k and outside the top-p nucleus set to -inf, as
    transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (in that order) do.

    Args:
        logits: [n, V] float logits of the next token.
    """
    scores = logits / temperature if temperature != 1.0 else logits  # [n, V]
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1)  # ascending, [n, V]
        remove = ordered.softmax(-1).cumsum(-1) <= 1 - top_p  # [n, V]
        remove[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(remove.scatter(-1, order, remove), -math.inf)
    return scores


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Draw one token per row from the filtered distribution by inverse-CDF sampling.

    Returns ``(tokens [n], logprobs [n])``; ``logprobs`` are ``log_softmax(logits / temperature)`` at the drawn
    tokens (before top-k/top-p: the policy's own log-probability, as the loss computes it).
    """
    logits = logits.float()  # [n, V]
    filtered = 0 < top_k < logits.shape[-1] or top_p < 1.0
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)  # [n, V]
    cdf = probs.cumsum(-1)  # [n, V]
    u = torch.rand(cdf.shape[0], 1, device=cdf.device, generator=generator)  # [n, 1]
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=cdf.shape[-1] - 1)  # [n, 1]
    if filtered:  # the policy's log-prob ignores the filters
        logprobs = (logits / temperature).log_softmax(-1).gather(-1, tokens)  # [n, 1]
    else:  # the sampling distribution is the policy's: its probability of the drawn token, logged
        logprobs = probs.gather(-1, tokens).clamp_(min=torch.finfo(probs.dtype).tiny).log()  # [n, 1]
    return tokens.squeeze(-1), logprobs.squeeze(-1)


def mergeable_lora_layers(model: nn.Module) -> list[Any] | None:
    """The PEFT LoRA layers of ``model`` if every one can be merged exactly into a plain float ``nn.Linear`` (no
    quantized base, no DoRA); None otherwise (or when there are none)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return None
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not all(mergeable_layer(layer) for layer in layers):
        return None
    return layers or None


def mergeable_layer(layer: Any) -> bool:
    """Whether a PEFT LoRA layer's active adapters merge exactly into its base: a plain float ``nn.Linear``, no DoRA."""
    base = layer.get_base_layer()
    if type(base) is not nn.Linear or not base.weight.dtype.is_floating_point:
        return False
    return not any(layer.use_dora.get(a, False) for a in layer.active_adapters)


def merged_weight(layer: Any) -> Tensor:
    """A LoRA layer's base weight plus its active adapters' ``B @ A * scale``, summed in float32 and rounded once to
    the weight's dtype: a new tensor [out, in] (the base weight is not written)."""
    weight = layer.get_base_layer().weight  # [out, in]
    merged = weight.detach().float()  # a copy unless the weights are float32 ...
    merged = merged.clone() if merged.data_ptr() == weight.data_ptr() else merged  # ... then one here
    for name in layer.active_adapters:
        if name in layer.lora_A:
            merged += layer.get_delta_weight(name)
    return merged.to(weight.dtype)


@contextlib.contextmanager
def merged_lora(model: HFModel) -> Iterator[bool]:
    """Within the block, ``model`` runs with its active LoRA adapters merged into copies of the base weights and the
    adapter layers disabled: one matmul per linear layer instead of three, no dtype casts between a float32
    adapter and a bf16 base (:func:`merged_weight`). On exit the original weight tensors are put back (bitwise
    unchanged: they were never written). Yields False, changing nothing, when the layers cannot be merged (see
    :func:`mergeable_lora_layers`) or ``model`` has no ``disable_adapter``. Costs one copy of the adapted weights
    while the block runs.
    """
    layers = mergeable_lora_layers(model) if hasattr(model, "disable_adapter") else None
    if layers is None:
        yield False
        return
    saved = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                saved.append((base, base.weight))
                base.weight = nn.Parameter(merged_weight(layer), requires_grad=False)
        with model.disable_adapter():
            yield True
    finally:
        for base, weight in saved:
            base.weight = weight


def prepack_linear_weight(weight: Tensor, rows: int) -> Tensor | None:
    """``weight`` [out, in] reordered by oneDNN for products with about ``rows`` input rows (the layout
    ``torch.compile``'s CPU backend prepares when it freezes weights), or None where torch has no oneDNN or the
    weight is not a float32/bf16 CPU tensor."""
    if not prepackable(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    except (AttributeError, RuntimeError):
        return None


def prepackable(weight: Tensor) -> bool:
    """Whether :func:`prepack_linear_weight` can prepack ``weight``: a CPU tensor of a dtype
    :func:`prepacking_works` for."""
    return weight.device.type == "cpu" and prepacking_works(weight.dtype)


@functools.cache
def prepacking_works(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU compute oneDNN-prepacked products in ``dtype`` (float32 or bf16), checked
    once per process on a small product against ``torch.nn.functional.linear``."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(24, 40, generator=g).to(dtype), torch.randn(3, 40, generator=g).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 3)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    ref = torch.nn.functional.linear(x.float(), weight.float())
    return out.shape == ref.shape and torch.allclose(out.float(), ref, rtol=2e-2, atol=5e-2)


def _packed_linear(packed: Tensor, dtype: torch.dtype, bias: Tensor | None, x: Tensor) -> Tensor:
    if x.dtype != dtype:  # not seen in practice (the layer's input has the model's dtype); kept correct anyway
        return _packed_linear(packed, dtype, bias, x.to(dtype)).to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@contextlib.contextmanager
def prepacked_linears(model: nn.Module, rows: int, weights: dict[nn.Module, Any] | None = None,
                   skip: set[nn.Module] | None = None) -> Iterator[int]:
    """Within the block (inference only: the weights must not change), every plain float ``nn.Linear`` of ``model``
    on CPU multiplies with a oneDNN-prepacked copy of its current weight. A decode step is ~16 rows against each
    weight, where torch's ``linear`` reaches about half the speed of the prepacked product (measured on an AVX-512
    CPU: all 210 layer products of SmolLM2 at 16 rows 24 -> 15 ms in bf16, 56 -> 26 ms in float32; its LM head 6.5
    -> 2.9 ms in bf16). bf16 results were bitwise equal to ``linear`` in our checks; float32 ones differ by summation
    order (~1e-4). Yields the number of layers switched (0: nothing changed). Costs one copy of those weights while
    the block runs.

    Args:
        weights: for these modules, a function returning the weight to prepack instead of their own (called once;
            the tensor is dropped after packing: how :func:`fast_linears` packs merged LoRA weights).
        skip: modules left as they are.
    """
    weights, skip = weights or {}, skip or set()
    switched: list[nn.Module] = []
    try:
        with torch.no_grad():
            for mod in model.modules():
                if type(mod) is not nn.Linear or "forward" in vars(mod) or mod in skip or not prepackable(mod.weight):
                    continue  # (checked before weights[mod]() computes a merged weight that would not be packed)
                packed = prepack_linear_weight(weights[mod]() if mod in weights else mod.weight, rows)
                if packed is None:
                    continue
                # an instance attribute over the class method; deleted in finally
                mod.forward = functools.partial(  # type: ignore[method-assign]
                    _packed_linear, packed, mod.weight.dtype, mod.bias)
                switched.append(mod)
        yield len(switched)
    finally:
        for mod in switched:
            del mod.forward


@contextlib.contextmanager
def fast_linears(model: HFModel, rows: int, merge: bool = True, prepack: bool = True) -> Iterator[None]:
    """The engine's linear layers for one rollout: the LoRA adapter merged (:func:`merged_lora`) and/or every
    weight prepacked (:func:`prepacked_linears`). With both, each merged weight is packed and dropped at once, so
    the block holds one extra copy of the weights (the packed one), not two."""
    layers = mergeable_lora_layers(model) if merge and hasattr(model, "disable_adapter") else None
    if prepack and layers is not None and all(prepackable(layer.get_base_layer().weight) for layer in layers):
        merged = {layer.get_base_layer(): functools.partial(merged_weight, layer) for layer in layers}
        adapters = {m for layer in layers for d in (layer.lora_A, layer.lora_B) for m in d.modules()}
        with prepacked_linears(model, rows, merged, skip=adapters), model.disable_adapter():
            yield
        return
    nothing = contextlib.nullcontext()
    with merged_lora(model) if merge else nothing, prepacked_linears(model, rows) if prepack else nothing:
        yield
