"""The batching worker of ``vpo serve``: one thread owns the model and turns queued requests into ``generate`` calls.

HTTP handler threads validate and tokenize a request (:mod:`vpo_lightning.serve.openai_api`), then queue a :class:`Job`.
The worker waits ``batch_wait_s`` for more requests, takes the oldest pending job and every other pending job with
the same :class:`~vpo_lightning.serve.openai_api.SamplingKey` (temperature, top-p, top-k, max_tokens, ignore_eos,
seed, adapter on/off) up to ``max_batch_size`` rows, and runs them as one ``generate`` call; stop strings are checked
per row while generating. Jobs with other keys wait for the next call. A failed call answers its jobs with a 500
and is counted in ``stats["errors"]``; the worker keeps serving.
"""

from __future__ import annotations

import copy
import logging
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
    """One queued request: its prompt, how many choices, its sampling key and stop strings."""

    prompt_ids: list[int]
    n: int
    key: SamplingKey
    stops: tuple[str, ...] = ()
    future: Future = field(default_factory=Future)


@dataclass
class Choice:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    tokens: int  # generated tokens counted in usage



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
        return sum(j.n for j in self._pending if not j.future.cancelled())

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
            self._pending = [j for j in self._pending if not j.future.cancelled()]
            if not self._pending:
                return []
            key, rows, batch, rest = self._pending[0].key, 0, [], []
            for job in self._pending:
                if job.key == key and rows + job.n <= self.max_batch_size:
                    batch.append(job)
                    rows += job.n
                else:
                    rest.append(job)
            self._pending = rest
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
            except Exception as err:  # noqa: BLE001 - one failed batch must not stop the server
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

        from transformers import StoppingCriteriaList

        from vpo_lightning.generation.engines import left_pad

        key = jobs[0].key
        rows = [job.prompt_ids for job in jobs for _ in range(job.n)]
        stops = [job.stops for job in jobs for _ in range(job.n)]
        ids, mask = left_pad(rows, self.tokenizer.pad_token_id, self.device)  # [R, P]
        kwargs: dict[str, Any] = {"max_new_tokens": key.max_tokens, "pad_token_id": self.tokenizer.pad_token_id,
                                  "eos_token_id": sorted(self.eos)}
        if key.temperature > 0:
            kwargs.update(do_sample=True, temperature=key.temperature, top_p=key.top_p, top_k=key.top_k)
        else:
            kwargs.update(do_sample=False)
        if key.ignore_eos:
            kwargs["min_new_tokens"] = key.max_tokens
        criteria = None
        if any(stops):
            criteria = StopOnStrings(self.tokenizer, ids.shape[1], stops, self.tokenizer_lock)
            kwargs["stopping_criteria"] = StoppingCriteriaList([criteria])
        use_base = not key.adapter and hasattr(self.model, "disable_adapter")
        if key.seed is not None:
            torch.manual_seed(key.seed)
        t0 = time.perf_counter()
        with self.model.disable_adapter() if use_base else nullcontext():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)  # [R, P + L]
        elapsed = time.perf_counter() - t0
        generated = out[:, ids.shape[1] :].tolist()
        choices: list[Choice] = []
        for r, tokens in enumerate(generated):
            choices.append(self._choice(tokens, stops[r], None if criteria is None else criteria.stopped_at.get(r),
                                        key.max_tokens))
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
