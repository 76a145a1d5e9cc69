"""The Python entry point, for notebooks and scripts: a dataset object and reward callables in, a trained run out.

    from vpo_lightning.api import train
    run = train("smollm2-135m", reward_funcs=[f1, f2], train_dataset=dataset, overrides={"trainer.max_steps": 50})

It runs ``vpo fit`` (the same code, defaults and outputs): the dataset is written to ``checkpoints/<run_name>/data/``
as JSONL and the settings to ``checkpoints/<run_name>/api_config.yaml``, so the saved ``config.yaml`` reproduces
the run from the command line (``vpo fit --config checkpoints/<run_name>/config.yaml --run_name other``). Reward
functions defined in an importable module are named by their dotted path; those defined in a notebook or a script
(``__main__``) are written, with the imports and constants they use, to ``checkpoints/<run_name>/api_rewards.py``
and named ``api_rewards.<function>`` (dotted paths resolve beside the config). A bad override raises ValueError
naming the key and the closest valid one. docs/COMING_FROM_TRL.md maps TRL's
``GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset)`` onto it.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vpo_lightning.training.records import read_records


def _write_dataset(dataset: Any, path: Path) -> str:
    """A ``datasets.Dataset``, a list of dicts or a path -> a data source ``vpo fit`` reads (a path string)."""
    if isinstance(dataset, (str, Path)):
        return str(dataset)
    path.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(dataset, "to_json") and hasattr(dataset, "column_names"):  # datasets.Dataset
        dataset.to_json(str(path), lines=True, force_ascii=False)
    elif isinstance(dataset, Iterable) and not isinstance(dataset, Mapping):
        rows = list(dataset)
        if not all(isinstance(r, Mapping) for r in rows):
            raise ValueError("train_dataset: give a datasets.Dataset, a list of dicts or a file path")
        path.write_text("".join(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    else:
        raise ValueError(f"train_dataset: give a datasets.Dataset, a list of dicts or a file path, got "
                         f"{type(dataset).__name__}")
    read_records(path)  # bad records fail here, naming the row, before any model is loaded
    return str(path)


REWARDS_MODULE = "api_rewards"  # checkpoints/<run_name>/api_rewards.py: the rewards defined in __main__
log = logging.getLogger(__name__)


def _global_names(code: Any) -> set[str]:
    """Names a code object (and the functions nested in it) looks up: globals and attribute names alike."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def _literal(value: Any) -> bool:
    """Whether ``repr(value)`` reads back as ``value`` (numbers, strings, and containers of them)."""
    try:
        text = repr(value)
        return len(text) < 100_000 and ast.literal_eval(text) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False


def rewards_source(fns: Sequence[Callable[..., Any]]) -> str:
    """The source of a module that defines ``fns`` (functions of ``__main__``) as they run here: their code, the
    other ``__main__`` functions they call, and the modules, importable functions and literal constants they use.
    ValueError with the reason when that cannot be written (no source, a global of another kind)."""
    from vpo_lightning.rewards import importable_name

    imports: list[str] = []
    constants: list[str] = []
    bodies: list[str] = []
    done: set[str] = set()
    pending = list(fns)
    while pending:
        fn = pending.pop(0)
        if fn.__name__ in done:
            continue
        done.add(fn.__name__)
        try:
            bodies.append(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError) as err:
            raise ValueError(f"the source of {fn.__name__!r} is not available ({err})") from None
        for name in sorted(_global_names(fn.__code__)):
            if name not in fn.__globals__ or name in done:
                continue  # a builtin or an attribute name
            value = fn.__globals__[name]
            if inspect.ismodule(value):
                imports.append(f"import {value.__name__}" if value.__name__ == name else
                               f"import {value.__name__} as {name}")
            elif inspect.isfunction(value) and value.__module__ == "__main__" and value.__name__ == name:
                pending.append(value)
            elif callable(value) and (path := importable_name(value)) and "." not in value.__qualname__:
                module, attr = path.rsplit(".", 1)
                imports.append(f"from {module} import {attr}" + (f" as {name}" if attr != name else ""))
            elif _literal(value):
                done.add(name)
                constants.append(f"{name} = {value!r}")
            else:
                raise ValueError(f"{fn.__name__!r} uses the global {name!r} ({type(value).__name__}), which cannot "
                                 "be written to a file")
    header = '"""Reward functions of a vpo_lightning.api.train run, written from the notebook or script (__main__)."""'
    source = "\n\n".join([header, "\n".join(dict.fromkeys(imports)), "\n".join(constants), *bodies]) + "\n"
    namespace: dict[str, Any] = {}
    try:  # it must define every function: imports resolve, decorators exist
        exec(compile(source, REWARDS_MODULE + ".py", "exec"), namespace)  # noqa: S102 - the user's own code
    except Exception as err:  # noqa: BLE001 - any failure means the file would not work from the command line
        raise ValueError(f"the written module does not run ({type(err).__name__}: {err})") from None
    for fn in fns:  # the source found must be the code that runs here (a stale or wrong file would differ)
        copy = namespace.get(fn.__name__)
        if getattr(copy, "__code__", None) is None or copy.__code__.co_code != fn.__code__.co_code:
            raise ValueError(f"the source found for {fn.__name__!r} is not the code that runs")
    return source


