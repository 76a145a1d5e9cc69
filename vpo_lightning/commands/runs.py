"""Run plumbing shared by ``vpo eval``, ``vpo search``, ``vpo serve`` and ``vpo plan``.

One place for: a run's TensorBoard scalars (:func:`read_scalars`, also used by benchmarks/); the
``--config/--ckpt/--adapter/--set`` argument group; finding and loading a `vpo fit` config (with OmegaConf
interpolation, as ``vpo fit`` parses it: ``parser_mode="omegaconf"``); the settings dataclasses built from it
(:class:`RunSettings`, every default taken from the code, never re-typed); and loading the model those settings
describe: the base model, base + a PEFT adapter, or base + the LoRA weights of a `vpo fit` checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vpo_lightning.training.config import apply_overrides, get
from vpo_lightning.training.config_keys import rename_old_keys

log = logging.getLogger(__name__)


# ---- command line ---------------------------------------------------------------------------------------------
def add_run_args(parser: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    """Add ``--config``, ``--ckpt`` / ``--adapter`` (mutually exclusive) and, with ``overrides``, ``--set``."""
    parser.add_argument("--config", help="the YAML used by `vpo fit` (default: config.yaml beside --ckpt/--adapter)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--ckpt", help="a Lightning .ckpt written by `vpo fit` (adapter weights under policy.*)")
    weights.add_argument("--adapter", help="a PEFT adapter directory (checkpoints/<run>/adapters/<name>)")
    if overrides:
        parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                            help="dotted config override, repeatable (e.g. rollout.sampling.max_new_tokens=64)")


# ---- configuration --------------------------------------------------------------------------------------------
def find_config(config: str | None, ckpt: str | None = None, adapter: str | None = None) -> Path:
    """``config``, else the ``config.yaml`` that `vpo fit` saved beside the checkpoint or adapter."""
    if config:
        return Path(config)
    weights = ckpt or adapter
    if weights:
        for folder in (Path(weights).parent, Path(weights).parent.parent):
            if (folder / "config.yaml").is_file():
                return folder / "config.yaml"
    raise ValueError("give --config (the YAML used by `vpo fit`); no config.yaml found beside the weights")


def load_config(path: str | Path, overrides: list[str] | None = None, *, require: tuple[str, ...] = ()) -> dict:
    """Read a `vpo fit` YAML the way ``vpo fit`` does (OmegaConf, ``${...}`` interpolation resolved; a ``fit:``
    wrapper is accepted; renamed keys read as their new ones, in the file and in the overrides apart, so a new key
    given as an old one still overrides the file), apply ``KEY=VALUE`` dotted overrides and return a plain dict.

    Args:
        path: the YAML file.
        overrides: ``["rollout.sampling.max_new_tokens=64", ...]``.
        require: top-level sections that must be present (e.g. ``("rollout",)``).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {str(path)!r}: no such file")
    bad = [o for o in overrides or [] if "=" not in o]
    if bad:
        raise ValueError(f"--set expects KEY=VALUE, got {bad[0]!r} (e.g. model.optim.micro_batch_size=4)")
    try:
        cfg = OmegaConf.load(path)
        if not OmegaConf.is_dict(cfg):
            raise ValueError(f"--config {str(path)!r}: expected a YAML mapping")
        if "fit" in cfg and OmegaConf.is_dict(cfg["fit"]):
            cfg = cfg["fit"]
        data = apply_overrides(rename_old_keys(OmegaConf.to_container(cfg, resolve=False), str(path)),
                               rename_old_keys(parse_overrides(overrides or []), "--set"))  # renamed keys: new
        out = OmegaConf.to_container(OmegaConf.create(data), resolve=True)  # ${...} read after the overrides
    except OmegaConfBaseException as err:
        raise ValueError(f"--config {str(path)!r}: {err}") from None
    missing = [s for s in require if s not in out]
    if missing:
        raise ValueError(f"config {str(path)!r} has no {missing[0]}: section (is it a `vpo fit` config?)")
    from vpo_lightning.rewards import add_config_dir

    add_config_dir(path.parent)  # dotted reward paths resolve beside the config too, as in `vpo fit`
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["rollout.group_size=4"]`` -> ``{"rollout.group_size": 4}``: each value read as YAML, as OmegaConf reads a
    dotlist (``${...}`` kept for the config's interpolation)."""
    from omegaconf import OmegaConf

    out = {}
    for item in items:
        key = item.partition("=")[0]
        out[key] = get(OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False), key)
    return out


def default_of(fn: Any, name: str) -> Any:
    """The default of parameter ``name`` of ``fn`` (a class: its ``__init__``), read from the code."""
    return inspect.signature(fn).parameters[name].default


@dataclass
class RunSettings:
    """The settings of a `vpo fit` run, instantiated from its config with the code's defaults filled in."""

    model: Any  # vpo_lightning.generation.models.ModelSettings
    optim: Any  # vpo_lightning.training.module.OptimSettings
    loss: Any  # vpo_lightning.training.module.LossSettings
    sampling: Any  # vpo_lightning.generation.engines.SamplingSettings
    batch_size: int  # data.batch_size
    max_prompt_tokens: int  # data.max_prompt_tokens (0 = unknown)
    group_size: int  # rollout.group_size
    engine: str  # the engine's class name
    engine_args: dict[str, Any] = field(default_factory=dict)  # its init_args, defaults filled in
    accelerator: str = "auto"
    engine_class: type | None = None  # the engine's class (tell engines apart by it, not by name)


