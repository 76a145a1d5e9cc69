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
(:func:`vpo_lightning.serve.openai_api.check_fields`). A request with a ``seed`` samples from its own generator, so
it gets the same tokens whichever requests share its steps (up to the rounding of padded attention sums);
``--ignore-seed`` drops seeds.

Model names: the base model is served under the config's ``model.model.name``; with ``--adapter`` (or ``--ckpt``)
the adapter is served under ``--adapter-name`` (default ``vpo``) and the base name runs the same weights with the
adapter disabled, like ``vllm serve BASE --enable-lora --lora-modules vpo=DIR``. A request without ``model`` gets
the adapter when there is one.

Batching (:mod:`vpo_lightning.serve.batching`, :mod:`vpo_lightning.serve.continuous`): a request is validated,
admitted, then rendered and tokenized on a thread and queued. One worker thread owns the model and batches
continuously: the sequences generating sit in decode groups of at most ``--step-rows`` rows, stepped in turn one token
at a time; between two group steps, queued requests join in fair order (the client served the least work first),
each prefilled at once (its first token comes from the prefill), and a sequence leaves as soon as it ends. Rows of
any sampling parameters share a step; stop strings are checked per sequence after each token.

HTTP: uvicorn's HTTP/1.1 connections (h11, asyncio) with Starlette's request and response classes, the stack of
vLLM's OpenAI server and TRL's ``vllm-serve``; one dispatcher takes every method and path, so that what no route
takes is a 405 or 404 in OpenAI's shape. What the server guarantees (``docs/SERVING.md``), and where:

- Parsing is h11's: request line, headers and ``Content-Length`` strictly (digits only, one value: ``1_0``, ``+2``
  and two different values are 400), a request head still incomplete past 16 KiB 431 (one that arrives whole in a
  single read is parsed), a request line of an HTTP version other than 1.0/1.1 505 with a status line; each in
  OpenAI's error shape (:meth:`_Connection.send_400_response` for what h11 refuses) and counted as a 4xx. A POST
  without ``Content-Length`` (or chunked) is 411, a body over ``--max-request-bytes`` 413 (not read: uvicorn drops
  it after the answer; over 16 times the limit the connection closes), a method no route takes 405 with ``Allow``.
  Apart from that 505 (the status HTTP names for it, counted as the client's error), no client input is answered
  with a 5xx: 500 is left for a failed ``generate``, 503 for shutting down, 504 for ``--request-timeout``.
- Admission comes before tokenization (:meth:`OpenAIServer.admit`): past ``--max-concurrency`` requests in flight,
  or past a client's budget of queued work (``--max-client-tokens``, ``n x max_tokens`` summed over its requests in
  flight), 429 with ``Retry-After``; a client that would still hold fewer requests than another is admitted up to
  twice ``--max-concurrency`` (max-min fairness), so clients that fill every slot cannot keep a new one out. A
  client with no room is refused before its body is decoded, and, when it already has requests in flight, after
  0.5 s, so that a pipelined flood of refused requests costs a few answers a second.
- Preparation runs off the event loop: bodies over 64 KiB are decoded on one shared thread, every request is
  rendered and tokenized on its client's own thread (one at a time per client). The chat template renders without
  a lock; the prompt route is decided on the rendered prompt's length (up to 16k characters: the shared tokenizer,
  else a second copy), so thousands of empty messages (0 content characters, a long prompt) never hold the shared
  one; a rendered prompt longer than the context could hold is refused before tokenizing.
- A client that hangs up is seen while its request waits or generates (pipelined bytes are read ahead, 64 KiB at
  most, so a hang-up is not hidden behind them): its job is dropped when pending and its rows stop at the next step
  when generating; it counts as ``client_disconnects``, not as an error.
