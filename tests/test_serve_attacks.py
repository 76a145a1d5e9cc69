"""`vpo serve` under attack (issue 54): floods of pipelined, slowloris, oversized and heavy requests from other client
addresses (127.0.0.2 and up, in a subprocess) while a valid request must be answered within 1 s; methods and
request lines the server does not take, malformed ``Content-Length``, a full queue. No client input gets a 5xx."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from test_serve import _Scripted  # the stand-in decode group (no model)

from vpo_lightning.generation.models import ModelSettings, load_base_model, load_tokenizer
from vpo_lightning.serve import Choice, ServeSettings, build_server

MSG = [{"role": "user", "content": "Say something."}]
VALID = json.dumps({"messages": MSG, "max_tokens": 1, "temperature": 0})


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is overhead-bound; one thread is far faster on a busy shared CPU
    yield load_base_model(ModelSettings(name="tiny-llama", dtype="fp32")), load_tokenizer("tiny-llama")
    torch.set_num_threads(threads)


def _server(tiny, **settings):
    model, tokenizer = tiny
    base = {"max_n": 4, "max_batch_size": 16, "max_tokens_limit": 32, "batch_wait_s": 0.0}
    return build_server(model, tokenizer, base_name="tiny-llama", settings=ServeSettings(**{**base, **settings}),
                        port=0).start()


def _post(port: int, body: str = VALID, source: str = "127.0.0.1", timeout: float = 30):
    """(status, payload, headers, seconds) of one request on a new connection from ``source``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = json.loads(resp.read() or b"null")
        return resp.status, payload, dict(resp.getheaders()), time.monotonic() - t0
    finally:
        conn.close()


