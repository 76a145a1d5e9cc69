"""A lean prefill and decode step for Llama-family models on CPU (``TransformersEngine(fused_decode=True)``, issue 25).

After the second pass of issue 25 a bf16 decode step of SmolLM2-135M over 16 rows took ~65 ms on a 2-core AVX-512
CPU, of which ~20 ms were Python and small operations in transformers' module code (~1,500 dispatched operations:
mask building, cache updates, three projections where one would do, dtype casts) and ~29 ms seven separate
prepacked products per layer. :class:`FusedDecoder` runs the same arithmetic from the same weights with less around
it, and builds those weights once per rollout:

- the LoRA adapter merged into each projection (:func:`vpo_lightning.generation.decoding.merged_weight`);
- the query, key and value projections as one product, the gate and up projections as one (4 products per layer
  instead of 7: fewer, wider products), each weight prepacked by oneDNN for the decode's row count where torch can
  (:func:`vpo_lightning.generation.decoding.prepack_linear_weight`);
- the residual sums fused into the output and down products (oneDNN post-ops);
- the prompt's keys and values kept once per prompt, not once per chain: the G chains of a group attend to the
  same prompt cache, so a decode step's attention over the prompt is one product per prompt and kv head for all
  G x heads/kv_heads queries (the prompt cache is read once instead of G times, as in cascade attention), plus one
  small product per chain over its own ``budget`` slots (the unwritten ones masked, so every step has the same
  shapes), joined by one float32 softmax;
- RMSNorm, rotary embeddings (the model's own rotary module computes cos/sin, so every RoPE scaling type it knows
  applies) and SiLU as transformers' Llama code computes them, in the same dtypes; the prefill's attention through
  SDPA.

Measured (2-core AVX-512 CPU, bf16, SmolLM2-135M, 16 rows, ~360 prompt tokens): a decode step ~65 ms -> ~36 ms, of
which the products of the linear layers are ~18 ms (~12 ms at one row: reading the weights), the attention products
~7 ms, and the rest small operations and Python.

It is a second implementation of the model's forward, so its log-probs differ from the trainer's by rounding (the
engine reports them: ``train/engine_logprob_gap``); tests check its logits against the model's own forward and its
greedy tokens against ``model.generate`` in float32. It covers ``llama``, ``mistral`` and ``qwen2`` models with plain
(or LoRA-adapted) float linear layers, SiLU MLPs and no sliding window; :meth:`FusedDecoder.build` returns None for
anything else, and the engine then decodes through the model's forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vpo_lightning.generation import HFModel
from vpo_lightning.generation.decoding import mergeable_layer, merged_weight, prepack_linear_weight, prepackable

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class FusedLinear:
    """``x @ weight.T + bias`` with ``weight`` prepacked by oneDNN where torch can (CPU, float32/bf16), plain
    ``F.linear`` otherwise; holds only the prepacked copy when prepacking works. :meth:`add` adds another tensor to the
    output inside the prepacked product (a oneDNN post-op: one pass over the output instead of two, applied before
    the final rounding to the output dtype)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, rows: int, prepack: bool = True) -> None:
        self.bias = None if bias is None else bias.detach()
        self.prepacked = prepack_linear_weight(weight, rows) if prepack and prepackable(weight) else None
        self.weight = weight.detach() if self.prepacked is None else None

    def __call__(self, x: Tensor) -> Tensor:
        if self.weight is None:  # exactly one of weight and prepacked is set
            return torch.ops.mkldnn._linear_pointwise(x, self.prepacked, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add(self, x: Tensor, other: Tensor) -> Tensor:
        """``(x @ W.T + b) + other`` (a residual connection)."""
        if self.weight is None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.prepacked, self.bias, "add")
        return F.linear(x, self.weight, self.bias) + other


@dataclass
class FusedLayer:
    """One decoder layer's weights: the norms' scales, the fused projections."""

    norm_in: Tensor  # [H]
    norm_post: Tensor  # [H]
    qkv: FusedLinear  # [H] -> [(heads + 2 kv_heads) * head_dim]
    out: FusedLinear  # [heads * head_dim] -> [H]
    gate_up: FusedLinear  # [H] -> [2 I]
    down: FusedLinear  # [I] -> [H]


