"""One route from a `vpo fit` configuration to objects, for every command.

``vpo fit`` parses its YAML with :class:`~vpo_lightning.training.cli.VPOCLI`'s jsonargparse parser and instantiates
the classes it names. ``vpo eval``, ``search``, ``serve``, ``plan`` and ``export`` read the same files through
:func:`resolve`: the same parser (the ``fit`` parser of the schema VPOCLI is built from,
:mod:`vpo_lightning.training.schema`, built without a CLI) parses the config, so every default comes from the
classes' typed signatures and every value is type-checked as ``vpo fit`` checks it; :class:`RunConfig` then
instantiates only what a command needs (the rollout callback with its chain protocol, reward vector and engine; the
settings dataclasses, without the module that holds them). Nothing here re-types a default or tells classes apart
by their names.

:func:`get` is the one dotted-key reader (``get(cfg, "rollout.sampling.max_new_tokens")``) over plain dicts,
jsonargparse namespaces and objects; :func:`apply_overrides` the one writer of dotted overrides.

Lightning is imported only when a config is resolved (``vpo --help`` and the commands' ``--help`` stay light).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]`` for ``"a.b"``, through dicts, jsonargparse namespaces and attributes; ``default`` where a
    key is missing or null."""
    node = cfg
    for key in dotted.split("."):
        if isinstance(node, Mapping):
            node = node.get(key)
        elif hasattr(node, "__contains__") and hasattr(node, "__getitem__") and not isinstance(node, (str, bytes)):
            node = node[key] if _contains(node, key) else None  # jsonargparse Namespace
        else:
            node = getattr(node, key, None)
        if node is None:
            return default
    return node


def apply_overrides(cfg: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``cfg`` with each ``{dotted key: value}`` of ``overrides`` set, sections created where missing;
    a mapping value merges into the mapping already there (as OmegaConf's merge and ``vpo fit``'s ``--config``
    files do), any other value replaces it. The one place where dotted overrides are applied: ``vpo fit``'s
    notebook entry (``api.train(overrides=...)``), the commands' ``--set KEY=VALUE`` and :func:`resolve`."""
    out = _plain(cfg)
    for key, value in overrides.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = _merged(node.get(last), _plain(value))
    return out


def _merged(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}
    return new


def _contains(node: Any, key: str) -> bool:
    try:
        return key in node
    except TypeError:
        return False


def import_class(class_path: str) -> type:
    """The class a ``class_path`` names (``package.module.Class``), as jsonargparse resolves it."""
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"class_path {class_path!r}: no such class") from None


def fit_parser() -> Any:
    """The parser of ``vpo fit`` (its ``fit`` subcommand parser), built from the same schema as ``vpo fit``'s
    (:data:`vpo_lightning.training.schema.FIT`): the same classes, arguments, defaults, links and trainer defaults;
    nothing is parsed, instantiated or run. Errors raise (to the command, which reports them)."""
    from vpo_lightning.training.schema import FIT

    return FIT.parser("fit")


# class paths renamed since runs were saved (a run's config.yaml names the engine and the callbacks): the classes
# that sat at the top of the package before the layers. old -> new
RENAMED_CLASS_PATHS = {
    "vpo_lightning.engines.TransformersEngine": "vpo_lightning.generation.engines.TransformersEngine",
    "vpo_lightning.engines.VLLMEngine": "vpo_lightning.generation.engines.VLLMEngine",
    "vpo_lightning.progress.StepProgressBar": "vpo_lightning.training.progress.StepProgressBar",
    "vpo_lightning.checkpointing.AdapterCheckpoint": "vpo_lightning.training.checkpointing.AdapterCheckpoint",
}


def _parent(cfg: dict[str, Any], dotted: str) -> tuple[Any, str]:
    """The mapping that holds ``dotted``'s last part (None where a section is missing), and that part."""
    parent, _, last = dotted.rpartition(".")
    return (get(cfg, parent) if parent else cfg), last


def _old_class_paths(cfg: Any) -> Iterator[dict[str, Any]]:
    """The mappings in ``cfg`` (lists included) whose ``class_path`` :data:`RENAMED_CLASS_PATHS` renames."""
    if isinstance(cfg, Mapping):
        if cfg.get("class_path") in RENAMED_CLASS_PATHS:
            yield cfg  # type: ignore[misc]
        for value in cfg.values():
            yield from _old_class_paths(value)
    elif isinstance(cfg, list):
        for value in cfg:
            yield from _old_class_paths(value)


def renamed_class_paths(cfg: Any) -> list[tuple[str, str]]:
    """``(old, new)`` of every class path in ``cfg`` that :data:`RENAMED_CLASS_PATHS` renames."""
    return [(node["class_path"], RENAMED_CLASS_PATHS[node["class_path"]]) for node in _old_class_paths(cfg)]


def _rename_old_class_paths(cfg: dict[str, Any], source: str) -> None:
    """Rewrite (in place) the class paths :data:`RENAMED_CLASS_PATHS` renames, with a warning."""
    for node in list(_old_class_paths(cfg)):
        old = node["class_path"]
        node["class_path"] = RENAMED_CLASS_PATHS[old]
        log.warning("%s: class_path %s is now %s; read as such", source, old, node["class_path"])


def _drop_unknown(cfg: dict[str, Any], parser: Any, source: str) -> None:
    """Remove from ``cfg`` (in place) the keys ``vpo fit`` does not know, each named with the closest known keys
    in a warning: the commands beside ``vpo fit`` read what they know of a config, as they always have."""
    from vpo_lightning.training.config_keys import config_file_keys, known_keys, suggest

    leaves, sections = known_keys(parser)
    for key in config_file_keys(cfg, leaves, sections):
        hint = suggest(key, leaves | sections)
        log.warning("%s: %s is not a `vpo fit` key%s; ignored", source, key,
                    f" (did you mean {' or '.join(hint)}?)" if hint else "")
        node, last = _parent(cfg, key)
        node.pop(last, None)


