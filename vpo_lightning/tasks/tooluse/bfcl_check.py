"""BFCL's own checker on our answers: the accuracy a BFCL user reads (issue 51), beside the 4-dimension reward.

The decision is BFCL's: ``bfcl_eval.eval_checker.ast_eval.ast_checker`` (the installed ``bfcl-eval`` package, never
copied) judges an answer's calls against the record's possible answers and function descriptions, which our
records keep in BFCL's own formats (``ground_truth``, ``tools``; ``tasks/tooluse/build.py``). Two things are ours:
reading the calls out of the answer (``calls.parse_output``: every complete ``<tool_call>`` block, as the reward
reads them), and the irrelevance categories, which BFCL scores by "no call decoded" (its ``irrelevance`` rule: the
answer is correct when it makes no call). ``ast_checker`` imports ``bfcl_eval.constants.model_config``, whose model
registry imports every API client BFCL supports (anthropic, openai, ...), none of which a checker needs; while it
imports, that one module is replaced by a registry holding only ``MODEL`` (no name rewriting), and the real module
is restored afterwards.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from vpo_lightning.tasks.tooluse.calls import parse_output

__all__ = ["MODEL", "bfcl_correct"]

MODEL = "vpo-lightning"  # the model name BFCL's checker is given (it only decides function-name rewriting)


@lru_cache(maxsize=1)
def _checker() -> tuple[Any, Any]:
    """``(ast_checker, Language)`` from the installed bfcl-eval, imported without its API clients."""
    name = "bfcl_eval.constants.model_config"
    saved = sys.modules.get(name)
    registry = types.ModuleType(name)
    registry.MODEL_CONFIG_MAPPING = {MODEL: types.SimpleNamespace(underscore_to_dot=False)}  # type: ignore[attr-defined]
    sys.modules[name] = registry
    try:
        from bfcl_eval.constants.enums import Language
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    except ImportError as err:
        raise ImportError(f"BFCL's checker needs the bfcl-eval package ({err}): pip install --no-deps bfcl-eval "
                          "(make setup installs it)") from err
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
    return ast_checker, Language


def bfcl_correct(answer: str | None, record: Mapping[str, Any]) -> bool:
    """Whether BFCL's checker accepts ``answer`` (one candidate's text; None = unparsed) for ``record``.

    Irrelevance records (no possible answer): correct when the answer makes no call. Others: the calls of the
    answer's ``<tool_call>`` blocks, in BFCL's form ``[{name: {arg: value}}]``, judged by ``ast_checker`` for the
    record's category (simple, multiple, parallel, parallel_multiple). Never raises on model text.
    """
    calls = [] if answer is None else [{name: dict(args)} for name, args in parse_output(answer).calls]
    category = str((record.get("meta") or {}).get("category", ""))
    gold = record.get("ground_truth") or []
    if "irrelevance" in category or not gold:
        return not calls
    if not calls:
        return False
    ast_checker, language = _checker()
    try:
        result = ast_checker(list(record["tools"]), calls, list(gold), language.PYTHON, category, MODEL)
    except Exception:  # noqa: BLE001 - the checker on arbitrary model output: an error is a wrong answer
        return False
    return bool(result.get("valid", False))
