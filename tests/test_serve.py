"""`vpo serve` in-process on a free port with the tiny random Llama (+ a LoRA adapter): a real `openai` client,
n choices and usage, stop strings, concurrent batched requests, and 4xx errors that leave the server up."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import pytest
import torch
import yaml

from vpo_lightning.generation.models import LoraSettings, ModelSettings, load_base_model, prompt_token_ids, wrap_lora
from vpo_lightning.serve import ServeSettings, build_server, load_for_serving, parse_messages

openai = pytest.importorskip("openai", reason="the openai client is in the dev extra: pip install 'openai>=1.40'")

REPO = Path(__file__).resolve().parents[1]
TINY = {"name": "tiny-llama", "dtype": "fp32", "lora": {"r": 4, "alpha": 8}}
MSG = [{"role": "user", "content": "Say something."}]


class _Scripted:
    """A stand-in decode group: answers each prefill's jobs at once with ``answer(jobs)`` (no model)."""

    def __init__(self, answer) -> None:
        self.answer, self.jobs, self.size = answer, [], 0

    def add(self, jobs):
        return list(zip(jobs, self.answer(jobs)))

    def step(self):
        return []


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is overhead-bound; one thread is far faster on a busy shared CPU
    folder = tmp_path_factory.mktemp("serve")
    cfg = yaml.safe_load((REPO / "configs/debug.yaml").read_text())
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    model = wrap_lora(load_base_model(ModelSettings(**TINY)), LoraSettings(r=4, alpha=8))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder / "adapter")
    model, tokenizer, _, _ = load_for_serving(str(folder / "config.yaml"), str(folder / "adapter"), None, [], "cpu")
    settings = ServeSettings(max_concurrency=8, max_tokens_limit=32, max_request_bytes=20_000, max_n=4,
                             max_batch_size=16, default_max_tokens=4, batch_wait_s=0.3)
    srv = build_server(model, tokenizer, base_name="tiny-llama", adapter_name="vpo", settings=settings, port=0)
    srv.start()
    yield srv
    srv.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _raw(server, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null"), dict(resp.getheaders())
    finally:
        conn.close()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama", "vpo"]
    status, body, _ = _raw(server, "GET", "/health")
    assert status == 200 and body["status"] == "ok"
    assert _raw(server, "GET", "/v1/models/vpo")[0] == 200


def test_n_choices_and_usage(server, client):
    r = client.chat.completions.create(model="vpo", messages=MSG, n=2, max_tokens=6, temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1] and r.model == "vpo" and r.object == "chat.completion"
    assert all(c.message.role == "assistant" and isinstance(c.message.content, str) for c in r.choices)
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    prompt = prompt_token_ids(server.generator.tokenizer, MSG)
    assert r.usage.prompt_tokens == len(prompt)  # counted once, as OpenAI does for n > 1
    assert 2 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # ignore_eos (vLLM's extension) makes every choice use its whole budget
    full = client.chat.completions.create(model="tiny-llama", messages=MSG, n=2, max_tokens=5,
                                          extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 10 and {c.finish_reason for c in full.choices} == {"length"}


def test_seed_reproducible_and_stop_honoured(client):
    def ask(seed: int, **kw):
        return client.chat.completions.create(model="vpo", messages=MSG, max_tokens=16, temperature=1.0, seed=seed,
                                              extra_body={"ignore_eos": True}, **kw)

    for seed in range(5):
        first = ask(seed)
        text = first.choices[0].message.content
        starts = [i for i in range(1, len(text) - 2) if text[i : i + 2].isascii() and text[i : i + 2].isalnum()]
        if starts:
            break
    else:
        pytest.skip("the random model wrote no ASCII pair to use as a stop string")
    assert ask(seed).choices[0].message.content == text  # same seed, same batch -> same sample
    stop = text[starts[len(starts) // 2] : starts[len(starts) // 2] + 2]
    stopped = ask(seed, stop=["\x00never", stop])
    assert stopped.choices[0].message.content == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < first.usage.completion_tokens == 16


def test_concurrent_requests_are_batched(server, client):
    before = dict(server.generator.stats)
    barrier, results, errors = threading.Barrier(8), [None] * 8, []

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            temperature = 1.0 if i % 2 else 0.7  # two sampling groups
            results[i] = client.chat.completions.create(
                model="vpo" if i % 3 else "tiny-llama", messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=4, temperature=temperature)
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(r is not None and len(r.choices) == 1 for r in results)
    stats = server.generator.stats
    assert stats["requests"] - before["requests"] == 8
    assert stats["batches"] - before["batches"] < 8  # some requests shared a generate call
    assert stats["max_batch_requests"] >= 2


def test_ignore_seed_lets_seeded_requests_share_a_batch(server):
    """OpenEvolve sends a new seed with every request: by default each gets its own generate call (keys differ);
    with ignore_seed the keys are equal, so the batcher groups them (and a bad seed is still a 400)."""
    from vpo_lightning.serve import APIError

    ignoring = build_server(server.generator.model, server.generator.tokenizer, base_name="tiny-llama",
                            adapter_name="vpo", settings=ServeSettings(max_n=4, max_batch_size=16, ignore_seed=True),
                            port=0)
    try:
        bodies = [{"model": "vpo", "messages": MSG, "max_tokens": 4, "seed": seed} for seed in (1, 2)]
        strict = [server.build_job(b)[0].key for b in bodies]
        loose = [ignoring.build_job(b)[0].key for b in bodies]
        assert strict[0] != strict[1] and [k.seed for k in strict] == [1, 2]
        assert loose[0] == loose[1] and loose[0].seed is None
        with pytest.raises(APIError) as err:
            ignoring.build_job({**bodies[0], "seed": "x"})
        assert err.value.status == 400
    finally:
        ignoring.server_close()


def test_adapter_and_base_differ(client):
    outs = {name: client.chat.completions.create(model=name, messages=MSG, max_tokens=8, temperature=0)
            .choices[0].message.content for name in ("vpo", "tiny-llama")}
    assert outs["vpo"] != outs["tiny-llama"]  # base = the same weights with the adapter disabled


BAD = [
    # (method, path, body, status, param or code)
    ("POST", "/v1/chat/completions", b"{not json", 400, None),
    ("POST", "/v1/chat/completions", b"\xff\xfe", 400, None),
    ("POST", "/v1/chat/completions", [1, 2], 400, None),
    ("POST", "/v1/chat/completions", {"model": "vpo"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.[0].role"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages.[0].content"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "n": 0}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "n": 5}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "n": "2"}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 33}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 9000}]}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"model": "gpt-4", "messages": MSG}, 404, "model"),
    ("POST", "/v1/chat/completions", "x" * 30_000, 413, None),
    # client mistakes that used to get 500 (or pass unchecked): each is a 400 naming the parameter
    ("POST", "/v1/chat/completions", {"model": ["vpo"], "messages": MSG}, 400, "model"),
    ("POST", "/v1/chat/completions", {"model": {"id": "vpo"}, "messages": MSG}, 400, "model"),
    ("POST", "/v1/chat/completions", '{"messages": ' + "[" * 5000 + "]" * 5000 + "}", 400, "nesting_too_deep"),
    ("POST", "/v1/chat/completions", '{"user": ' + "{\"a\": " * 200 + "1" + "}" * 200 + "}", 400,
     "nesting_too_deep"),
    ("POST", "/v1/chat/completions", '{"messages": [], "max_tokens": 1' + "0" * 5000 + "}", 400, "number_too_large"),
    ("POST", "/v1/chat/completions", '{"messages": [], "logit_bias": {"1": ' + "9" * 40 + "}}", 400,
     "number_too_large"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "seed": 2**70}, 400, "seed"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "seed": -(2**63) - 1}, 400, "seed"),
    ("POST", "/v1/chat/completions", {"messages": MSG, "top_k": 2**40}, 400, "top_k"),
    ("POST", "/v1/chat/completions", '{"messages": [], "temperature": NaN}', 400, "invalid_number"),
    ("POST", "/v1/chat/completions", '{"messages": [], "top_p": NaN}', 400, "invalid_number"),
    ("POST", "/v1/chat/completions", '{"messages": [], "temperature": Infinity}', 400, "invalid_number"),
    ("POST", "/v1/chat/completions", '{"messages": [], "top_p": -Infinity}', 400, "invalid_number"),
    ("POST", "/v1/chat/completions", '{"messages": [], "temperature": 1e999}', 400, "invalid_number"),
    ("POST", "/v1/chat/completions", '{"messages": [], "presence_penalty": NaN}', 400, "invalid_number"),
    ("GET", "/v1/nothing", None, 404, None),
    ("POST", "/v1/completions", {"prompt": "x"}, 404, None),
    ("GET", "/v1/chat/completions", None, 405, None),
    ("POST", "/v1/models", {}, 405, None),
    ("DELETE", "/v1/models", None, 405, None),
]