- Connections: at most ``--max-connections``; past it a connection of the client holding the most (the new one
  included) is closed, the one that has owed a request the longest first, else one being answered (another
  client's only); a connection that owes a request for ``--idle-timeout`` seconds, between requests or sending one
  however slowly, is closed.
- Fair generation: requests join the decode groups in fair order (the client with the least work served first,
  new clients at the current virtual time) while the sequences generating stay within ``--max-batch-size``; a client
  holding fewer sequences than another joins past it, up to twice. So a light request waits for one group's step and
  its own prefill, not for the requests under way (continuous batching; tests/test_serve_attacks.py).

Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``; ``GET /stats`` counts 4xx and 5xx
answers apart, clients that hang up as ``client_disconnects``, ``connections_open`` and ``connections_evicted``.
The server binds 127.0.0.1 by default and has no authentication unless ``--api-key`` is given; clients are told
apart by their address, so behind a reverse proxy all of them share one budget.

Why uvicorn and Starlette now (issue 54), after the standard library's ``ThreadingHTTPServer`` with hand-written
connection handling: attacks kept finding what a maintained HTTP stack already does (pipelined keep-alive
connections that were never idle and so never evicted, a 505 without a status line, ``Content-Length: 1_0``
accepted, unknown methods as 501), and a thread per connection made every waiting connection cost a thread. The
batching (sampling keys, n choices, seeds, adapter on/off, stop strings) stays ours whichever server fronts it;
LitServe's batcher groups requests by arrival only, one output per input. FastAPI would add request models and
OpenAPI on top of Starlette, which the hand-written OpenAI validation (:mod:`vpo_lightning.serve.openai_api`) does
not need. Both packages are locked dependencies (``requirements/``), not an extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import CancelledError
from typing import Any

import anyio
import h11
import torch
import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from vpo_lightning.app import parse_args, report_error
from vpo_lightning.serve.batching import SMALL_PROMPT_CHARS, BatchGenerator
from vpo_lightning.serve.jobs import Choice, Job, logprob_entries
from vpo_lightning.serve.openai_api import (
    APIError,
    ChatRequest,
    ServeSettings,
    bad_request,
    decode_json,
    parse_chat_request,
)

log = logging.getLogger(__name__)

OWNER = "vpo-lightning"
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
INLINE_BODY_BYTES = 65_536  # bodies up to this size are decoded on the event loop (well under a millisecond)
PIPELINE_READ_AHEAD = 65_536  # pipelined bytes read while a request is answered, so that a hang-up is seen
REFUSAL_DELAY_S = 0.5  # a 429 to a client that has requests in flight is sent after this long
CLOSE_ABOVE = 16  # a refused body over this many times --max-request-bytes is not read: the connection closes
GET_ROUTES = ("/v1/models", "/health", "/stats")
POST_ROUTES = ("/v1/chat/completions",)
NOT_IMPLEMENTED = ("/v1/completions", "/v1/embeddings", "/v1/responses")
KNOWN_METHODS = "GET, HEAD, POST"
CPU_STEP_ROWS = 16  # rows per decode step on a CPU unless --step-rows says otherwise


class _ClientGone(Exception):
    """The client hung up before its answer was sent."""


class _NoAnswer(Response):
    """What an endpoint returns for a client that hung up: nothing is sent."""

    def __init__(self) -> None:
        super().__init__()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        return None


class _Stream(StreamingResponse):
    """A server-sent-event response that calls ``on_close`` once it ends, however it ends (done, client gone,
    server stopping), even when its body was never started."""

    def __init__(self, content: Any, on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _ToLoop:
    """``put`` from the worker thread into an asyncio queue of the event loop (a streamed job's events)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> None:
        self.loop, self.events = loop, events

    def put(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class _QuietLog:
    """uvicorn's per-connection logger: a client's malformed request is routine (debug), not a warning."""

    level = logging.INFO  # uvicorn logs its per-connection trace messages below this

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        log.debug(msg, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(log, name)


class _Admission:
    """A slot taken by :meth:`OpenAIServer.admit`; ``release`` gives it back once, however often it is called."""

    def __init__(self, server: OpenAIServer, client: str, work: int) -> None:
        self.server, self.client, self.work, self.held = server, client, work, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.server.release(self.client, self.work)


class _Connection(H11Protocol):
    """uvicorn's HTTP/1.1 connection (h11: strict parsing of request lines, headers and ``Content-Length``,
    keep-alive, pipelining) with the server's connection rules: the cap with eviction of the connection idle the
    longest (:meth:`OpenAIServer.connection_opened`), the deadline for a request to arrive
    (:meth:`OpenAIServer.reap_idle`), read-ahead of pipelined requests so a hang-up drops the work, and malformed
    requests answered with a 4xx in OpenAI's shape and counted."""

    owner: OpenAIServer  # set on the subclass each server makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = _QuietLog()
        self.owes_since = time.monotonic()  # when the connection last started to owe the server a request
        self.protocol_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def recording() -> Any:  # keep h11's reason (and status hint) for send_400_response
            try:
                return next_event()
            except h11.RemoteProtocolError as err:
                self.protocol_error = err
                raise

        self.conn.next_event = recording  # type: ignore[method-assign]

    def answering(self) -> bool:
        """A whole request was read and is being answered: not evicted, no deadline."""
        return self.conn.their_state is h11.DONE

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.owes_since = time.monotonic()
        self.owner.connection_opened(self)

    def on_response_complete(self) -> None:
        self.owes_since = time.monotonic()
        super().on_response_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # h11 stops at a pipelined request until the current one is answered, and uvicorn then stops reading, so a
        # client that hangs up meanwhile would go unseen and its work be done for nobody. Read on, a bounded amount.
        if (self.answering() and self.flow.read_paused and not self.transport.is_closing()
                and len(self.conn.trailing_data[0]) <= PIPELINE_READ_AHEAD):
            self.flow.resume_reading()

    def send_400_response(self, msg: str) -> None:
        """A request h11 refuses (bad request line, header or ``Content-Length``, headers too long): a 400 (431
        for headers too long) in OpenAI's shape, then the connection closes."""
        err = self.protocol_error
        status = 431 if err is not None and err.error_status_hint == 431 else 400
        body = json.dumps(APIError(status, f"malformed HTTP request: {err or msg}", code="bad_http_request")
                          .body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response was under way: only closing is left
            pass
        self.transport.close()
        self.owner.count_status(status)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server loop, which also closes connections past their deadline twice a second."""

    owner: OpenAIServer

    async def on_tick(self, counter: int) -> bool:
        if counter % 5 == 0:
            self.owner.reap_idle()
        return await super().on_tick(counter)


class OpenAIServer:
    """The HTTP front end (Starlette routes on uvicorn): validation, admission, limits, model names; generation is
    delegated to a :class:`BatchGenerator`.

    Args:
        generator: the batching worker (started by :meth:`start`).
        models: served model id -> whether it uses the adapter.
        settings: limits.
        context_length: the model's maximum sequence length (prompt + completion).
        address: ``(host, port)``; port 0 picks a free port. The socket is bound here.
    """

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
        # peer address -> [requests in flight, their n x max_tokens, the limiter its requests are prepared under]
        self._clients: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self.http_stats = {"http_4xx": 0, "http_5xx": 0, "connections_evicted": 0, "client_disconnects": 0}
        # Preparing a request runs on threads: decoding a large body on one thread at a time, so that a flood of
        # them holds the interpreter lock against the event loop no more than one thread can; rendering and
        # tokenizing on one thread per client, so that a client's flood waits for itself, never for other clients.
        self._light = anyio.CapacityLimiter(4)
        self._heavy = anyio.CapacityLimiter(1)
        host = address[0]
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind(address)
            self.socket.listen(2048)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()[:2]

        async def app(scope: Any, receive: Any, send: Any) -> None:
            """The ASGI application: Starlette's request and responses, one dispatcher (every method and path,
            so that an unknown method gets 405 in OpenAI's shape), answers counted by status."""
            async def send_counted(message: Any) -> None:
                if message["type"] == "http.response.start":
                    self.count_status(message["status"])
                await send(message)

            response = await self._dispatch(Request(scope, receive))
            await response(scope, receive, send_counted)

        connection = type("Connection", (_Connection,), {"owner": self})
        config = uvicorn.Config(app, http=connection, ws="none", lifespan="off", loop="asyncio",
                                log_config=None, log_level="warning", access_log=False, server_header=False,
                                timeout_keep_alive=max(1, math.ceil(settings.idle_timeout_s)),
                                timeout_graceful_shutdown=5)
        self._uvicorn = _Uvicorn(config)
        self._uvicorn.owner = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}/v1"

    def serve_forever(self) -> None:
        """Serve HTTP on this thread until :meth:`shutdown` (or, on the main thread, SIGINT/SIGTERM)."""
        self._uvicorn.run(sockets=[self.socket])

    def shutdown(self) -> None:
        """Stop accepting; :meth:`serve_forever` returns once open requests end (5 s at most)."""
        self._uvicorn.should_exit = True

    def start(self) -> OpenAIServer:
        """Start the worker and serve HTTP on a background thread (tests, benchmarks)."""
        self.generator.start()
        self._thread = threading.Thread(target=self.serve_forever, name="vpo-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._uvicorn.started:
            raise RuntimeError("vpo serve: the HTTP server did not start")
        return self

    def close(self) -> None:
        """Stop serving: queued requests get 503, open connections are closed, the socket is released."""
        self.shutdown()
        self.generator.close()
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.server_close()

    def server_close(self) -> None:
        self.socket.close()

    # ---- counters -----------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``GET /stats``: the worker's batching counters, requests in flight, 4xx/5xx answers and connections."""
        with self._lock:
            return {**self.generator.stats, "in_flight": self._in_flight, "clients_in_flight": len(self._clients),
                    **self.http_stats, "connections_open": len(self._live_connections())}

    def count_disconnect(self) -> None:
        with self._lock:
            self.http_stats["client_disconnects"] += 1

    def count_status(self, status: int) -> None:
        """Count an answer: 505 (a request line of another HTTP version) is the client's error like every 4xx."""
        if status >= 400:
            with self._lock:
                self.http_stats["http_5xx" if status >= 500 and status != 505 else "http_4xx"] += 1

    # ---- connections --------------------------------------------------------------------------------------------
    def _live_connections(self) -> list[_Connection]:
        connections = list(self._uvicorn.server_state.connections)  # a copy: stats() may run on another thread
        return [c for c in connections if not c.transport.is_closing()]

    def connection_opened(self, new: _Connection) -> None:
        """The connection cap: past it, a connection of the client (peer address) holding the most connections,
        the new one included, is closed to make room: the one that has owed a request the longest (waiting for one
        or still sending it), else, for another client, one being answered (its request is dropped). When the new
        connection's own client holds the most and all its other connections are being answered, the new one gets
        429 and is closed. So no client, however many connections it opens, can lock out one with fewer."""
        live = self._live_connections()
        if len(live) <= self.settings.max_connections:
            return
        mine = new.client[0] if new.client else ""
        held: dict[str, list[_Connection]] = {mine: []}
        for c in live:
            if c is not new:
                held.setdefault(c.client[0] if c.client else "", []).append(c)
        top = max(held, key=lambda h: (len(held[h]) + (h == mine), h != mine))
        idle = [c for c in held[top] if not c.answering()]
        victims = idle or (held[top] if top != mine else [])
        if victims:
            min(victims, key=lambda c: c.owes_since).transport.close()
            with self._lock:
                self.http_stats["connections_evicted"] += 1
            return
        body = json.dumps(self._busy_error("too many open connections").body()).encode()
        new.transport.write(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nConnection: close\r\n"
                            b"Retry-After: " + str(self.retry_after()).encode() + b"\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
        new.transport.close()
        self.count_status(429)

    def reap_idle(self) -> None:
        """Close connections that have owed a request for ``idle_timeout_s``: between requests, or sending one
        however slowly (a slowloris client trickling a byte at a time)."""
        limit = time.monotonic() - self.settings.idle_timeout_s
        for c in self._live_connections():
            if not c.answering() and c.owes_since < limit:
                c.transport.close()

    # ---- admission ----------------------------------------------------------------------------------------------
    def retry_after(self) -> int:
        """Seconds a refused client should wait: about as long as the last answered request generated."""
        return max(1, min(60, math.ceil(self.generator.wait_s)))

    def _busy_error(self, message: str) -> APIError:
        err = APIError(429, f"{message}; retry later", type="rate_limit_error", code="too_many_requests")
        err.headers = {"Retry-After": str(self.retry_after())}
        return err

    def admit(self, client: str = "", work: int = 0) -> anyio.CapacityLimiter:
        """Take a slot for a request of ``client`` with ``work`` = n x max_tokens, before its prompt is tokenized;
        429 (with ``Retry-After``) when the server is full or this client's queued work would pass its budget.
        Returns the limiter the client's requests are prepared under (one at a time per client).

        Full means ``max_concurrency`` requests in flight, except for a client that would still hold fewer than
        another client: it is admitted up to twice ``max_concurrency`` (max-min fairness), so clients that took
        every slot cannot keep the next one out.
        """
        with self._lock:
            refused = self._room(client, work)
            if refused is not None:
                raise refused
            held = self._clients.setdefault(client, [0, 0, anyio.CapacityLimiter(1)])
            held[0] += 1
            held[1] += work
            self._in_flight += 1
            return held[2]

    def _room(self, client: str, work: int) -> APIError | None:
        """None when a request of ``client`` with ``work`` may be admitted now, else its 429 (under the lock)."""
        s = self.settings
        requests, queued = self._clients.get(client, (0, 0))[:2]
        if self._in_flight >= s.max_concurrency:
            most = max((held[0] for held in self._clients.values()), default=0)
            if not (requests + 1 < most and self._in_flight < 2 * s.max_concurrency):
                return self._busy_error(f"the server is busy ({self._in_flight} requests in flight)")
        if queued + work > s.max_client_tokens:
            return self._busy_error(f"this client's requests in flight ask for {queued} tokens (n x max_tokens) "
                                    f"and this one for {work}: at most {s.max_client_tokens} per client")
        return None

    def release(self, client: str = "", work: int = 0) -> None:
        with self._lock:
            self._in_flight -= 1
            held = self._clients.get(client)
            if held is not None:
                held[0] -= 1
                held[1] -= work
                if held[0] <= 0:
                    del self._clients[client]

    # ---- preparing a request ------------------------------------------------------------------------------------
    def parse(self, raw: bytes) -> ChatRequest:
        """A request body (bytes) into a validated :class:`ChatRequest` (a 4xx :class:`APIError` otherwise)."""
        return parse_chat_request(decode_json(raw), self.settings, self.models, self.default_model)

    def build_job(self, body: Any, client: str = "") -> tuple[Job, ChatRequest]:
        """Validate a decoded request body into a :class:`Job` and its :class:`ChatRequest` (no admission)."""
        request = parse_chat_request(body, self.settings, self.models, self.default_model)
        return self.job_for(request, client), request

    def job_for(self, request: ChatRequest, client: str = "") -> Job:
        """Render the messages with the chat template and tokenize them: a prompt of up to ``SMALL_PROMPT_CHARS``
        rendered characters with the shared tokenizer, a longer one with the second copy, so that thousands of
        empty messages (a long rendered prompt of few content characters) never hold the shared one."""
        chars = sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in request.messages)
        chars += len(json.dumps(request.tools)) if request.tools else 0
        if chars > self.max_prompt_chars:  # certainly past the context: refused before rendering
            raise self._too_long(f"the messages hold {chars} characters")
        gen = self.generator
        messages, tools = request.messages, request.tools
        if not self.template_tools:  # the template ignores tools: the tool-use task's system message carries them
            messages, tools = tooluse_messages(messages, tools), None
        try:  # Jinja, no tokenizer state: needs no lock
            text = gen.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # noqa: BLE001 - a chat template may reject a message order
            raise bad_request(f"cannot render the messages with the chat template: {err}", "messages") from None
        if len(text) > self.max_prompt_chars:
            raise self._too_long(f"the rendered prompt holds {len(text)} characters")
        small = len(text) <= SMALL_PROMPT_CHARS
        with gen.tokenizer_lock if small else gen.long_tokenizer_lock:
            prompt = (gen.tokenizer if small else gen.long_tokenizer)(text, add_special_tokens=False)["input_ids"]
        max_tokens = request.key.max_tokens
        if len(prompt) + max_tokens > self.context_length:
            raise bad_request(f"This model's maximum context length is {self.context_length} tokens. However, you "
                              f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                              f"{max_tokens} in the completion). Please reduce the length of the messages or "
                              "completion.", "messages", "context_length_exceeded")
        return Job(prompt, request.n, request.key, request.stops, logprobs=request.logprobs, client=client)

    def _too_long(self, what: str) -> APIError:
        return bad_request(f"This model's maximum context length is {self.context_length} tokens and {what} (no "
                           f"token is longer than {self.max_token_chars}, so at most {self.max_prompt_chars} "
                           "characters can fit). Please reduce the length of the messages.", "messages",
                           "context_length_exceeded")

    # ---- answering ----------------------------------------------------------------------------------------------
    @staticmethod
    def _result(future: Any) -> list[Choice]:
        """The choices of a finished job (its APIError, e.g. a failed ``generate``, raised)."""
        try:
            return future.result(timeout=0)
        except CancelledError:
            raise APIError(503, "the server is shutting down", type="server_error") from None

    def _timeout(self) -> APIError:
        return APIError(504, f"generation did not finish within {self.settings.request_timeout_s:.0f}s",
                        type="server_error")

    async def _until_answer(self, request: Request, awaitable: Any, job: Job, timeout: float | None) -> Any:
        """Await ``awaitable`` unless the client hangs up first (the job is dropped: :class:`_ClientGone`) or
        ``timeout`` passes (504)."""
        task = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(self._hang_up(request))
        try:
            done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this request was cancelled (the server is stopping)
            task.cancel()
            job.dropped = True
            raise
        finally:
            gone.cancel()
        if task in done:
            return task.result()
        task.cancel()
        job.dropped = True
        await asyncio.wait({task})  # let it end (a stream's generator must not be running when it is closed)
        if gone in done:
            raise _ClientGone
        raise self._timeout()

    @staticmethod
    async def _hang_up(request: Request) -> None:
        """Returns when the client has gone (its request body was read before)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def answer(self, request: Request, job: Job, chat: ChatRequest) -> dict[str, Any]:
        """Generate ``job`` and give OpenAI's ``chat.completion`` object."""
        future = self.generator.submit(job)
        try:
            await self._until_answer(request, asyncio.wrap_future(future), job, self.settings.request_timeout_s)
        except asyncio.CancelledError:
            if not future.cancelled():
                raise
        choices = self._result(future)
        completion = sum(c.tokens for c in choices)
        out = []
        for i, c in enumerate(choices):
            message, finish = message_of(c, chat)
            logprobs = None if c.logprobs is None else {"content": c.logprobs, "refusal": None}
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": chat.model, "system_fingerprint": None, "choices": out,
            "usage": {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion,
                      "total_tokens": len(job.prompt_ids) + completion},
        }

    async def stream(self, job: Job, request: ChatRequest, events: asyncio.Queue) -> AsyncIterator[dict[str, Any]]:
        """OpenAI's ``chat.completion.chunk`` objects of a streamed request, as tokens are generated (``events``:
        the queue ``job.events`` puts into).

        The first chunk (each choice's role) comes once generation has produced something, so that a request that
        fails before (504, a failed ``generate``) raises :class:`APIError` from the first ``__anext__`` and can be
        answered with a plain error. Text is sent once final (:class:`StreamedChoice`, decoded on a thread: the
        tokenizer's lock is never waited for on the event loop); the rest, tool calls and the finish reason come in
        each choice's last chunk, the usage in a chunk of its own with ``stream_options.include_usage``.
        """
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

        def step(tokens: list[tuple[int, int, float, list]]) -> list[dict[str, Any]]:
            """The content chunks for newly generated tokens (on a worker thread)."""
            out = []
            for index, token, logprob, alternatives in tokens:
                state = states[index]
                delta, first, end = state.add(token, logprob, alternatives, decode)
                if end > first:
                    logprobs = None if request.logprobs is None else \
                        {"content": entries(state, first, end), "refusal": None}
                    if delta or (logprobs and logprobs["content"]):
                        out.append(chunk([{"index": index, "delta": {"content": delta}, "logprobs": logprobs,
                                           "finish_reason": None}]))
            return out

        holds = request.stops + ((TOOL_OPEN,) if request.tools else ())
        states = [StreamedChoice(holds, request.key.max_tokens, gen.eos) for _ in range(request.n)]
        future = self.generator.submit(job)
        future.add_done_callback(lambda _: job.events.put(None))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.request_timeout_s
        started, finished = False, False
        try:
            while not finished:
                try:
                    batch = [await asyncio.wait_for(events.get(), max(0.0, deadline - loop.time()))]
                except asyncio.TimeoutError:
                    raise self._timeout() from None
                while not events.empty():
                    batch.append(events.get_nowait())
                finished = batch[-1] is None
                tokens = [e for e in batch if e is not None]
                if not tokens:
                    continue
                if not started:
                    started = True
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for i in range(request.n)])
                for item in await anyio.to_thread.run_sync(step, tokens, limiter=self._light):
                    yield item
            choices = self._result(future)
        finally:
            if not future.done():
                future.cancel()
                job.dropped = True
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

    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": self.created, "owned_by": OWNER}
                                           for m in self.models]}

    # ---- routes -------------------------------------------------------------------------------------------------
    @staticmethod
    def _json(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
        response = Response(json.dumps(payload), status, media_type="application/json")
        # as written (Starlette would lower-case them): "Allow", "Retry-After" as most servers send them
        response.raw_headers.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items())
        return response

    def _error(self, err: APIError) -> Response:
        return self._json(err.status, err.body(), err.headers or None)

    async def _dispatch(self, request: Request) -> Response:
        """Every request: routes, errors in OpenAI's shape; nothing a client sends is a 500."""
        try:
            return await self._route(request)
        except APIError as err:
            return self._error(err)
        except (_ClientGone, ClientDisconnect):
            self.count_disconnect()
            return _NoAnswer()
        except Exception as err:  # report, keep serving
            log.exception("request failed")
            return self._error(APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error"))

    def _refuse_body(self, request: Request, err: APIError) -> APIError:
        """``err`` for a request whose body is not read: uvicorn reads and drops it after the answer, unless it is
        huge or of unknown length (then the connection closes)."""
        length = request.headers.get("content-length")
        if length is None or int(length) > CLOSE_ABOVE * self.settings.max_request_bytes:
            err.headers = {**err.headers, "Connection": "close"}
        return err

    def _authorized(self, request: Request) -> bool:
        key = self.settings.api_key
        return not key or request.headers.get("authorization") == f"Bearer {key}"

    async def _route(self, request: Request) -> Response:
        version = request.scope.get("http_version", "1.1")
        if version not in ("1.0", "1.1"):
            raise self._refuse_body(request, APIError(
                505, f"HTTP/{version} is not supported: send HTTP/1.1", code="http_version_not_supported"))
        method, path = request.method, request.scope["path"].rstrip("/") or "/"
        if method == "POST" and path in POST_ROUTES:
            return await self._chat(request)
        if method in ("GET", "HEAD") and (path in GET_ROUTES or path.startswith("/v1/models/")):
            if path != "/health" and not self._authorized(request):
                raise self._unauthorized()
            return self._get(path)
        raise self._refuse_body(request, self._route_error(method, path))

    @staticmethod
    def _unauthorized() -> APIError:
        return APIError(401, "invalid or missing API key (Authorization: Bearer ...)", type="authentication_error",
                        code="invalid_api_key")

    def _get(self, path: str) -> Response:
        if path == "/health":
            return self._json(200, {"status": "ok", "models": list(self.models)})
        if path == "/v1/models":
            return self._json(200, self.list_models())
        if path == "/stats":
            return self._json(200, self.stats())
        name = path[len("/v1/models/") :]
        found = [m for m in self.list_models()["data"] if m["id"] == name]
        if not found:
            raise APIError(404, f"The model {name!r} does not exist", param="model", code="model_not_found")
        return self._json(200, found[0])

    @staticmethod
    def _route_error(method: str, path: str) -> APIError:
        allowed = "GET, HEAD" if path in GET_ROUTES or path.startswith("/v1/models/") else \
            "POST" if path in POST_ROUTES else None
        if allowed is None and method not in ("GET", "HEAD", "POST"):  # a method no route takes, on any path
            allowed = KNOWN_METHODS
        if allowed:
            err = APIError(405, f"method {method} is not allowed on {path}; use {allowed}", code="method_not_allowed")
            err.headers = {"Allow": allowed}
            return err
        if path in NOT_IMPLEMENTED:
            return APIError(404, f"{path} is not implemented by vpo serve; send chat messages to POST "
                                 "/v1/chat/completions", code="not_found")
        return APIError(404, f"no route {method} {path}; routes: POST /v1/chat/completions, GET /v1/models, "
                             "GET /health", code="not_found")

    async def _chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``: body, validation, admission, then tokenizing on a thread, generation."""
        if not self._authorized(request):
            raise self._refuse_body(request, self._unauthorized())
        length = request.headers.get("content-length")
        if length is None or "transfer-encoding" in request.headers:
            raise self._refuse_body(request, APIError(
                411, "a Content-Length header is required (chunked bodies are not supported)", code="length_required"))
        size = int(length)  # h11 accepts only digits, and one value
        if size > self.settings.max_request_bytes:
            raise self._refuse_body(request, APIError(
                413, f"request body of {size} bytes exceeds the limit of {self.settings.max_request_bytes} bytes",
                code="request_too_large"))
        client = request.client.host if request.client else ""
        with self._lock:  # no room for this client even for no work: refused before its body is read and decoded
            refused, holding = self._room(client, 0), client in self._clients
        if refused is not None:
            if holding:  # a client refused while its own requests are in flight waits for its 429: a pipelining
                await asyncio.sleep(REFUSAL_DELAY_S)  # flood then costs the event loop a few requests a second
            raise refused
        raw = await request.body()
        if size <= INLINE_BODY_BYTES:
            chat = self.parse(raw)
        else:
            chat = await anyio.to_thread.run_sync(self.parse, raw, limiter=self._heavy)
        slot = _Admission(self, client, chat.n * chat.key.max_tokens)
        limiter = self.admit(slot.client, slot.work)
        try:
            job = await anyio.to_thread.run_sync(self.job_for, chat, client, limiter=limiter)
            if chat.stream:
                response = await self._stream_response(request, job, chat, slot)
                slot = None  # the response releases it when it ends
                return response
            return self._json(200, await self.answer(request, job, chat))
        finally:
            if slot is not None:
                slot.release()

    async def _stream_response(self, request: Request, job: Job, chat: ChatRequest, slot: _Admission) -> Response:
        """Server-sent events (``data: {...}``, then ``data: [DONE]``). An error before the first chunk is a plain
        error answer; one after it is sent as an ``error`` event."""
        events: asyncio.Queue = asyncio.Queue()
        job.events = _ToLoop(asyncio.get_running_loop(), events)
        chunks = self.stream(job, chat, events)
        try:
            first = await self._until_answer(request, chunks.__anext__(), job, None)
        except StopAsyncIteration:
            raise APIError(500, "the stream produced no chunk", type="server_error") from None
        except BaseException:
            await chunks.aclose()
            raise
        state = {"done": False}

        async def body() -> AsyncIterator[bytes]:
            try:
                yield b"data: " + json.dumps(first).encode() + b"\n\n"
                try:
                    async for item in chunks:
                        yield b"data: " + json.dumps(item).encode() + b"\n\n"
                except APIError as err:
                    self.count_status(err.status)
                    yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
                state["done"] = True
            finally:
                await chunks.aclose()

        def on_close() -> None:
            slot.release()
            if not state["done"]:  # the client hung up (or the server stopped) mid-stream: stop its rows
                job.dropped = True
                self.count_disconnect()

        return _Stream(body(), on_close)


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
    step_rows = settings.step_rows
    if step_rows is None:  # a CPU step costs about its rows (small groups lose little); a GPU's about the same for 64
        step_rows = CPU_STEP_ROWS if torch.device(device).type == "cpu" else settings.max_batch_size
    generator = BatchGenerator(model, tokenizer, device, settings.max_batch_size, settings.batch_wait_s, step_rows)
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
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="most sequences generating at once (twice as many for clients holding fewer than another)")
    p.add_argument("--default-max-tokens", type=int,
                   help="max_tokens when a request gives none (default: the config's rollout.sampling.max_new_tokens)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0,
                   help="when idle, wait this long after a request for more to prefill with it")
    p.add_argument("--step-rows", type=int,
                   help="most sequences in one decode step: the sequences generating are split into groups of at "
                        f"most this many, stepped in turn; new requests join between two (default: {CPU_STEP_ROWS} on "
                        "a CPU, --max-batch-size on a GPU)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a waiting request gets 504")
    p.add_argument("--max-connections", type=int,
                   help="open connections at once; when all are taken the one idle the longest is closed "
                        "(default: max(64, 4 x --max-concurrency))")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds a connection may owe a request (between requests, or sending one however slowly) "
                        "before it is closed")
    p.add_argument("--max-client-tokens", type=int,
                   help="queued work of one client address, n x max_tokens summed over its requests in flight, "
                        "before 429 (default: max(max_n x max_tokens_limit, max_batch_size x max_tokens_limit / 2))")
    p.add_argument("--api-key", default=os.environ.get("VPO_SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $VPO_SERVE_API_KEY; none = no auth)")
    p.add_argument("--ignore-seed", action="store_true",
                   help="drop requests' seed (seeded requests share decode steps with all others either way, each "
                        "sampling from its own generator; kept for clients that should not be reproducible)")
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
            max_client_tokens=args.max_client_tokens, step_rows=args.step_rows,
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
    # uvicorn stops gracefully on SIGINT and SIGTERM, then raises the signal again for the previous handler: SIGINT's
    # is KeyboardInterrupt (caught below), SIGTERM's would end the process before close(), so it gets a no-op
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
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
