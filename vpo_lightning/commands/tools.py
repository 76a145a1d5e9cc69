"""What the commands beside ``vpo fit`` share: one flag style (:func:`parse_args`) and one way to finish
(:func:`run_command`).

Each command lives in its own module with a ``main(argv: list[str]) -> int``, listed in
:data:`vpo_lightning.launcher.COMMANDS` and imported only when used.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vpo_lightning.training.runtime import report_error


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