def _stats(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/stats")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _exchange(port: int, raw: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes, return everything the server answers until it closes (or ``timeout``)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    out = b""
    try:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before all was sent: read its answer
            pass
        while chunk := sock.recv(65536):
            out += chunk
        return out
    except OSError:
        return out
    finally:
        sock.close()


# ---- methods, request lines and Content-Length ---------------------------------------------------------------------
PROTOCOL = [
    # (raw request, expected status line start)
    (b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 405"),
    (b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 405"),
    (b"TRACE / HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 405"),
    (b"PUT /v1/nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", b"HTTP/1.1 405"),
    (b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200"),
    (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", b"HTTP/1.1 505"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1_0\r\n\r\n0123456789", b"HTTP/1.1 400"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n{}", b"HTTP/1.1 400"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0x2\r\n\r\n{}", b"HTTP/1.1 400"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
     b"HTTP/1.1 400"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}", b"HTTP/1.1 400"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 411"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
     b"HTTP/1.1 411"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9999999999\r\n\r\n{}", b"HTTP/1.1 413"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", b"HTTP/1.1 400"),
    # a head still incomplete past 16 KiB (all of it read by the server: it then closes without a reset)
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000, b"HTTP/1.1 431"),
    (b"\x00\x01\x02 garbage\r\n\r\n", b"HTTP/1.1 400"),
    (b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n", b"HTTP/1.1 400"),
]


def test_methods_request_lines_and_content_length_get_4xx_with_a_status_line(tiny):
    """Unknown methods get 405 (with Allow), an HTTP/2.0 request line 505 with a status line, every malformed
    Content-Length (``1_0``, ``+2``, two values) 400, a missing one 411, one past the limit 413, headers too long
    431: each a status line and OpenAI's JSON error, counted as a 4xx (the old server: 501, a 505 without a status
    line, ``1_0`` and ``+2`` accepted, the first of two Content-Lengths used)."""
    srv = _server(tiny, max_request_bytes=10_000)
    port = srv.server_address[1]
    try:
        before = _stats(port)
        for raw, status in PROTOCOL:
            answer = _exchange(port, raw)
            assert answer.startswith(status), (raw[:80], answer[:200])
            if raw.startswith(b"HEAD"):
                continue
            head, _, body = answer.partition(b"\r\n\r\n")
            assert json.loads(body)["error"]["message"], answer
            if status == b"HTTP/1.1 405":
                assert b"\r\nAllow: " in head, head
        after = _stats(port)
        assert after["http_5xx"] == before["http_5xx"] == 0
        assert after["http_4xx"] - before["http_4xx"] == len(PROTOCOL) - 1  # all but the HEAD
        assert _post(port)[0] == 200
    finally:
        srv.close()


# ---- admission ------------------------------------------------------------------------------------------------------
def _slow_generator(srv, seconds: float, calls: list):
    def run_batch(jobs):
        calls.append([getattr(j, "client", "") for j in jobs])  # (getattr: also runs against the old server)
        time.sleep(seconds)
        return [[Choice("ok", "stop", 1) for _ in range(j.n)] for j in jobs]

    srv.generator.new_group = lambda adapter: _Scripted(run_batch)


def test_a_full_queue_is_429_with_retry_after_before_tokenizing(tiny):
    """More requests than --max-concurrency: 429 with Retry-After (OpenAI clients wait that long), refused before the
    prompt is tokenized; a client past its n x max_tokens budget gets 429 while another client is still admitted."""
    srv = _server(tiny, max_concurrency=2, max_client_tokens=40)
    calls: list = []
    _slow_generator(srv, 1.0, calls)
    port = srv.server_address[1]
    tokenized = []
    job_for = srv.job_for
    srv.job_for = lambda request, client="": tokenized.append(client) or job_for(request, client)
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(_post(port))) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # both admitted, the first batch generating
        status, payload, headers, _ = _post(port)
        assert status == 429 and int(headers["Retry-After"]) >= 1, (status, payload)
        assert payload["error"]["type"] == "rate_limit_error"
        assert len(tokenized) == 2  # the refused one was never tokenized
        for t in threads:
            t.join()
        assert [r[0] for r in results] == [200, 200]
        # the budget per client: 32 tokens in flight, 32 more would pass 40; another address is admitted
        big = json.dumps({"messages": MSG, "max_tokens": 32})
        first = threading.Thread(target=lambda: results.append(_post(port, big)))
        first.start()
        time.sleep(0.3)
        status, payload, headers, _ = _post(port, big)
        assert status == 429 and "Retry-After" in headers and "32" in payload["error"]["message"], payload
        assert _post(port, big, source="127.0.0.2")[0] == 200
        first.join()
        assert _stats(port)["http_5xx"] == 0
    finally:
        srv.close()


def test_pipelined_requests_of_a_client_that_hangs_up_are_dropped(tiny):
    """A client pipelines 6 requests on one connection and hangs up: what has not started generating is dropped,
    and the server is free again at once (the old server generated all of them for nobody)."""
    srv = _server(tiny)
    calls: list = []
    _slow_generator(srv, 0.5, calls)
    port = srv.server_address[1]
    try:
        body = VALID.encode()
        one = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(one * 6)
        time.sleep(0.2)  # the first is generating
        sock.close()
        deadline = time.monotonic() + 5
        while _stats(port)["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # time for any dropped request to be (wrongly) generated
        stats = _stats(port)
        assert stats["in_flight"] == 0 and stats["client_disconnects"] >= 1 and stats["http_5xx"] == 0, stats
        assert len(calls) <= 2, calls  # the one generating when it hung up (and at most one more), not 6
    finally:
        srv.close()


def test_a_stream_whose_client_hangs_up_before_its_first_chunk_is_no_error(tiny, caplog):
    """A streamed request whose client hangs up while it waits in the queue: a disconnect, its slot freed, no 5xx
    and no traceback (its generator is closed only once it has stopped)."""
    srv = _server(tiny)
    calls: list = []
    _slow_generator(srv, 1.0, calls)
    port = srv.server_address[1]
    try:
        blocker = threading.Thread(target=_post, args=(port,))
        blocker.start()  # the worker is busy for a second
        time.sleep(0.2)
        body = json.dumps({"messages": MSG, "max_tokens": 2, "stream": True}).encode()
        with caplog.at_level("DEBUG", logger="vpo_lightning.serve.server"):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(0.3)
            sock.close()
            blocker.join()
            deadline = time.monotonic() + 5
            while (_stats(port)["in_flight"] or not _stats(port)["client_disconnects"]) and time.monotonic() < deadline:
                time.sleep(0.05)
        stats = _stats(port)
        assert stats["in_flight"] == 0 and stats["client_disconnects"] == 1 and stats["http_5xx"] == 0, stats
        assert len(calls) == 1, calls  # the hung-up stream was dropped before generating
        assert not any(r.levelname in ("ERROR", "CRITICAL") for r in caplog.records), caplog.text
    finally:
        srv.close()


def test_a_slowloris_connection_is_closed_at_the_idle_deadline(tiny):
    """A client trickling its headers a byte at a time is never silent, but owes a request: it is closed once it
    has owed one for --idle-timeout seconds."""
    srv = _server(tiny, idle_timeout_s=1.0)
    port = srv.server_address[1]
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        t0 = time.monotonic()
        closed = None
        for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100:
            try:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
            except OSError:
                closed = time.monotonic() - t0
                break
        assert closed is not None and closed < 3.0, closed
    finally:
        sock.close()
        srv.close()


# ---- floods: a valid request answers within a second ------------------------------------------------------------
FLOOD = r'''
import json, socket, sys, threading, time
kind, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
stop = time.monotonic() + seconds

def connect(source="127.0.0.2", timeout=5):
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    return s

def post(body, length=None):
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body) if length is None else length).encode() + b"\r\n\r\n" + body)

def read_answers(s, n):
    # read until n responses have arrived (or the flood's time is up); a closed connection ends the round
    got = b""
    while got.count(b"HTTP/1.1 ") < n and time.monotonic() < stop:
        chunk = s.recv(1 << 16)
        if not chunk:
            raise OSError
        got += chunk

def pipeline():
    # thousands of empty messages: 0 content characters, a long rendered prompt; 8 pipelined per round
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 1500, "max_tokens": 1}).encode()
    short = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    while time.monotonic() < stop:
        try:
            s = connect()
            while time.monotonic() < stop:
                s.sendall((post(body) + post(short)) * 4)
                read_answers(s, 8)
        except OSError:
            pass

def slowloris():
    socks = []
    while time.monotonic() < stop:
        try:
            s = connect()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        except OSError:
            pass
        for s in list(socks):
            try:
                s.sendall(b"X: y\r\n")
            except OSError:
                socks.remove(s)
        time.sleep(0.05)

def oversized():
    junk = b"x" * (1 << 16)
    while time.monotonic() < stop:
        try:
            s = connect()
            s.sendall(post(b"", length=10**9))  # a body that never ends
            while time.monotonic() < stop:
                s.sendall(junk)
        except OSError:
            pass
        try:
            s = connect()
            s.sendall(post(b'{"messages": [{"role": "user", "content": "' + b"a" * 2_000_000 + b'"}]}'))
            s.recv(1 << 16)
        except OSError:
            pass

def work(source):
    # issue 54's work flood: n = 16, max_tokens = 256, ignore_eos, two requests in flight per connection
    body = json.dumps({"messages": [{"role": "user", "content": "go"}], "n": 16, "max_tokens": 256,
                       "ignore_eos": True, "temperature": 1.0}).encode()
    while time.monotonic() < stop:
        try:
            s = connect(source, timeout=max(1.0, stop - time.monotonic()))  # waits for its answers: never hangs up
            while time.monotonic() < stop:
                s.sendall(post(body) * 2)
                read_answers(s, 2)
        except OSError:
            pass

if kind == "work":
    threads = [threading.Thread(target=work, args=(f"127.0.0.{i}",)) for i in range(2, 6) for _ in range(2)]
else:
    threads = [threading.Thread(target={"pipeline": pipeline, "slowloris": slowloris, "oversized": oversized}[kind])
               for _ in range({"pipeline": 64, "slowloris": 4, "oversized": 8}[kind])]
for t in threads:
    t.start()
print("started", flush=True)
for t in threads:
    t.join()
'''


WORK = {"max_n": 16, "max_tokens_limit": 256, "max_batch_size": 64}  # what the work flood asks for is allowed


def _latencies_during(srv, kind: str, seconds: float, warm: float, requests: int = 5) -> tuple[list, dict]:
    """Flood ``srv`` from other addresses for ``seconds``; after ``warm`` seconds, ``requests`` valid requests one
    after another from 127.0.0.1: their (status, payload, headers, seconds), and /stats after the flood."""
    port = srv.server_address[1]
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, kind, str(port), str(seconds)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert flood.stdout.readline().strip() == "started"
        time.sleep(warm)  # the flood is under way
        results = [_post(port, timeout=60) for _ in range(requests)]
    finally:
        flood.wait(timeout=120)
        stats = _stats(port)
        srv.close()
    assert [r[0] for r in results] == [200] * requests, [(r[0], r[1]) for r in results]
    assert stats["http_5xx"] == 0 and stats["errors"] == 0, stats
    return results, stats


@pytest.mark.parametrize("kind", ["pipeline", "slowloris", "oversized", "work"])
def test_a_valid_request_answers_within_a_second_during_a_flood(tiny, kind):
    """While another client address floods the server (64 connections pipelining prompts of 1500 empty messages;
    slowloris connections past the connection cap; bodies that never end and 2 MB bodies; issue 54's work flood:
    four clients keeping n = 16, max_tokens = 256, ignore_eos requests in flight), five valid requests from
    127.0.0.1 each get 200 within 1 s, and no answer is a 5xx. The old server answered 503 or reset (pipeline), 4-8 s
    late (empty messages) or 23.8 s late (work).

    The work flood keeps 64 rows generating for a whole 6 s: a valid request joins between two decode steps
    (continuous batching) instead of waiting for the requests under way. The tiny model keeps steps short; the same
    flood on SmolLM2-135M is :func:`test_a_valid_request_answers_during_the_work_flood_on_smollm2`."""
    srv = _server(tiny, max_concurrency=8, max_request_bytes=1_000_000, idle_timeout_s=5.0,
                  **(WORK if kind == "work" else {}))
    results, stats = _latencies_during(srv, kind, seconds=6, warm=1.5)
    latencies = [round(r[3], 3) for r in results]
    assert max(latencies) < 1.0, latencies
    if kind == "work":
        assert stats["max_batch_rows"] >= 64, stats  # the flood did fill the batch


@pytest.mark.slow
def test_a_valid_request_answers_during_the_work_flood_on_smollm2():
    """Issue 54's work flood against SmolLM2-135M (fp32, one thread, the server's default limits but max_tokens up to
    256): four clients keep n = 16, max_tokens = 256, ignore_eos requests in flight (64 rows, 4 decode groups of 16
    on a CPU) while 8 valid requests (max_tokens 1) are sent one after another.

    A valid request waits for one group's step and its own prefill. Measured on one core shared with two trainers at
    a higher priority (this test at nice 10): 0.59-1.03 s; the old static batcher in the same conditions: 17.9-34.5 s
    (it waited for the requests under way). On a busier share of the core the same code measured 1.8-3.4 s, so the
    bound asserted here is 5 s on every request: it separates "waits for a decode step" from "waits for the flood's
    work", without making a latency figure of a shared CI core the test (docs/SERVING.md has the measurements)."""
    from vpo_lightning.generation.models import ModelSettings, load_base_model, load_tokenizer

    model = load_base_model(ModelSettings(name="smollm2-135m", dtype="fp32"))
    srv = build_server(model, load_tokenizer("smollm2-135m"), base_name="smollm2-135m", port=0,
                       settings=ServeSettings(max_tokens_limit=256, idle_timeout_s=60.0)).start()
    _post(srv.server_address[1])  # warm-up
    results, stats = _latencies_during(srv, "work", seconds=40, warm=8, requests=8)
    latencies = sorted(round(r[3], 3) for r in results)
    print("valid request latencies under the work flood (s):", latencies)
    assert latencies[-1] < 5.0, latencies
    assert stats["max_batch_rows"] >= 64, stats
