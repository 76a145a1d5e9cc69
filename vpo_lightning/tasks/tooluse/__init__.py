"""The ToolRL-style tool-use prompt: a compact system message listing the tools and the answer format.

The model answers with a ``<think>...</think>`` block followed by a ``<tool_call>`` block holding one JSON object per
line, ``{"name": ..., "parameters": {...}}``, and/or a ``<response>...</response>`` text reply (used when no tool
fits). The rewards (:mod:`vpo_lightning.tasks.tooluse.calls`) parse exactly this format.

Tool documents come from BFCL, whose parameter schemas use Python-flavoured type names (``dict``, ``float``,
``tuple``, ``any``); :func:`to_json_schema` turns them into JSON-schema types for the prompt. Records keep the
original BFCL documents in ``tools`` so that BFCL's own checker can read them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# The system message lists the record's tools (ToolRL format), so the chat template must not list them again
# (vpo_lightning.tasks.prompt_lists_tools).
PROMPT_LISTS_TOOLS = True

# BFCL type name -> JSON-schema type name; None drops the "type" key ("any" has no JSON-schema type).
_TYPE_MAP: dict[str, str | None] = {"dict": "object", "float": "number", "tuple": "array", "any": None}

SYSTEM_HEADER = "You are a helpful assistant that can call tools to solve the user's task.\n\nAvailable tools:"

OUTPUT_FORMAT = """Answer format:
<think> your reasoning </think>
<tool_call>
{"name": "tool name", "parameters": {"argument name": value}}
(one JSON object per line, one line per call)
</tool_call>
<response> text reply to the user </response>

Always start with <think>. Then give <tool_call>, <response>, or both. Call only the tools listed, with the \
arguments the request gives. If no tool fits the request, call none and reply in <response>."""


def to_json_schema(schema: Any) -> Any:
    """Convert a BFCL parameter schema to JSON schema (``dict`` -> ``object``, ``float`` -> ``number`` ...).

    Only structural keys (``properties``, ``items``, ``additionalProperties``) are descended into, so parameter
    names and default values that happen to read ``"type"`` are left alone.

    Args:
        schema: a BFCL schema node (normally a dict); anything else is returned unchanged.

    Returns:
        A new schema node; the input is not modified.
    """
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            new_type = _TYPE_MAP.get(value, value)
            if new_type is not None:
                out[key] = new_type
        elif key == "properties" and isinstance(value, Mapping):
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = [to_json_schema(v) for v in value] if isinstance(value, list) else to_json_schema(value)
        else:
            out[key] = value
    return out


def describe_tool(index: int, tool: Mapping[str, Any]) -> str:
    """One numbered tool entry of the system message: name, description and JSON-schema parameters."""
    params = json.dumps(to_json_schema(tool.get("parameters", {})), ensure_ascii=False)
    return f"{index}. Name: {tool.get('name', '')}\nDescription: {tool.get('description', '')}\nParameters: {params}"


def build_system_prompt(tools: Sequence[Mapping[str, Any]], extra: str = "") -> str:
    """The ToolRL system message for ``tools``.

    Args:
        tools: tool documents (``name``, ``description``, ``parameters``), BFCL or JSON-schema typed.
        extra: further system instructions (e.g. a dataset's own system turn), appended at the end.

    Returns:
        The system message text.
    """
    parts = [SYSTEM_HEADER, *(describe_tool(i, t) for i, t in enumerate(tools, 1)), OUTPUT_FORMAT]
    if extra.strip():
        parts.append(extra.strip())
    return "\n\n".join(parts)


def build_messages(tools: Sequence[Mapping[str, Any]], turn: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """The complete prompt: the ToolRL system message, then the conversation turn's messages.

    System messages inside ``turn`` are merged into the single leading system message (chat templates accept one).

    Args:
        tools: the tool documents offered to the model.
        turn: the conversation so far, ``[{"role": ..., "content": ...}, ...]``, ending with a user message.

    Returns:
        Chat messages ``[{"role": "system", ...}, ..., {"role": "user", ...}]``.
    """
    extra = "\n\n".join(str(m.get("content", "")) for m in turn if m.get("role") == "system")
    rest = [{"role": str(m["role"]), "content": str(m.get("content", ""))} for m in turn if m.get("role") != "system"]
    return [{"role": "system", "content": build_system_prompt(tools, extra)}, *rest]


def format_answer(
    calls: Sequence[Mapping[str, Any]], think: str = "Let me work out the call.", response: str | None = None
) -> str:
    """Write an answer in the ToolRL format (used for tests, demos and reference answers).

    Args:
        calls: ``[{"name": ..., "parameters": {...}}, ...]``; empty for a text-only reply.
        think: the reasoning text.
        response: the reply text; defaults to a short refusal when there are no calls, omitted otherwise.

    Returns:
        ``<think>..</think>`` then the ``<tool_call>`` block and/or the ``<response>`` block.
    """
    parts = [f"<think> {think} </think>"]
    if calls:
        lines = [json.dumps({"name": c["name"], "parameters": c.get("parameters", {})}, ensure_ascii=False)
                 for c in calls]
        parts.append("<tool_call>\n" + "\n".join(lines) + "\n</tool_call>")
    if response is None and not calls:
        response = "None of the available tools can help with this request."
    if response is not None:
        parts.append(f"<response> {response} </response>")
    return "\n".join(parts)