@pytest.mark.parametrize("method, path, body, status, param", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_4xx(server, method, path, body, status, param):
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    got, payload, headers = _raw(server, method, path, body, {"Content-Type": "application/json"})
    assert got == status, payload
    error = payload["error"]
    assert isinstance(error["message"], str) and error["message"] and "type" in error
    if param is not None:
        assert param in (error["param"], error["code"]), error
    if status == 405:
        assert headers.get("Allow")


def test_server_survives_errors_and_limits(server, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="vpo", messages=MSG, max_tokens=1000)
    with server._lock:
        server._in_flight += server.settings.max_concurrency  # as if 8 requests were in flight
    try:
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="vpo", messages=MSG, max_tokens=2)
    finally:
        with server._lock:
            server._in_flight -= server.settings.max_concurrency
    server.settings.api_key = "secret"
    try:
        assert _raw(server, "GET", "/v1/models")[0] == 401
        assert _raw(server, "GET", "/v1/models", headers={"Authorization": "Bearer secret"})[0] == 200
    finally:
        server.settings.api_key = None
    r = client.chat.completions.create(model="vpo", messages=MSG, max_tokens=2)  # default model, still serving
    assert len(r.choices) == 1 and server.generator.stats["errors"] == 0


def test_stats_count_client_and_server_errors_apart(server):
    """/stats counts 4xx (client mistakes) and 5xx (server failures) separately; a client's mistake (a seed out of
    range) is a 4xx and never reaches the batching worker's error counter."""
    before = _raw(server, "GET", "/stats")[1]
    assert {"http_4xx", "http_5xx", "errors"} <= set(before)
    assert _raw(server, "POST", "/v1/chat/completions", json.dumps({"messages": MSG, "seed": 2**70}))[0] == 400
    assert _raw(server, "GET", "/v1/nothing")[0] == 404
    after = _raw(server, "GET", "/stats")[1]
    assert after["http_4xx"] - before["http_4xx"] == 2
    assert after["http_5xx"] == before["http_5xx"] and after["errors"] == before["errors"]