def _weight_and_bias(module: Any, merge: bool) -> tuple[Tensor, Tensor | None] | None:
    """A projection's effective weight [out, in] and bias: a plain float ``nn.Linear``'s own, or a LoRA layer's base
    weight with its active adapters merged (``merge``); None for anything else (quantized, DoRA, unmerged LoRA)."""
    try:
        from peft.tuners.lora import LoraLayer

        lora_types: tuple[type, ...] = (LoraLayer,)
    except ImportError:  # pragma: no cover - peft is a dependency
        lora_types = ()
    is_lora = isinstance(module, lora_types)  # (a bool: module stays duck-typed below)
    if is_lora:
        active = [a for a in module.active_adapters if a in module.lora_A] if not module.disable_adapters else []
        if not active:  # the adapter is off: the base layer as it is
            return _weight_and_bias(module.get_base_layer(), merge)
        return (merged_weight(module), module.get_base_layer().bias) if merge and mergeable_layer(module) else None
    if type(module) is nn.Linear and module.weight.dtype.is_floating_point:
        return module.weight.detach(), module.bias
    return None


def _fused(modules: list[Any], rows: int, merge: bool, prepack: bool) -> FusedLinear | None:
    """One :class:`FusedLinear` for projections that read the same input: weights (and biases) stacked by rows."""
    parts = [_weight_and_bias(m, merge) for m in modules]
    found = [p for p in parts if p is not None]
    if len(found) != len(parts):
        return None
    weights = [w for w, _ in found]
    biases = [b for _, b in found]
    bias: Tensor | None = None
    if any(b is not None for b in biases):
        filled = [b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)]
        bias = torch.cat(filled) if len(filled) > 1 else filled[0]
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]  # [sum(out), in]
    return FusedLinear(weight, bias, rows, prepack)


