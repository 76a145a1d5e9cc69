"""The keys a ``vpo`` parser knows, and the closest known keys to one it does not.

Plain functions over a jsonargparse parser's actions and loaded YAML mappings, used by the config resolver
(:mod:`vpo_lightning.training.config`, which drops unknown keys with a warning) and by the error messages of
:mod:`vpo_lightning.training.config_check`; they import neither, so the two do not import each other.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["config_file_keys", "is_known", "known_keys", "suggest"]

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
