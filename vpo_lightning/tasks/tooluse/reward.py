"""The tool-use rewards ``[format, tool_name, arg_key, arg_value]`` of one answer (ToolRL style, VPO-SPEC section 8).

See :mod:`vpo_lightning.tasks.tooluse.calls` for how an answer's tool calls are parsed, aligned with BFCL's gold
calls and scored, and :mod:`vpo_lightning.tasks.tooluse` for the prompt and answer format.
"""

from __future__ import annotations

from vpo_lightning.rewards import register
from vpo_lightning.tasks.tooluse.calls import (
    arg_key_reward,
    arg_value_reward,
    format_reward,
    gold_calls,
    parse_output,
    tool_name_reward,
    tooluse_rewards,
)

register("format", descriptions=["Producing a well-formed structured response"], vector_repeats=True)(format_reward)
register("tool_name", descriptions=["Calling the right tools"], vector_repeats=True)(tool_name_reward)
register("arg_key", descriptions=["Filling in the right argument keys"], vector_repeats=True)(arg_key_reward)
register("arg_value", descriptions=["Using the right argument values"], vector_repeats=True)(arg_value_reward)

__all__ = ["arg_key_reward", "arg_value_reward", "format_reward", "gold_calls", "parse_output", "tool_name_reward",
           "tooluse_rewards"]
