"""What every ``vpo`` command shares, whatever its layer: one flag style and one way to answer bad input.

Plain Python (no torch, no Lightning), so ``vpo fit``/``vpo sft`` (``training/cli.py``, ``sft/cli.py``), the
commands beside them (``commands/``) and ``vpo serve`` all import it: :func:`parse_args` and
:func:`underscored` (``--max-prompts`` is ``--max_prompts``), :func:`report_error` (``<command>: error: ...``, exit
code 2) and :func:`run_command` (a command that writes a JSON report).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def report_error(command: str, err: BaseException) -> int:
    """Print ``<command>: error: ...`` for bad input and return exit code 2; with ``VPO_DEBUG`` set, re-raise."""
    if os.environ.get("VPO_DEBUG"):
        raise err
    print(f"{command}: error: {err}\n(set VPO_DEBUG=1 for the full traceback)", file=sys.stderr)
    return 2


def underscored(token: str) -> str:
    """``--run-name=x`` -> ``--run_name=x``: an option's key with dashes as underscores (its value untouched); other
    tokens as they are. The keys of `vpo fit` and `vpo sft` are Python names, which never hold a dash."""
    if not token.startswith("--") or len(token) < 3:
        return token
    key, eq, value = token[2:].partition("=")
    return "--" + key.replace("-", "_") + eq + value


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args`` with the one flag style of every ``vpo`` command: ``--max_prompts`` and
    ``--max-prompts`` are the same option, and where the command takes ``--set KEY=VALUE``, a dotted
    ``--section.key VALUE`` (as in ``vpo fit``) is the same override."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for action in list(parser._actions):
        for opt in action.option_strings:
            if opt.startswith("--"):
                for alias in (opt.replace("-", "_").replace("__", "--", 1), "--" + opt[2:].replace("_", "-")):
                    parser._option_string_actions.setdefault(alias, action)
    if "--set" in parser._option_string_actions:
        out, i = [], 0
        while i < len(argv):
            key, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
            if "." in key and f"--{key}" not in parser._option_string_actions:
                if not eq and i + 1 < len(argv):
                    value, i = argv[i + 1], i + 1
                out += ["--set", f"{key}={value}"]
            else:
                out.append(argv[i])
            i += 1
        argv = out
    return parser.parse_args(argv)


def run_command(command: str, args: Any, run: Callable[[Any], Path], report_name: str,
                summary: Callable[[dict[str, Any]], str]) -> int:
    """Run a subcommand's ``run(args)`` (which returns its output folder), then print ``summary`` of the JSON report
    it wrote there and where it is; bad input gets a one-line error and exit code 2 (:func:`report_error`)."""
    try:
        out = run(args)
    except (ValueError, FileNotFoundError, ImportError, OSError) as err:
        return report_error(command, err)
    print(summary(json.loads((out / report_name).read_text())))
    print(f"wrote {out / report_name}")
    return 0
