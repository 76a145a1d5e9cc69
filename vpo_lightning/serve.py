"""``vpo serve``: an OpenAI-compatible chat-completions server over the transformers engine, with request batching.

    vpo serve --config configs/tooluse.yaml                               # base model on http://127.0.0.1:8000/v1
    vpo serve --config configs/tooluse.yaml --adapter checkpoints/tooluse-vpo/adapters/last --port 8001
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "vpo", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 32}'

Endpoints: ``POST /v1/chat/completions`` (``messages``, ``n``, ``temperature``, ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``stop``; vLLM's ``top_k`` and ``ignore_eos`` extensions), ``GET /v1/models``,
``GET /health`` and ``GET /stats`` (batching counters). Messages are rendered with the tokenizer's chat template
(:func:`vpo_lightning.models.prompt_token_ids`), exactly as in training. No streaming. A request with a ``seed``
is batched only with requests of the same seed, and the sampler is seeded before that batch (reproducible when
the batch is the same); ``--ignore-seed`` drops seeds so that they batch with everything.

Model names: the base model is served under the config's ``model.model.name``; with ``--adapter`` (or ``--ckpt``)
the adapter is served under ``--adapter-name`` (default ``vpo``) and the base name runs the same weights with the
adapter disabled, like ``vllm serve BASE --enable-lora --lora-modules vpo=DIR``. A request without ``model`` gets
the adapter when there is one.

Batching: HTTP handler threads validate and tokenize a request, then queue it. One worker thread owns the model:
it waits ``--batch-wait-ms`` for more requests, takes the oldest pending request and every other pending request
with the same sampling parameters (temperature, top-p, top-k, max_tokens, ignore_eos, seed, adapter on/off) up to
``--max-batch-size`` sequences, and runs them as one ``generate`` call; stop strings are checked per sequence while
generating. Requests with other parameters wait for the next call.

Limits: request bodies over ``--max-request-bytes`` get 413, more than ``--max-concurrency`` requests in flight get
429 (OpenAI clients retry those), ``n`` above ``--max-n`` and ``max_tokens`` above ``--max-tokens-limit`` or past
the model's context get 400. Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
The server binds 127.0.0.1 by default and has no authentication unless ``--api-key`` is given.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from vpo_lightning.tools import report_error

log = logging.getLogger(__name__)

OWNER = "vpo-lightning"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 4  # OpenAI allows up to 4 stop sequences


# ---- errors -----------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error returned to the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- settings and requests --------------------------------------------------------------------------------------
@dataclass
class ServeSettings:
    """Server limits.

    Args:
        max_concurrency: chat-completion requests in flight (queued or generating) before new ones get 429.
        max_tokens_limit: largest ``max_tokens`` a request may ask for.
        max_request_bytes: largest request body accepted.
        max_n: largest ``n`` (choices per request).
        max_batch_size: most sequences (rows) in one ``generate`` call; at least ``max_n``.
        default_max_tokens: ``max_tokens`` when the request gives none.
        batch_wait_s: how long the worker waits for more requests before a ``generate`` call.
        request_timeout_s: a request still waiting after this long gets 504.
        api_key: when set, requests need ``Authorization: Bearer <api_key>``.
        ignore_seed: drop each request's ``seed``, so that seeded requests share ``generate`` calls with the
            others. Without it, a request is batched only with requests of the same seed; clients that send a new
            seed per request (OpenEvolve sends one per iteration) then get no batching at all.
    """

    max_concurrency: int = 8
    max_tokens_limit: int = 1024
    max_request_bytes: int = 1_000_000
    max_n: int = 16
    max_batch_size: int = 64
    default_max_tokens: int = 256
    batch_wait_s: float = 0.01
    request_timeout_s: float = 600.0
    api_key: str | None = None
    ignore_seed: bool = False

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "max_tokens_limit", "max_request_bytes", "max_n", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_size < self.max_n:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) must be >= max_n ({self.max_n})")
        self.default_max_tokens = min(self.default_max_tokens, self.max_tokens_limit)


@dataclass(frozen=True)
class SamplingKey:
    """The parameters a generate call shares; requests are batched together only when their keys are equal."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    ignore_eos: bool
    adapter: bool
    seed: int | None = None


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


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{name}' must be a number, got {json.dumps(value)[:80]}", name)
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise _bad(f"'{name}' must be in {bound}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer, got {json.dumps(value)[:80]}", name)
    return value


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """Validate OpenAI chat messages into ``[{"role", "content"}]`` strings (text content parts are joined)."""
    if raw is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(raw):
        param = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"{param} must be an object with 'role' and 'content'", param)
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{param}.role must be one of {sorted(ROLES)}, got {json.dumps(role)[:40]}", f"{param}.role")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"{param}.content: only text parts are supported", f"{param}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"{param}.content must be a string", f"{param}.content")
        out.append({"role": ROLES[role], "content": content})
    return out


