"""The batching worker of ``vpo serve``: one thread owns the model and turns queued requests into ``generate`` calls.

HTTP handler threads validate and tokenize a request (:mod:`vpo_lightning.serve.openai_api`), then queue a :class:`Job`.
The worker waits ``batch_wait_s`` for more requests, takes the oldest pending job of the client that has been served the
least work (fair queuing: ``n x max_tokens`` served per client, counted from the current virtual time for a client that
comes back or is new) and every other pending job with the same :class:`~vpo_lightning.serve.openai_api.SamplingKey`
(temperature, top-p, top-k, max_tokens, ignore_eos, seed, adapter on/off) up to ``max_batch_size`` rows, and runs them
as one ``generate`` call; stop strings are checked per row while generating. Jobs with other keys wait for the next
call. So a new or light client's request goes first in the next call, however many heavy requests other clients keep
queued: it waits for the call under way (static batching: a call is not interrupted). A job whose client hung up
(``Job.dropped``) is skipped when pending and its rows stop at the next step when generating. A failed call answers
its jobs with a 500 and is counted in ``stats["errors"]``; the worker keeps serving.

Log-probabilities and streaming (:class:`StepRecorder`): when a job of the call asks for ``logprobs`` or streams,
the call applies temperature, top-k and top-p itself (transformers' own warpers, in transformers' order) and a last
logits processor keeps the log-softmax of the scores sampling then draws from; after each step the sampled token's
log-prob and the step's top alternatives are recorded per row, and tokens of streaming jobs are handed to their
queue as they are generated. With temperature 0 (greedy) the log-probs are those of the unscaled distribution.
Sampling applies the request's temperature, top-k and top-p only: min-p, typical-p and the epsilon/eta cutoffs of a
model's ``generation_config.json`` are switched off (transformers would add them after the recorder).
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from vpo_lightning.serve.openai_api import APIError, SamplingKey

log = logging.getLogger(__name__)


SMALL_PROMPT_CHARS = 16_384  # prompts up to this many characters use the shared tokenizer (a few ms each)


@dataclass
class Job:
    """One queued request: its prompt, how many choices, its sampling key and stop strings.

    ``logprobs``: None, or the number of top alternatives to give per token (0-20). ``events``: for a streamed
    request, a queue that receives ``(choice index, token id, log-prob, [(id, log-prob)...] alternatives)`` for each
    token as it is generated (and ``None`` when the job is done: the server adds that).
    """

    prompt_ids: list[int]
    n: int
    key: SamplingKey
    stops: tuple[str, ...] = ()
    future: Future = field(default_factory=Future)
    logprobs: int | None = None
    events: Any = None  # anything with put(): a queue.Queue, or the server's hand-over to its event loop
    client: str = ""  # who sent it (the peer address): clients take turns at the head of the queue
    dropped: bool = False  # the client hung up: skip it when pending, stop its rows when generating


@dataclass
class Choice:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    tokens: int  # generated tokens counted in usage
    logprobs: list[dict[str, Any]] | None = None  # OpenAI's logprobs.content, one entry per token of text


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE piece uses -> that byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars)}


BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes]:
    """The exact bytes each token stands for (OpenAI's ``bytes``): byte-level BPE pieces through GPT-2's alphabet,
    SentencePiece byte-fallback pieces (``<0xE2>``) as that byte, other pieces as UTF-8 with ``▁`` as a space."""
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
    out = []
    for piece in pieces:
        piece = piece or ""
        if byte_level and all(c in BYTE_DECODER for c in piece):
            out.append(bytes(BYTE_DECODER[c] for c in piece))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("▁", " ").encode("utf-8"))
    return out


def logprob_entries(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float],
                    tops: Sequence[Sequence[tuple[int, float]]], top: int) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: per token its text, log-prob, bytes and up to ``top`` alternatives (those
    the sampler could draw: alternatives that top-k/top-p ruled out, log-prob -inf, are left out)."""
    alternatives = sorted({t for row in tops for t, _ in row[:top]})
    pieces = dict(zip(alternatives, token_bytes(tokenizer, alternatives)))
    out = []
    for raw, lp, row in zip(token_bytes(tokenizer, ids), logprobs, tops):
        out.append({"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw),
                    "top_logprobs": [{"token": pieces[t].decode("utf-8", "replace"), "logprob": v,
                                      "bytes": list(pieces[t])} for t, v in row[:top] if v > -float("inf")]})
    return out


class StepRecorder:
    """The last logits processor and a stopping criterion of a ``generate`` call: records, per row, each sampled
    token's log-prob under the distribution it was drawn from (the scores after temperature, top-k and top-p) and
    the step's ``top`` most likely tokens; hands each new token of a streaming row to its queue.

    Args:
        top: alternatives to keep per step (the most any job of the call asks for).
        streams: per row, ``(queue, choice index)`` or None.
        eos: end-of-sequence ids: a row's recording stops after one.
    """

    def __init__(self, top: int, streams: Sequence[tuple[queue.Queue, int] | None], eos: set[int]) -> None:
        self.top, self.streams, self.eos = top, list(streams), eos
        self.ids: list[list[int]] = [[] for _ in streams]
        self.logprobs: list[list[float]] = [[] for _ in streams]
        self.tops: list[list[list[tuple[int, float]]]] = [[] for _ in streams]
        self._step: torch.Tensor | None = None  # [R, V] log-softmax of the current step's processed scores
        self._done = [False] * len(streams)

    def process(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The logits-processor side: keep the step's log-probs; the scores pass unchanged."""
        self._step = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        """The stopping-criterion side, after the step's tokens were appended: record them; never stops a row."""
        if self._step is not None:
            step, self._step = self._step, None
            chosen = input_ids[:, -1:]  # [R, 1]
            picked = step.gather(-1, chosen).squeeze(-1).tolist()
            if self.top:
                values, indices = step.topk(self.top, dim=-1)  # [R, top]
                alternatives = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            else:
                alternatives = [[] for _ in picked]
            for row, token in enumerate(chosen.squeeze(-1).tolist()):
                if self._done[row]:
                    continue
                self.ids[row].append(token)
                self.logprobs[row].append(picked[row])
                self.tops[row].append(alternatives[row])
                self._done[row] = token in self.eos
                if self.streams[row] is not None:
                    events, index = self.streams[row]
                    events.put((index, token, picked[row], alternatives[row]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Processor:
    """Adapts :meth:`StepRecorder.process` to transformers' ``LogitsProcessor`` call."""

    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.recorder.process(input_ids, scores)



class DropAbandoned:
    """A ``StoppingCriteria``: the rows of jobs whose client hung up are done (when all are, generation ends)."""

    def __init__(self, jobs: Sequence[Job]) -> None:
        self.jobs = [job for job in jobs for _ in range(job.n)]

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor([job.dropped for job in self.jobs], dtype=torch.bool, device=input_ids.device)


class StopOnStrings:
    """A ``StoppingCriteria``: a row is done once its decoded completion contains one of its stop strings.

    Records, per row, how many tokens had been generated when its stop string appeared (for usage and trimming).
    """

    def __init__(self, tokenizer: Any, prompt_len: int, stops: Sequence[tuple[str, ...]], lock: threading.Lock):
        self.tokenizer, self.prompt_len, self.stops, self.lock = tokenizer, prompt_len, stops, lock
        longest = max((len(s) for row in stops for s in row), default=0)
        self.window = longest + 8  # tokens decoded at the tail; every token decodes to >= 1 character in practice
        self.stopped_at: dict[int, int] = {}

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        generated = input_ids.shape[1] - self.prompt_len
        for row, stops in enumerate(self.stops):
            if not stops:
                continue
            if row in self.stopped_at:
                done[row] = True
                continue
            tail = input_ids[row, max(self.prompt_len, input_ids.shape[1] - self.window) :].tolist()
            with self.lock:
                text = self.tokenizer.decode(tail, skip_special_tokens=True)
            if any(s in text for s in stops):
                self.stopped_at[row] = generated
                done[row] = True
        return done


class BatchGenerator:
    """Owns the model; a worker thread turns queued :class:`Job` s into batched ``generate`` calls.

    Args:
        model: a causal LM, or a PEFT model (``SamplingKey.adapter=False`` runs it with its adapter disabled).
        tokenizer: its tokenizer (pad token set).
        device: where the model lives.
        max_batch_size: most rows in one ``generate`` call.
        batch_wait_s: wait this long after the first pending request before taking a batch.
        max_regroup_s: longest extra wait for clients of the last batch to send their next request (see ``_take``).
    """

    def __init__(self, model: Any, tokenizer: Any, device: torch.device | str = "cpu", max_batch_size: int = 64,
                 batch_wait_s: float = 0.01, max_regroup_s: float = 2.0) -> None:
        from vpo_lightning.generation.engines import eos_token_ids

        self.model, self.tokenizer, self.device = model.eval(), tokenizer, torch.device(device)
        self.max_batch_size, self.batch_wait_s, self.max_regroup_s = max_batch_size, batch_wait_s, max_regroup_s
        self._recent_rows, self._last_generate_s = 1, 0.0
        self._served: dict[str, int] = {}  # client -> work served (n x max_tokens), from the virtual time on
        self._vtime = 0  # the served work of the last call's first job: where a new or returning client starts
        self.eos = eos_token_ids(model, tokenizer)
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to use from several threads at once
        # Prompts longer than SMALL_PROMPT_CHARS are tokenized by a second copy under its own lock (the fast
        # tokenizer releases the GIL while it encodes), so a flood of long prompts queues behind itself while short
        # requests and the worker's decoding keep the first copy: a 1 MB prompt took the shared lock for ~2.5 s.
        self.long_tokenizer = copy.deepcopy(tokenizer)
        self.long_tokenizer_lock = threading.Lock()
        self._pending: list[Job] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.stats = {"batches": 0, "requests": 0, "rows": 0, "generated_tokens": 0, "generate_s": 0.0,
                      "max_batch_requests": 0, "max_batch_rows": 0, "errors": 0}

    # -- queue ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="vpo-serve-worker", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for job in pending:
            job.future.cancel()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def submit(self, job: Job) -> Future:
        with self._cond:
            if self._stop:
                raise APIError(503, "the server is shutting down", type="server_error")
            self._pending.append(job)
            self._cond.notify()
        return job.future

    def _pending_rows(self) -> int:
        return sum(j.n for j in self._pending if not (j.dropped or j.future.cancelled()))

    def _take(self) -> list[Job]:
        """Wait for work; return the oldest job and the pending jobs sharing its key (FIFO, up to the row cap).

        Static batches split concurrent clients into groups that alternate (those that missed a batch wait for it
        and then form the next one). So after the first wait, the worker also waits, up to a tenth of the last
        generate call (at most ``max_regroup_s``), until as many rows are pending as were in demand around the
        last call (its rows plus those left pending): clients that just got their answers rejoin one batch.
        """
        with self._cond:
            while not self._pending and not self._stop:
                self._cond.wait()
            if self._stop:
                return []
        if self.batch_wait_s > 0:
            time.sleep(self.batch_wait_s)  # let concurrent requests join this batch
        want = min(self._recent_rows, self.max_batch_size)
        deadline = time.monotonic() + min(self.max_regroup_s, 0.1 * self._last_generate_s)
        with self._cond:
            while self._pending_rows() < want and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        with self._cond:
            for job in self._pending:
                if job.dropped:
                    job.future.cancel()
            self._pending = [j for j in self._pending if not j.future.cancelled()]
            if not self._pending:
                return []
            # the head: the oldest job of the client served the least work (a new one starts at the virtual time)
            head = min(self._pending, key=lambda j: max(self._served.get(j.client, 0), self._vtime))
            key, rows, batch, rest = head.key, head.n, [head], []
            for job in self._pending:
                if job is head:
                    continue
                if job.key == key and rows + job.n <= self.max_batch_size:
                    batch.append(job)
                    rows += job.n
                else:
                    rest.append(job)
            self._pending = rest
            self._vtime = max(self._served.get(head.client, 0), self._vtime)
            for job in batch:
                self._served[job.client] = max(self._served.get(job.client, 0), self._vtime) + job.n * key.max_tokens
            if len(self._served) > 10_000:  # clients at or below the virtual time lose nothing by being forgotten
                self._served = {c: w for c, w in self._served.items() if w > self._vtime}
        return [j for j in batch if j.future.set_running_or_notify_cancel()]

    def _loop(self) -> None:
        while True:
            jobs = self._take()
            if self._stop:
                for job in jobs:
                    job.future.set_exception(APIError(503, "the server is shutting down", type="server_error"))
                return
            if not jobs:
                continue
            try:
                results = self.run_batch(jobs)
            except Exception as err:  # one failed batch must not stop the server
                log.exception("generate failed for a batch of %d requests", len(jobs))
                self.stats["errors"] += 1
                error = APIError(500, f"generation failed: {type(err).__name__}: {err}", type="server_error")
                for job in jobs:
                    job.future.set_exception(error)
                continue
            with self._cond:
                self._recent_rows = sum(j.n for j in jobs) + self._pending_rows()
            for job, choices in zip(jobs, results):
                job.future.set_result(choices)

    # -- generation -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_batch(self, jobs: Sequence[Job]) -> list[list[Choice]]:
        """One ``generate`` call for all choices of ``jobs`` (which share a :class:`SamplingKey`)."""
        from contextlib import nullcontext

        from transformers import (
            LogitsProcessorList,
            StoppingCriteriaList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        from vpo_lightning.generation.engines import left_pad

        key = jobs[0].key
        rows = [job.prompt_ids for job in jobs for _ in range(job.n)]
        stops = [job.stops for job in jobs for _ in range(job.n)]
        ids, mask = left_pad(rows, self.tokenizer.pad_token_id, self.device)  # [R, P]
        kwargs: dict[str, Any] = {"max_new_tokens": key.max_tokens, "pad_token_id": self.tokenizer.pad_token_id,
                                  "eos_token_id": sorted(self.eos)}
        recorder = None
        if any(job.logprobs is not None or job.events is not None for job in jobs):
            streams = [(job.events, i) if job.events is not None else None for job in jobs for i in range(job.n)]
            recorder = StepRecorder(max(job.logprobs or 0 for job in jobs), streams, self.eos)
        if key.temperature > 0:  # only the request's warpers: none from the model's generation_config.json
            kwargs.update(min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
        if key.temperature > 0 and recorder is not None:
            # the warpers transformers would add, in its order, then the recorder: it sees what sampling draws from
            warpers: list[Any] = []
            if key.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(key.temperature))
            if key.top_k:
                warpers.append(TopKLogitsWarper(key.top_k))
            if key.top_p < 1.0:
                warpers.append(TopPLogitsWarper(key.top_p))
            kwargs.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                          logits_processor=LogitsProcessorList([*warpers, _Processor(recorder)]))
        elif key.temperature > 0:
            kwargs.update(do_sample=True, temperature=key.temperature, top_p=key.top_p, top_k=key.top_k)
        else:
            kwargs.update(do_sample=False)
            if recorder is not None:
                kwargs["logits_processor"] = LogitsProcessorList([_Processor(recorder)])
        if key.ignore_eos:
            kwargs["min_new_tokens"] = key.max_tokens
        criteria = None
        stopping: list[Any] = [DropAbandoned(jobs)] + ([] if recorder is None else [recorder])
        if any(stops):
            criteria = StopOnStrings(self.tokenizer, ids.shape[1], stops, self.tokenizer_lock)
            stopping.append(criteria)
        if stopping:
            kwargs["stopping_criteria"] = StoppingCriteriaList(stopping)
        use_base = not key.adapter and hasattr(self.model, "disable_adapter")
        if key.seed is not None:
            torch.manual_seed(key.seed)
        t0 = time.perf_counter()
        with self.model.disable_adapter() if use_base else nullcontext():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)  # [R, P + L]
        elapsed = time.perf_counter() - t0
        generated = out[:, ids.shape[1] :].tolist()
        tops = [job.logprobs for job in jobs for _ in range(job.n)]
        choices: list[Choice] = []
        for r, tokens in enumerate(generated):
            choice = self._choice(tokens, stops[r], None if criteria is None else criteria.stopped_at.get(r),
                                  key.max_tokens)
            if recorder is not None and tops[r] is not None:
                choice.logprobs = self._logprobs(recorder, r, choice, tops[r])
            choices.append(choice)
        self._count(jobs, len(rows), sum(c.tokens for c in choices), elapsed)
        grouped, start = [], 0
        for job in jobs:
            grouped.append(choices[start : start + job.n])
            start += job.n
        return grouped

    def _choice(self, tokens: list[int], stops: tuple[str, ...], stopped_at: int | None, max_tokens: int) -> Choice:
        if stopped_at is not None:
            tokens, finish = tokens[:stopped_at], "stop"
        else:
            cut = next((i for i, t in enumerate(tokens) if t in self.eos), None)
            if cut is not None:
                tokens, finish = tokens[: cut + 1], "stop"
            else:
                finish = "length" if len(tokens) >= max_tokens else "stop"
        with self.tokenizer_lock:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            text, finish = text[: min(hits)], "stop"
        return Choice(text, finish, len(tokens))

    def _logprobs(self, recorder: StepRecorder, row: int, choice: Choice, top: int) -> list[dict[str, Any]]:
        """The log-prob entries of the tokens of ``choice.text``: its counted tokens less a final end-of-sequence
        token, and less those wholly past the text where a stop string cut it."""
        count = min(choice.tokens, len(recorder.ids[row]))
        ids = recorder.ids[row][:count]
        if ids and ids[-1] in self.eos:
            ids = ids[:-1]
        with self.tokenizer_lock:
            entries = logprob_entries(self.tokenizer, ids, recorder.logprobs[row], recorder.tops[row], top)
        size = len(choice.text.encode("utf-8"))
        if choice.finish_reason != "stop" or size >= sum(len(e["bytes"]) for e in entries):
            return entries
        kept, have = 0, 0
        while kept < len(entries) and have < size:  # cut at a stop string: a token straddling the cut is kept
            have += len(entries[kept]["bytes"])
            kept += 1
        return entries[:kept]

    def _count(self, jobs: Sequence[Job], rows: int, tokens: int, elapsed: float) -> None:
        s = self.stats
        s["batches"] += 1
        s["requests"] += len(jobs)
        s["rows"] += rows
        s["generated_tokens"] += tokens
        s["generate_s"] += elapsed
        self._last_generate_s = elapsed
        s["max_batch_requests"] = max(s["max_batch_requests"], len(jobs))
        s["max_batch_rows"] = max(s["max_batch_rows"], rows)