def test_generation_failure_is_a_5xx_in_stats(server):
    """A failing generate call (here: the model raises) answers 500 and is counted as a 5xx and a worker error."""
    gen = server.generator
    srv = build_server(gen.model, gen.tokenizer, base_name="tiny-llama", adapter_name="vpo",
                       settings=ServeSettings(max_n=4, max_batch_size=16, max_tokens_limit=8), port=0)

    def broken(jobs):
        raise RuntimeError("out of memory (simulated)")

    srv.generator.new_group = lambda adapter: _Scripted(broken)
    srv.start()
    try:
        status, body, _ = _raw(srv, "POST", "/v1/chat/completions", json.dumps({"messages": MSG, "max_tokens": 2}))
        assert status == 500 and body["error"]["type"] == "server_error"
        stats = _raw(srv, "GET", "/stats")[1]
        assert stats["http_5xx"] == 1 and stats["http_4xx"] == 0 and stats["errors"] == 1
    finally:
        srv.close()


def test_idle_connections_cannot_lock_out_other_clients(server):
    """More idle (and half-sent) connections than the connection cap, all on loopback: a new client is still
    answered at once, because idle connections are closed, oldest first, to make room (and time out on their own).
    """
    import socket
    import time

    gen = server.generator
    cap = 4
    srv = build_server(gen.model, gen.tokenizer, base_name="tiny-llama", adapter_name="vpo",
                       settings=ServeSettings(max_connections=cap, idle_timeout_s=30.0), port=0).start()
    port = srv.server_address[1]
    hogs: list[socket.socket] = []
    try:
        for i in range(2 * cap + 2):  # bounded: twice the cap, plus two
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished (slowloris)
            hogs.append(sock)
        t0 = time.monotonic()
        for _ in range(3):  # three clients in a row, each served while the hogs stay connected
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            resp.read()
            conn.close()
        assert time.monotonic() - t0 < 10  # not after an idle timeout
        stats = _raw(srv, "GET", "/stats")[1]
        assert stats["connections_evicted"] >= 1 and stats["connections_open"] <= cap
    finally:
        for sock in hogs:
            sock.close()
        srv.close()