def run_config(cfg: dict, source: str = "the config", estimator: str | None = None) -> Any:
    """``cfg`` parsed by the ``vpo fit`` parser (:func:`vpo_lightning.training.config.resolve`): a
    :class:`~vpo_lightning.training.config.RunConfig` whose every value is typed and defaulted as `vpo fit` does;
    ``estimator`` overrides ``rollout.estimator`` (``--estimator``)."""
    from vpo_lightning.training.config import resolve

    return resolve(cfg, source, {"rollout.estimator": estimator} if estimator else None)


def run_settings(cfg: dict | Any) -> RunSettings:
    """The settings dataclasses of ``cfg`` (``model.model``, ``model.optim``, ``model.loss``, ``rollout.sampling``)
    and the data, rollout and engine knobs, parsed and instantiated as `vpo fit` does (:func:`run_config`); no
    module or callback is built."""
    from vpo_lightning.training.config import RunConfig

    run = cfg if isinstance(cfg, RunConfig) else run_config(cfg)
    engine = run.engine_class()
    return RunSettings(
        model=run.model_settings(), optim=run.instantiate("model.optim"), loss=run.instantiate("model.loss"),
        sampling=run.sampling(),
        batch_size=int(run.value("data.batch_size")), max_prompt_tokens=int(run.value("data.max_prompt_tokens")),
        group_size=int(run.value("rollout.group_size")), engine=engine.__name__, engine_args=run.engine_args(),
        accelerator=str(run.value("trainer.accelerator")), engine_class=engine,
    )


# ---- the model ------------------------------------------------------------------------------------------------
def pick_device(name: str) -> torch.device:
    """``auto`` = cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def event_files(run_dir: Path, *, recursive: bool = False) -> list[Path]:
    """The run's TensorBoard event files (``events.out.tfevents.*``), oldest first (by mtime, then name)."""
    found = run_dir.rglob("events.out.tfevents.*") if recursive else run_dir.glob("events.out.tfevents.*")
    return sorted(found, key=lambda f: (f.stat().st_mtime, f.name))


def read_scalars(run_dir: Path, *, recursive: bool = False) -> dict[str, dict[int, float]]:
    """Every scalar of a run's event files as ``{tag: {step: value}}``; where a step was logged twice (a resumed
    run), the later file's value wins. Empty when there are no event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for f in event_files(run_dir, recursive=recursive):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, {}).update((e.step, e.value) for e in acc.Scalars(tag))
    return out



def load_ckpt_policy(settings: Any, ckpt: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """Rebuild the policy from settings and load the checkpoint's trainable weights (``policy.*`` keys)."""
    from vpo_lightning.generation.models import load_base_model, wrap_lora

    model = load_base_model(settings, device)
    if settings.lora.enabled:
        model = wrap_lora(model, settings.lora)
    state = {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}
    if not state:
        raise ValueError("the checkpoint holds no policy.* weights (not written by `vpo fit`?)")
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatch: another rank or model
        raise ValueError(f"checkpoint weights do not fit the model built from the config: {err}") from None
    if result.unexpected_keys:
        raise ValueError(f"checkpoint weights do not fit the model built from the config (e.g. "
                         f"{result.unexpected_keys[0]!r}): check model.model.name and model.model.lora")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(state))
    if settings.lora.enabled and missing:
        raise ValueError(f"checkpoint lacks adapter weights such as {missing[0]!r}: check model.model.lora")
    return model


def _model_settings(raw: dict[str, Any]) -> Any:
    """``model.model`` typed and defaulted by the ``vpo fit`` parser (training/config.py), as `vpo fit` builds it."""
    from vpo_lightning.training.config import resolve

    return resolve({"model": {"model": raw}}, "model.model").model_settings()


def load_model(cfg: dict[str, Any], device: torch.device, ckpt: str | None = None,
               adapter: str | None = None) -> tuple[Any, Any, dict]:
    """Load the policy a config describes: the base model, base + PEFT ``adapter``, or base + the LoRA weights of a
    `vpo fit` ``ckpt`` (whose trained model name and LoRA shape win over the config's).

    Returns:
        ``(model, ModelSettings, info)``; ``info`` names the weights and their sha256 (for eval.json).
    """
    from vpo_lightning.generation.adapters import adapter_weights_file, read_meta
    from vpo_lightning.generation.models import load_base_model

    raw = dict(get(cfg, "model.model", {}) or {})
    info: dict[str, Any] = {"ckpt": ckpt, "adapter": adapter, "weights_sha256": None, "global_step": None}
    if ckpt:
        path = Path(ckpt)
        if not path.is_file():
            raise FileNotFoundError(f"--ckpt {str(path)!r} does not exist")
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved = (state.get("hyper_parameters") or {}).get("model")
        if isinstance(saved, dict):  # the trained architecture wins; precision and attention follow the config
            if raw.get("name") and saved.get("name") != raw.get("name"):
                log.warning("--ckpt was trained on %s, not the config's %s: using %s", saved.get("name"),
                            raw.get("name"), saved.get("name"))
            raw.update({k: saved[k] for k in ("name", "lora", "adapter") if k in saved})
        settings = _model_settings(raw)
        model = load_ckpt_policy(settings, state, device)
        info.update(weights_sha256=sha256_file(path), global_step=state.get("global_step"))
        return model, settings, info
    if adapter and (meta := read_meta(adapter)) and meta.get("includes_start_adapter"):
        # a self-contained export: the starting adapter is stacked into it, so it goes on the raw base
        raw["adapter"] = None
        info["start_adapter"] = meta.get("start_adapter")
    settings = _model_settings(raw)
    model = load_base_model(settings, device)  # merges the run's starting adapter (model.adapter) when set
    info["adapter"] = adapter or settings.adapter
    if adapter:
        from peft import PeftModel

        info["weights_sha256"] = sha256_file(adapter_weights_file(Path(adapter)))
        model = PeftModel.from_pretrained(model, adapter)
    return model, settings, info