def _plain(value: Any) -> Any:
    """``value`` as plain dicts and lists (a deep copy of them)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@dataclass
class RunConfig:
    """A `vpo fit` configuration parsed by the ``vpo fit`` parser: ``parsed`` holds every key with its default."""

    parsed: Any  # jsonargparse Namespace of the `fit` subcommand
    parser: Any  # the parser that parsed it (fit_parser())
    source: str  # what the config came from, for messages

    def value(self, dotted: str, default: Any = None) -> Any:
        """A parsed value (its default from the signature when the config omits it)."""
        return get(self.parsed, dotted, default)

    def instantiate(self, key: str) -> Any:
        """The object of one class section, instantiated as ``vpo fit`` does: the same class (the fit parser's),
        the parsed values, nested classes included. ``key`` is a top-level section (``rollout``, ``model``,
        ``data``, ``checkpoint``, ``eval``) or a settings dataclass inside one (``model.optim``,
        ``rollout.sampling``): the settings are read without building the module or the callback that holds them."""
        import dataclasses

        from jsonargparse import Namespace
        from lightning.pytorch.cli import LightningArgumentParser

        group = self.parser.groups.get(key)
        cls = getattr(group, "group_class", None)
        if cls is None:
            raise ValueError(f"{key!r} is not a class section of `vpo fit` (rollout, model, data, checkpoint, eval, or "
                             "a settings dataclass in one, e.g. model.optim)")
        one = LightningArgumentParser(exit_on_error=False)  # just this section, so others need not be complete
        if dataclasses.is_dataclass(cls):
            one.add_class_arguments(cls, key)
        else:
            one.add_lightning_class_args(cls, key)
        values = Namespace()
        values[key] = self.parsed[key].clone()
        return one.instantiate_classes(values)[key]

    def rollout(self) -> Any:
        """The :class:`~vpo_lightning.training.rollout.RolloutCallback`: chain protocol, reward vector, sampling,
        engine."""
        self._require_rewards()
        return self.instantiate("rollout")

    def protocol(self) -> Any:
        """The run's :class:`~vpo_lightning.core.protocol.ChainProtocol`, built from the parsed ``rollout:`` values
        as the rollout callback builds it (:func:`~vpo_lightning.training.sampler.chain_protocol`), without the
        callback or its engine."""
        import inspect

        from vpo_lightning.training.sampler import chain_protocol

        self._require_rewards()
        names = inspect.signature(chain_protocol).parameters
        return chain_protocol(**{name: self.value(f"rollout.{name}") for name in names})

    def sampling(self) -> Any:
        """The training :class:`~vpo_lightning.generation.engines.SamplingSettings` (``rollout.sampling``)."""
        return self.instantiate("rollout.sampling")

    def eval_sampling(self) -> Any:
        """What ``vpo eval`` and ``vpo search`` sample at: the training ``rollout.sampling`` (its top-k and token
        budget) at the ``eval:`` section's temperature and top-p
        (:class:`~vpo_lightning.training.sampler.EvalSettings`), as the reference evaluates held-out pools."""
        from dataclasses import replace

        settings = self.instantiate("eval")
        return replace(self.sampling(), temperature=settings.temperature, top_p=settings.top_p)

    def _require_rewards(self) -> None:
        if self.value("rollout.rewards") is None:
            raise ValueError(f"{self.source}: rollout.rewards is required (the reward names, e.g. [maze])")

    def model_settings(self) -> Any:
        """The policy's :class:`~vpo_lightning.generation.models.ModelSettings` (``model.model``), with the values
        and defaults ``vpo fit`` gives it (types checked by the same parser; a nested ``lora`` section included)."""
        return self.instantiate("model.model")

    def engine_class(self) -> type:
        """The rollout engine's class, as the config names it (``rollout.engine.class_path``)."""
        return import_class(str(self.value("rollout.engine.class_path")))

    def engine_args(self) -> dict[str, Any]:
        """The engine's ``init_args``, every default of its signature filled in by the parser."""
        args = self.value("rollout.engine.init_args")
        return args.as_dict() if hasattr(args, "as_dict") else dict(args or {})


def resolve(cfg: Mapping[str, Any], source: str = "the config", overrides: Mapping[str, Any] | None = None,
            *, require_all: bool = False) -> RunConfig:
    """Parse a `vpo fit` config (a loaded, interpolated mapping) with the ``vpo fit`` parser.

    Args:
        cfg: the config's mapping (``vpo_lightning.commands.runs.load_config``).
        source: the file it came from, named in messages.
        overrides: ``{dotted key: value}`` set after loading (e.g. ``{"rollout.estimator": "grpo"}``).
        require_all: also require what ``vpo fit`` requires (``data.train_files``, ``rollout.rewards``); by
            default a command checks what it uses when it instantiates it.

    Raises:
        ValueError: a value ``vpo fit`` would refuse, naming the key.
    """
    from jsonargparse import ArgumentError

    from vpo_lightning.training.config_keys import rename_old_keys

    parser = fit_parser()
    data = rename_old_keys(cfg, source)  # a copy: the renames and removals below leave the caller's mapping as it was
    _rename_old_class_paths(data, source)
    _drop_unknown(data, parser, source)
    data = apply_overrides(data, rename_old_keys(overrides or {}, "overrides"))
    try:
        parsed = parser.parse_object(data, _skip_required=not require_all)
    except ArgumentError as err:
        raise ValueError(f"{source}: {str(err).strip()}") from None
    return RunConfig(parsed, parser, source)