def parse_stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise _bad(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in stops if s)


# ---- the batching worker ----------------------------------------------------------------------------------------
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
        from vpo_lightning.engines import eos_token_ids

        self.model, self.tokenizer, self.device = model.eval(), tokenizer, torch.device(device)
        self.max_batch_size, self.batch_wait_s, self.max_regroup_s = max_batch_size, batch_wait_s, max_regroup_s
        self._recent_rows, self._last_generate_s = 1, 0.0
        self.eos = eos_token_ids(model, tokenizer)
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to use from several threads at once
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

        from vpo_lightning.engines import left_pad

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


# ---- HTTP -------------------------------------------------------------------------------------------------------
class OpenAIServer(ThreadingHTTPServer):
    """The HTTP front end: validation, limits, model names; generation is delegated to a :class:`BatchGenerator`.

    Args:
        generator: the batching worker (started by :meth:`start`).
        models: served model id -> whether it uses the adapter.
        settings: limits.
        context_length: the model's maximum sequence length (prompt + completion).
        address: ``(host, port)``; port 0 picks a free port.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, generator: BatchGenerator, models: dict[str, bool], settings: ServeSettings,
                 context_length: int, address: tuple[str, int] = ("127.0.0.1", 8000)) -> None:
        self.generator, self.models, self.settings = generator, dict(models), settings
        self.context_length = context_length
        self.default_model = next((m for m, adapter in models.items() if adapter), next(iter(models)))
        self.created = int(time.time())
        self._in_flight = 0
        self._lock = threading.Lock()
        self._connections = threading.BoundedSemaphore(max(64, 4 * settings.max_concurrency))
        self._serve_thread: threading.Thread | None = None
        self._open: dict[Any, threading.Thread] = {}  # connection socket -> its handler thread
        host = address[0]
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}/v1"

    def start(self) -> OpenAIServer:
        """Start the worker and serve HTTP on a background thread (tests, benchmarks)."""
        self.generator.start()
        self._serve_thread = threading.Thread(target=self.serve_forever, name="vpo-serve-http", daemon=True)
        self._serve_thread.start()
        return self

    def close(self) -> None:
        """Stop serving, fail queued requests with 503, release the socket and end open connections' threads."""
        if self._serve_thread is not None:
            self.shutdown()
            self._serve_thread.join(timeout=10)
        self.generator.close()
        self.server_close()
        # Keep-alive clients leave handler threads blocked on their next request line; daemon threads still alive
        # at interpreter exit are killed mid-call (std::terminate inside torch). Close their sockets and join them.
        with self._lock:
            open_now = list(self._open.items())
        for sock, _ in open_now:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, thread in open_now:
            thread.join(timeout=10)

    # connection cap: beyond it a client gets 503 and the connection is closed, no thread is spawned
    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._connections.acquire(blocking=False):
            try:
                body = json.dumps(APIError(503, "too many open connections", type="server_error").body()).encode()
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._open[request] = threading.current_thread()
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)
            self._connections.release()

    # admission control for generation requests
    def admit(self) -> None:
        with self._lock:
            if self._in_flight >= self.settings.max_concurrency:
                raise APIError(429, f"the server is busy ({self.settings.max_concurrency} requests in flight); "
                                    "retry later", type="rate_limit_error", code="too_many_requests")
            self._in_flight += 1

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    # the chat-completions endpoint
    def build_job(self, body: Any) -> tuple[Job, str]:
        """Validate a request body into a :class:`Job` and the model id it names."""
        from vpo_lightning.models import prompt_token_ids

        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        s = self.settings
        model = body.get("model") or self.default_model
        if model not in self.models:
            raise APIError(404, f"The model {json.dumps(model)[:100]} does not exist. Served models: "
                                f"{', '.join(self.models)}", param="model", code="model_not_found")
        if body.get("stream"):
            raise _bad("streaming is not supported by vpo serve; set stream=false", "stream")
        messages = parse_messages(body.get("messages"))
        n = _integer(body, "n", 1)
        if not 1 <= n <= s.max_n:
            raise _bad(f"'n' must be between 1 and {s.max_n}, got {n}", "n")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _integer(body, name, s.default_max_tokens)
        if max_tokens < 1:
            raise _bad(f"'{name}' must be >= 1, got {max_tokens}", name)
        if max_tokens > s.max_tokens_limit:
            raise _bad(f"'{name}' is too large: {max_tokens}; this server allows at most {s.max_tokens_limit}", name)
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
        top_k = _integer(body, "top_k", 0)
        if top_k < -1:
            raise _bad(f"'top_k' must be -1 or 0 (off) or positive, got {top_k}", "top_k")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
        stops = parse_stop(body.get("stop"))
        seed = _integer(body, "seed", None)  # validated even when ignored
        if self.settings.ignore_seed:
            seed = None
        with self.generator.tokenizer_lock:
            try:
                prompt = prompt_token_ids(self.generator.tokenizer, messages)
            except Exception as err:  # noqa: BLE001 - a chat template may reject a message order
                raise _bad(f"cannot render the messages with the chat template: {err}", "messages") from None
        if len(prompt) + max_tokens > self.context_length:
            raise _bad(f"This model's maximum context length is {self.context_length} tokens. However, you "
                       f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} "
                       "in the completion). Please reduce the length of the messages or completion.",
                       "messages", "context_length_exceeded")
        key = SamplingKey(temperature, top_p if temperature > 0 else 1.0, max(top_k, 0) if temperature > 0 else 0,
                          max_tokens, ignore_eos, self.models[model], seed)
        return Job(prompt, n, key, stops), model

    def complete(self, body: Any) -> dict[str, Any]:
        job, model = self.build_job(body)
        self.admit()
        try:
            future = self.generator.submit(job)
            try:
                choices: list[Choice] = future.result(timeout=self.settings.request_timeout_s)
            except FutureTimeout:
                future.cancel()
                raise APIError(504, f"generation did not finish within {self.settings.request_timeout_s:.0f}s",
                               type="server_error") from None
            except CancelledError:
                raise APIError(503, "the server is shutting down", type="server_error") from None
        finally:
            self.release()
        completion = sum(c.tokens for c in choices)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion,
                      "total_tokens": len(job.prompt_ids) + completion},
        }

    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": self.created, "owned_by": OWNER}
                                           for m in self.models]}


