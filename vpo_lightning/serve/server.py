"""``vpo serve``: an OpenAI-compatible chat-completions server over the transformers engine, with request batching.

    vpo serve --config configs/tooluse.yaml                               # base model on http://127.0.0.1:8000/v1
    vpo serve --config configs/tooluse.yaml --adapter checkpoints/tooluse-vpo/adapters/last --port 8001
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "vpo", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 32}'

Endpoints: ``POST /v1/chat/completions`` (``messages``, ``n``, ``temperature``, ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``seed``, ``stream`` with ``stream_options.include_usage``, ``logprobs`` /
``top_logprobs``, ``tools`` with ``tool_choice`` "auto" or "none"; vLLM's ``top_k`` and ``ignore_eos`` extensions),
``GET /v1/models``, ``GET /health`` and ``GET /stats`` (batching counters). Messages are rendered with the tokenizer's
chat template (:func:`vpo_lightning.generation.models.prompt_token_ids`), exactly as in training; ``tools`` go to the
template, or, when the template ignores them (SmolLM2's), into the tool-use task's system message
(:func:`vpo_lightning.tasks.tooluse.build_messages`); ``<tool_call>`` blocks in the answer come back as OpenAI
``tool_calls``. Every other field, and every value the server cannot honour, is a 400 naming it
(:func:`vpo_lightning.serve.openai_api.check_fields`). A request with a ``seed`` is batched only with requests of the
same seed, and the sampler is seeded before that batch (reproducible when the batch is the same); ``--ignore-seed``
drops seeds so that they batch with everything.

Model names: the base model is served under the config's ``model.model.name``; with ``--adapter`` (or ``--ckpt``)
the adapter is served under ``--adapter-name`` (default ``vpo``) and the base name runs the same weights with the
adapter disabled, like ``vllm serve BASE --enable-lora --lora-modules vpo=DIR``. A request without ``model`` gets
the adapter when there is one.

Batching (:mod:`vpo_lightning.serve.batching`): HTTP handler threads validate and tokenize a request, then queue
it. One worker thread owns the model: it waits ``--batch-wait-ms`` for more requests, takes the oldest pending request
and every other pending request with the same sampling parameters (temperature, top-p, top-k, max_tokens,
ignore_eos, seed, adapter on/off) up to ``--max-batch-size`` sequences, and runs them as one ``generate`` call; stop
strings are checked per sequence while generating. Requests with other parameters wait for the next call.

Limits: request bodies over ``--max-request-bytes`` get 413, more than ``--max-concurrency`` requests in flight get
429 (OpenAI clients retry those), ``n`` above ``--max-n`` and ``max_tokens`` above ``--max-tokens-limit`` or past
the model's context get 400, and so does every malformed body (wrong types, nesting deeper than 64, integers of more
than 32 digits, NaN/Infinity anywhere, a seed outside torch's range: :mod:`vpo_lightning.serve.openai_api`; the body is
checked in linear time). Messages longer than the context could hold (context x the longest token's characters) get
400 before any tokenization; prompts over 16k characters are tokenized by a second tokenizer copy, so long prompts
wait for each other, never short ones. Errors use OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}``; ``GET /stats`` counts 4xx and 5xx answers apart, and clients that hang up before their answer is sent
as ``client_disconnects`` (not errors). At most ``--max-connections`` connections are open; when all are taken, the
one idle the longest (waiting for its next request or still sending one) is closed to make room, so idle or slow
clients cannot lock others out; a connection silent for ``--idle-timeout`` seconds is closed. The server binds
127.0.0.1 by default and has no authentication unless ``--api-key`` is given.

Why the standard library's HTTP server and not FastAPI/uvicorn or LitServe (decided when splitting serve.py): the
part that needs care, batching keyed by sampling parameters with n choices, seeds, adapter on/off and stop strings,
is ours whichever server fronts it; LitServe's batcher groups requests by arrival only, one output per input, so it
would be an HTTP shell around this same worker. What uvicorn would add is asynchronous connections with header and
keep-alive timeouts; the threads here get the same protection from the connection cap with idle eviction and the
idle timeout (tested with more idle connections than the cap). None of these packages is installed or in the lock
file (FastAPI alone brings starlette, anyio and sniffio; uvicorn brings h11 and click) for an optional subcommand.
Streaming (issue 53) needed no more than a chunked HTTP/1.1 body of server-sent events written by the handler thread
(:meth:`Handler._stream`), fed by the worker through a queue per request.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from vpo_lightning.commands.tools import parse_args
from vpo_lightning.serve.batching import SMALL_PROMPT_CHARS, BatchGenerator, Choice, Job, logprob_entries
from vpo_lightning.serve.openai_api import (
    APIError,
    ChatRequest,
    ServeSettings,
    bad_request,
    decode_json,
    parse_chat_request,
)
from vpo_lightning.training.runtime import report_error

log = logging.getLogger(__name__)

OWNER = "vpo-lightning"
EVICT_WAIT_S = 2.0  # how long a new connection waits for an evicted idle one to release its slot
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PROBE_TOOL = "vpo_probe_tool"


# ---- tools ------------------------------------------------------------------------------------------------------
def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes ``tools`` into the prompt (Qwen2.5's does; SmolLM2's ignores
    them)."""
    probe = [{"type": "function", "function": {"name": PROBE_TOOL, "description": "", "parameters": {}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=probe,
                                             add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that rejects tools does not render them
        return False
    return PROBE_TOOL in text


def tool_call_text(calls: list[dict[str, Any]]) -> str:
    """An assistant message's ``tool_calls`` in the project's format: one ``<tool_call>`` block, a JSON object per
    line (:mod:`vpo_lightning.tasks.tooluse`)."""
    lines = []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = call["function"]["arguments"]
        lines.append(json.dumps({"name": call["function"]["name"], "parameters": arguments}, ensure_ascii=False))
    return f"{TOOL_OPEN}\n" + "\n".join(lines) + f"\n{TOOL_CLOSE}"


def tooluse_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages as the tool-use task writes them, for chat templates that ignore ``tools``: the tools in a
    leading system message with the answer format (:func:`vpo_lightning.tasks.tooluse.build_messages`, exactly as
    in training), earlier calls as ``<tool_call>`` blocks in the assistant's text."""
    from vpo_lightning.tasks.tooluse import build_messages

    plain = []
    for m in messages:
        content = m["content"]
        if m.get("tool_calls"):
            content = (content + "\n" if content else "") + tool_call_text(m["tool_calls"])
        plain.append({"role": m["role"], "content": content})
    if not tools:
        return plain
    docs = [{"name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"]} for t in tools]
    return build_messages(docs, plain)


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a completion: the calls of its complete ``<tool_call>`` blocks
    (:func:`vpo_lightning.tasks.tooluse.calls.parse_output`) in OpenAI's shape, and the text with those blocks
    removed (None when nothing else is left). Without a call, the text is the content, unchanged."""
    from vpo_lightning.tasks.tooluse.calls import parse_output

    calls = parse_output(text).calls
    if not calls:
        return text, []
    content, pos = [], 0
    while (start := text.find(TOOL_OPEN, pos)) >= 0:
        end = text.find(TOOL_CLOSE, start + len(TOOL_OPEN))
        if end < 0:
            break
        content.append(text[pos:start])
        pos = end + len(TOOL_CLOSE)
    content.append(text[pos:])
    rest = "".join(content)
    return (rest if rest.strip() else None), [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        for name, arguments in calls]


def message_of(choice: Choice, request: ChatRequest) -> tuple[dict[str, Any], str]:
    """The assistant message of a choice and its finish reason (``tool_calls`` when it calls a tool)."""
    if request.tools is None:
        return {"role": "assistant", "content": choice.text}, choice.finish_reason
    content, calls = split_tool_calls(choice.text)
    if not calls:
        return {"role": "assistant", "content": choice.text}, choice.finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


class StreamedChoice:
    """The text of one streamed choice sent so far: tokens are sent once their text is final, that is, it ends on
    a whole character and no stop string (nor, with tools, ``<tool_call>``) could start in it."""

    def __init__(self, holds: tuple[str, ...], max_tokens: int, eos: set[int]) -> None:
        self.holds, self.max_tokens, self.eos = holds, max_tokens, eos
        self.margin = max((len(h) - 1 for h in holds), default=0)
        self.ids: list[int] = []
        self.logprobs: list[tuple[float, list]] = []
        self.text, self.sent_tokens, self.sent_entries = "", 0, 0

    def add(self, token: int, logprob: float, alternatives: list, decode: Any) -> tuple[str, int, int]:
        """Take a generated token; return ``(new text, first, end)``: the text now final and the token range
        ``[first, end)`` it completes."""
        if len(self.ids) >= self.max_tokens:  # a step past the budget (transformers' deferred stop check)
            return "", self.sent_tokens, self.sent_tokens
        self.ids.append(token)
        self.logprobs.append((logprob, alternatives))
        full = decode(self.ids)
        limit = len(full) - self.margin
        for hold in self.holds:
            at = full.find(hold)
            if at >= 0:
                limit = min(limit, at)
        first, text, end = self.sent_tokens, self.text, self.sent_tokens
        while end < len(self.ids):
            candidate = full if end + 1 == len(self.ids) else decode(self.ids[: end + 1])
            if candidate.endswith("\ufffd") or len(candidate) > limit or not candidate.startswith(self.text):
                break
            text, end = candidate, end + 1
        delta, self.text, self.sent_tokens = text[len(self.text) :], text, end
        return delta, first, end


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
        # the longest token's text bounds the characters per token, so longer messages cannot fit the context
        self.max_token_chars = max((len(t) for t in generator.tokenizer.get_vocab()), default=1) or 1
        self.max_prompt_chars = context_length * self.max_token_chars
        self.template_tools = template_renders_tools(generator.tokenizer)  # else: the tool-use task's system message
        self.default_model = next((m for m, adapter in models.items() if adapter), next(iter(models)))
        self.created = int(time.time())
        self._in_flight = 0
        self._lock = threading.Lock()
        self._connections = threading.BoundedSemaphore(settings.max_connections)
        self._serve_thread: threading.Thread | None = None
        self._open: dict[Any, threading.Thread] = {}  # connection socket -> its handler thread
        self._idle: dict[Any, float] = {}  # connection socket -> since when it waits for (or sends) a request
        self.http_stats = {"http_4xx": 0, "http_5xx": 0, "connections_evicted": 0, "client_disconnects": 0}
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

    def stats(self) -> dict[str, Any]:
        """``GET /stats``: the worker's batching counters, requests in flight, 4xx/5xx answers and connections."""
        with self._lock:
            return {**self.generator.stats, "in_flight": self._in_flight, **self.http_stats,
                    "connections_open": len(self._open)}

    def count_disconnect(self) -> None:
        with self._lock:
            self.http_stats["client_disconnects"] += 1

    def count_status(self, status: int) -> None:
        if status >= 400:
            with self._lock:
                self.http_stats["http_5xx" if status >= 500 else "http_4xx"] += 1

    # connection cap: when it is reached, the connection idle the longest is closed to make room; when none is idle
    # (every connection has a request being answered), the new client gets 503 and no thread is spawned
    def mark_idle(self, request: Any) -> None:
        """The connection waits for its next request (or is still sending one): it may be evicted."""
        with self._lock:
            self._idle[request] = time.monotonic()

    def mark_busy(self, request: Any) -> bool:
        """A whole request was read: the connection may not be evicted until it is idle again. False when it was
        evicted already (its socket is shut down)."""
        with self._lock:
            return self._idle.pop(request, None) is not None

    def _evict_idlest(self) -> bool:
        with self._lock:
            if not self._idle:
                return False
            victim = min(self._idle, key=self._idle.__getitem__)
            del self._idle[victim]
            self.http_stats["connections_evicted"] += 1
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its handler's read returns EOF; the thread ends, freeing the slot
        except OSError:
            pass
        return True

    def process_request(self, request: Any, client_address: Any) -> None:
        admitted = self._connections.acquire(blocking=False)
        if not admitted and self._evict_idlest():
            admitted = self._connections.acquire(timeout=EVICT_WAIT_S)
        if not admitted:
            self.count_status(503)
            try:
                body = json.dumps(APIError(503, "too many open connections", type="server_error").body()).encode()
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self.mark_idle(request)
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._open[request] = threading.current_thread()
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)
                self._idle.pop(request, None)
            self._connections.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (or an evicted connection) is routine: no traceback on stderr."""
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            log.debug("connection from %s ended: %s", client_address, err)
        else:
            super().handle_error(request, client_address)

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
    def build_job(self, body: Any) -> tuple[Job, ChatRequest]:
        """Validate a request body into a :class:`Job` and its :class:`ChatRequest` (model, tools, streaming)."""
        from vpo_lightning.generation.models import prompt_token_ids

        request = parse_chat_request(body, self.settings, self.models, self.default_model)
        chars = sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in request.messages)
        chars += len(json.dumps(request.tools)) if request.tools else 0
        if chars > self.max_prompt_chars:  # certainly past the context: refused before any tokenization
            raise bad_request(f"This model's maximum context length is {self.context_length} tokens and the "
                              f"messages hold {chars} characters (no token is longer than {self.max_token_chars}, "
                              f"so at most {self.max_prompt_chars} characters can fit). Please reduce the length of "
                              "the messages.", "messages", "context_length_exceeded")
        gen = self.generator
        small = chars <= SMALL_PROMPT_CHARS
        messages, tools = request.messages, request.tools
        if not self.template_tools:  # the template ignores tools: the tool-use task's system message carries them
            messages, tools = tooluse_messages(messages, tools), None
        with gen.tokenizer_lock if small else gen.long_tokenizer_lock:
            try:
                prompt = prompt_token_ids(gen.tokenizer if small else gen.long_tokenizer, messages, tools)
            except Exception as err:  # noqa: BLE001 - a chat template may reject a message order
                raise bad_request(f"cannot render the messages with the chat template: {err}", "messages") from None
        max_tokens = request.key.max_tokens
        if len(prompt) + max_tokens > self.context_length:
            raise bad_request(f"This model's maximum context length is {self.context_length} tokens. However, you "
                              f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                              f"{max_tokens} in the completion). Please reduce the length of the messages or "
                              "completion.", "messages", "context_length_exceeded")
        job = Job(prompt, request.n, request.key, request.stops, logprobs=request.logprobs,
                  events=queue.Queue() if request.stream else None)
        return job, request

    def _submit(self, job: Job) -> Any:
        """Queue an admitted job; with ``job.events``, ``None`` is put there once it is done (or failed)."""
        future = self.generator.submit(job)
        if job.events is not None:
            events = job.events
            future.add_done_callback(lambda _: events.put(None))
        return future

    def _result(self, future: Any, timeout: float) -> list[Choice]:
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            future.cancel()
            raise APIError(504, f"generation did not finish within {self.settings.request_timeout_s:.0f}s",
                           type="server_error") from None
        except CancelledError:
            raise APIError(503, "the server is shutting down", type="server_error") from None

    def complete(self, body: Any) -> dict[str, Any]:
        """A non-streamed chat completion for a request body (``stream: true`` bodies go to :meth:`stream`)."""
        job, request = self.build_job(body)
        if request.stream:
            raise bad_request("use OpenAIServer.stream for a streamed request", "stream")
        return self.answer(job, request)

    def answer(self, job: Job, request: ChatRequest) -> dict[str, Any]:
        """Generate ``job`` and give OpenAI's ``chat.completion`` object."""
        self.admit()
        try:
            choices = self._result(self._submit(job), self.settings.request_timeout_s)
        finally:
            self.release()
        completion = sum(c.tokens for c in choices)
        out = []
        for i, c in enumerate(choices):
            message, finish = message_of(c, request)
            logprobs = None if c.logprobs is None else {"content": c.logprobs, "refusal": None}
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "system_fingerprint": None, "choices": out,
            "usage": {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion,
                      "total_tokens": len(job.prompt_ids) + completion},
        }

    def stream(self, job: Job, request: ChatRequest) -> Iterator[dict[str, Any]]:
        """OpenAI's ``chat.completion.chunk`` objects of a streamed request, as tokens are generated.

        The first chunk (each choice's role) comes once generation has produced something, so that a request that
        fails before (429, 504, a failed ``generate``) raises :class:`APIError` from the first ``next`` and can be
        answered with a plain error. Text is sent once final (:class:`StreamedChoice`); the rest, tool calls and
        the finish reason come in each choice's last chunk, the usage in a chunk of its own with
        ``stream_options.include_usage``.
        """
        assert job.events is not None
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        gen = self.generator

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
            out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": request.model,
                   "system_fingerprint": None, "choices": choices}
            if request.include_usage:
                out["usage"] = usage
            return out

        def decode(ids: list[int]) -> str:
            with gen.tokenizer_lock:
                return gen.tokenizer.decode(ids, skip_special_tokens=True)

        def entries(state: StreamedChoice, first: int, end: int) -> list[dict[str, Any]]:
            ids = [t for t in state.ids[first:end] if t not in gen.eos]
            pairs = [p for t, p in zip(state.ids[first:end], state.logprobs[first:end]) if t not in gen.eos]
            with gen.tokenizer_lock:
                made = logprob_entries(gen.tokenizer, ids, [p[0] for p in pairs], [p[1] for p in pairs],
                                       request.logprobs or 0)
            state.sent_entries += len(made)
            return made

        holds = request.stops + ((TOOL_OPEN,) if request.tools else ())
        states = [StreamedChoice(holds, request.key.max_tokens, gen.eos) for _ in range(request.n)]
        self.admit()
        try:
            future = self._submit(job)
            deadline = time.monotonic() + self.settings.request_timeout_s
            started = False
            while True:
                try:
                    event = job.events.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    future.cancel()
                    raise APIError(504, f"generation did not finish within {self.settings.request_timeout_s:.0f}s",
                                   type="server_error") from None
                if event is None:
                    break
                if not started:
                    started = True
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for i in range(request.n)])
                index, token, logprob, alternatives = event
                state = states[index]
                delta, first, end = state.add(token, logprob, alternatives, decode)
                if end > first:
                    logprobs = None if request.logprobs is None else \
                        {"content": entries(state, first, end), "refusal": None}
                    if delta or (logprobs and logprobs["content"]):
                        yield chunk([{"index": index, "delta": {"content": delta}, "logprobs": logprobs,
                                      "finish_reason": None}])
            choices = self._result(future, 0)
            if not started:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(request.n)])
            for i, (choice, state) in enumerate(zip(choices, states)):
                message, finish = message_of(choice, request)
                content = message.get("content") or ""
                last: dict[str, Any] = {}
                if content.startswith(state.text) and len(content) > len(state.text):
                    last["content"] = content[len(state.text) :]
                elif not content.startswith(state.text):
                    log.warning("streamed text of choice %d is not a prefix of its final text", i)
                if message.get("tool_calls"):
                    last["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                rest = None if choice.logprobs is None else choice.logprobs[state.sent_entries :]
                logprobs = None if rest is None else {"content": rest, "refusal": None}
                yield chunk([{"index": i, "delta": last, "logprobs": logprobs, "finish_reason": finish}])
            if request.include_usage:
                completion = sum(c.tokens for c in choices)
                yield chunk([], {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion,
                                 "total_tokens": len(job.prompt_ids) + completion})
        finally:
            self.release()

    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": self.created, "owned_by": OWNER}
                                           for m in self.models]}


