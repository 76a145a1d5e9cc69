"""The reward registry: named reward functions composed by the config into a reward vector.

A *scalar* reward is ``fn(candidate: str, sample: Mapping) -> float`` and gives one dimension named after it.
A *vector* reward is registered with ``dims=(...)`` and returns one float per declared dimension. ``sample`` is the
data record the prompt came from (its ``ground_truth``, ``tools``, ``meta`` ...). Every value must lie in [0, 1].

In YAML, ``rollout.rewards: [format, tool_name, arg_key, arg_value]`` gives a D = 4 reward vector whose dimension
names are logged. A name that is not registered is imported as a dotted path (``my_pkg.rewards.exact``), TRL style.

Model output never crashes a run: a reward that raises, returns the wrong length, NaN or a value outside [0, 1] is
reported once with its name and the offending input, scores 0 for that candidate, and is counted in the logs.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Mapping[str, Any]], "float | Sequence[float]"]

# Modules whose import registers the built-in rewards. Imported on first lookup, not at package import.
_BUILTIN_MODULES = ("vpo_lightning.rewards.tooluse", "vpo_lightning.rewards.maze", "vpo_lightning.rewards.code",
                    "vpo_lightning.tasks.musique.rewards", "vpo_lightning.tasks.eureqa.rewards",
                    "vpo_lightning.tasks.livecodebench.rewards")


@dataclass(frozen=True)
class RewardEntry:
    """A registered reward: its function, the names of the dimensions it yields, and how to run it."""

    name: str
    fn: RewardFn
    dims: tuple[str, ...]
    parallel: bool = False  # candidates scored in a thread pool (rewards that wait on sandbox subprocesses)
    f_weights: tuple[float, ...] | None = None  # weights of the task's scalar f over dims (None: plain mean)


REWARDS: dict[str, RewardEntry] = {}


def register(
    name: str, *, dims: Sequence[str] | None = None, parallel: bool = False,
    f_weights: Sequence[float] | None = None,
) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name``. ``dims`` declares a vector reward's dimension names;
    ``f_weights`` (one non-negative weight per dimension) makes the task's scalar f, used by ``vpo eval`` for
    best@k, a weighted mean instead of the plain mean (MuSiQue: f = (sum of hops + 3 * answer_f1) / 7)."""
    names = tuple(dims) if dims else (name,)
    if f_weights is not None and (len(f_weights) != len(names) or min(f_weights) < 0 or not sum(f_weights) > 0):
        raise ValueError(f"reward {name!r}: f_weights needs {len(names)} non-negative weights with a positive sum")

    def wrap(fn: RewardFn) -> RewardFn:
        if name in REWARDS and REWARDS[name].fn is not fn:
            raise ValueError(f"reward {name!r} is registered twice ({REWARDS[name].fn.__module__} and {fn.__module__})")
        REWARDS[name] = RewardEntry(name, fn, names, parallel, tuple(map(float, f_weights)) if f_weights else None)
        return fn

    return wrap


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def registered_names() -> list[str]:
    _load_builtins()
    return sorted(REWARDS)


def get_reward(name: str) -> RewardEntry:
    """Look up a registered reward by name, else import ``name`` as a dotted path to a function."""
    _load_builtins()
    if name in REWARDS:
        return REWARDS[name]
    if "." in name:
        module_name, attr = name.rsplit(".", 1)
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward {name!r}: cannot import it as a dotted path ({err})") from err
        if name in REWARDS:  # the import registered it under its dotted name
            return REWARDS[name]
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        return RewardEntry(name, fn, (attr,), False)
    close = difflib.get_close_matches(name, REWARDS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown reward {name!r}.{hint} Registered rewards: {', '.join(sorted(REWARDS))}; "
        "or give a dotted path such as my_pkg.rewards.my_fn"
    )


@dataclass
class RewardScores:
    """Scores of one rollout batch. N chains, m candidates, D dimensions."""

    rewards: Tensor  # [N, m, D] float32 in [0, 1]; zero rows where absent
    mask: Tensor  # [N, m] bool, True where the candidate is present
    num_errors: int = 0  # reward calls that raised or returned an invalid value (scored 0)
    errors: list[str] = field(default_factory=list)  # the first few error reports


class RewardVector:
    """The configured reward functions, composed into a D-dimensional vector per candidate.

    Args:
        names: registered reward names or dotted paths, in dimension order.
        max_workers: threads for rewards registered with ``parallel=True`` (default: the CPU count).
    """

    MAX_REPORTS = 20

    def __init__(self, names: Sequence[str], max_workers: int | None = None) -> None:
        if not names:
            raise ValueError("rewards: give at least one reward name, e.g. [format, tool_name, arg_key, arg_value]")
        self.entries = [get_reward(n) for n in names]
        self.dim_names = [d for e in self.entries for d in e.dims]
        self.max_workers = max_workers
        self._reported = 0

    @property
    def dim(self) -> int:
        return len(self.dim_names)

    @property
    def f_weights(self) -> list[float]:
        """Per-dimension weights of the scalar f (1 for rewards registered without ``f_weights``)."""
        return [w for e in self.entries for w in (e.f_weights or (1.0,) * len(e.dims))]

    def _call(self, entry: RewardEntry, candidate: str, sample: Mapping[str, Any], errors: list[str]) -> list[float]:
        zeros = [0.0] * len(entry.dims)
        try:
            out = entry.fn(candidate, sample)
            values = [float(out)] if len(entry.dims) == 1 and not isinstance(out, Sequence) else [float(v) for v in out]
            if len(values) != len(entry.dims):
                raise ValueError(f"returned {len(values)} values, expected {len(entry.dims)}")
            bad = [v for v in values if math.isnan(v) or not 0.0 <= v <= 1.0]
            if bad:
                raise ValueError(f"returned {bad[0]!r}, outside [0, 1]")
            return values
        except Exception as err:  # noqa: BLE001 - a reward bug must not stop training
            message = f"reward {entry.name!r} failed on candidate {candidate[:200]!r}: {type(err).__name__}: {err}"
            errors.append(message)
            if self._reported < self.MAX_REPORTS:
                log.warning(message)
                self._reported += 1
            return zeros

    def score(self, candidates: Sequence[Sequence[str | None]], samples: Sequence[Mapping[str, Any]]) -> RewardScores:
        """Score ``candidates[n][j]`` (None = absent) of chain n against its record ``samples[n]``."""
        if len(candidates) != len(samples):
            raise ValueError(f"candidates has {len(candidates)} chains but samples has {len(samples)}")
        n_chains, m = len(candidates), max((len(c) for c in candidates), default=0)
        rewards = torch.zeros(n_chains, m, self.dim)  # [N, m, D]
        mask = torch.zeros(n_chains, m, dtype=torch.bool)  # [N, m]
        jobs = [(i, j, c) for i, chain in enumerate(candidates) for j, c in enumerate(chain) if c]
        for i, j, _ in jobs:
            mask[i, j] = True
        errors: list[str] = []
        col = 0
        for entry in self.entries:
            width = len(entry.dims)
            if entry.parallel and len(jobs) > 1:
                with ThreadPoolExecutor(self.max_workers or torch.get_num_threads()) as pool:
                    results = list(pool.map(lambda job: self._call(entry, job[2], samples[job[0]], errors), jobs))
            else:
                results = [self._call(entry, c, samples[i], errors) for i, j, c in jobs]
            for (i, j, _), values in zip(jobs, results):
                rewards[i, j, col : col + width] = torch.tensor(values)
            col += width
        return RewardScores(rewards, mask, len(errors), errors[: self.MAX_REPORTS])
