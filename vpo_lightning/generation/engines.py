"""Rollout engines: turn B prompts into G sampled completions each, behind one small interface.

``TransformersEngine`` (the default) runs ``model.generate`` once per step for all B x G chains, on CPU or GPU.
``VLLMEngine`` (GPU only) imports vLLM lazily in ``setup``; it serves the policy's LoRA adapter through a
``LoRARequest`` and re-exports only the adapter after each optimizer step (never merging into a 4-bit base).
The vLLM path has not been run on a GPU by this project: its calls are tested against a fake ``vllm`` module
(tests/test_vllm_fake.py), written from how TRL's colocate mode drives vLLM; see the README.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vpo_lightning.core.types import Generation
from vpo_lightning.generation import HFModel
from vpo_lightning.generation.threads import adapt_threads, parse_threads

log = logging.getLogger(__name__)


@dataclass
class SamplingSettings:
    """Sampling settings shared by all engines.

    Args:
        temperature: softmax temperature (1.0 = the policy's own distribution, as the loss assumes).
        top_p: nucleus sampling mass (1.0 = off).
        top_k: top-k sampling (0 = off).
        max_new_tokens: generation budget per chain (the whole m-answer chain shares it).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"sampling.temperature must be > 0 (RL needs sampling), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class RolloutShape:
    """The largest rollout step of a run: B prompts of up to P tokens, G chains each of up to L new tokens.

    Args:
        batch_size: B, prompts per generate call (``data.batch_size``).
        group_size: G, chains per prompt (``rollout.group_size``).
        max_prompt_tokens: P (``data.max_prompt_tokens``; 0 = not bounded, prompts may be any length).
        max_new_tokens: L (``rollout.sampling.max_new_tokens``).
    """

    batch_size: int
    group_size: int
    max_prompt_tokens: int
    max_new_tokens: int

    @property
    def chains(self) -> int:
        return self.batch_size * self.group_size

    @property
    def sequence_tokens(self) -> int | None:
        """P + L, the longest sequence a chain reaches (None when prompts are not bounded)."""
        return self.max_prompt_tokens + self.max_new_tokens if self.max_prompt_tokens else None


ProgressFn = Callable[[int, int, int], None]  # (chains finished, chains in the rollout, tokens generated so far)


class Engine:
    """Interface: ``prepare`` and ``setup`` once, ``generate`` each step, ``sync`` after each optimizer step.

    ``progress``, when the rollout sets it, is called during ``generate`` with (chains finished, chains in the
    rollout, tokens generated so far), after each decoded token where the engine decodes token by token, and once at
    the end with every chain finished: the progress bar shows it inside a step (minutes on a CPU).
    """

    shape: RolloutShape | None = None
    progress: ProgressFn | None = None

    def prepare(self, shape: RolloutShape) -> None:
        """Told, before ``setup``, the largest step the run asks for (engines that size buffers by it read it)."""
        self.shape = shape

    def setup(self, module: Any) -> None:
        """Build heavy state (called by the rollout callback's setup hook, never in ``__init__``)."""

    def generate(self, module: Any, prompt_ids: list[list[int]], group_size: int, sampling: SamplingSettings,
                 seeds: list[int] | None = None) -> Generation:
        """Sample ``group_size`` completions per prompt (group-contiguous). ``seeds`` (one per prompt) let an engine
        make each prompt's samples independent of the batch layout."""
        raise NotImplementedError

    def sync(self, module: Any) -> None:
        """Push the policy's new weights to the engine (no-op when the engine uses the training model)."""

    def teardown(self) -> None:
        """Release engine resources."""


def _offset_report(progress: ProgressFn, chains_before: int, tokens_before: int, total: int, finished: int,
                   tokens: int) -> None:
    """``progress`` for one generate call of several: its counts added to the earlier calls' ones."""
    progress(chains_before + finished, total, tokens_before + tokens)


def left_pad(prompt_ids: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts into ``input_ids`` and ``attention_mask``, both ``[B, P]``."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros_like(ids)  # [B, P]
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def trim_completion(ids: list[int], eos_ids: set[int], pad_id: int) -> list[int]:
    """Cut a generated row after its first EOS (kept) and drop right padding."""
    out = []
    for t in ids:
        out.append(t)
        if t in eos_ids:
            break
    while out and out[-1] == pad_id and pad_id not in eos_ids:
        out.pop()
    return out


def eos_token_ids(model: HFModel, tokenizer: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def accepts_logits_to_keep(model: HFModel) -> bool:
    """Whether the (PEFT-wrapped) causal LM's forward takes ``logits_to_keep`` (transformers' decoder LMs do)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


@functools.cache
def preallocated_layer_class() -> type[Any]:
    """``PreallocatedKVLayer``: a ``DynamicLayer`` subclass, built on first use (transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedKVLayer(DynamicLayer):
        """A KV-cache layer for ``generate`` that writes each step's keys and values into a buffer allocated once.

        transformers' ``DynamicLayer`` appends with ``torch.cat``, which copies the whole cache of every layer at
        every decode step (on a 2-core CPU that copy took ~13% of a rollout, py-spy, maze RL run). This layer holds
        a [rows, kv_heads, capacity, head_dim] buffer, copies only the new positions into it and returns views of
        the filled part: the same values as the concatenated tensors, so attention computes the same numbers. The
        buffer grows (doubling) if a call writes past ``capacity``.
        """

        keys: torch.Tensor  # set by _views once initialised (DynamicLayer says Tensor | None)
        values: torch.Tensor

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity, self.length = capacity, 0
            # [rows, kv_heads, capacity, head_dim] buffers from lazy_initialization on (None before)
            self._k: Any = None
            self._v: Any = None

        @classmethod
        def from_layer(cls, layer: Any, repeats: int, capacity: int) -> Any:
            """A preallocated copy of a filled ``DynamicLayer``, its rows repeated ``repeats`` times (interleaved,
            as ``batch_repeat_interleave``) and room for ``capacity`` positions."""
            new = cls(capacity)
            if layer.is_initialized and layer.get_seq_length() > 0:
                k, v = layer.keys, layer.values  # [b, kv_heads, n, head_dim]
                b, n = k.shape[0], k.shape[-2]
                new.capacity = max(capacity, n)
                new.lazy_initialization(k, v, rows=b * repeats)
                # written straight into the buffer (no repeat_interleave copy first): row b * repeats + r = row b
                for buf, src in ((new._k, k), (new._v, v)):
                    buf[:, :, :n].unflatten(0, (b, repeats)).copy_(src.unsqueeze(1).expand(b, repeats, *src.shape[1:]))
                new.length = n
                new._views()
            return new

        @classmethod
        def from_parts(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], width: int, capacity: int) -> Any:
            """The rows of several ``(keys, values)`` pairs ([b_i, kv_heads, n_i, head_dim], n_i <= ``width``)
            stacked, each right-aligned at ``width`` positions and left-padded with zeros (masked by the caller),
            with room for ``capacity`` positions: ``vpo serve`` joins and drops rows of a running batch this way."""
            new = cls(max(capacity, width))
            rows = sum(k.shape[0] for k, _ in parts)
            new.lazy_initialization(parts[0][0], parts[0][1], rows=rows)
            start = 0
            for k, v in parts:
                b, n = k.shape[0], k.shape[-2]
                for buf, src in ((new._k, k), (new._v, v)):
                    buf[start : start + b, :, : width - n].zero_()  # padding: finite, so 0 x value stays 0
                    buf[start : start + b, :, width - n : width].copy_(src)
                start += b
            new.length = width
            new._views()
            return new

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor,
                                rows: int | None = None) -> None:
            """Allocate the buffers: ``rows`` rows (default: as many as ``key_states``), ``capacity`` positions."""
            _, heads, _, dim = key_states.shape
            rows = key_states.shape[0] if rows is None else rows
            self.device = key_states.device
            self._k = key_states.new_empty(rows, heads, self.capacity, dim)  # [rows, kv_heads, capacity, head_dim]
            self._v = value_states.new_empty(rows, value_states.shape[1], self.capacity, value_states.shape[-1])
            self._views()
            self.is_initialized = True

        def _grow(self, needed: int) -> None:
            self.capacity = max(needed, 2 * self.capacity)
            k, v = self._k, self._v
            self._k = k.new_empty(*k.shape[:2], self.capacity, k.shape[-1])
            self._v = v.new_empty(*v.shape[:2], self.capacity, v.shape[-1])
            self._k[:, :, : self.length] = k[:, :, : self.length]
            self._v[:, :, : self.length] = v[:, :, : self.length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                self._grow(end)
            self._k[:, :, self.length : end] = key_states
            self._v[:, :, self.length : end] = value_states
            self.length = end
            self._views()
            return self.keys, self.values

        def _views(self) -> None:
            """``keys`` / ``values``: views of the buffers' filled part (no copy)."""
            self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def reset(self) -> None:
            self.length = 0
            self._k = self._v = None
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
            if tokens_to_remove and self.is_initialized:
                self.length = max(0, self.length + tokens_to_remove)
                self._views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.get_seq_length() > 0:
                self._k, self._v = self._k.repeat_interleave(repeats, 0), self._v.repeat_interleave(repeats, 0)
                self._views()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.get_seq_length() > 0:
                self._k, self._v = self._k[indices, ...], self._v[indices, ...]
                self._views()

    return PreallocatedKVLayer


class TransformersEngine(Engine):
    """``model.generate`` on the training model: one batched call per step for all B x G chains.

    Args:
        max_batch_size: split the B x G chains into generate calls of at most this many rows (0 = one call).
        per_prompt_seed: one generate call per prompt, seeded by the prompt's seed, so that what a prompt samples
            does not depend on which rank or batch it lands in (slower: no batching across prompts).
        share_prompt_prefix: compute each prompt's prefill once and copy its KV cache to the G chains of the group
            (G times less prefill work; the G chains of a prompt share it).
        preallocate_cache: with ``share_prompt_prefix``, hold the KV cache in buffers sized for the prompt and
            ``max_new_tokens`` (``PreallocatedKVLayer``) instead of growing it by concatenation at every step; the
            same tokens, less copying.
        decode_loop: with ``share_prompt_prefix``, decode with this engine's own loop over the model's forward
            (:mod:`vpo_lightning.generation.decoding`: inverse-CDF sampling instead of ``torch.multinomial``) instead of
            ``model.generate``. (The single decode query's attention is :mod:`vpo_lightning.generation.attention`'s,
            which models loaded with SDPA use in either case.) The same model, distribution and settings; other random
            draws for the same seed; per-token log-probs reported for ``train/engine_logprob_gap``.
        merge_lora: on CPU, run each rollout with the LoRA adapter merged into a copy of the base weights (the
            originals are put back untouched; skipped for quantized bases and DoRA, and on GPUs, where the copy
            would take GPU memory and the unmerged products cost little). One matmul per layer instead of three;
            the merged weights round once to the model dtype, so log-probs differ from the unmerged policy's by
            rounding (logged as ``train/engine_logprob_gap`` with ``decode_loop``).
        prepack_weights: on CPU, multiply with oneDNN-prepacked copies of the linear weights during each rollout
            (:func:`~vpo_lightning.generation.decoding.prepacked_linears`; ~1.6x faster products at decode's 16 rows in
            bf16, ~2x in float32; float32 results differ by summation order). Costs a copy of the weights while
            generating.
        fused_decode: with ``decode_loop``, on CPU, for Llama-family models (``llama``, ``mistral``, ``qwen2``):
            prefill and decode through :class:`~vpo_lightning.generation.fused_decode.FusedDecoder` instead of the
            model's forward: the same arithmetic from merged (``merge_lora``), fused and prepacked (``prepack_weights``)
            weights, without transformers' per-module overhead. Another implementation of the forward, so its
            log-probs differ from the trainer's by rounding (``train/engine_logprob_gap``). Other models, quantized
            bases, DoRA and ``merge_lora=False`` with an adapter fall back to the model's forward.
        threads: on CPU, the intra-op thread count, set before each rollout (it holds for the training step after
            it too). ``"auto"``: one thread per core that other processes leave free, re-measured over every step
            (:class:`~vpo_lightning.generation.threads.ThreadPolicy`; a busy core would stall every parallel
            region); an integer fixes the count.
    """

    def __init__(
        self, max_batch_size: int = 0, per_prompt_seed: bool = False, share_prompt_prefix: bool = True,
        preallocate_cache: bool = True, decode_loop: bool = True, merge_lora: bool = True, prepack_weights: bool = True,
        fused_decode: bool = True, threads: int | str = "auto",
    ) -> None:
        self.max_batch_size, self.per_prompt_seed = max_batch_size, per_prompt_seed
        self.share_prompt_prefix, self.preallocate_cache = share_prompt_prefix, preallocate_cache
        self.decode_loop, self.merge_lora, self.prepack_weights = decode_loop, merge_lora, prepack_weights
        self.fused_decode = fused_decode
        self.threads = parse_threads(threads)

    def _calls(self, prompt_ids: list[list[int]], group_size: int,
               seeds: list[int] | None) -> list[tuple[list[list[int]], int | None]]:
        """Distinct prompts per generate call (each expanded to ``group_size`` rows), with an optional seed."""
        if self.per_prompt_seed and seeds is not None:
            return [([p], s) for p, s in zip(prompt_ids, seeds)]
        step = max(1, self.max_batch_size // group_size) if self.max_batch_size else len(prompt_ids)
        return [(prompt_ids[i : i + step], None) for i in range(0, len(prompt_ids), step)]

    def _prefill_once(self, model: HFModel, ids: torch.Tensor, mask: torch.Tensor, group_size: int,
                      max_new_tokens: int) -> Any:
        """Run the prompts (all but the last token) once and copy the KV cache to the G chains of each group:
        a group shares its prompt, so the prompt's prefill is not repeated G times."""
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)  # [b, P] as generate() derives them
        # only the KV cache is used: the decoder runs without the LM head where the model exposes it, otherwise
        # the head runs on one position instead of all P - 1 (a [b * P, vocab] product, ~10% of a short rollout's
        # time on CPU when it ran on every position; its one-position slice still cost a [b, H, vocab] copy)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
        extra = {"logits_to_keep": 1} if decoder is base and accepts_logits_to_keep(model) else {}
        out = (model if decoder is base else decoder)(
            input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=position_ids[:, :-1], use_cache=True,
            **extra)
        # transformers >= 5.2x names the KV cache `cache` (`past_key_values` still works, with a warning)
        name = "cache" if "cache" in getattr(out, "__dataclass_fields__", {}) else "past_key_values"
        cache = getattr(out, name)
        if self.preallocate_cache and hasattr(cache, "layers"):
            layer_class, capacity = preallocated_layer_class(), ids.shape[1] + max_new_tokens
            cache.layers = [layer_class.from_layer(layer, group_size, capacity) for layer in cache.layers]
        else:
            cache.batch_repeat_interleave(group_size)  # [b * G, ...] group-contiguous, like the rows below
        return name, cache

    def _decode(self, model: HFModel, ids: torch.Tensor, mask: torch.Tensor, group_size: int,
                sampling: SamplingSettings, eos: set[int], pad_id: int, fused: Any = None,
                report: Callable[[int, int], None] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """This engine's decode loop: the shared prefill, then one forward per new token for all ``b * G`` rows
        (finished rows get ``pad_id``, as ``generate`` does), until every row has produced EOS or the budget.
        With ``fused`` (a :class:`~vpo_lightning.generation.fused_decode.FusedDecoder`) the prefill and each step run
        through it instead of the model's forward. ``report(rows finished, tokens so far)`` after each token."""
        from vpo_lightning.generation.decoding import sample_next

        budget = sampling.max_new_tokens
        if fused is not None:
            fused.prefill(ids, mask, group_size, budget)
        else:
            name, cache = self._prefill_once(model, ids, mask, group_size, budget)
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # [n, P]
        n, width = ids.shape
        full_mask = torch.cat([mask, mask.new_ones(n, budget)], 1)  # [n, P + L]
        position = mask.sum(1, keepdim=True) - 1  # [n, 1] the last prompt token's position, as prefilled
        token = ids[:, -1:]  # [n, 1]
        tokens = torch.full((n, budget), pad_id, dtype=torch.long, device=ids.device)  # [n, L]
        logprobs = torch.zeros(n, budget, device=ids.device)  # [n, L]
        stops = torch.tensor(sorted(eos), dtype=torch.long, device=ids.device)
        done = torch.zeros(n, dtype=torch.bool, device=ids.device)  # [n]
        extra = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
        steps, generated = 0, 0
        for t in range(budget):
            if fused is not None:
                logits = fused.step(token[:, 0], t)  # [n, V]
            else:
                logits = model(input_ids=token, attention_mask=full_mask[:, : width + t], position_ids=position + t,
                               use_cache=True, **{name: cache}, **extra).logits[:, -1]
            nxt, lp = sample_next(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            nxt = nxt.masked_fill(done, pad_id)  # [n]
            tokens[:, t], logprobs[:, t], steps = nxt, lp, t + 1
            if report is not None:  # rows not finished before this token generated one
                generated += n - int(done.sum())
            done |= torch.isin(nxt, stops)
            if report is not None:
                report(int(done.sum()), generated)
            if bool(done.all()):
                break
            token = nxt.unsqueeze(1)  # [n, 1]
        rows = [trim_completion(r, eos, pad_id) for r in tokens[:, :steps].tolist()]
        return rows, [lp[: len(r)] for lp, r in zip(logprobs[:, :steps].tolist(), rows)]

    @torch.inference_mode()
    def generate(self, module: Any, prompt_ids: list[list[int]], group_size: int, sampling: SamplingSettings,
                 seeds: list[int] | None = None) -> Generation:
        from vpo_lightning.generation.decoding import fast_linears

        model, tok = module.policy, module.tokenizer
        was_training = model.training
        model.eval()
        eos = eos_token_ids(model, tok)
        completions: list[list[int]] = []
        logprobs: list[list[float]] | None = [] if self.decode_loop and self.share_prompt_prefix else None
        calls = self._calls(prompt_ids, group_size, seeds)
        rows = len(calls[0][0]) * group_size  # rows of a generate call
        total, progress = len(prompt_ids) * group_size, self.progress
        on_cpu = torch.device(module.device).type == "cpu"  # on a GPU a merged copy would cost its memory
        if on_cpu:
            adapt_threads(self.threads)
        try:
            fused = None
            if self.fused_decode and logprobs is not None and on_cpu:
                from vpo_lightning.generation.fused_decode import FusedDecoder

                fused = FusedDecoder.build(model, rows, merge=self.merge_lora, prepack=self.prepack_weights)
            with (fast_linears(model, rows, merge=self.merge_lora and on_cpu, prepack=self.prepack_weights)
                  if fused is None else contextlib.nullcontext()):
                for prompts, seed in calls:
                    ids, mask = left_pad(prompts, tok.pad_token_id, module.device)  # [b, P]
                    if seed is not None:
                        torch.manual_seed(seed)
                    report = None
                    if progress is not None:  # this call's counts on top of the earlier calls' chains and tokens
                        before, so_far = len(completions), sum(len(c) for c in completions)
                        report = functools.partial(_offset_report, progress, before, so_far, total)
                    if logprobs is not None and ids.shape[1] > 1:
                        chains, lps = self._decode(model, ids, mask, group_size, sampling, eos, tok.pad_token_id,
                                                   fused, report)
                        completions, logprobs = completions + chains, logprobs + lps
                        continue
                    completions += self._generate_call(model, tok, ids, mask, group_size, sampling, eos)
                    if progress is not None:  # generate() reports nothing inside: the call as a whole
                        progress(len(completions), total, sum(len(c) for c in completions))
                    if logprobs is not None:  # a one-token prompt: generate() has no log-probs to report
                        logprobs = None
        finally:
            model.train(was_training)
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        num_tokens = sum(len(c) for c in completions)
        if progress is not None:
            progress(total, total, num_tokens)
        return Generation(completions, texts, num_tokens, engine_logprobs=logprobs)

    def _generate_call(self, model: HFModel, tok: Any, ids: torch.Tensor, mask: torch.Tensor, group_size: int,
                       sampling: SamplingSettings, eos: set[int]) -> list[list[int]]:
        """One ``model.generate`` call for ``b`` prompts, ``group_size`` rows each (``decode_loop=False``)."""
        extra = {}
        if self.share_prompt_prefix and ids.shape[1] > 1 and group_size > 1:
            name, cache = self._prefill_once(model, ids, mask, group_size, sampling.max_new_tokens)
            extra[name] = cache  # generate() takes the cache under the name the model output used
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # [b * G, P]
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k or None, max_new_tokens=sampling.max_new_tokens,
            pad_token_id=tok.pad_token_id, eos_token_id=sorted(eos), **extra,
        )  # [b * G, P + L]
        return [trim_completion(r, eos, tok.pad_token_id) for r in out[:, ids.shape[1] :].tolist()]


# vLLM accepts these LoRA ranks only (vllm.config.LoRAConfig.max_lora_rank); the README's `vllm serve` recipe too.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of rank ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"an adapter of rank {rank} is above the largest max_lora_rank vLLM accepts "
                     f"({VLLM_LORA_RANKS[-1]}): lower model.lora.r")


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 outside torch.distributed)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _vllm_engine_args() -> set[str]:
    """The names ``vllm.LLM(**kwargs)`` accepts (the fields of vLLM's ``EngineArgs``), to use newer options only where
    the installed vLLM has them."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return set()
    return {f.name for f in dataclasses.fields(EngineArgs)} if dataclasses.is_dataclass(EngineArgs) else set()


def kv_cache_tokens(llm: Any) -> int | None:
    """Tokens vLLM's KV cache holds (GPU blocks x block size), or None where this vLLM version does not say."""
    engine = getattr(llm, "llm_engine", None)
    config = getattr(engine, "cache_config", None) or getattr(getattr(engine, "vllm_config", None), "cache_config",
                                                               None)
    blocks, block_size = getattr(config, "num_gpu_blocks", None), getattr(config, "block_size", None)
    return int(blocks) * int(block_size) if blocks and block_size else None


class VLLMEngine(Engine):
    """vLLM rollouts with the LoRA adapter served per request (GPU only; vLLM is imported in ``setup``).

    Colocated with the trainer in one process, as TRL's ``vllm_mode="colocate"``: vLLM sleeps (level 1: weights to
    CPU RAM, KV cache dropped) during the training step and wakes for each rollout, after the trainer's cached CUDA
    blocks are handed back (``torch.cuda.empty_cache``), which vLLM could not use otherwise.

    Args:
        gpu_memory_utilization: fraction of the card vLLM may take while awake: its weights, LoRA slots, activation
            peak and KV cache (``vpo plan`` shows what is left for the KV cache).
        max_model_len: longest prompt + completion vLLM must hold; at least ``data.max_prompt_tokens`` +
            ``rollout.sampling.max_new_tokens`` (checked in ``setup``).
        enable_sleep_mode: release vLLM's memory during the training step (``sleep``/``wake_up``).
        tensor_parallel_size: GPUs for tensor parallelism in the engine.
        max_lora_rank: must be >= the adapter rank; rounded up to a value vLLM accepts (1, 8, 16, 32, 64, 128, 256,
            320, 512).
        max_num_batched_tokens: tokens per vLLM scheduler step (prefill chunk). vLLM sizes its activation peak by
            it when profiling memory; 4096 as TRL (vLLM's larger default leaves less for the KV cache).
        max_num_seqs: chains vLLM runs at once; None = B x G of the run (the rollout's chains, all at once).
        adapter_dir: where the adapter is exported for vLLM (default: a temporary directory).
    """

    def __init__(
        self,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int = 4096,
        enable_sleep_mode: bool = True,
        tensor_parallel_size: int = 1,
        max_lora_rank: int = 64,
        max_num_batched_tokens: int = 4096,
        max_num_seqs: int | None = None,
        adapter_dir: str | None = None,
    ) -> None:
        self.gpu_memory_utilization, self.max_model_len = gpu_memory_utilization, max_model_len
        self.enable_sleep_mode, self.tensor_parallel_size = enable_sleep_mode, tensor_parallel_size
        self.max_lora_rank, self.adapter_dir = vllm_lora_rank(max_lora_rank), adapter_dir
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.llm: Any = None
        self.lora_version = 0
        self.asleep = False
        self.logprobs_processed = False  # whether vLLM reports log-probs after temperature (logprobs_mode)
        self._tmp: str | None = None

    def engine_kwargs(self, module: Any) -> dict[str, Any]:
        """Arguments for ``vllm.LLM``: the base model (never merged), LoRA on, bitsandbytes for a 4-bit base."""
        from vpo_lightning.generation.models import resolve_dtype, resolve_model_path

        settings = module.model_settings
        kwargs = {
            "model": resolve_model_path(settings.name), "enable_lora": settings.lora.enabled,
            "max_lora_rank": self.max_lora_rank, "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_model_len": self.max_model_len, "enable_sleep_mode": self.enable_sleep_mode,
            "tensor_parallel_size": self.tensor_parallel_size,
            "dtype": str(resolve_dtype(settings.dtype)).split(".")[-1],
            "enable_prefix_caching": True,  # the G chains of a prompt share its prefix
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        seqs = self.max_num_seqs or (self.shape.chains if self.shape is not None else None)
        if seqs:
            kwargs["max_num_seqs"] = seqs
        if settings.load_in_4bit:
            kwargs["quantization"] = "bitsandbytes"
        rank, world = _rank_and_world()
        if world > 1:  # one engine per rank, inside the trainer's process group (as TRL's colocate mode)
            kwargs.update(distributed_executor_backend="external_launcher", seed=rank // self.tensor_parallel_size)
        return kwargs

    def check_lengths(self) -> None:
        """Refuse a budget vLLM would cut short: prompt + new tokens must fit in ``max_model_len``."""
        shape = self.shape
        if shape is None:
            return
        if shape.max_new_tokens >= self.max_model_len or (shape.sequence_tokens or 0) > self.max_model_len:
            need = shape.sequence_tokens or shape.max_new_tokens + 1
            raise ValueError(
                f"data.max_prompt_tokens ({shape.max_prompt_tokens}) + rollout.sampling.max_new_tokens "
                f"({shape.max_new_tokens}) = {need} tokens do not fit in rollout.engine.init_args.max_model_len="
                f"{self.max_model_len}: vLLM would stop chains early. Raise max_model_len to at least {need} (within "
                "the model's context), or lower data.max_prompt_tokens or rollout.sampling.max_new_tokens")
        if not shape.max_prompt_tokens:
            log.warning("data.max_prompt_tokens is 0 (unbounded): a prompt longer than %d tokens leaves less than "
                        "rollout.sampling.max_new_tokens=%d for its chains (vLLM's max_model_len=%d)",
                        self.max_model_len - shape.max_new_tokens, shape.max_new_tokens, self.max_model_len)

    def check_kv_cache(self) -> None:
        """Log the KV cache vLLM reserved; refuse one that cannot hold a single full sequence."""
        tokens = kv_cache_tokens(self.llm)
        seq = (self.shape.sequence_tokens if self.shape is not None else None) or self.max_model_len
        if tokens is None:
            log.warning("vLLM did not report its KV cache size (cache_config.num_gpu_blocks): not checked")
            return
        chains = self.shape.chains if self.shape is not None else 0
        log.info("vLLM KV cache: %d tokens = %.1f full sequences of %d tokens (a rollout runs %d chains; fewer at "
                 "once means vLLM queues the rest)", tokens, tokens / seq, seq, chains)
        if tokens < seq:
            raise ValueError(
                f"vLLM's KV cache holds {tokens} tokens, less than one full sequence ({seq} tokens): raise "
                f"rollout.engine.init_args.gpu_memory_utilization (now {self.gpu_memory_utilization}), lower "
                f"max_num_batched_tokens (now {self.max_num_batched_tokens}) or the sequence length "
                "(vpo plan --gpu-mem SIZE shows the KV cache left)")

    def setup(self, module: Any) -> None:
        if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
            raise ImportError(
                "rollout.engine=VLLMEngine needs vLLM and a CUDA GPU: pip install 'vpo-lightning[vllm]' on a GPU "
                "machine, or use rollout.engine.class_path=vpo_lightning.generation.engines.TransformersEngine"
            )
        self.check_lengths()
        from vllm import LLM

        device = torch.device(getattr(module, "device", "cuda"))
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # vLLM builds on the current device: this rank's, not cuda:0
        kwargs = self.engine_kwargs(module)
        rank, world = _rank_and_world()
        if world > 1:  # vLLM's external launcher reads the process group from these, as TRL sets them
            local = device.index if device.type == "cuda" and device.index is not None else rank
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world))
        if "logprobs_mode" in _vllm_engine_args():
            kwargs["logprobs_mode"] = "processed_logprobs"  # after temperature, as the trainer's log-probs
            self.logprobs_processed = True
        else:
            log.warning("this vLLM has no logprobs_mode: its log-probs are the raw model's (before temperature), so "
                        "train/engine_logprob_gap is meaningful only at rollout.sampling.temperature=1")
        self._free_trainer_cache()  # vLLM measures free memory at start-up
        self.llm = LLM(**kwargs)
        self.asleep = False
        self.check_kv_cache()
        self.sync(module)

    @staticmethod
    def _free_trainer_cache() -> None:
        """Hand the trainer's cached CUDA blocks back to the driver: vLLM allocates outside torch's caching
        allocator and cannot use memory the trainer's cache still holds (TRL does the same before each wake-up)."""
        gc.collect()
        torch.cuda.empty_cache()

    def export_adapter(self, module: Any) -> Path:
        """Write the current adapter in PEFT format to a fresh versioned directory and return it. vLLM holds the raw
        base, so a run started from ``model.adapter`` exports that adapter stacked with the trained one (export.py)."""
        from vpo_lightning.generation.adapters import save_policy_adapter

        if self.adapter_dir is None:
            self._tmp = self._tmp or tempfile.mkdtemp(prefix="vpo-adapter-")
        root = Path(self.adapter_dir or self._tmp or "")  # one of the two is set just above
        self.lora_version += 1
        out = root / f"v{self.lora_version}"
        rank = save_policy_adapter(module.policy, out, getattr(module.model_settings, "adapter", None))
        if rank > self.max_lora_rank:
            raise ValueError(f"the adapter served to vLLM has rank {rank} (with model.adapter: the starting adapter's "
                             f"rank + model.lora.r), above rollout.engine.init_args.max_lora_rank="
                             f"{self.max_lora_rank}: raise it to at least {vllm_lora_rank(rank)}")
        old = root / f"v{self.lora_version - 1}"
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        return out

    def sync(self, module: Any) -> None:
        if module.model_settings.lora.enabled:
            self.adapter_path = self.export_adapter(module)  # only the adapter travels; the base stays in vLLM
        else:
            raise NotImplementedError("VLLMEngine supports LoRA policies only; set model.lora.enabled=true")

    def sampling_params(self, group_size: int, sampling: SamplingSettings, seed: int | None = None) -> dict[str, Any]:
        params = {
            "n": group_size, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1, "max_tokens": sampling.max_new_tokens, "logprobs": 0,
        }
        if seed is not None:
            params["seed"] = seed % 2**31
        return params

    def lora_request(self) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"policy-v{self.lora_version}", self.lora_version, str(self.adapter_path))

    def wake(self) -> None:
        """Wake vLLM (if asleep) after handing the trainer's cached blocks back to the driver."""
        if self.asleep:
            self._free_trainer_cache()
            self.llm.wake_up()
            self.asleep = False

    def generate(self, module: Any, prompt_ids: list[list[int]], group_size: int, sampling: SamplingSettings,
                 seeds: list[int] | None = None) -> Generation:
        from vllm import SamplingParams

        self.wake()
        per_prompt: list[int | None] = list(seeds) if seeds else [None] * len(prompt_ids)
        params = [SamplingParams(**self.sampling_params(group_size, sampling, s)) for s in per_prompt]  # one per prompt
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], params, lora_request=self.lora_request(), use_tqdm=False,
        )
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)
            self.asleep = True
        gen = outputs_to_generation(outputs)
        if not self.logprobs_processed and sampling.temperature != 1.0:
            gen.engine_logprobs = None  # raw log-probs: not the sampled distribution, no gap to report
        if self.progress is not None:  # one call for the whole rollout: its end only
            self.progress(len(gen.texts), len(gen.texts), gen.num_tokens)
        return gen

    def teardown(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def outputs_to_generation(outputs: list[Any]) -> Generation:
    """Map vLLM ``RequestOutput`` objects (each with ``.outputs`` of n completions) to a ``Generation``."""
    ids, texts, logps = [], [], []
    for request in outputs:
        for completion in request.outputs:
            tokens = list(completion.token_ids)
            ids.append(tokens)
            texts.append(completion.text)
            per_token = completion.logprobs or []
            logps.append([float(step[t].logprob) for step, t in zip(per_token, tokens)])
    return Generation(ids, texts, sum(len(t) for t in ids), engine_logprobs=logps)
