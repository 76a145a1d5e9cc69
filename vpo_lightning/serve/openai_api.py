"""The OpenAI chat-completions API of ``vpo serve``: errors, limits, and request validation (no HTTP, no model).

Every malformed request becomes an :class:`APIError` with a 4xx status and OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``), never a 500:

- the body is decoded by :func:`decode_json` in linear time, which refuses nesting deeper than ``MAX_JSON_DEPTH``
  (checked on the parsed value; the parser's own ``RecursionError`` is a 400 too), integers longer than
  ``MAX_INT_DIGITS`` digits (Python refuses to convert more than 4300 and a long one is never a valid value here), and
  ``NaN``/``Infinity``/overflowing floats anywhere in the body (``temperature: NaN`` would otherwise compare false
  against every bound and pass);
- :func:`parse_chat_request` checks every field it uses: types (``model`` must be a string), ranges (``n``,
  ``max_tokens``, ``temperature``, ``top_p``, ``top_k``) and the seed range torch accepts; a temperature below
  ``MIN_TEMPERATURE`` (1e-5) is greedy decoding, as in vLLM.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
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
        max_connections: open connections at once (default ``max(64, 4 * max_concurrency)``). When all are taken,
            the connection idle the longest (waiting for a request, or still sending one) is closed to make room;
            only when every connection has a request being answered does a new one get 503.
        idle_timeout_s: a connection silent for this long (between requests, or mid-request) is closed.
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
    """A validated chat-completions request (before tokenization)."""

    model: str
    messages: list[dict[str, str]]
    n: int
    key: SamplingKey
    stops: tuple[str, ...]
    max_tokens_param: str  # "max_tokens" or "max_completion_tokens", for error messages


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


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """Validate OpenAI chat messages into ``[{"role", "content"}]`` strings (text content parts are joined)."""
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
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"{param}.content: only text parts are supported", f"{param}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"{param}.content must be a string", f"{param}.content")
        out.append({"role": ROLES[role], "content": content})
    return out


def parse_stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in stops if s)


# Fields of OpenAI's API that vpo serve does not implement: a request that sets one (to anything but its "off" value)
# gets a 400 naming it, instead of an answer that silently ignores it. name -> (is it off?, what to say)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "tools": (lambda v: v in (None, []), "tool calling is not implemented by vpo serve"),
    "functions": (lambda v: v in (None, []), "function calling is not implemented by vpo serve"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calling is not implemented by vpo serve"),
    "function_call": (lambda v: v in (None, "none", "auto"), "function calling is not implemented by vpo serve"),
    "logprobs": (lambda v: v in (None, False), "log-probabilities are not returned by vpo serve"),
    "top_logprobs": (lambda v: v in (None, 0), "log-probabilities are not returned by vpo serve"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "structured output (response_format) is not implemented by vpo serve; only {'type': 'text'}"),
    "logit_bias": (lambda v: v in (None, {}), "logit_bias is not implemented by vpo serve"),
    "presence_penalty": (lambda v: v in (None, 0), "presence_penalty is not implemented by vpo serve; leave it 0"),
    "frequency_penalty": (lambda v: v in (None, 0), "frequency_penalty is not implemented by vpo serve; leave it 0"),
}


def check_unsupported(body: dict) -> None:
    """A 400 naming the first field of :data:`UNSUPPORTED` that ``body`` sets."""
    for name, (off, why) in UNSUPPORTED.items():
        value = body.get(name)
        try:
            is_off = bool(off(value))
        except TypeError:  # an unhashable or odd value: it is set
            is_off = False
        if not is_off:
            raise bad_request(f"'{name}': {why} (got {json.dumps(value)[:80]}); remove it from the request", name,
                              code="unsupported_parameter")


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
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    if stream:
        raise bad_request("streaming is not supported by vpo serve; set stream=false", "stream")
    check_unsupported(body)
    messages = parse_messages(body.get("messages"))
    n = integer(body, "n", 1, 1, s.max_n)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer(body, name, s.default_max_tokens, 1, s.max_tokens_limit,
                         f" (this server allows at most {s.max_tokens_limit})")
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_p = number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = integer(body, "top_k", 0, -1, TOP_K_MAX, " (-1 or 0: off)")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be a boolean", "ignore_eos")
    stops = parse_stop(body.get("stop"))
    seed = integer(body, "seed", None, *SEED_RANGE)  # validated even when ignored
    if s.ignore_seed:
        seed = None
    sampled = temperature > 0
    key = SamplingKey(temperature, top_p if sampled else 1.0, max(top_k, 0) if sampled else 0, max_tokens,
                      ignore_eos, models[model], seed)
    return ChatRequest(model, messages, n, key, stops, name)
