"""``vpo serve``: an OpenAI-compatible chat-completions server with request batching, in three layers.

- :mod:`~vpo_lightning.serve.openai_api`: OpenAI's request and error shapes, limits (:class:`ServeSettings`) and
  validation; every malformed request, and every field not implemented, is a 4xx, without HTTP or a model.
- :mod:`~vpo_lightning.serve.batching`: the worker thread that owns the model and batches queued requests with equal
  sampling parameters into one ``generate`` call; it records log-probs and streams tokens (:class:`StepRecorder`).
- :mod:`~vpo_lightning.serve.server`: the HTTP front end (Starlette routes on uvicorn's h11 connections: admission
  before tokenization, shares per client, the connection cap with idle eviction, ``/stats``), building a server from
  a config, and the ``vpo serve`` command. Its docstring gives the usage and what the HTTP stack guarantees.
"""

from vpo_lightning.serve.batching import BatchGenerator, Choice, Job, StepRecorder, StopOnStrings, token_bytes
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
    "APIError", "BatchGenerator", "ChatRequest", "Choice", "Job", "OpenAIServer", "SamplingKey",
    "ServeSettings", "StepRecorder", "StopOnStrings", "build_parser", "build_server", "check_fields", "decode_json",
    "load_for_serving", "main", "parse_chat_request", "parse_messages", "parse_stop", "parse_tools", "token_bytes",
]
