"""Continuous batching for ``vpo serve``: a decode group holds sequences being generated and their KV cache; requests
join it and finished sequences leave it between decode steps (iteration-level batching, as vLLM and TGI do).

Layout: the KV cache is right-aligned. Every row's newest position is the cache's last column; shorter histories are
left-padded with zeros and masked. That is the layout ``generate`` gives left-padded prompts, so a row's tokens are
those ``generate`` would give it alone, up to the rounding of attention sums over padded columns (greedy tokens are
checked equal in tests/test_serve_continuous.py). A request joins through one prefill of its prompt, which also
yields its first token; its ``n`` rows copy that cache and are stacked under the running rows, the shorter side
left-padded (``PreallocatedKVLayer.from_parts``, the transformers engine's cache layer). Rows leave when done (EOS,
``max_tokens``, a stop string, a client that hung up), and leading columns that every remaining row pads are cut.
Those copies happen only when rows join or leave; a step writes one position into buffers sized for the longest
remaining budget.

Sampling per row (:func:`pick`): the request's own temperature, top-k and top-p (transformers' warpers in its order,
:func:`vpo_lightning.generation.decoding.filter_logits`), EOS masked for ``ignore_eos``, ``argmax`` at temperature 0.
A token is drawn by inverse CDF from one uniform variate; a request with a ``seed`` draws it from its own
``torch.Generator``, so it samples the same tokens whichever requests share its steps. The log-prob recorded is that
of the distribution sampled from (greedy: the unscaled one), as OpenAI's ``logprobs`` report it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from vpo_lightning.serve.jobs import Choice, Job, logprob_entries


@dataclass
class Row:
    """One sequence of a job (choice ``index``): what it generated so far and why it stopped."""

    job: Job
    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)  # the step's alternatives, when asked for
    stopped_at: int | None = None  # tokens generated when a stop string appeared
    done: bool = False


def pick(logits: Tensor, rows: Sequence[Row], eos: Tensor,
         generators: dict[int, torch.Generator]) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """One token per row, each under its own request's sampling parameters.

    Args:
        logits: ``[R, V]`` next-token logits, one row per entry of ``rows``.
        eos: end-of-sequence ids, masked for rows of ``ignore_eos`` requests.
        generators: ``id(job)`` -> the generator of a seeded request (others draw from torch's global one).

    Returns ``(tokens, log-probs, alternatives)``: per row the token, its log-prob under the distribution it was
    drawn from, and that distribution's most likely tokens (as many as the row's request asks for, else none).
    """
    from vpo_lightning.generation.decoding import filter_logits

    logits = logits.float()  # [R, V]
    ignore = [i for i, r in enumerate(rows) if r.job.key.ignore_eos]
    if ignore:
        logits = logits.clone()
        logits[torch.tensor(ignore, device=logits.device)[:, None], eos.to(logits.device)[None, :]] = -math.inf
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, r in enumerate(rows):
        k = r.job.key
        groups.setdefault((k.temperature if k.temperature > 0 else 0.0, k.top_k or 0, k.top_p), []).append(i)
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)  # [R]
    dist = torch.empty_like(logits)  # [R, V] log-probs of the distribution each row draws from
    for (temperature, top_k, top_p), members in groups.items():
        idx = torch.tensor(members, device=logits.device)
        scores = logits[idx]  # [g, V]
        if temperature == 0:
            lp = scores.log_softmax(-1)
            tokens[idx] = scores.argmax(-1)
        else:
            lp = filter_logits(scores, temperature, top_k, top_p).log_softmax(-1)
            cdf = lp.exp().cumsum(-1)  # [g, V]
            u = torch.cat([torch.rand(1, device=logits.device, generator=generators.get(id(rows[i].job)))
                           for i in members])  # [g]
            drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # [g, 1]
            tokens[idx] = drawn.clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
        dist[idx] = lp
    picked = dist.gather(-1, tokens[:, None]).squeeze(-1)  # [R]
    top = max(r.job.logprobs or 0 for r in rows)
    alternatives: list[list[tuple[int, float]]] = [[] for _ in rows]
    if top:
        values, indices = dist.topk(top, dim=-1)  # [R, top]
        alternatives = [list(zip(i, v)) if r.job.logprobs else []
                        for r, i, v in zip(rows, indices.tolist(), values.tolist())]
    return tokens.tolist(), picked.tolist(), alternatives


class DecodeGroup:
    """Rows generated together, one forward per step, with their KV cache; jobs join (:meth:`add`) and finished
    jobs come out of :meth:`add` and :meth:`step` as ``(job, choices)``.

    Args:
        model: the causal LM (a PEFT model: ``adapter`` says whether its adapter is on for this group's rows).
        tokenizer: its tokenizer (pad token set); used under ``lock`` for stop strings and the answers' text.
        eos: end-of-sequence ids.
        device: the model's device.
        lock: the tokenizer's lock (fast tokenizers are not thread-safe).
        adapter: run with the adapter (True) or with it disabled.
    """

    def __init__(self, model: Any, tokenizer: Any, eos: set[int], device: torch.device, lock: threading.Lock,
                 adapter: bool) -> None:
        from vpo_lightning.generation.engines import accepts_logits_to_keep

        self.model, self.tokenizer, self.eos, self.device, self.lock = model, tokenizer, eos, device, lock
        self.adapter, self.use_base = adapter, not adapter and hasattr(model, "disable_adapter")
        self.extra = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
        self.eos_ids = torch.tensor(sorted(eos), dtype=torch.long)
        self.rows: list[Row] = []
        self.jobs: list[Job] = []  # in the order they joined
        self.generators: dict[int, torch.Generator] = {}  # id(job) -> a seeded request's generator
        self._rows_of: dict[int, list[Row]] = {}  # id(job) -> all its rows, done or not
        self.cache: Any = None  # transformers' cache object, its layers replaced when rows join or leave
        self.cache_name = "past_key_values"
        self.mask: Tensor | None = None  # [R, T] 1 = a real position, 0 = left padding
        self.last: Tensor | None = None  # [R] the token each row feeds next

    @property
    def size(self) -> int:
        return len(self.rows)

    def _forward(self, **kwargs: Any) -> Any:
        with self.model.disable_adapter() if self.use_base else nullcontext():
            return self.model(use_cache=True, **self.extra, **kwargs)

    @torch.inference_mode()
    def add(self, jobs: Sequence[Job]) -> list[tuple[Job, list[Choice]]]:
        """Prefill the jobs' prompts (one row each), sample every row's first token and stack the rows (``n`` per
        job) under the running ones. Returns the jobs already finished (``max_tokens`` 1, an early EOS)."""
        from vpo_lightning.generation.engines import left_pad

        ids, mask = left_pad([job.prompt_ids for job in jobs], self.tokenizer.pad_token_id, self.device)  # [J, P]
        position = (mask.cumsum(1) - 1).clamp(min=0)  # [J, P] as generate() derives them
        out = self._forward(input_ids=ids, attention_mask=mask, position_ids=position)
        # transformers >= 5.2x names the KV cache `cache` (`past_key_values` still works, with a warning)
        name = "cache" if "cache" in getattr(out, "__dataclass_fields__", {}) else "past_key_values"
        cache = getattr(out, name)
        index = torch.tensor([j for j, job in enumerate(jobs) for _ in range(job.n)], device=self.device)  # [r]
        rows = [Row(job, i) for job in jobs for i in range(job.n)]
        for job in jobs:
            self.jobs.append(job)
            self._rows_of[id(job)] = [r for r in rows if r.job is job]
            if job.key.seed is not None and job.key.temperature > 0:
                self.generators[id(job)] = torch.Generator(self.device).manual_seed(job.key.seed)
        new = [(layer.keys[index], layer.values[index]) for layer in cache.layers]  # [r, kv_heads, P, head_dim]
        if self.cache is None:
            self.cache, self.cache_name = cache, name
        running = ids.new_empty(0) if self.last is None else self.last
        self.last = torch.cat([running, ids.new_zeros(len(rows))])  # the new rows' entries: set by _advance
        self._relayout(torch.arange(len(self.rows), device=self.device), rows, new, mask[index])
        logits = out.logits[:, -1][index]  # [r, V]
        return self._advance(logits, range(len(self.rows) - len(rows), len(self.rows)))

    @torch.inference_mode()
    def step(self) -> list[tuple[Job, list[Choice]]]:
        """One decode step for every row (rows of jobs whose client hung up leave first)."""
        if not self.rows:
            return []
        if any(r.job.dropped for r in self.rows):
            for r in self.rows:
                r.done = r.done or r.job.dropped
            finished = self._leave()
            if not self.rows:
                return finished
        else:
            finished = []
        assert self.mask is not None and self.last is not None
        mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], 1)  # [R, T + 1]
        position = self.mask.sum(1, keepdim=True)  # [R, 1] the fed token's position: real tokens before it
        out = self._forward(input_ids=self.last[:, None], attention_mask=mask, position_ids=position,
                            **{self.cache_name: self.cache})
        self.mask = mask
        return finished + self._advance(out.logits[:, -1], range(len(self.rows)))

    def _advance(self, logits: Tensor, which: range) -> list[tuple[Job, list[Choice]]]:
        """Sample a token for rows ``which`` from ``logits`` (one per row), record it, then let done rows leave."""
        rows = [self.rows[i] for i in which]
        tokens, logprobs, tops = pick(logits, rows, self.eos_ids, self.generators)
        assert self.last is not None
        self.last[which.start : which.stop] = torch.tensor(tokens, device=self.device)
        for row, token, lp, alternatives in zip(rows, tokens, logprobs, tops):
            row.ids.append(token)
            row.logprobs.append(lp)
            row.tops.append(alternatives)
            if row.job.events is not None:
                row.job.events.put((row.index, token, lp, alternatives))
            key = row.job.key
            row.done = len(row.ids) >= key.max_tokens or (token in self.eos and not key.ignore_eos)
            if row.job.stops and not row.done and self._stopped(row):
                row.stopped_at, row.done = len(row.ids), True
        return self._leave() if any(r.done for r in self.rows) else []

    def _stopped(self, row: Row) -> bool:
        window = max(len(s) for s in row.job.stops) + 8  # tokens decoded at the tail: each decodes to >= 1 character
        with self.lock:
            text = self.tokenizer.decode(row.ids[-window:], skip_special_tokens=True)
        return any(s in text for s in row.job.stops)

    def _leave(self) -> list[tuple[Job, list[Choice]]]:
        """Drop done rows from the cache; return the jobs all of whose rows are done, with their choices."""
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        assert self.last is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.last = self.last[index]
        self._relayout(index, [], None, None)
        finished, running = [], []
        for job in self.jobs:
            if all(r.done for r in self._rows_of[id(job)]):
                finished.append((job, [self.choice(r) for r in self._rows_of.pop(id(job))]))
                self.generators.pop(id(job), None)
            else:
                running.append(job)
        self.jobs = running
        return finished

    def _relayout(self, keep: Tensor, new_rows: list[Row], new: list[tuple[Tensor, Tensor]] | None,
                  new_mask: Tensor | None) -> None:
        """Rebuild the cache from the kept rows (``keep``: their indices) and the new ones, right-aligned; leading
        columns that every row pads are cut."""
        from vpo_lightning.generation.engines import preallocated_layer_class

        kept = [self.rows[i] for i in keep.tolist()]
        self.rows = kept + new_rows
        if not self.rows:
            self.cache = self.mask = self.last = None
            return
        layers, masks = [], []
        if kept:
            assert self.mask is not None
            old_mask = self.mask[keep]  # [k, T]
            first = int(old_mask.any(0).nonzero()[0])  # the first column some kept row uses
            masks.append(old_mask[:, first:])
            layers.append([(layer.keys[keep, :, first:], layer.values[keep, :, first:]) for layer in self.cache.layers])
        if new is not None and new_mask is not None:
            masks.append(new_mask)
            layers.append(new)
        width = max(m.shape[1] for m in masks)
        budget = max(r.job.key.max_tokens - len(r.ids) for r in self.rows)
        layer_class = preallocated_layer_class()
        self.cache.layers = [layer_class.from_parts([part[i] for part in layers], width, width + budget + 1)
                             for i in range(len(layers[0]))]
        self.mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in masks])  # [R, width]

    # -- answers --------------------------------------------------------------------------------------------------
    def choice(self, row: Row) -> Choice:
        """A done row as a :class:`Choice`: text up to EOS or its stop string, with log-probs when asked for."""
        tokens, key, stops = row.ids, row.job.key, row.job.stops
        if row.stopped_at is not None:
            tokens, finish = tokens[: row.stopped_at], "stop"
        else:
            cut = next((i for i, t in enumerate(tokens) if t in self.eos), None)
            if cut is not None:
                tokens, finish = tokens[: cut + 1], "stop"
            else:
                finish = "length" if len(tokens) >= key.max_tokens else "stop"
        with self.lock:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            text, finish = text[: min(hits)], "stop"
        out = Choice(text, finish, len(tokens))
        if row.job.logprobs is not None:
            out.logprobs = self._logprobs(row, out, row.job.logprobs)
        return out

    def _logprobs(self, row: Row, choice: Choice, top: int) -> list[dict[str, Any]]:
        """The log-prob entries of the tokens of ``choice.text``: its counted tokens less a final end-of-sequence
        token, and less those wholly past the text where a stop string cut it."""
        ids = row.ids[: choice.tokens]
        if ids and ids[-1] in self.eos:
            ids = ids[:-1]
        with self.lock:
            entries = logprob_entries(self.tokenizer, ids, row.logprobs, row.tops, top)
        size = len(choice.text.encode("utf-8"))
        if choice.finish_reason != "stop" or size >= sum(len(e["bytes"]) for e in entries):
            return entries
        kept, have = 0, 0
        while kept < len(entries) and have < size:  # cut at a stop string: a token straddling the cut is kept
            have += len(entries[kept]["bytes"])
            kept += 1
        return entries[:kept]
