"""BFCL's own checker on our answers: the accuracy a BFCL user reads (issue 51), beside the 4-dimension reward.

The decision is BFCL's: ``bfcl_eval.eval_checker.ast_eval.ast_checker`` (the installed ``bfcl-eval`` package, never
copied) judges an answer's calls against the record's possible answers and function descriptions, which our
records keep in BFCL's own formats (``ground_truth``, ``tools``; ``tasks/tooluse/build.py``). Two things are ours:
reading the calls out of the answer (``calls.parse_output``: every complete ``<tool_call>`` block, as the reward
reads them), and the irrelevance categories, which BFCL scores by "no call decoded" (its ``irrelevance`` rule: the
answer is correct when it makes no call). ``ast_checker`` imports ``bfcl_eval.constants.model_config``, whose model
registry imports every API client BFCL supports (anthropic, openai, ...), none of which a checker needs; while it
imports, that one module is replaced by a registry that rewrites no model's function names, and the real module is
restored afterwards (:func:`load_ast_checker`).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from vpo_lightning.tasks.tooluse.calls import parse_output

__all__ = ["MODEL", "bfcl_correct", "check_eval", "load_ast_checker", "main"]

MODEL = "vpo-lightning"  # the model name BFCL's checker is given (it only decides function-name rewriting)


class _NoRewrite(dict):
    """BFCL's model registry as the checker reads it: every model name keeps its function names (no dots to
    underscores), the way our prompts write them."""

    def __missing__(self, key: str) -> Any:
        return types.SimpleNamespace(underscore_to_dot=False)


@lru_cache(maxsize=1)
def _checker() -> tuple[Any, Any]:
    """``(ast_checker, Language)`` from the installed bfcl-eval, imported without its API clients."""
    name = "bfcl_eval.constants.model_config"
    saved = sys.modules.get(name)
    registry = types.ModuleType(name)
    registry.MODEL_CONFIG_MAPPING = _NoRewrite()  # type: ignore[attr-defined]
    sys.modules[name] = registry
    try:
        from bfcl_eval.constants.enums import Language
        from bfcl_eval.eval_checker.ast_eval import ast_checker as module
    except ImportError as err:
        raise ImportError(f"BFCL's checker needs the bfcl-eval package ({err}): pip install --no-deps bfcl-eval "
                          "(make setup installs it)") from err
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
    if not isinstance(module.MODEL_CONFIG_MAPPING, _NoRewrite):  # imported earlier with another registry
        module.MODEL_CONFIG_MAPPING = _NoRewrite(module.MODEL_CONFIG_MAPPING)
    return module.ast_checker, Language


def load_ast_checker() -> Any:
    """BFCL's ``ast_checker(func_description, model_output, possible_answer, language, test_category, model_name)``,
    with a registry that keeps every model's function names as given."""
    return _checker()[0]


def bfcl_correct(answer: str | None, record: Mapping[str, Any]) -> bool:
    """Whether BFCL's checker accepts ``answer`` (one candidate's text; None = not written: wrong) for ``record``.

    Irrelevance records (no possible answer): correct when the answer makes no call. Others: the calls of the
    answer's ``<tool_call>`` blocks, in BFCL's form ``[{name: {arg: value}}]``, judged by ``ast_checker`` for the
    record's category (simple, multiple, parallel, parallel_multiple). Never raises on model text.
    """
    if answer is None:  # no answer written (an unparsed chain slot): wrong in every category
        return False
    calls = [{name: dict(args)} for name, args in parse_output(answer).calls]
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


def check_eval(eval_dir: Path) -> dict[str, Any]:
    """BFCL's verdict on every answer of a `vpo eval` of tool use (``eval.json`` + ``samples.jsonl``).

    Per prompt: ``correct`` (one bool per answer, in eval.json's order: chain by chain), and over all prompts:
    ``checker_pass_at_k`` (some answer among k is correct: the unbiased estimator), ``best_answer_correct_at_k``
    (the answer with the highest f, the mean of the reward dimensions, among k drawn at random is correct, ties
    broken at random: what a user who keeps the best-scoring answer reads; exact,
    :func:`vpo_lightning.core.metrics.best_pick_correct_at_k`), and accuracy per category of answers (k = 1).
    """
    import torch

    from vpo_lightning.core.chains import parse_chain
    from vpo_lightning.core.estimators import get_estimator
    from vpo_lightning.core.metrics import best_pick_correct_at_k, pass_at_k_curve

    report = json.loads((eval_dir / "eval.json").read_text(encoding="utf-8"))
    lines = Path(report["data_file"]).read_text(encoding="utf-8").splitlines()  # the tool-use splits are JSONL
    records = {r.get("id"): r for r in map(json.loads, filter(str.strip, lines))}
    chains: dict[Any, list[str]] = {}
    for line in (eval_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        chains.setdefault(row["id"], []).append(row["text"])
    m, chained = int(report["m"]), get_estimator(report["estimator"]).chained
    prompts: list[dict[str, Any]] = []
    solved: list[Any] = []
    best_rows: list[Any] = []
    per_cat: dict[str, list[bool]] = {}
    for p in report["prompts"]:
        record = records[p["id"]]
        answers = [a for text in chains[p["id"]]
                   for a in (parse_chain(text, m, report["tag_family"]) if chained else [text])]
        correct = [bfcl_correct(a, record) for a in answers]
        f = [sum(r) / len(r) for r in p["rewards"]]  # [n]
        best_rows.append(torch.tensor([best_pick_correct_at_k(f, correct, k) for k in range(1, len(f) + 1)],
                                      dtype=torch.float64))  # [n]
        solved.append(torch.tensor(correct, dtype=torch.bool))  # [n]
        cat = str((record.get("meta") or {}).get("category"))
        per_cat.setdefault(cat, []).extend(correct)
        prompts.append({"id": p["id"], "category": cat, "correct": correct})
    return {"eval": str(eval_dir), "label": report.get("label"), "num_prompts": len(prompts),
            "checker_pass_at_k": [round(float(v), 6) for v in pass_at_k_curve(solved)],
            "best_answer_correct_at_k": [round(float(v), 6) for v in torch.stack(best_rows).mean(0)],
            "accuracy_by_category": {c: round(sum(v) / len(v), 6) for c, v in sorted(per_cat.items())},
            "prompts": prompts}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vpo_lightning.tasks.tooluse.bfcl_check EVAL_DIR``: writes EVAL_DIR/bfcl.json, prints a line."""
    p = argparse.ArgumentParser(description="BFCL's own checker on a `vpo eval` of tool use: writes bfcl.json")
    p.add_argument("eval_dir", type=Path)
    args = p.parse_args(argv)
    out = check_eval(args.eval_dir)
    (args.eval_dir / "bfcl.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    n = len(out["checker_pass_at_k"])
    print(f"{out['label']}: BFCL checker pass@1 {out['checker_pass_at_k'][0]:.3f}, pass@{n} "
          f"{out['checker_pass_at_k'][-1]:.3f}, best answer of {n} correct {out['best_answer_correct_at_k'][-1]:.3f}"
          f" ({out['num_prompts']} prompts) -> {args.eval_dir / 'bfcl.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