class Handler(BaseHTTPRequestHandler):
    """Routes: POST /v1/chat/completions, GET /v1/models, GET /v1/models/<id>, GET /health, GET /stats."""

    protocol_version = "HTTP/1.1"  # keep-alive: every response carries Content-Length
    server_version = "vpo-serve"
    timeout = 120  # seconds a connection may stay silent (slow or idle clients release their thread)
    server: OpenAIServer

    GET_ROUTES = ("/v1/models", "/health", "/stats")
    POST_ROUTES = ("/v1/chat/completions",)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's signature
        log.debug("%s - %s", self.address_string(), format % args)

    def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: APIError, headers: dict[str, str] | None = None) -> None:
        self._send(err.status, err.body(), headers)

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _route_error(self, method: str) -> None:
        path = self._path()
        allowed = [m for m, routes in (("GET", self.GET_ROUTES), ("POST", self.POST_ROUTES))
                   if path in routes or (m == "GET" and path.startswith("/v1/models/"))]
        self._discard_body()
        if allowed:
            self._error(APIError(405, f"method {method} is not allowed on {path}; use {', '.join(allowed)}",
                                 code="method_not_allowed"), {"Allow": ", ".join(allowed)})
        else:
            self._error(APIError(404, f"no route {method} {path}; routes: POST /v1/chat/completions, "
                                      "GET /v1/models, GET /health", code="not_found"))

    def _authorized(self) -> bool:
        key = self.server.settings.api_key
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self._discard_body()
            self._error(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                 type="authentication_error", code="invalid_api_key"))
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        path = self._path()
        if path == "/health":
            self._send(200, {"status": "ok", "models": list(self.server.models)})
        elif not self._authorized():
            return
        elif path == "/v1/models":
            self._send(200, self.server.list_models())
        elif path.startswith("/v1/models/"):
            name = path[len("/v1/models/") :]
            found = [m for m in self.server.list_models()["data"] if m["id"] == name]
            if found:
                self._send(200, found[0])
            else:
                self._error(APIError(404, f"The model {name!r} does not exist", param="model",
                                     code="model_not_found"))
        elif path == "/stats":
            self._send(200, {**self.server.generator.stats, "in_flight": self.server._in_flight})
        else:
            self._route_error("GET")

    def do_POST(self) -> None:  # noqa: N802
        if self._path() not in self.POST_ROUTES:
            self._route_error("POST")
            return
        if not self._authorized():
            return
        try:
            body = self._read_json()
            self._send(200, self.server.complete(body))
        except APIError as err:
            self._error(err)
        except Exception as err:  # noqa: BLE001 - report, keep serving
            log.exception("request failed")
            self._error(APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error"))

    def _discard_body(self) -> None:
        """Read and drop a request body we will not use (closing a socket with unread data resets it, and the
        client could lose the response), then close the connection; a chunked or huge body is not read."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            return
        try:
            size = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            size = -1
        if size == 0:
            return
        if size < 0 or size > 16 * self.server.settings.max_request_bytes:
            self.close_connection = True
            return
        try:
            while size > 0:
                chunk = self.rfile.read(min(size, 1 << 16))
                if not chunk:
                    break
                size -= len(chunk)
        except OSError:
            pass
        self.close_connection = True

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked" or length is None:
            self.close_connection = True
            raise APIError(411, "a Content-Length header is required (chunked bodies are not supported)",
                           code="length_required")
        try:
            size = int(length)
        except ValueError:
            self.close_connection = True
            raise _bad(f"invalid Content-Length {length!r}") from None
        if size < 0 or size > self.server.settings.max_request_bytes:
            self._discard_body()
            raise APIError(413, f"request body of {size} bytes exceeds the limit of "
                                f"{self.server.settings.max_request_bytes} bytes", code="request_too_large")
        raw = self.rfile.read(size)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _bad(f"the request body is not valid JSON: {err}") from None

    def do_PUT(self) -> None:  # noqa: N802
        self._route_error("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._route_error("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._route_error("PATCH")


# ---- building a server ------------------------------------------------------------------------------------------
def build_server(model: Any, tokenizer: Any, *, base_name: str, adapter_name: str | None = None,
                 settings: ServeSettings | None = None, host: str = "127.0.0.1", port: int = 8000,
                 device: torch.device | str = "cpu") -> OpenAIServer:
    """An :class:`OpenAIServer` over a loaded model (not started: call ``.start()`` or ``.serve_forever()``).

    Args:
        model: the causal LM; with ``adapter_name``, a PEFT model whose adapter serves that name.
        tokenizer: its tokenizer.
        base_name: id of the base model (the adapter disabled when there is one).
        adapter_name: id of the adapter, or None when serving only the base.
        settings: limits (defaults: :class:`ServeSettings`).
        host, port: where to listen (port 0 = a free port).
        device: the model's device.
    """
    settings = settings or ServeSettings()
    models = {base_name: False}
    if adapter_name:
        if not hasattr(model, "disable_adapter"):
            raise ValueError("adapter_name given but the model has no adapter (not a PEFT model)")
        if adapter_name == base_name:
            raise ValueError(f"--adapter-name {adapter_name!r} is also the base model's name")
        models[adapter_name] = True
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = getattr(model, "config", None)
    context = int(getattr(config, "max_position_embeddings", 0) or getattr(tokenizer, "model_max_length", 0) or 2048)
    generator = BatchGenerator(model, tokenizer, device, settings.max_batch_size, settings.batch_wait_s)
    return OpenAIServer(generator, models, settings, context, (host, port))


def load_for_serving(config: str | None, adapter: str | None, ckpt: str | None, overrides: list[str],
                     device: torch.device) -> tuple[Any, Any, Any, dict[str, Any]]:
    """``(model, tokenizer, model settings, config dict)`` for ``vpo serve``, loaded like ``vpo eval`` does."""
    from vpo_lightning import runs
    from vpo_lightning.models import load_tokenizer

    cfg = runs.load_config(runs.find_config(config, ckpt, adapter), overrides, require=("rollout",))
    model, settings, _ = runs.load_model(cfg, device, ckpt=ckpt, adapter=adapter)
    return model.eval(), load_tokenizer(settings.name), settings, cfg


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vpo serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="the YAML used by `vpo fit` (default: config.yaml beside --adapter/--ckpt)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--adapter", help="a PEFT adapter directory (checkpoints/<run>/adapters/<name>)")
    weights.add_argument("--ckpt", help="a Lightning .ckpt written by `vpo fit`")
    p.add_argument("--adapter-name", default="vpo", help="model id of the adapter (the base keeps its own name)")
    p.add_argument("--model-name", help="model id of the base model (default: the config's model.model.name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = a free one, printed at start)")
    p.add_argument("--max-concurrency", type=int, default=8, help="requests in flight before 429")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens a request may ask for")
    p.add_argument("--max-request-bytes", type=int, default=1_000_000, help="largest request body")
    p.add_argument("--max-n", type=int, default=16, help="largest n (choices per request)")
    p.add_argument("--max-batch-size", type=int, default=64, help="most sequences in one generate call")
    p.add_argument("--default-max-tokens", type=int,
                   help="max_tokens when a request gives none (default: the config's rollout.sampling.max_new_tokens)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, help="wait for more requests before generating")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a waiting request gets 504")
    p.add_argument("--api-key", default=os.environ.get("VPO_SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $VPO_SERVE_API_KEY; none = no auth)")
    p.add_argument("--ignore-seed", action="store_true",
                   help="drop requests' seed so they batch with all others (throughput over reproducibility; "
                        "for clients such as OpenEvolve that send a new seed with every request)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (0 = torch's default; 1 is much faster on a busy shared CPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override, repeatable (e.g. model.model.dtype=fp32, faster than bf16 on "
                        "most CPUs)")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``vpo serve``: load, bind, serve until Ctrl-C or SIGTERM."""
    from vpo_lightning.runs import pick_device

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        device = pick_device(args.device)
        model, tokenizer, model_settings, cfg = load_for_serving(args.config, args.adapter, args.ckpt,
                                                                 args.overrides, device)
        default_tokens = args.default_max_tokens or int(((cfg.get("rollout") or {}).get("sampling") or {})
                                                        .get("max_new_tokens", 256))
        settings = ServeSettings(
            max_concurrency=args.max_concurrency, max_tokens_limit=args.max_tokens_limit,
            max_request_bytes=args.max_request_bytes, max_n=args.max_n, max_batch_size=args.max_batch_size,
            default_max_tokens=default_tokens, batch_wait_s=args.batch_wait_ms / 1000,
            request_timeout_s=args.request_timeout, api_key=args.api_key, ignore_seed=args.ignore_seed,
        )
        trained = bool(args.adapter or args.ckpt)
        adapter_name = args.adapter_name if trained and hasattr(model, "disable_adapter") else None
        base_name = args.model_name or model_settings.name
        if trained and adapter_name is None:  # a fully fine-tuned checkpoint: no base to serve beside it
            base_name = args.model_name or args.adapter_name
        server = build_server(model, tokenizer, base_name=base_name,
                              adapter_name=adapter_name, settings=settings, host=args.host, port=args.port,
                              device=device)
    except (ValueError, FileNotFoundError, ImportError, OSError) as err:
        return report_error("vpo serve", err)
    if not _is_loopback(args.host):
        print(f"vpo serve: warning: binding {args.host} exposes the model beyond this machine"
              + ("" if args.api_key else " with no API key (--api-key)"), file=sys.stderr)
    server.generator.start()

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"vpo serve: serving {', '.join(server.models)} at {server.url} "
          f"(max concurrency {settings.max_concurrency}, max_tokens <= {settings.max_tokens_limit}, "
          f"context {server.context_length}, {model_settings.dtype} weights, {torch.get_num_threads()} threads)",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    print("vpo serve: stopped", flush=True)
    return 0