class Handler(BaseHTTPRequestHandler):
    """Routes: POST /v1/chat/completions, GET /v1/models, GET /v1/models/<id>, GET /health, GET /stats."""

    protocol_version = "HTTP/1.1"  # keep-alive: every response carries Content-Length
    server_version = "vpo-serve"
    server: OpenAIServer

    GET_ROUTES = ("/v1/models", "/health", "/stats")
    POST_ROUTES = ("/v1/chat/completions",)

    def setup(self) -> None:
        self.timeout = self.server.settings.idle_timeout_s  # a silent connection is closed after this long
        super().setup()

    def handle_one_request(self) -> None:
        self.server.mark_idle(self.connection)  # waiting for the next request: may be evicted when the cap is hit
        super().handle_one_request()

    def _busy(self) -> bool:
        """Mark the connection busy (a whole request was read); False, and close, when it was evicted meanwhile."""
        if self.server.mark_busy(self.connection):
            return True
        self.close_connection = True
        return False

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's signature
        log.debug("%s - %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, header too long, unknown method) in OpenAI's JSON shape."""
        self.close_connection = True
        text = message or self.responses.get(code, ("error",))[0]
        kind = "server_error" if code >= 500 else "invalid_request_error"
        self._error(APIError(code, f"{text}{f': {explain}' if explain else ''}", type=kind))

    def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except (ConnectionError, TimeoutError) as err:  # the client hung up: not an error of this server
            self._client_gone(err)
            return
        self.server.count_status(status)

    def _stream(self, chunks: Iterator[dict[str, Any]]) -> None:
        """Send chunks as server-sent events (``data: {...}``, then ``data: [DONE]``) in a chunked HTTP/1.1 body.
        An error before the first chunk raises (a plain error answer); one after it is sent as an ``error`` event."""
        try:
            first = next(chunks)
        except StopIteration:
            raise APIError(500, "the stream produced no chunk", type="server_error") from None
        except BaseException:
            chunks.close()
            raise
        status = 200
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()

            def event(data: bytes) -> None:
                payload = b"data: " + data + b"\n\n"
                self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
                self.wfile.flush()

            event(json.dumps(first).encode("utf-8"))
            try:
                for item in chunks:
                    event(json.dumps(item).encode("utf-8"))
            except APIError as err:
                status = err.status
                event(json.dumps(err.body()).encode("utf-8"))
            event(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (ConnectionError, TimeoutError) as err:  # the client hung up mid-stream
            self._client_gone(err)
            return
        finally:
            chunks.close()
        self.server.count_status(status)

    def _client_gone(self, err: BaseException) -> None:
        self.close_connection = True
        self.server.count_disconnect()
        log.debug("client %s went away: %s", self.client_address, err)

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
        elif path in ("/v1/completions", "/v1/embeddings", "/v1/responses"):
            self._error(APIError(404, f"{path} is not implemented by vpo serve; send chat messages to POST "
                                      "/v1/chat/completions", code="not_found"))
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
        if not self._busy():
            return
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
            self._send(200, self.server.stats())
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
            if not self._busy():
                return
            job, request = self.server.build_job(body)
            if request.stream:
                self._stream(self.server.stream(job, request))
            else:
                self._send(200, self.server.answer(job, request))
        except APIError as err:
            self._error(err)
        except (ConnectionError, TimeoutError) as err:  # hung up while sending its request
            self._client_gone(err)
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
            raise bad_request(f"invalid Content-Length {length!r}") from None
        if size < 0 or size > self.server.settings.max_request_bytes:
            self._discard_body()
            raise APIError(413, f"request body of {size} bytes exceeds the limit of "
                                f"{self.server.settings.max_request_bytes} bytes", code="request_too_large")
        raw = self.rfile.read(size)
        if len(raw) < size:
            raise ConnectionAbortedError(f"the client closed the connection after {len(raw)} of {size} body bytes")
        return decode_json(raw)

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
    """``(model, tokenizer, model settings, parsed config)`` for ``vpo serve``, loaded like ``vpo eval`` does (the
    config parsed as `vpo fit` parses it: ``vpo_lightning.commands.runs.run_config``)."""
    from vpo_lightning.commands import runs
    from vpo_lightning.generation.models import load_tokenizer

    path = runs.find_config(config, ckpt, adapter)
    cfg = runs.load_config(path, overrides, require=("rollout",))
    parsed = runs.run_config(cfg, str(path))  # before loading: a bad value fails fast
    model, settings, _ = runs.load_model(cfg, device, ckpt=ckpt, adapter=adapter)
    return model.eval(), load_tokenizer(settings.name), settings, parsed


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
    p.add_argument("--max-connections", type=int,
                   help="open connections at once; when all are taken the one idle the longest is closed "
                        "(default: max(64, 4 x --max-concurrency))")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds a connection may stay silent (between requests or mid-request) before it is closed")
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
    from vpo_lightning.commands.runs import pick_device

    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        device = pick_device(args.device)
        model, tokenizer, model_settings, cfg = load_for_serving(args.config, args.adapter, args.ckpt,
                                                                 args.overrides, device)
        default_tokens = args.default_max_tokens or int(cfg.value("rollout.sampling.max_new_tokens"))
        settings = ServeSettings(
            max_concurrency=args.max_concurrency, max_tokens_limit=args.max_tokens_limit,
            max_request_bytes=args.max_request_bytes, max_n=args.max_n, max_batch_size=args.max_batch_size,
            default_max_tokens=default_tokens, batch_wait_s=args.batch_wait_ms / 1000,
            request_timeout_s=args.request_timeout, api_key=args.api_key, ignore_seed=args.ignore_seed,
            max_connections=args.max_connections, idle_timeout_s=args.idle_timeout,
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