def supports(model: HFModel) -> str | None:
    """Why :class:`FusedDecoder` cannot run ``model`` (a sentence), or None when it can."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model_type {kind!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "mlp_bias", False):
        return "the MLP is not a bias-free SiLU MLP"
    if getattr(cfg, "sliding_window", None) is not None or (getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return "sliding-window attention or pretraining_tp > 1"
    decoder = getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    embed = getattr(decoder, "embed_tokens", None)
    if layers is None or not hasattr(base, "lm_head") or type(embed) is not nn.Embedding:
        return "not a <Model>ForCausalLM with model.layers, model.embed_tokens and lm_head"
    for layer in layers:
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms):
            return "a layer's norms are not RMSNorm"
    return None


class FusedDecoder:
    """The model's forward for a shared prefill and a batched decode, from weights built once (see the module
    docstring). Use: ``build`` (None if unsupported), then ``prefill(ids, mask, group_size, budget)`` once, then
    ``step(tokens, t)`` for t = 0, 1, ... (the first step feeds the prompts' last tokens)."""

    def __init__(self, base: HFModel, layers: list[FusedLayer], head: FusedLinear) -> None:
        cfg = base.config
        self.embed = base.model.embed_tokens.weight.detach()  # [V, H]
        self.norm = base.model.norm.weight.detach()  # [H]
        self.eps = base.model.norm.variance_epsilon
        self.layer_eps = [(layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon)
                          for layer in base.model.layers]
        self.rotary = base.model.rotary_emb
        self.layers, self.head = layers, head
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.inter = cfg.intermediate_size

    @classmethod
    def build(cls, model: HFModel, rows: int, merge: bool = True, prepack: bool = True) -> FusedDecoder | None:
        """The decoder for ``model`` (a transformers Llama-family model, optionally a PEFT LoRA model: the adapter
        is merged) with weights prepacked for ``rows`` rows; None if :func:`supports` says no or a projection is not
        a plain float linear layer (quantized, DoRA, or LoRA with ``merge=False``)."""
        if supports(model) is not None:
            return None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = []
        with torch.no_grad():
            for layer in base.model.layers:
                att, mlp = layer.self_attn, layer.mlp
                qkv, out, gate_up, down = (_fused([att.q_proj, att.k_proj, att.v_proj], rows, merge, prepack),
                                           _fused([att.o_proj], rows, merge, prepack),
                                           _fused([mlp.gate_proj, mlp.up_proj], rows, merge, prepack),
                                           _fused([mlp.down_proj], rows, merge, prepack))
                if qkv is None or out is None or gate_up is None or down is None:
                    return None
                layers.append(FusedLayer(layer.input_layernorm.weight.detach(),
                                         layer.post_attention_layernorm.weight.detach(), qkv, out, gate_up, down))
            head = _fused([base.lm_head], rows, merge, prepack)
        if head is None:
            return None
        return cls(base, layers, head)

    def _rms(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """transformers' Llama RMSNorm: normalised in float32, rounded to the input dtype, then scaled (torch's
        one-call ``rms_norm(x, weight)`` rounds once instead of twice in bf16; it was not measurably faster here)."""
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def _rope(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """cos and a signed sin [..., 1, head_dim] (broadcast over heads) such that ``x * cos + x.roll(d / 2) * sin``
        is transformers' ``x * cos + rotate_half(x) * sin`` exactly: ``rotate_half(x) = [-x_2, x_1]`` and
        ``roll(x, d / 2) = [x_2, x_1]``, so the sign moves onto sin's first half (one roll instead of two slices, a
        negation and a concatenation per call)."""
        cos, sin = self.rotary(x, position_ids)  # [b, q, head_dim] each, in x's dtype
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        return cos.unsqueeze(-2), sin.unsqueeze(-2)  # [b, q, 1, head_dim]

    def _mlp(self, x: Tensor, layer: FusedLayer, eps: float) -> Tensor:
        """``x + down(silu(gate(h)) * up(h))``, ``h = norm(x)``: gate and up as one product, the residual sum fused
        into the down product. (Separate gate and up products with SiLU and the product fused into them were
        slower: two 16-row products cost more than one twice as wide.)"""
        gate, up = layer.gate_up(self._rms(x, layer.norm_post, eps)).split(self.inter, dim=-1)  # [..., I] each
        return layer.down.add(F.silu(gate) * up, x)

    @torch.inference_mode()
    def prefill(self, ids: Tensor, mask: Tensor, group_size: int, budget: int) -> None:
        """Run ``ids[:, :-1]`` of each left-padded prompt once and keep its keys and values once per prompt (the
        ``group_size`` chains of a prompt attend to the same prompt cache, see :meth:`step`), with room for
        ``budget`` decode steps per chain.

        Args:
            ids, mask: [b, P] left-padded prompts and their attention mask.
        """
        b, width = ids.shape
        q_len, nkv, hd = width - 1, self.kv_heads, self.head_dim
        self.b, self.group_size, self.q_len = b, group_size, q_len
        rows = b * nkv * group_size  # a chain's own cache, batch order (prompt, kv head, chain)
        self.own = [(self.embed.new_zeros(rows, budget, hd), self.embed.new_zeros(rows, budget, hd))
                    for _ in self.layers]
        # additive mask over [prompt | own tokens], [b * nkv, 1, 1, q + budget]: the prompt's left padding and the
        # own slots not written yet are -inf (step t opens slot q + t)
        pad = torch.cat([~mask[:, :-1].bool(), mask.new_ones(b, budget, dtype=torch.bool)], 1)  # [b, q + L]
        self.mask = torch.zeros(b * nkv, 1, 1, q_len + budget).masked_fill_(
            pad.repeat_interleave(nkv, 0)[:, None, None], -math.inf)
        self.positions = mask.sum(1).repeat_interleave(group_size) - 1  # [n] the last prompt token's position
        # each prompt's keys and values at its slots in [b * nkv, q_len, hd]; left-padding slots stay zero (masked)
        self.prompt = [(self.embed.new_zeros(b * nkv, q_len, hd), self.embed.new_zeros(b * nkv, q_len, hd))
                       for _ in self.layers]
        pads = (~mask.bool()).sum(1).tolist()  # left padding per prompt
        for i, first in enumerate(pads):  # one prompt at a time, unpadded: plain causal attention, no mask
            if first < q_len:
                self._prefill_prompt(ids[i : i + 1, first:-1], slice(i * nkv, (i + 1) * nkv), first)

    def _prefill_prompt(self, ids: Tensor, rows: slice, first: int) -> None:
        """The prompt ``ids`` [1, q] (unpadded, all but its last token) through every layer, its keys and values
        written to ``rows`` of the prompt cache from slot ``first``."""
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        x = self.embed[ids]  # [1, q, H]
        cos, sin = self._rope(x, torch.arange(ids.shape[1])[None])  # [1, q, 1, hd]: positions 0..q-1
        for layer, (eps_in, eps_post), (prompt_k, prompt_v) in zip(self.layers, self.layer_eps, self.prompt):
            qkv = layer.qkv(self._rms(x, layer.norm_in, eps_in))  # [1, q, (nh + 2 nkv) hd]
            qk = qkv[..., : (nh + nkv) * hd].unflatten(-1, (nh + nkv, hd))  # [1, q, nh + nkv, hd]
            qk = qk * cos + qk.roll(hd // 2, -1) * sin
            v = qkv[..., (nh + nkv) * hd :].unflatten(-1, (nkv, hd)).transpose(1, 2)  # [1, nkv, q, hd]
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)  # [1, nh, q, hd], [1, nkv, q, hd]
            prompt_k[rows, first:] = k[0]
            prompt_v[rows, first:] = v[0]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=nh != nkv)  # [1, nh, q, hd]
            x = layer.out.add(o.transpose(1, 2).flatten(2), x)
            x = self._mlp(x, layer, eps_post)

    def _attend(self, qk: Tensor, v: Tensor, t: int, layer: int) -> Tensor:
        """One decode query per chain against [its prompt's cache | its own tokens], with the chain's new key and
        value (step ``t``) written first. The prompt part is one product per prompt and kv head for all
        ``G x groups`` queries that share it (the prompt's keys are read once, not G times: the chains of a group
        share their prompt); the own part one small product per chain over all ``budget`` own slots, the ones not
        written yet masked (every step has the same shapes: no strided copies of a growing cache, and oneDNN
        reuses its kernels). One float32 softmax over both parts.

        Args:
            qk: [n, heads + kv_heads, hd] rotated queries and keys; v: [n, kv_heads, hd]. Returns [n, heads * hd].
        """
        b, G, q_len = self.b, self.group_size, self.q_len
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        g = nh // nkv
        own_k, own_v = self.own[layer]  # [b * nkv * G, budget, hd], zeros where not written
        budget = own_k.shape[1]
        own_k.view(b, nkv, G, budget, hd)[:, :, :, t] = qk[:, nh:].view(b, G, nkv, hd).transpose(1, 2)
        own_v.view(b, nkv, G, budget, hd)[:, :, :, t] = v.view(b, G, nkv, hd).transpose(1, 2)
        q = qk[:, :nh].reshape(b, G, nkv, g, hd).transpose(1, 2).contiguous()  # [b, nkv, G, g, hd]
        prompt_k, prompt_v = self.prompt[layer]  # [b * nkv, q_len, hd]
        prompt = torch.bmm(q.view(b * nkv, G * g, hd), prompt_k.transpose(1, 2))  # [b * nkv, G * g, q_len]
        own = torch.bmm(q.view(b * nkv * G, g, hd), own_k.transpose(1, 2))  # [b * nkv * G, g, budget]
        scores = torch.cat([prompt.view(b * nkv, G, g, q_len), own.view(b * nkv, G, g, budget)], -1)
        # mask + scale * scores in float32 (one pass; the mask is 0 or -inf), softmax in float32
        weights = torch.add(self.mask, scores, alpha=self.scale).softmax(-1).to(v.dtype)  # [b nkv, G, g, q + L]
        out = torch.bmm(weights[..., :q_len].view(b * nkv, G * g, q_len), prompt_v)  # [b * nkv, G * g, hd]
        out = torch.baddbmm(out.view(b * nkv * G, g, hd), weights[..., q_len:].view(b * nkv * G, g, budget),
                            own_v).view(b, nkv, G, g, hd)
        return out.transpose(1, 2).reshape(b * G, nh * hd)  # [n, heads * hd], chain-major

    @torch.inference_mode()
    def step(self, tokens: Tensor, t: int) -> Tensor:
        """Decode step ``t``: ``tokens`` [n] (step 0: the prompts' last tokens); returns the next-token logits [n, V]
        in the model's dtype."""
        n = tokens.shape[0]
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        x = self.embed[tokens]  # [n, H]
        cos, sin = self._rope(x[:, None], (self.positions + t)[:, None])  # [n, 1, 1, hd]
        cos, sin = cos[:, 0], sin[:, 0]  # [n, 1, hd]
        self.mask[..., self.q_len + t] = 0.0  # this step's own slot
        for i, (layer, (eps_in, eps_post)) in enumerate(zip(self.layers, self.layer_eps)):
            qkv = layer.qkv(self._rms(x, layer.norm_in, eps_in))  # [n, (nh + 2 nkv) hd]
            qk = qkv[:, : (nh + nkv) * hd].view(n, nh + nkv, hd)
            qk = qk * cos + qk.roll(hd // 2, -1) * sin  # [n, nh + nkv, hd]
            x = layer.out.add(self._attend(qk, qkv[:, (nh + nkv) * hd :].view(n, nkv, hd), t, i), x)
            x = self._mlp(x, layer, eps_post)
        return self.head(self._rms(x, self.norm, self.eps))  # [n, V]
