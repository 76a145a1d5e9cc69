"""The ``vpo`` console script: the one table of commands, ``vpo --help``, and dispatch. Imports nothing heavy.

``vpo --help`` answers in a fraction of a second because this module imports neither torch nor Lightning: each
command's module is imported only when that command runs. A command is listed with its summary in
:data:`COMMANDS`, or with the first line of its module's docstring (``"``vpo NAME ...``: what it does."``), read
from the source without importing it, so adding a command is one line in :data:`COMMANDS`.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import sys
from pathlib import Path

# name -> ("module:function" called with the arguments after the name, its line in `vpo --help`; None: the first
# line of the module's docstring). The one list of `vpo` commands, in the order `vpo --help` lists them.
COMMANDS: dict[str, tuple[str, str | None]] = {
    "fit": ("vpo_lightning.training.cli:fit", "train a policy with VPO (or a baseline estimator) from a YAML config"),
    "validate": ("vpo_lightning.training.cli:validate",
                 "score the validation prompts with a config (and a checkpoint) without training"),
    "sft": ("vpo_lightning.sft.cli:main", "supervised cold start: fine-tune a LoRA adapter on demonstrations"),
    "eval": ("vpo_lightning.commands.evaluate:main", None),
    "compare": ("vpo_lightning.commands.compare:main", None),
    "replicates": ("vpo_lightning.commands.replicates:main", None),
    "plan": ("vpo_lightning.commands.plan:main", None),
    "serve": ("vpo_lightning.serve:main", None),
    "search": ("vpo_lightning.commands.search:main", None),
    "export": ("vpo_lightning.commands.export:main", None),
}
# names users try, and what to run instead
RENAMED = {
    "test": "eval", "predict": "eval", "evaluate": "eval", "train": "fit", "grpo": "fit", "rl": "fit",
}


def _summary(module: str) -> str:
    """The first docstring line of ``module`` without importing it, less its ``vpo NAME ...``: prefix."""
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return ""
    doc = ast.get_docstring(ast.parse(Path(origin).read_text(encoding="utf-8"))) or ""
    line = doc.strip().splitlines()[0] if doc.strip() else ""
    if line.startswith("``") and "``: " in line:
        line = line.split("``: ", 1)[1]
    return line.replace("``", "").rstrip(".")


def commands() -> dict[str, str]:
    """Every subcommand with its one-line summary, in the order ``vpo --help`` lists them."""
    return {name: summary or _summary(target.split(":")[0]) for name, (target, summary) in COMMANDS.items()}


def top_help() -> str:
    table = commands()
    width = max(map(len, table))
    lines = ["usage: vpo COMMAND [options]     (vpo COMMAND --help: the options of one command)", "",
             "Post-train language models with Vector Policy Optimization (Lightning + transformers + peft).", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in table.items()]
    lines += ["", "Options use one style everywhere: --section.key value (or --section.key=value), e.g.",
              "  vpo fit --config configs/debug.yaml --rollout.group_size 4 --model.optim.lr 1e-4",
              "Coming from TRL: docs/COMING_FROM_TRL.md (GRPOConfig names, datasets, reward functions)."]
    return "\n".join(lines)


def unknown_command(name: str) -> str | None:
    """None for a known command, else the message for ``vpo NAME``."""
    table = commands()
    if name in table:
        return None
    if name in RENAMED:
        return f"vpo: error: there is no 'vpo {name}': use 'vpo {RENAMED[name]}' (vpo {RENAMED[name]} --help)"
    names = list(table)  # ties go to the command listed first (fit before sft for "fti")
    ratio, _, best = max((difflib.SequenceMatcher(None, name, c).ratio(), -i, c) for i, c in enumerate(names))
    hint = f" Did you mean {best!r}?" if ratio >= 0.6 else ""
    return f"vpo: error: unknown command {name!r}.{hint} Commands: {', '.join(table)} (vpo --help)"


def run(argv: list[str]) -> int | None:
    """Run the command ``argv[0]`` with the arguments after it (a leading option goes to LightningCLI as it is)."""
    if argv[0].startswith("-"):
        from vpo_lightning.training.cli import main as lightning_main

        return lightning_main(argv)
    module_name, function = COMMANDS[argv[0]][0].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            raise SystemExit(f"vpo {argv[0]}: not available in this version") from None
        raise
    code = getattr(module, function)(list(argv[1:]))
    if code:
        raise SystemExit(code)
    return code


def main(argv: list[str] | None = None) -> int | None:
    """Entry point of the ``vpo`` console script (and of ``python -m vpo_lightning``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(top_help())
        return 0
    if argv[0] == "--version":
        from vpo_lightning import __version__

        print(f"vpo-lightning {__version__}")
        return 0
    if not argv[0].startswith("-") and (message := unknown_command(argv[0])):
        print(message, file=sys.stderr)
        raise SystemExit(2)
    from vpo_lightning.training.progress import print_action_needed
    from vpo_lightning.training.runtime import prepare_process, tune_malloc

    prepare_process()
    tune_malloc()  # keep freed logits-sized buffers in the heap; VPO_MALLOC_TUNING=0 turns it off
    try:
        return run(argv)
    finally:
        print_action_needed()


if __name__ == "__main__":
    sys.exit(main())
