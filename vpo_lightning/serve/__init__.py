"""``vpo serve``: an OpenAI-compatible chat-completions server with request batching, in three layers.

- :mod:`~vpo_lightning.serve.openai_api`: OpenAI's request and error shapes, limits (:class:`ServeSettings`) and
  validation; every malformed request, and every field not implemented, is a 4xx, without HTTP or a model.
- :mod:`~vpo_lightning.serve.batching`: the worker thread that owns the model and schedules queued requests, in fair
  order, into decode groups that requests join and leave between steps (continuous batching).
- :mod:`~vpo_lightning.serve.continuous`: a decode group: prefill of joining requests, one token per row and step
  under each request's own sampling parameters (seeded ones with their own generator), log-probs and streamed tokens.
- :mod:`~vpo_lightning.serve.server`: the HTTP front end (Starlette routes on uvicorn's h11 connections: admission
  before tokenization, shares per client, the connection cap with idle eviction, ``/stats``), building a server from
  a config, and the ``vpo serve`` command. Its docstring gives the usage and what the HTTP stack guarantees.
"""

from vpo_lightning.serve.batching import BatchGenerator
from vpo_lightning.serve.continuous import DecodeGroup, Row, pick
from vpo_lightning.serve.jobs import Choice, Job, token_bytes
from vpo_lightning.serve.openai_api import (
    APIError,
    ChatRequest,
    SamplingKey,
    ServeSettings,
    check_fields,
    decode_json,
    parse_chat_request,
    parse_messages,
    parse_stop,
    parse_tools,
)
from vpo_lightning.serve.server import OpenAIServer, build_parser, build_server, load_for_serving, main

__all__ = [
    "APIError", "BatchGenerator", "ChatRequest", "Choice", "DecodeGroup", "Job", "OpenAIServer", "Row", "SamplingKey",
    "ServeSettings", "build_parser", "build_server", "check_fields", "decode_json", "load_for_serving", "main",
    "parse_chat_request", "parse_messages", "parse_stop", "parse_tools", "pick", "token_bytes",
]
