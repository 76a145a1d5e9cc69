"""The Python entry point, for notebooks and scripts: a dataset object and reward callables in, a trained run out.

    from vpo_lightning.api import train
    run = train("smollm2-135m", reward_funcs=[f1, f2], train_dataset=dataset, overrides={"trainer.max_steps": 50})

It runs ``vpo fit`` (the same code, defaults and outputs): the dataset is written to ``checkpoints/<run_name>/data/``
as JSONL and the settings to ``checkpoints/<run_name>/api_config.yaml``, so the saved ``config.yaml`` reproduces
the run from the command line as long as the reward functions stay importable. docs/COMING_FROM_TRL.md maps TRL's
``GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset)`` onto it.
"""

from __future__ import annotations

import json
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


def _nested(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{"rollout.group_size": 4}`` -> ``{"rollout": {"group_size": 4}}``."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


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
        ValueError: bad records, reward signatures or settings, with the message ``vpo fit`` would print.
    """
    from vpo_lightning.rewards import register_callable
    from vpo_lightning.training import cli
    from vpo_lightning.training.run_folders import held_files
    from vpo_lightning.training.runtime import prepare_process

    names = [f if isinstance(f, str) else register_callable(f) for f in reward_funcs]
    run_dir = Path(cli.OUTPUT_ROOT) / run_name
    flat = dict(overrides or {})
    if held_files(run_dir) and not flat.get("ckpt_path"):  # refuse before rewriting an existing run's inputs
        if not flat.get("overwrite"):
            raise ValueError(f"{run_dir} already holds a run ({', '.join(held_files(run_dir)[:4])}): give another "
                             "run_name, resume with overrides={'ckpt_path': 'last'}, or replace it with "
                             "overrides={'overwrite': True}")
        import shutil

        shutil.rmtree(run_dir)
    settings: dict[str, Any] = {
        "run_name": run_name,
        "seed_everything": 0,
        "model": {"model": {"name": model}},
        "data": {"train_files": [_write_dataset(train_dataset, run_dir / "data" / "train.jsonl")]},
        "rollout": {"rewards": names},
    }
    if eval_dataset is not None:
        settings["data"]["val_files"] = [_write_dataset(eval_dataset, run_dir / "data" / "val.jsonl")]
    _merge(settings, _nested(overrides or {}))
    run_dir.mkdir(parents=True, exist_ok=True)
    api_config = run_dir / "api_config.yaml"
    import yaml

    api_config.write_text(yaml.safe_dump(settings, sort_keys=False), encoding="utf-8")
    prepare_process()
    args = ["fit", *(["--config", str(config)] if config else []), "--config", str(api_config)]
    try:
        cli.run_lightning(args)
    finally:
        from vpo_lightning.training import progress

        progress.print_action_needed()
    return run_dir
