"""Subcommands beside LightningCLI's fit/validate/test: ``vpo eval|compare|plan|serve|search|export ...``.

Each lives in its own module with a ``main(argv: list[str]) -> int`` and is imported only when used.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMMANDS = {
    "eval": "vpo_lightning.evaluate",
    "compare": "vpo_lightning.compare",
    "plan": "vpo_lightning.plan",
    "serve": "vpo_lightning.serve",
    "search": "vpo_lightning.search",
    "export": "vpo_lightning.export",
}


def report_error(command: str, err: BaseException) -> int:
    """Print ``<command>: error: ...`` for bad input and return exit code 2; with ``VPO_DEBUG`` set, re-raise."""
    if os.environ.get("VPO_DEBUG"):
        raise err
    print(f"{command}: error: {err}\n(set VPO_DEBUG=1 for the full traceback)", file=sys.stderr)
    return 2


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


def main(argv: list[str]) -> int:
    """Dispatch ``argv[0]`` to its module's ``main(argv[1:])``."""
    name, rest = argv[0], argv[1:]
    try:
        module = importlib.import_module(COMMANDS[name])
    except ModuleNotFoundError as err:
        if err.name == COMMANDS[name]:
            raise SystemExit(f"vpo {name}: not available in this version") from None
        raise
    code = module.main(rest)
    if code:
        raise SystemExit(code)
    return 0