def test_close_ends_keep_alive_connections(server):
    """A client that keeps its connection open must not keep the server alive after close(): the HTTP thread ends
    and the connection is closed (daemon threads still running at interpreter exit get killed inside torch calls:
    std::terminate, exit status 134)."""
    gen = server.generator
    srv = build_server(gen.model, gen.tokenizer, base_name="tiny-llama", adapter_name="vpo",
                       settings=ServeSettings(), port=0).start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().read()  # HTTP/1.1 keep-alive: the connection now waits for the next request
    assert srv.stats()["connections_open"] == 1
    srv.close()
    assert not srv._thread.is_alive()
    assert conn.sock.recv(1) == b""  # closed by the server
    conn.close()


def test_decode_json_limits():
    from vpo_lightning.serve import APIError, decode_json
    from vpo_lightning.serve.openai_api import MAX_JSON_DEPTH, value_depth

    assert value_depth(json.loads('{"a": [1, {"b": "[[[{{{"}], "c": "\\"]]]"}')) == 3  # strings do not count
    assert value_depth([]) == 1 and value_depth("x") == 0
    assert decode_json(b'{"seed": -12, "t": 0.5, "s": "NaN"}') == {"seed": -12, "t": 0.5, "s": "NaN"}
    assert decode_json(("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH).encode())  # the limit itself is accepted
    for raw, code in [(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nesting_too_deep"),
                      (b"[" + b"1" * 33 + b"]", "number_too_large"), (b"[-Infinity]", "invalid_number"),
                      (b"[-1e400]", "invalid_number")]:
        with pytest.raises(APIError) as err:
            decode_json(raw)
        assert (err.value.status, err.value.code) == (400, code)


def test_any_json_in_any_field_is_a_4xx_or_valid():
    """Hypothesis: arbitrary JSON values in every field the server reads give a valid request or an APIError with a
    4xx status, never another exception (which the server would answer with 500)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from vpo_lightning.serve import APIError, parse_chat_request

    leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(
        max_size=5)
    value = st.recursive(leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids,
                                                                                          max_size=3), max_leaves=8)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | value,
                                     "content": st.text(max_size=5) | value})
    fields = ["model", "stream", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
              "ignore_eos", "stop", "seed", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice",
              "parallel_tool_calls", "response_format", "logit_bias", "presence_penalty", "store", "user", "x"]
    body = st.fixed_dictionaries({"messages": st.lists(message, max_size=2) | value},
                                 optional=dict.fromkeys(fields, value))
    models = {"base": False, "vpo": True}

    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(body | value)
    def check(raw):
        try:
            request = parse_chat_request(raw, ServeSettings(max_n=4, max_batch_size=16), models, "vpo")
        except APIError as err:
            assert 400 <= err.status < 500
        else:
            assert request.model in models and 1 <= request.n <= 4 and request.messages

    check()


def test_parse_messages_and_settings():
    parts = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert parse_messages(parts) == [{"role": "system", "content": "ab"}]
    with pytest.raises(ValueError):
        ServeSettings(max_n=8, max_batch_size=4)
    with pytest.raises(ValueError):
        ServeSettings(max_concurrency=0)


@pytest.mark.slow
def test_openevolve_two_iterations_against_vpo_serve(tmp_path, tiny_model_dir):
    """benchmarks/openevolve_code.py end to end: `vpo serve` subprocess (tiny model), OpenEvolve 2 iterations."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("openevolve") is None:
        pytest.skip("openevolve is not installed (bash benchmarks/setup_openevolve.sh pins openevolve==0.4.1)")
    out = tmp_path / "openevolve_results.md"
    cmd = [sys.executable, str(REPO / "benchmarks/openevolve_code.py"), "--model", "tiny-llama", "--iterations", "2",
           "--problem-ids", "HumanEval/1", "--max-tokens", "16", "--workers", "2", "--work-dir", str(tmp_path / "work"),
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "work/results.json").read_text())
    base = results["models"][0]
    assert base["label"] == "base" and base["requests"] >= 2  # one LLM call per iteration, through the server
    run = base["runs"]["HumanEval/1"]
    assert run["iterations"] == run["traced_iterations"] == 2  # OpenEvolve's trace: two children evaluated
    assert results["settings"]["workers"] == 2  # two OpenEvolve worker processes, both calling the server
    assert "--ignore-seed" in results["settings"]["serve_args"]  # so that their per-iteration seeds can batch
    assert 1 <= base["generate_calls"] <= base["requests"]
    assert run["num_tests"] >= 1 and 0 <= run["tests_passed"] <= run["num_tests"]
    assert [m.get("skipped") for m in results["models"][1:]] == ["no adapter given"] * 2
    text = out.read_text()
    assert "| HumanEval/1 |" in text and "2 iterations per problem" in text


# ---- issue 41: no input stalls the server ----------------------------------------------------------------------------
def _flood_server(server, **settings):
    gen = server.generator
    return build_server(gen.model, gen.tokenizer, base_name="tiny-llama", adapter_name="vpo", port=0,
                        settings=ServeSettings(**{"max_request_bytes": 2_000_000, "max_tokens_limit": 8,
                                                  "batch_wait_s": 0.0, **settings})).start()


def test_a_1mb_body_is_answered_within_a_second(server):
    """Bodies that made the old depth check quadratic (escaped quotes in an unterminated string: 40 kB froze the
    server for 9.5 s) or nest deeply, at 1 MB each: a 400 within a second, and the server keeps answering."""
    import time

    srv = _flood_server(server)
    try:
        for body in ['"' + '\\"' * 500_000, '{"messages": ' + "[" * 1_000_000, "[" * 100 + "1" + "]" * 100]:
            t0 = time.monotonic()
            status, payload, _ = _raw(srv, "POST", "/v1/chat/completions", body.encode())
            elapsed = time.monotonic() - t0
            assert status == 400 and elapsed < 1.0, (status, elapsed, payload)
        assert _raw(srv, "GET", "/health")[0] == 200
    finally:
        srv.close()


def test_a_flood_of_long_prompts_does_not_starve_short_requests(server):
    """Four clients post 1 MB and 300 kB prompts in a loop (1 MB ones held the shared tokenizer for ~2.5 s each, so
    valid requests waited out the flood: 17.7 s instead of 0.06 s); short requests beside them stay fast."""
    import time

    srv = _flood_server(server, max_concurrency=16)
    stop = threading.Event()
    flood_status: list[int] = []

    def flood(size: int) -> None:
        body = json.dumps({"messages": [{"role": "user", "content": "word " * (size // 5)}], "max_tokens": 1})
        while not stop.is_set():
            flood_status.append(_raw(srv, "POST", "/v1/chat/completions", body)[0])

    threads = [threading.Thread(target=flood, args=(size,)) for size in (1_000_000, 1_000_000, 300_000, 300_000)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)  # the flood is under way
        latencies = []
        for _ in range(5):
            t0 = time.monotonic()
            status, payload, _ = _raw(srv, "POST", "/v1/chat/completions",
                                      json.dumps({"messages": MSG, "max_tokens": 1, "temperature": 0}))
            latencies.append(time.monotonic() - t0)
            assert status == 200, payload
    finally:
        stop.set()
        for t in threads:
            t.join()
        srv.close()
    assert flood_status and set(flood_status) == {400}  # every flood request is refused (past the context)
    assert max(latencies) < 1.0, latencies


def test_tiny_temperatures_are_greedy(server):
    """A temperature in (0, 1e-5) is greedy decoding (1e-39 overflowed the logits to inf: 500)."""
    body = {"messages": MSG, "max_tokens": 6, "model": "vpo"}
    status, tiny, _ = _raw(server, "POST", "/v1/chat/completions", json.dumps({**body, "temperature": 1e-39}))
    assert status == 200, tiny
    greedy = _raw(server, "POST", "/v1/chat/completions", json.dumps({**body, "temperature": 0}))[1]
    assert tiny["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


def test_a_client_hanging_up_is_not_a_server_error(server, caplog):
    """A client that resets its connection while its request is generating is counted as a disconnect, not a 5xx,
    and leaves no traceback in the log."""
    import socket
    import struct
    import time

    srv = _flood_server(server, batch_wait_s=0.5)  # the answer comes after the client is gone
    try:
        body = json.dumps({"messages": MSG, "max_tokens": 2}).encode()
        with caplog.at_level("DEBUG", logger="vpo_lightning.serve.server"):
            sock = socket.create_connection(("127.0.0.1", srv.server_address[1]))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(0.2)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            sock.close()
            deadline = time.monotonic() + 10
            while _raw(srv, "GET", "/stats")[1]["client_disconnects"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
        stats = _raw(srv, "GET", "/stats")[1]
        assert stats["client_disconnects"] == 1 and stats["http_5xx"] == 0, stats
        assert not any(r.levelname in ("ERROR", "CRITICAL") for r in caplog.records), caplog.text
    finally:
        srv.close()


# ---- issue 53: streaming, logprobs, tools, and a 400 for every field not implemented ------------------------------
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _token_ids(tokenizer, entries) -> list[int]:
    """The token ids behind OpenAI logprob entries (their exact bytes, through the byte-level BPE alphabet)."""
    from vpo_lightning.serve.jobs import BYTE_DECODER

    encoder = {b: c for c, b in BYTE_DECODER.items()}
    return tokenizer.convert_tokens_to_ids(["".join(encoder[b] for b in e.bytes) for e in entries])


def test_openai_client_streams_what_it_would_answer(server, client):
    """stream=True (with n=2, include_usage and a stop string) gives, chunk by chunk, exactly the text, finish
    reason and usage of the same request unstreamed; the old server refused stream=True with a 400."""
    for extra in ({}, {"stop": ["e"]}, {"tools": WEATHER, "stop": ["a"]}):
        kwargs = dict(model="vpo", messages=MSG, n=2, max_tokens=12, temperature=0.8, seed=3, **extra)
        plain = client.chat.completions.create(**kwargs)
        stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        texts, finish, usage, roles = ["", ""], [None, None], None, set()
        for chunk in stream:
            assert chunk.object == "chat.completion.chunk" and chunk.model == "vpo"
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                roles.add(c.delta.role)
                texts[c.index] += c.delta.content or ""
                finish[c.index] = c.finish_reason or finish[c.index]
        assert roles >= {"assistant"}
        assert texts == [c.message.content or "" for c in plain.choices], extra
        assert not any(stop in text for stop in extra.get("stop", []) for text in texts)
        assert finish == [c.finish_reason for c in plain.choices]
        assert usage is not None and usage.model_dump() == plain.usage.model_dump(include={
            "prompt_tokens", "completion_tokens", "total_tokens"}) | {"completion_tokens_details": None,
                                                                      "prompt_tokens_details": None}


def test_openai_client_logprobs_are_those_sampled_from(server, client):
    """logprobs/top_logprobs in OpenAI's shape, for n=2 sampled choices (temperature 0.7, top-p 0.9), equal to a
    separate forward pass's log-softmax after the same temperature and top-p; the streamed request gives the same
    entries; the old server answered "logprobs": null."""
    from transformers import TopPLogitsWarper

    tok = server.generator.tokenizer
    kwargs = dict(model="vpo", messages=MSG, n=2, max_tokens=6, temperature=0.7, top_p=0.9, seed=5, logprobs=True,
                  top_logprobs=3, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kwargs)
    prompt = prompt_token_ids(tok, MSG)
    for choice in r.choices:
        entries = choice.logprobs.content
        text = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
        assert len(entries) == 6 and text == choice.message.content
        ids = _token_ids(tok, entries)
        with torch.no_grad():
            logits = server.generator.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(TopPLogitsWarper(0.9)(None, logits / 0.7), dim=-1)
        for e, token, row in zip(entries, ids, expected):
            assert e.logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert 1 <= len(e.top_logprobs) <= 3 and e.token == bytes(e.bytes).decode("utf-8", "replace")
            tops = [t.logprob for t in e.top_logprobs]
            assert tops == sorted(tops, reverse=True) and tops[0] == pytest.approx(row.max().item(), abs=1e-4)
            assert e.logprob <= tops[0] + 1e-6
    streamed = [[], []]
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.logprobs.content if c.logprobs and c.logprobs.content else []
    assert [[(e.token, round(e.logprob, 4)) for e in s] for s in streamed] == \
        [[(e.token, round(e.logprob, 4)) for e in c.logprobs.content] for c in r.choices]
    greedy = client.chat.completions.create(model="vpo", messages=MSG, max_tokens=4, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in greedy.choices[0].logprobs.content)
    assert client.chat.completions.create(model="vpo", messages=MSG, max_tokens=2).choices[0].logprobs is None


def test_openai_client_tools_reach_the_prompt_and_calls_come_back(server, client):
    """tools go into the prompt (SmolLM2's template ignores them, so the tool-use task's system message carries
    them: more prompt tokens, exactly that prompt); an answer in the tool-call format comes back as OpenAI
    tool_calls with finish_reason "tool_calls", streamed or not; a conversation with the call and its result is
    accepted. The old server counted the same prompt tokens with or without tools and refused role "tool"."""
    from vpo_lightning.serve import Choice
    from vpo_lightning.serve.server import tooluse_messages

    tok = server.generator.tokenizer
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    bare = client.chat.completions.create(model="vpo", messages=ask, max_tokens=1)
    with_tools = client.chat.completions.create(model="vpo", messages=ask, max_tokens=1, tools=WEATHER)
    expected = prompt_token_ids(tok, tooluse_messages(ask, WEATHER))
    assert with_tools.usage.prompt_tokens == len(expected) > bare.usage.prompt_tokens
    assert "get_weather" in tok.decode(expected)
    none = client.chat.completions.create(model="vpo", messages=ask, max_tokens=1, tools=WEATHER, tool_choice="none")
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens

    gen = server.generator
    srv = build_server(gen.model, tok, base_name="tiny-llama", adapter_name="vpo", port=0,
                       settings=ServeSettings(max_n=4, max_batch_size=16, max_tokens_limit=32))
    answer = ('<think> I need the weather. </think>\n<tool_call>\n{"name": "get_weather", "parameters": '
              '{"city": "Paris"}}\n</tool_call>')
    srv.generator.new_group = lambda adapter: _Scripted(
        lambda jobs: [[Choice(answer, "stop", 20) for _ in range(j.n)] for j in jobs])
    srv.start()
    try:
        scripted = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        r = scripted.chat.completions.create(model="vpo", messages=ask, tools=WEATHER, n=2)
        for choice in r.choices:
            call = choice.message.tool_calls[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            assert choice.message.content.strip() == "<think> I need the weather. </think>"
        assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id
        calls, finish = {}, None
        for chunk in scripted.chat.completions.create(model="vpo", messages=ask, tools=WEATHER, stream=True):
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and calls == {0: ["get_weather", '{"city": "Paris"}']}
        plain = scripted.chat.completions.create(model="vpo", messages=ask)  # no tools: the text as written
        assert plain.choices[0].message.content == answer and plain.choices[0].finish_reason == "stop"
    finally:
        srv.close()

    call = r.choices[0].message.tool_calls[0]
    turn = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18}'}]
    follow = client.chat.completions.create(model="vpo", messages=turn, tools=WEATHER, max_tokens=2)
    assert follow.usage.prompt_tokens > with_tools.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="vpo", messages=ask, tools=WEATHER, tool_choice="required")


UNSUPPORTED = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"logit_bias": {"50": 10}}, "logit_bias"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"store": True}, "store"),
    ({"min_p": 0.1}, "min_p"),  # an unknown field (a vLLM extension not implemented)
    ({"tools": WEATHER, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools.[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.[0].function.name"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]}, "messages.[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages.[0].audio"),
]


@pytest.mark.parametrize("extra, param", UNSUPPORTED, ids=[p for _, p in UNSUPPORTED])
def test_fields_not_implemented_are_a_400_naming_them(server, extra, param):
    """Each field (or value) vpo serve does not implement is a 400 in OpenAI's shape naming it and the fix; the old
    server answered 200 and ignored it."""
    status, payload, _ = _raw(server, "POST", "/v1/chat/completions",
                              json.dumps({"model": "vpo", "messages": MSG, "max_tokens": 2, **extra}))
    assert status == 400, payload
    error = payload["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[0] in error["message"] and len(error["message"]) > 30


def test_openai_client_gets_400_for_response_format_and_200_for_neutral_values(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="vpo", messages=MSG, max_tokens=2, response_format={"type": "json_object"})
    assert err.value.status_code == 400 and "response_format" in str(err.value) and "JSON mode" in str(err.value)
    r = client.chat.completions.create(model="vpo", messages=MSG, max_tokens=2, response_format={"type": "text"},
                                       presence_penalty=0, frequency_penalty=0, store=False, user="u1",
                                       parallel_tool_calls=True, tools=WEATHER, tool_choice="auto")
    assert len(r.choices) == 1


def test_a_stream_that_fails_early_is_a_plain_error_and_a_hang_up_frees_its_slot(server, client):
    """A streamed request refused before its first token (429 here) gets a plain error the client raises; a client
    that hangs up mid-stream frees its slot (no request stays in flight) and is no server error."""
    import socket
    import time

    with server._lock:
        server._in_flight += server.settings.max_concurrency
    try:
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="vpo", messages=MSG, max_tokens=2, stream=True)
    finally:
        with server._lock:
            server._in_flight -= server.settings.max_concurrency
    body = json.dumps({"messages": MSG, "max_tokens": 32, "stream": True, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = sock.recv(4096)
    assert b"200 OK" in head and b"text/event-stream" in head, head
    sock.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = _raw(server, "GET", "/stats")[1]
        if stats["in_flight"] == 0:
            break
        time.sleep(0.1)
    assert stats["in_flight"] == 0 and stats["http_5xx"] == 0
    assert client.chat.completions.create(model="vpo", messages=MSG, max_tokens=2).choices


def test_a_template_that_renders_tools_gets_them_and_the_calls_unchanged(server):
    """With a chat template that writes tools (as Qwen2.5's does), the tools and an earlier assistant call go to the
    template as OpenAI sent them, and no tool-use system message is added."""
    import copy

    tok = copy.deepcopy(server.generator.tokenizer)
    tok.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
        "[call {{ c.function.name }} {{ c.function.arguments }}]{% endfor %}|{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    srv = build_server(server.generator.model, tok, base_name="tiny-llama", adapter_name="vpo", port=0,
                       settings=ServeSettings(max_n=4, max_batch_size=16))
    try:
        assert srv.template_tools and not server.template_tools
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
        turn = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
        job, request = srv.build_job({"model": "vpo", "messages": turn, "tools": WEATHER})
        assert tok.decode(job.prompt_ids) == ('TOOLS:get_weather;|user: Weather?|assistant: '
                                              '[call get_weather {"city": "P"}]|tool: 18C|assistant: ')
        assert request.tools == WEATHER
    finally:
        srv.server_close()
