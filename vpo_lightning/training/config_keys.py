"""The keys a ``vpo`` parser knows, the closest known keys to one it does not, and the keys that were renamed.

Plain functions over a jsonargparse parser's actions and loaded YAML mappings, used by the config resolver
(:mod:`vpo_lightning.training.config`, which drops unknown keys with a warning) and by the error messages of
:mod:`vpo_lightning.training.config_check`; they import neither, so the two do not import each other.

:data:`RENAMED_KEYS` is the one table of renamed keys and :func:`rename_old_keys` / :func:`rename_old_flags` the one
mover: a config file given to ``vpo fit`` (a saved ``config.yaml`` resumed with ``--ckpt_path last`` included), the
config a command beside it resolves, ``--set`` overrides, command-line flags and ``api.train``'s overrides all read
an old key as its new one, with a one-line notice; where both are given, the new one wins.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["RENAMED_KEYS", "config_file_keys", "is_known", "known_keys", "rename_old_flags", "rename_old_keys",
           "suggest"]

log = logging.getLogger(__name__)

# keys renamed since runs were saved (a run's config.yaml lists every key, each engine argument included): old -> new
RENAMED_KEYS = {
    "rollout.engine.init_args.pack_weights": "rollout.engine.init_args.prepack_weights",
    "rollout.eval_temperature": "eval.temperature",  # evaluation settings left the rollout callback (issue 52)
    "rollout.eval_top_p": "eval.top_p",
}

# jsonargparse actions that are not settable keys (help printers); their dests end with ".help" or are "help".
_SKIPPED_ACTIONS = ("_HelpAction", "_ActionHelpClassPath", "_ActionHelpClass")
_GROUP_ACTIONS = ("_ActionConfigLoad",)  # "--rollout CONFIG": a section, not a leaf


def known_keys(parser: Any) -> tuple[frozenset[str], frozenset[str]]:
    """``(leaves, sections)`` of a jsonargparse parser: settable dotted keys, and the sections above them."""
    leaves: set[str] = set()
    sections: set[str] = set()
    for action in getattr(parser, "_actions", []):
        dest, kind = getattr(action, "dest", None), type(action).__name__
        if not dest or dest == "help" or dest.endswith(".help") or kind in _SKIPPED_ACTIONS:
            continue
        (sections if kind in _GROUP_ACTIONS else leaves).add(dest)
    for key in list(leaves):
        parts = key.split(".")
        sections.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(leaves), frozenset(sections)


def _inside_leaf(key: str, leaves: Iterable[str]) -> bool:
    """A key below a settable key: the init_args of a class-typed option (trainer.logger.init_args.save_dir)."""
    return any(key.startswith(leaf + ".") for leaf in leaves)


def is_known(key: str, leaves: frozenset[str], sections: frozenset[str]) -> bool:
    return key in leaves or key in sections or _inside_leaf(key, leaves)


def suggest(key: str, known: Iterable[str], n: int = 2) -> list[str]:
    """The closest known keys to ``key``: the same last part one level deeper in its section
    (``rollout.max_new_tokens`` -> ``rollout.sampling.max_new_tokens``); by its last part within the same section;
    failing that, by the whole dotted key; failing that, the keys with the same last part in another section
    (``model.lora.r`` -> ``model.model.lora.r``).
    """
    known = sorted(set(known))
    parent, _, last = key.rpartition(".")
    nested = [k for k in known if parent and k.startswith(parent + ".") and k.rpartition(".")[2] == last]
    if nested:
        return nested[:n]
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    close = [siblings[m] for m in difflib.get_close_matches(last, list(siblings), n=n, cutoff=0.75)]
    close = close or difflib.get_close_matches(key, known, n=n, cutoff=0.75)
    return close or [k for k in known if k.rpartition(".")[2] == last][:n]


def config_file_keys(data: Mapping[str, Any], leaves: frozenset[str], sections: frozenset[str],
                     prefix: str = "") -> list[str]:
    """Unknown dotted keys of a loaded YAML mapping (values of settable keys are not looked into)."""
    unknown = []
    for name, value in data.items():
        key = f"{prefix}{name}"
        if key in leaves or _inside_leaf(key, leaves):
            continue
        if key in sections:
            if isinstance(value, Mapping):
                unknown += config_file_keys(value, leaves, sections, key + ".")
            continue
        unknown.append(key)
    return unknown


def _find(cfg: Mapping[str, Any], dotted: str) -> tuple[Any, str] | None:
    """The mapping that holds ``dotted`` and the key it has there: the flat dotted key itself (an override
    mapping, ``{"rollout.eval_top_p": 0.9}``) or the nested path (a loaded YAML); None where it is not given."""
    if dotted in cfg:
        return cfg, dotted
    node: Any = cfg
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.get(part) if isinstance(node, Mapping) else None
    return (node, last) if isinstance(node, Mapping) and last in node else None


def _put(cfg: dict[str, Any], dotted: str, value: Any, flat: bool) -> None:
    if flat:
        cfg[dotted] = value
        return
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _copy(value: Any) -> Any:
    """A copy with every mapping as a plain ``dict`` (not ``copy.deepcopy``: the keys are then moved in place, and a
    read-only or non-dict mapping, e.g. a parser's, must come out as one that :func:`_put` can write into)."""
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    return [_copy(v) for v in value] if isinstance(value, list) else value


def rename_old_keys(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A copy of ``cfg`` (a loaded config, nested, or a ``{dotted key: value}`` override mapping) with each old key
    of :data:`RENAMED_KEYS` moved to its new key, each named in a one-line notice; where the new key is also given,
    it wins and the old value is dropped."""
    out = _copy(cfg)
    for old, new in RENAMED_KEYS.items():
        found = _find(out, old)
        if found is None:
            continue
        node, key = found
        value = node.pop(key)
        if _find(out, new) is not None:
            log.warning("%s: %s is now %s, which is also given; the old key is ignored", source, old, new)
        else:
            _put(out, new, value, flat=key == old)
            log.warning("%s: %s is now %s; read as such", source, old, new)
    return out


def rename_old_flags(args: Sequence[str], source: str = "the command line") -> list[str]:
    """``args`` with each ``--<old key>`` flag of :data:`RENAMED_KEYS` (``--key value`` or ``--key=value``) spelt as
    its new key, with a one-line notice; where the new key's flag is also given, the old flag and its value are
    dropped (the new one wins, wherever it stands)."""
    keys = [a[2:].partition("=")[0] for a in args if a.startswith("--")]
    out: list[str] = []
    skip_value = False
    for token in args:
        if skip_value:
            skip_value = False
            continue
        key, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if key not in RENAMED_KEYS:
            out.append(token)
            continue
        new = RENAMED_KEYS[key]
        if new in keys:
            log.warning("%s: %s is now %s, which is also given; the old key is ignored", source, key, new)
            skip_value = not eq
            continue
        log.warning("%s: %s is now %s; read as such", source, key, new)
        out.append(f"--{new}{eq}{value}")
    return out
