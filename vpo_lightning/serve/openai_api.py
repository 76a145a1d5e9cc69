"""The OpenAI chat-completions API of ``vpo serve``: errors, limits, and request validation (no HTTP, no model).

Every malformed request becomes an :class:`APIError` with a 4xx status and OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``), never a 500:

- the body is decoded by :func:`decode_json` in linear time, which refuses nesting deeper than ``MAX_JSON_DEPTH``
  (checked on the parsed value; the parser's own ``RecursionError`` is a 400 too), integers longer than
  ``MAX_INT_DIGITS`` digits (Python refuses to convert more than 4300 and a long one is never a valid value here), and
  ``NaN``/``Infinity``/overflowing floats anywhere in the body (``temperature: NaN`` would otherwise compare false
  against every bound and pass);
- :func:`parse_chat_request` checks every field it uses: types (``model`` must be a string), ranges (``n``,
  ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``top_logprobs``) and the seed range torch accepts; a
  temperature below ``MIN_TEMPERATURE`` (1e-5) is greedy decoding, as in vLLM;
- a field the server does not implement (``response_format``, ``logit_bias``, ``functions``, audio ...) or does not
  know is a 400 naming it and what to do instead (:func:`check_fields`), never silently ignored; so is an
  unsupported value of a supported field (``tool_choice: "required"``, ``parallel_tool_calls: false``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MESSAGE_KEYS = frozenset({"role", "content", "name"})  # and tool_calls/tool_call_id on assistant/tool messages
MAX_TOP_LOGPROBS = 20  # as OpenAI
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_STOPS = 4  # OpenAI allows up to 4 stop sequences
MAX_JSON_DEPTH = 64  # nested arrays/objects; a chat request with tools and JSON schemas needs about 10
MAX_INT_DIGITS = 32  # longest integer literal accepted anywhere in a body (2**64 has 20 digits)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts
TOP_K_MAX = 2**31 - 1
# Temperatures below this are greedy (as in vLLM): dividing logits by 1e-39 overflows to inf and sampling fails.
MIN_TEMPERATURE = 1e-5


# ---- errors -----------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error returned to the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers: dict[str, str] = {}  # extra response headers (Retry-After, Allow, Connection)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


# ---- settings ---------------------------------------------------------------------------------------------------
@dataclass
class ServeSettings:
    """Server limits.

    Args:
        max_concurrency: chat-completion requests in flight (being tokenized, queued or generating) before new ones
            get 429 with ``Retry-After``; a request is admitted before its prompt is tokenized. Past it, a client
            that would still hold fewer requests than another client is admitted, up to twice this many.
        max_tokens_limit: largest ``max_tokens`` a request may ask for.
        max_request_bytes: largest request body accepted.
        max_n: largest ``n`` (choices per request).
        max_batch_size: most sequences (rows) generating at once; at least ``max_n``. A client holding fewer rows
            than another may join past it, up to twice this many.
        default_max_tokens: ``max_tokens`` when the request gives none.
        batch_wait_s: when the worker is idle, how long it waits after a request for more to prefill with it.
        request_timeout_s: a request still waiting after this long gets 504.
        api_key: when set, requests need ``Authorization: Bearer <api_key>``.
        ignore_seed: drop each request's ``seed``. Seeded requests share decode steps with the others either way
            (each samples from its own generator); before continuous batching a seed kept a request out of others'
            ``generate`` calls, and OpenEvolve, which sends a new seed per iteration, got no batching without this.
        max_client_tokens: queued work of one client, ``n x max_tokens`` summed over its requests in flight,
            before its next ones get 429 (default: half of ``max_batch_size x max_tokens_limit``, and at least
            one request of ``max_n x max_tokens_limit``).
        max_connections: open connections at once (default ``max(64, 4 * max_concurrency)``). When all are taken,
            the connection idle the longest (waiting for a request, or still sending one) is closed to make room;
            only when every connection has a request being answered does a new one get 429.
        idle_timeout_s: a connection that owes the server a request for this long is closed: between requests, or
            still sending one (headers or body, however slowly it trickles in).
        step_rows: most rows in one decode step; the rows generating are split into groups of at most this many,
            stepped in turn, and new requests join between two (None: 16 on a CPU, ``max_batch_size`` on a GPU).
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
    max_connections: int | None = None
    idle_timeout_s: float = 30.0
    max_client_tokens: int | None = None
    step_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "max_tokens_limit", "max_request_bytes", "max_n", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_size < self.max_n:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) must be >= max_n ({self.max_n})")
        if self.max_connections is None:
            self.max_connections = max(64, 4 * self.max_concurrency)
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_client_tokens is None:
            self.max_client_tokens = max(self.max_n * self.max_tokens_limit,
                                         self.max_batch_size * self.max_tokens_limit // 2)
        if self.max_client_tokens < 1:
            raise ValueError(f"max_client_tokens must be >= 1, got {self.max_client_tokens}")
        if self.step_rows is not None and self.step_rows < 1:
            raise ValueError(f"step_rows must be >= 1, got {self.step_rows}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
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


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request (before tokenization).

    ``tools`` are OpenAI function tools (``{"type": "function", "function": {...}}``), None without tools or with
    ``tool_choice: "none"``; ``logprobs`` is None when not asked for, else the number of ``top_logprobs`` (0-20).
    """

    model: str
    messages: list[dict[str, Any]]
    n: int
    key: SamplingKey
    stops: tuple[str, ...]
    max_tokens_param: str  # "max_tokens" or "max_completion_tokens", for error messages
    tools: list[dict[str, Any]] | None = None
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


# ---- the body ---------------------------------------------------------------------------------------------------
def value_depth(value: Any) -> int:
    """Deepest nesting of lists/dicts in a decoded JSON value (``[]`` is 1, a scalar 0); linear time, no recursion,
    and it stops as soon as ``MAX_JSON_DEPTH`` is passed."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _int_literal(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise bad_request(f"an integer in the body has {len(text.lstrip('-'))} digits; at most {MAX_INT_DIGITS} "
                          "are accepted", code="number_too_large")
    return int(text)


def _float_literal(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise bad_request(f"the number {text[:40]} overflows a float; numbers must be finite", code="invalid_number")
    return value


def _constant(text: str) -> float:
    raise bad_request(f"{text} is not valid JSON; numbers must be finite", code="invalid_number")


def decode_json(raw: bytes) -> Any:
    """The request body as JSON, or a 400: not UTF-8, not JSON, nested deeper than ``MAX_JSON_DEPTH``, an integer of
    more than ``MAX_INT_DIGITS`` digits, or a non-finite number (``NaN``, ``Infinity``, ``1e999``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad_request(f"the request body is not valid JSON: not UTF-8 ({err.reason} at byte {err.start})") \
            from None
    # The C parser is linear and stops deep nesting with RecursionError (at the interpreter's recursion limit);
    # the depth of what it built is then checked in linear time. (A regex that blanked out strings before counting
    # brackets was quadratic: a 40 kB body held the server's GIL for 9.5 s.)
    try:
        value = json.loads(text, parse_int=_int_literal, parse_float=_float_literal, parse_constant=_constant)
    except json.JSONDecodeError as err:
        raise bad_request(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise bad_request(f"the request body nests more than {MAX_JSON_DEPTH} levels deep",
                          code="nesting_too_deep") from None
    depth = value_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise bad_request(f"the request body nests {depth}+ levels deep; at most {MAX_JSON_DEPTH} are accepted",
                          code="nesting_too_deep")
    return value


# ---- fields -----------------------------------------------------------------------------------------------------
def number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    """``body[name]`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a finite number, got {json.dumps(value)[:80]}", name)
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise bad_request(f"'{name}' must be in {bound}, got {value}", name)
    return float(value)


def integer(body: dict, name: str, default: int | None, low: int | None = None, high: int | None = None,
            hint: str = "") -> int | None:
    """``body[name]`` as an int in ``[low, high]`` (either bound optional), else a 400; ``hint`` ends the message."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {json.dumps(value)[:80]}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        shown = str(value) if abs(value) < 10**12 else f"{str(value)[:12]}... ({len(str(abs(value)))} digits)"
        raise bad_request(f"'{name}' must be between {low} and {high}{hint}, got {shown}", name)
    return value


def _text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts joined; anything else is a 400."""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad_request(f"{param}: only text parts are supported (no images, audio or files)", param)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_request(f"{param} must be a string", param)
    return content


def _message_tool_calls(raw: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (a conversation sent back after a call) in OpenAI's shape."""
    if not isinstance(raw, list):
        raise bad_request(f"{param} must be a list of tool calls", param)
    calls = []
    for j, call in enumerate(raw):
        where = f"{param}.[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" \
                or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments", "{}"), str):
            raise bad_request(f"{where} must be {{\"type\": \"function\", \"id\": ..., \"function\": {{\"name\": "
                              "str, \"arguments\": JSON string}}", where)
        calls.append({"id": str(call.get("id", "")), "type": "function",
                      "function": {"name": function["name"], "arguments": function.get("arguments", "{}")}})
    return calls


def parse_messages(raw: Any) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages into ``[{"role", "content"}]`` strings (text content parts are joined).

    An assistant message may carry ``tool_calls`` (its content may then be null) and a ``tool`` message its
    ``tool_call_id``; both are kept for the chat template.
    """
    if raw is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(raw):
        param = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object with 'role' and 'content'", param)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"{param}.role must be one of {sorted(ROLES)}, got {json.dumps(role)[:40]}",
                              f"{param}.role")
        allowed = MESSAGE_KEYS | ({"tool_calls", "refusal", "annotations"} if role == "assistant" else set()) \
            | ({"tool_call_id"} if role == "tool" else set())
        extra = sorted(k for k, v in message.items() if k not in allowed and v not in (None, [], ""))
        if extra:
            raise bad_request(f"{param}.{extra[0]} is not supported on a {role} message by vpo serve (it reads "
                              f"{', '.join(sorted(allowed))}); leave it out", f"{param}.{extra[0]}",
                              "unsupported_parameter")
        content = message.get("content")
        calls = message.get("tool_calls") if role == "assistant" else None
        if content is None and calls:
            content = ""
        entry: dict[str, Any] = {"role": ROLES[role], "content": _text(content, f"{param}.content")}
        if calls:
            entry["tool_calls"] = _message_tool_calls(calls, f"{param}.tool_calls")
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            entry["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]  # for the chat template (SmolLM2's ignores it)
        out.append(entry)
    return out


def parse_tools(raw: Any) -> list[dict[str, Any]]:
    """Validate ``tools``: a non-empty list of ``{"type": "function", "function": {"name", "description",
    "parameters"}}`` (OpenAI's shape), returned in that shape."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {\"name\", "
                          "\"description\", \"parameters\"}} objects", "tools")
    tools = []
    for i, tool in enumerate(raw):
        param = f"tools.[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            got = json.dumps(tool.get("type") if isinstance(tool, dict) else tool)[:40]
            raise bad_request(f"{param}.type must be \"function\" (the only tool type vpo serve implements; no "
                              f"built-in tools such as web search), got {got}", f"{param}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{param}.function must be an object with 'name', 'description', 'parameters'",
                              f"{param}.function")
        name, description = function.get("name"), function.get("description", "")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad_request(f"{param}.function.name must be 1-64 letters, digits, '_' or '-', got "
                              f"{json.dumps(name)[:80]}", f"{param}.function.name")
        if not isinstance(description, str):
            raise bad_request(f"{param}.function.description must be a string", f"{param}.function.description")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"{param}.function.parameters must be a JSON-schema object",
                              f"{param}.function.parameters")
        if function.get("strict"):
            raise bad_request(f"{param}.function.strict: vpo serve does not constrain decoding to the schema; "
                              "leave 'strict' unset or false and check the arguments yourself",
                              f"{param}.function.strict")
        tools.append({"type": "function", "function": {"name": name, "description": description,
                                                       "parameters": parameters}})
    return tools


def parse_stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in stops if s)


# Every field a chat-completions body may carry: the ones implemented, and the identifiers that by definition
# change nothing in the answer (accepted and not used). Anything else is a 400 naming the field (OpenAI itself
# refuses unknown arguments).
IMPLEMENTED = frozenset({
    "model", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "stream",
    "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "top_k", "ignore_eos",  # vLLM's extensions
    "frequency_penalty", "presence_penalty", "logit_bias", "response_format", "modalities", "store",  # neutral only
})
IDENTIFIERS = frozenset({"user", "safety_identifier", "prompt_cache_key", "metadata"})
FIX = "; leave it out (vpo serve does not implement it)"
# field -> (is the value harmless: the same as leaving the field out, what to do instead)
NEUTRAL: dict[str, tuple[Any, str]] = {
    "frequency_penalty": (lambda v: v == 0, "only 0 is supported (no repetition penalties)" + FIX),
    "presence_penalty": (lambda v: v == 0, "only 0 is supported (no repetition penalties)" + FIX),
    "logit_bias": (lambda v: v == {}, "biasing tokens is not implemented" + FIX),
    "response_format": (lambda v: v == {"type": "text"},
                        "only {\"type\": \"text\"} is supported: there is no JSON mode or structured output; ask "
                        "for JSON in the messages and validate the answer yourself, or leave 'response_format' out"),
    "modalities": (lambda v: v == ["text"], "only [\"text\"] is supported (no audio output)" + FIX),
    "store": (lambda v: v is False, "vpo serve stores nothing (no stored completions or evals)" + FIX),
}
UNSUPPORTED = {
    "functions": "the deprecated 'functions' is not implemented; send 'tools' "
                 "([{\"type\": \"function\", \"function\": {...}}]) instead",
    "function_call": "the deprecated 'function_call' is not implemented; send 'tools' and 'tool_choice' instead",
    "audio": "audio output is not implemented (text only)" + FIX,
    "prediction": "predicted outputs are not implemented" + FIX,
    "reasoning_effort": "the model has no reasoning-effort setting" + FIX,
    "web_search_options": "web search is not implemented" + FIX,
    "service_tier": "there are no service tiers" + FIX,
    "verbosity": "the model has no verbosity setting" + FIX,
    "best_of": "'best_of' is a legacy-completions field; use 'n' and pick among the choices",
    "echo": "'echo' is a legacy-completions field (there is no /v1/completions); leave it out",
    "suffix": "'suffix' is a legacy-completions field (there is no /v1/completions); leave it out",
}


def check_fields(body: dict[str, Any]) -> None:
    """A 400 for the first field of ``body`` that the server does not implement, naming it and what to do instead;
    fields whose value is the same as leaving them out (``presence_penalty: 0``, ``response_format: {"type":
    "text"}``, ``store: false``) pass."""
    for name, value in body.items():
        if value is None or name in IDENTIFIERS:
            continue
        if name in NEUTRAL:
            harmless, fix = NEUTRAL[name]
            if not harmless(value):
                raise bad_request(f"'{name}' = {json.dumps(value)[:80]} is not supported by vpo serve: {fix}", name,
                                  "unsupported_parameter")
        elif name in UNSUPPORTED:
            raise bad_request(f"'{name}' is not supported by vpo serve: {UNSUPPORTED[name]}", name,
                              "unsupported_parameter")
        elif name not in IMPLEMENTED:
            raise bad_request(f"Unrecognized request argument supplied: '{str(name)[:80]}'. vpo serve implements "
                              f"{', '.join(sorted(IMPLEMENTED - set(NEUTRAL)))}; leave the field out", str(name)[:80],
                              "unsupported_parameter")


def boolean(body: dict, name: str, default: bool = False) -> bool:
    """``body[name]`` as a bool (absent or null: ``default``), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {json.dumps(value)[:80]}", name)
    return value


def parse_tool_choice(body: dict, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools the model is given: ``tools`` with ``tool_choice`` absent or ``"auto"``, None with ``"none"``;
    ``"required"``, a named function, or ``parallel_tool_calls: false`` are a 400 (nothing constrains decoding)."""
    choice = body.get("tool_choice")
    if choice is not None and tools is None:
        raise bad_request("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
        if not body["parallel_tool_calls"]:
            raise bad_request("'parallel_tool_calls': false is not supported: vpo serve cannot stop the model from "
                              "writing several calls; leave it out (or true) and use the first call",
                              "parallel_tool_calls", "unsupported_parameter")
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        return None
    raise bad_request(f"'tool_choice' {json.dumps(choice)[:80]} is not supported: vpo serve does not constrain "
                      "decoding, so it cannot force a call; use \"auto\" (the model decides) or \"none\" (no tools "
                      "in the prompt)", "tool_choice", "unsupported_parameter")


def parse_chat_request(body: Any, settings: ServeSettings, models: dict[str, bool], default_model: str) \
        -> ChatRequest:
    """Validate a decoded chat-completions body against the served ``models`` (id -> uses the adapter)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    s = settings
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string (one of {', '.join(models)}), got {json.dumps(model)[:80]}",
                          "model")
    model = model or default_model
    if model not in models:
        raise APIError(404, f"The model {json.dumps(model)[:100]} does not exist. Served models: "
                            f"{', '.join(models)}", param="model", code="model_not_found")
    check_fields(body)
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad_request("'stream_options' must be {\"include_usage\": bool} (the only option vpo serve "
                              "implements)", "stream_options", "unsupported_parameter")
        include_usage = boolean(options, "include_usage")
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body["tools"]) if body.get("tools") is not None else None
    tools = parse_tool_choice(body, tools)
    logprobs = boolean(body, "logprobs")
    top_logprobs = integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true; send both, or leave 'top_logprobs' out",
                          "top_logprobs")
    n = integer(body, "n", 1, 1, s.max_n)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer(body, name, s.default_max_tokens, 1, s.max_tokens_limit,
                         f" (this server allows at most {s.max_tokens_limit})")
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_p = number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = integer(body, "top_k", 0, -1, TOP_K_MAX, " (-1 or 0: off)")
    ignore_eos = boolean(body, "ignore_eos")
    stops = parse_stop(body.get("stop"))
    seed = integer(body, "seed", None, *SEED_RANGE)  # validated even when ignored
    if s.ignore_seed:
        seed = None
    sampled = temperature > 0
    key = SamplingKey(temperature, top_p if sampled else 1.0, max(top_k, 0) if sampled else 0, max_tokens,
                      ignore_eos, models[model], seed)
    return ChatRequest(model, messages, n, key, stops, name, tools, (top_logprobs or 0) if logprobs else None,
                       stream, include_usage)