def _reward_names(reward_funcs: Sequence[Callable[..., Any] | str], run_dir: Path) -> list[str]:
    """Register ``reward_funcs``; the names the config uses. Functions of ``__main__`` go to ``api_rewards.py``
    in the run folder (named ``api_rewards.<function>``) when :func:`rewards_source` can write them."""
    from vpo_lightning.rewards import importable_name, register_callable
    from vpo_lightning.training.progress import action_needed

    local = [f for f in reward_funcs if not isinstance(f, str) and importable_name(f) is None
             and getattr(f, "__name__", "<lambda>") != "<lambda>"]
    written: set[int] = set()
    if local:
        try:
            source = rewards_source(local)
        except ValueError as err:
            names = ", ".join(repr(f.__name__) for f in local)
            action_needed(f"the saved config.yaml names the reward(s) {names} by their bare name, so it cannot be run "
                          f"from the command line: {err}. Define them in a module (my_rewards.py) and import them "
                          "from there")
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / f"{REWARDS_MODULE}.py").write_text(source, encoding="utf-8")
            written = {id(f) for f in local}
    return [f if isinstance(f, str) else
            register_callable(f, f"{REWARDS_MODULE}.{f.__name__}" if id(f) in written else None)
            for f in reward_funcs]


def _check_overrides(overrides: Mapping[str, Any]) -> None:
    """ValueError for an override key ``vpo fit`` does not know, with the closest keys (TRL's names mapped)."""
    from vpo_lightning.training import config_check
    from vpo_lightning.training.config import fit_parser

    leaves, sections = config_check.known_keys(fit_parser())
    bad = [config_check.unknown_key(k, "overrides", leaves | sections).message()
           for k in overrides if not config_check.is_known(k, leaves, sections)]
    if bad:
        raise ValueError("; ".join(bad) + " (every key: vpo fit --help)")


def train(model: str, reward_funcs: Sequence[Callable[..., Any] | str], train_dataset: Any, *,
          eval_dataset: Any = None, config: str | Path | None = None, run_name: str = "vpo",
          overrides: Mapping[str, Any] | None = None) -> Path:
    """Train with VPO from Python; returns the run folder (``checkpoints/<run_name>``).

    Args:
        model: a built-in alias (``smollm2-135m``), a local folder or a Hub id, as ``model.model.name``.
        reward_funcs: reward callables, TRL's ``f(prompts, completions, **kwargs) -> list[float]`` or ours
            ``f(candidate, sample) -> float``, and/or registered names or dotted paths; one dimension each.
        train_dataset: a ``datasets.Dataset``, a list of dicts (TRL's ``prompt`` formats or ``messages``), or a
            path ``vpo fit`` reads (JSONL, JSON, Parquet, CSV, a ``save_to_disk`` folder).
        eval_dataset: validation prompts, in the same forms (optional).
        config: a YAML to start from (e.g. ``configs/debug.yaml``); the arguments here override it.
        run_name: outputs go to ``checkpoints/<run_name>/``.
        overrides: dotted keys of ``vpo fit`` (``{"rollout.group_size": 4, "trainer.max_steps": 50}``);
            ``{"ckpt_path": "last"}`` resumes the run, ``{"overwrite": True}`` replaces it (an existing run folder is
            refused otherwise, as by ``vpo fit``).

    Raises:
        ValueError: bad records, reward signatures, override keys or values, with the message ``vpo fit`` would
            print (never SystemExit).
    """
    from vpo_lightning.training import cli
    from vpo_lightning.training.config import apply_overrides
    from vpo_lightning.training.config_keys import rename_old_keys
    from vpo_lightning.training.run_folders import held_files
    from vpo_lightning.training.runtime import prepare_process

    flat = rename_old_keys(overrides or {}, "overrides")  # a renamed key is read as its new one
    _check_overrides(flat)
    run_dir = Path(cli.OUTPUT_ROOT) / run_name
    if held_files(run_dir) and not flat.get("ckpt_path"):  # refuse before rewriting an existing run's inputs
        if not flat.get("overwrite"):
            raise ValueError(f"{run_dir} already holds a run ({', '.join(held_files(run_dir)[:4])}): give another "
                             "run_name, resume with overrides={'ckpt_path': 'last'}, or replace it with "
                             "overrides={'overwrite': True}")
        import shutil

        shutil.rmtree(run_dir)
    names = _reward_names(reward_funcs, run_dir)
    settings: dict[str, Any] = {
        "run_name": run_name,
        "seed_everything": 0,
        "model": {"model": {"name": model}},
        "data": {"train_files": [_write_dataset(train_dataset, run_dir / "data" / "train.jsonl")]},
        "rollout": {"rewards": names},
    }
    if eval_dataset is not None:
        settings["data"]["val_files"] = [_write_dataset(eval_dataset, run_dir / "data" / "val.jsonl")]
    settings = apply_overrides(settings, flat)
    run_dir.mkdir(parents=True, exist_ok=True)
    api_config = run_dir / "api_config.yaml"
    import yaml

    api_config.write_text(yaml.safe_dump(settings, sort_keys=False), encoding="utf-8")
    prepare_process()
    args = ["fit", *(["--config", str(config)] if config else []), "--config", str(api_config)]
    class NotebookCLI(cli.VPOCLI):
        raise_parse_errors = True  # a bad value raises ValueError: a notebook's flow goes on

    try:
        cli.run_lightning(args, cli_class=NotebookCLI)
    finally:
        from vpo_lightning.training import progress

        progress.print_action_needed()
    return run_dir
