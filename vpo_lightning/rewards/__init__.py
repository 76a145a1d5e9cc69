"""The reward registry: named reward functions composed by the config into a reward vector.

A *scalar* reward is ``fn(candidate: str, sample: Mapping) -> float`` and gives one dimension named after it.
A *vector* reward is registered with ``dims=(...)`` and returns one float per declared dimension. ``sample`` is the
data record the prompt came from (its ``ground_truth``, ``tools``, ``meta`` ...). Every value must lie in [0, 1].

In YAML, ``rollout.rewards: [format, tool_name, arg_key, arg_value]`` gives a D = 4 reward vector whose dimension
names are logged. A name that is not registered is imported as a dotted path (``my_pkg.rewards.exact``), TRL style,
from the installed packages or the working directory.

A TRL reward function, ``fn(prompts, completions, **kwargs) -> list[float | None]``, is recognised by its signature
(``inspect.signature``, when the config is read) and called once per batch with every candidate of the batch, the
prompts they answer and the record's other fields as keyword lists, as TRL does; each is one dimension, so TRL's
``reward_funcs=[f1, f2, f3]`` is a D = 3 reward vector. ``None`` counts 0 (TRL sums with ``nansum``). A callable
that fits neither signature is refused at start-up with both signatures in the message.
A vector reward declares its dimensions wherever it comes from: registered with ``dims=``, or, imported by dotted
path, either registered (under any name) by its module or carrying a ``dims`` attribute (``fn.dims = ("a", "b")``);
a reward that returns a different number of values than it declares stops the run at once with an error saying so.

Model output never crashes a run: a reward that raises or returns NaN on a candidate is reported once per reward
(one line naming it, the record and the error; later failures are counted, not printed), and the candidate scores 0
on every dimension of the vector (VPO-SPEC section 3: the candidate scores 0, not only that reward's dimensions); it
is counted in the logs. A value outside [0, 1] is a bug in the reward's definition, not bad model output (TRL takes any
float; VPO's set reward needs [0, 1]): it stops the run at the first batch that shows it
(:class:`RewardRangeError`, naming the reward, the value, the record and how to rescale), never a silent 0.

Per-record D. A reward registered with ``real_dims=fn`` has a variable number of real dimensions per record
(code tasks: one per test, at most 16): ``fn(sample)`` gives how many of its declared dimensions are real for that
record (1..len(dims)), the reward returns that many values, and the rest are padding, scored 0 and marked False in
:attr:`RewardScores.dim_mask` so that estimators and metrics leave them out. A reward that fails on each
of its first ``fail_after`` calls (default 100) is broken, not unlucky: the run stops with an error naming it
instead of training on zeros.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vpo_lightning.core.types import DERIVED, RewardScores

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Mapping[str, Any]], "float | Sequence[float]"]



@dataclass(frozen=True)
class RewardEntry:
    """A registered reward: its function, the names of the dimensions it yields, and how to run it."""

    name: str
    fn: RewardFn
    dims: tuple[str, ...]
    parallel: bool = False  # candidates scored in a thread pool (rewards that wait on sandbox subprocesses)
    f_weights: tuple[float, ...] | None = None  # weights of the task's scalar f over dims (None: plain mean)
    real_dims: Callable[[Mapping[str, Any]], int] | None = None  # real dims per record (None: all of them)
    descriptions: tuple[str, ...] | None = None  # one phrase per dim, shown by goal-conditioned GRPO (None: names)
    answer_key: Callable[[str], Any] | None = None  # when two answers of one chain are the same (count once)
    vector_repeats: bool = False  # two answers of one chain with one reward vector are the same (Multi-RLVR)
    batch: bool = False  # TRL signature fn(prompts, completions, **kwargs): one call per batch


REWARDS: dict[str, RewardEntry] = {}
SIGNATURES = ("fn(candidate: str, sample: Mapping) -> float (or one float per declared dim)",
              "TRL's fn(prompts: list, completions: list, **kwargs) -> list[float | None]")
_TRL_EXCLUDED = ("prompt", "completion", "completion_ids")  # columns TRL does not pass as keyword arguments


def is_trl_reward(fn: Callable[..., Any], name: str) -> bool:
    """True for TRL's batch signature (a ``completions`` parameter), False for ours (callable as ``fn(candidate,
    sample)``); a ValueError naming both accepted signatures for anything else."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: try them as ours
        return False
    if "completions" in params:
        kinds = {p.kind for p in params.values()}
        if "prompts" in params or inspect.Parameter.VAR_KEYWORD in kinds:
            return True
        raise ValueError(f"reward {name!r}: a TRL reward function takes prompts and completions as keyword arguments "
                         f"(def {getattr(fn, '__name__', 'f')}(prompts, completions, **kwargs)); add **kwargs or a "
                         "prompts parameter")
    try:
        inspect.signature(fn).bind("candidate", {})
    except TypeError:
        sig = f"{getattr(fn, '__name__', name)}{inspect.signature(fn)}"
        raise ValueError(f"reward {name!r} has the signature {sig}, which fits neither accepted signature: "
                         f"{SIGNATURES[0]}, or {SIGNATURES[1]}") from None
    return False


def entry_for(name: str, fn: Callable[..., Any]) -> RewardEntry:
    """A :class:`RewardEntry` for a plain callable: TRL batch functions give one dimension named ``name``; ours may
    declare several with a ``dims`` attribute (``fn.dims = ("a", "b")``)."""
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    if is_trl_reward(fn, name):
        return RewardEntry(name, fn, (name.rsplit(".", 1)[-1],), batch=True)
    for entry in REWARDS.values():  # registered by its module under another name: keep its declared dims
        if entry.fn is fn:
            return RewardEntry(name, fn, entry.dims, entry.parallel, real_dims=entry.real_dims,
                               descriptions=entry.descriptions, answer_key=entry.answer_key,
                               vector_repeats=entry.vector_repeats)
    dims = getattr(fn, "dims", None)
    if dims is not None:
        if isinstance(dims, str) or not dims or not all(isinstance(d, str) for d in dims):
            raise ValueError(f"reward {name!r}: its dims attribute must be a non-empty sequence of dimension "
                             f"names, got {dims!r}")
        return RewardEntry(name, fn, tuple(dims), bool(getattr(fn, "parallel", False)))
    return RewardEntry(name, fn, (name.rsplit(".", 1)[-1],), False)


def importable_name(fn: Callable[..., Any]) -> str | None:
    """``module.qualname`` of a function a fresh process can import (not one defined in ``__main__`` or a
    function body), else None."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and qualname and "<locals>" not in qualname:
        return f"{module}.{qualname}"
    return None


def register_callable(fn: Callable[..., Any], name: str | None = None) -> str:
    """Register a reward callable given from Python (the notebook entry point); returns the name the config uses:
    ``name`` when given, else its dotted path when its module can be imported again (so the saved config.yaml runs
    from the command line), else its ``__name__``. A different function already registered under that name is
    refused, unless both come from ``__main__`` (a notebook cell run again)."""
    bare = getattr(fn, "__name__", None)
    if not bare or bare == "<lambda>":
        raise ValueError(f"reward {fn!r}: give a named function (def ...), not a lambda: its name names the "
                         "reward dimension in the logs")
    name = name or importable_name(fn) or bare
    _load_builtins()
    redefined = name in REWARDS and getattr(REWARDS[name].fn, "__module__", None) == fn.__module__ == "__main__"
    if name in REWARDS and REWARDS[name].fn is not fn and not redefined:
        raise ValueError(f"reward {name!r}: a different reward is registered under this name "
                         f"({REWARDS[name].fn.__module__}); rename your function")
    REWARDS[name] = entry_for(name, fn)
    return name


_CONFIG_DIRS: list[str] = []  # folders of the configs read in this process (add_config_dir)


def add_config_dir(folder: str | os.PathLike[str]) -> None:
    """Import dotted reward paths from ``folder`` too (a config's folder: ``my_rewards.py`` beside the YAML), after
    the installed packages and the working directory."""
    folder = os.path.abspath(folder)
    if folder not in _CONFIG_DIRS:
        _CONFIG_DIRS.append(folder)


def _from_config_file(module_name: str, attr: str) -> Any | None:
    """``attr`` of the file ``<config folder>/<module_name>.py`` of the most recently read config that has one,
    loaded from that file. For a module name another folder already took in this process: two runs of one notebook
    each write ``api_rewards.py`` beside their own config, and the first one imported would hide the second's."""
    rel = os.path.join(*module_name.split(".")) + ".py"
    for folder in reversed(_CONFIG_DIRS):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if hasattr(module, attr):
            sys.modules[module_name] = module  # what a later import (and pickling) of the name finds
            return getattr(module, attr)
    return None


def _import_dotted(name: str) -> Any:
    """Import ``pkg.module.attr``; the working directory and the configs' folders are searched too (after the
    installed packages), so a ``my_rewards.py`` beside the config works without ``PYTHONPATH=.``."""
    module_name, attr = name.rsplit(".", 1)
    cwd = os.getcwd()
    for folder in ([] if "" in sys.path else [cwd]) + _CONFIG_DIRS:
        if folder not in sys.path:
            sys.path.append(folder)
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        found = _from_config_file(module_name, attr)
        if found is not None:
            return found
        where = ", ".join([cwd, *[d for d in _CONFIG_DIRS if d != cwd]])
        raise ValueError(f"reward {name!r}: cannot import it as a dotted path ({err}); the module must be "
                         f"importable from the installed packages, the working directory or the config's folder "
                         f"({where})") from err


def register(
    name: str, *, dims: Sequence[str] | None = None, parallel: bool = False,
    f_weights: Sequence[float] | None = None, real_dims: Callable[[Mapping[str, Any]], int] | None = None,
    descriptions: Sequence[str] | None = None, answer_key: Callable[[str], Any] | None = None,
    vector_repeats: bool = False,
) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name``. ``dims`` declares a vector reward's dimension names;
    ``f_weights`` (one non-negative weight per dimension) makes the task's scalar f, used by ``vpo eval`` for
    best@k, a weighted mean instead of the plain mean (MuSiQue: f = (sum of hops + 3 * answer_f1) / 7);
    ``real_dims(sample)`` gives the number of real leading dimensions for a record (the rest is padding);
    ``descriptions`` (one phrase per dimension) is what goal-conditioned GRPO's prompt calls each objective;
    ``answer_key`` (a hashable per answer, or None) says when two answers of one training chain are the same:
    repeats count once (absent, scoring 0), as the reference's maze reward does (see chains.distinct);
    ``vector_repeats`` says that two answers of one chain with the same reward vector are the same answer for
    Multi-RLVR's sum (the reference's ``dedup_by_vector``: tool use, MuSiQue)."""
    names = tuple(dims) if dims else (name,)
    if f_weights is not None and (len(f_weights) != len(names) or min(f_weights) < 0 or not sum(f_weights) > 0):
        raise ValueError(f"reward {name!r}: f_weights needs {len(names)} non-negative weights with a positive sum")
    if descriptions is not None and (len(descriptions) != len(names) or not all(isinstance(d, str) and d
                                                                                  for d in descriptions)):
        raise ValueError(f"reward {name!r}: descriptions needs {len(names)} non-empty strings, one per dimension")
    if f_weights is not None and real_dims is not None:
        raise ValueError(f"reward {name!r}: f_weights and real_dims cannot be combined (f over padding is undefined)")

    def wrap(fn: RewardFn) -> RewardFn:
        if name in REWARDS and REWARDS[name].fn is not fn:
            raise ValueError(f"reward {name!r} is registered twice ({REWARDS[name].fn.__module__} and {fn.__module__})")
        REWARDS[name] = RewardEntry(name, fn, names, parallel, tuple(map(float, f_weights)) if f_weights else None,
                                    real_dims, tuple(descriptions) if descriptions else None, answer_key,
                                    vector_repeats=vector_repeats)
        return fn

    return wrap


def _load_builtins() -> None:
    """Import ``vpo_lightning.tasks.<name>.reward`` of every built-in task (:func:`vpo_lightning.tasks.builtin_tasks`,
    the folder is the list): its import registers the task's rewards.

    Imported on first lookup, not at package import."""
    from vpo_lightning.tasks import builtin_tasks

    for task in builtin_tasks():
        importlib.import_module(f"vpo_lightning.tasks.{task}.reward")


def registered_names() -> list[str]:
    _load_builtins()
    return sorted(REWARDS)


def get_reward(name: str) -> RewardEntry:
    """Look up a registered reward by name, else import ``name`` as a dotted path to a function."""
    _load_builtins()
    if name in REWARDS:
        return REWARDS[name]
    if "." in name:
        fn = _import_dotted(name)
        if name in REWARDS:  # the import registered it under its dotted name
            return REWARDS[name]
        return entry_for(name, fn)
    close = difflib.get_close_matches(name, REWARDS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown reward {name!r}.{hint} Registered rewards: {', '.join(sorted(REWARDS))}; "
        "or give a dotted path such as my_pkg.rewards.my_fn"
    )


class RewardDeclarationError(ValueError):
    """A reward returned a different number of values than the dimensions it declares (a bug in the reward)."""


class RewardRangeError(RewardDeclarationError):
    """A reward returned a value outside [0, 1] (a bug in its definition: rescale it)."""


RANGE_SLACK = 1e-6  # float rounding: a value this close outside [0, 1] is clamped, not refused


def _range_error(name: str, value: float, sample: Mapping[str, Any], candidate: str) -> RewardRangeError:
    return RewardRangeError(
        f"reward {name!r} returned {value!r} for record {sample.get('id')!r} (candidate {candidate[:80]!r}), outside "
        "[0, 1]: every reward dimension must lie in [0, 1] (VPO compares weighted sums of them; TRL takes any float). "
        "Rescale it in the function, e.g. (r + 1) / 2 for a reward in [-1, 1], or min(r / R, 1.0) for one in [0, R]")


def _in_range(values: list[float], name: str, sample: Mapping[str, Any], candidate: str) -> list[float]:
    """``values`` clamped to [0, 1] within :data:`RANGE_SLACK` (NaN passes: a failure), else
    :class:`RewardRangeError`."""
    for v in values:
        if not math.isnan(v) and not -RANGE_SLACK <= v <= 1.0 + RANGE_SLACK:
            raise _range_error(name, v, sample, candidate)
    return [v if math.isnan(v) else min(1.0, max(0.0, v)) for v in values]


class BrokenRewardError(RuntimeError):
    """A reward failed on every one of its first ``fail_after`` calls: it is broken, so the run stops."""


class RewardVector:
    """The configured reward functions, composed into a D-dimensional vector per candidate.

    Args:
        names: registered reward names or dotted paths, in dimension order.
        max_workers: threads for rewards registered with ``parallel=True`` (default: the CPU count).
        fail_after: raise :class:`BrokenRewardError` once a reward has failed this many times without a single
            success (None = never).
    """

    MAX_REPORTS = 20

    def __init__(self, names: Sequence[str], max_workers: int | None = None, fail_after: int | None = 100) -> None:
        if not names:
            raise ValueError("rewards: give at least one reward name, e.g. [format, tool_name, arg_key, arg_value]")
        if fail_after is not None and fail_after < 1:
            raise ValueError(f"fail_after must be >= 1 or None, got {fail_after}")
        self.entries = [get_reward(n) for n in names]  # signatures are checked here, at start-up
        self.dim_names = [d for e in self.entries for d in e.dims]
        self.max_workers = max_workers
        self.fail_after = fail_after
        self.failures = {e.name: 0 for e in self.entries}  # calls that raised or returned an invalid value
        self.successes = {e.name: 0 for e in self.entries}
        self._last_error: dict[str, str] = {}
        self._lock = threading.Lock()  # parallel rewards update the counts from pool threads

    @property
    def dim(self) -> int:
        return len(self.dim_names)

    @property
    def descriptions(self) -> list[str]:
        """One phrase per dimension (the registered descriptions, else the dimension names)."""
        return [d for e in self.entries for d in (e.descriptions or e.dims)]

    @property
    def variable_dims(self) -> bool:
        """Whether some reward has a per-record number of real dimensions."""
        return any(e.real_dims is not None for e in self.entries)

    def real_counts(self, entry: RewardEntry, sample: Mapping[str, Any]) -> int:
        """How many of ``entry``'s dimensions are real for ``sample`` (all, unless it registered ``real_dims``)."""
        if entry.real_dims is None:
            return len(entry.dims)
        try:
            n = entry.real_dims(sample)
        except Exception as err:  # a record the reward cannot size is bad data, not bad model output
            raise ValueError(f"reward {entry.name!r}: cannot tell the number of real dimensions of record "
                             f"{sample.get('id')!r} ({type(err).__name__}: {err}); check its ground_truth") from err
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(entry.dims):
            raise ValueError(f"reward {entry.name!r}: record {sample.get('id')!r} has {n!r} real dimensions; it must "
                             f"have 1..{len(entry.dims)} (e.g. a code record needs at least one test)")
        return n

    def dim_mask(self, samples: Sequence[Mapping[str, Any]]) -> Tensor:
        """``[N, D]`` bool: True on the real dimensions of each sample's record."""
        rows = [[i < self.real_counts(e, s) for e in self.entries for i in range(len(e.dims))] for s in samples]
        return torch.tensor(rows, dtype=torch.bool).view(len(samples), self.dim)

    @property
    def f_weights(self) -> list[float]:
        """Per-dimension weights of the scalar f (1 for rewards registered without ``f_weights``)."""
        return [w for e in self.entries for w in (e.f_weights or (1.0,) * len(e.dims))]

    def _call(self, entry: RewardEntry, candidate: str, sample: Mapping[str, Any],
              errors: list[str]) -> list[float] | None:
        """The reward's values padded to its declared width, or None when it raised or returned an invalid value."""
        width = self.real_counts(entry, sample)
        try:
            out = entry.fn(candidate, sample)
            values = [float(out)] if len(entry.dims) == 1 and not isinstance(out, Sequence) else [float(v) for v in out]
            values = _in_range(values, entry.name, sample, candidate)
            if any(math.isnan(v) for v in values):
                raise ValueError("returned NaN")
        except RewardRangeError:
            raise
        except Exception as err:  # noqa: BLE001 - model output must not stop training
            message = (f"reward {entry.name!r} failed on record {sample.get('id')!r} (candidate "
                       f"{candidate[:200]!r}): {type(err).__name__}: {err}")
            self._record_failure(entry.name, message, errors)
            return None
        if len(values) != width:
            real = f" ({width} real for record {sample.get('id')!r})" if width != len(entry.dims) else ""
            raise RewardDeclarationError(
                f"reward {entry.name!r} returned {len(values)} values but declares {len(entry.dims)} dimension(s) "
                f"{list(entry.dims)}{real}: declare a vector reward's dimensions with register(name, dims=(...)) or, "
                "for a dotted path, a dims attribute on the function (fn.dims = ('a', 'b'))"
            )
        with self._lock:
            self.successes[entry.name] += 1
        return values + [0.0] * (len(entry.dims) - width)

    def _call_batch(self, entry: RewardEntry, jobs: list[tuple[int, int, str]],
                    samples: Sequence[Mapping[str, Any]], errors: list[str]) -> list[list[float]]:
        """One call of a TRL reward function over every candidate of the batch (see the module docstring)."""
        rows = [samples[i] for i, _, _ in jobs]
        prompts = [r.get("prompt", r.get("messages")) for r in rows]
        completions = [c if isinstance(p, str) else [{"role": "assistant", "content": c}]
                       for p, (_, _, c) in zip(prompts, jobs)]
        derived = rows[0].get(DERIVED, ())  # fields vpo added (messages of a TRL prompt, id): not columns
        kwargs: dict[str, Any] = {k: [r.get(k) for r in rows] for k in rows[0]
                                  if k not in _TRL_EXCLUDED and k != DERIVED and k not in derived}
        kwargs["prompts"] = prompts
        params = inspect.signature(entry.fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}  # a function without **kwargs: its names only
        try:
            out = entry.fn(completions=completions, **kwargs)
            if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) or len(out) != len(jobs):
                got = f"{len(out)} values" if isinstance(out, Sequence) else type(out).__name__
                raise RewardDeclarationError(f"reward {entry.name!r} returned {got} for {len(jobs)} completions: a "
                                             "TRL reward function returns one float (or None) per completion")
        except RewardDeclarationError:
            raise
        except Exception as err:  # noqa: BLE001 - as for per-candidate rewards: scored 0, counted, reported
            message = (f"reward {entry.name!r} failed on a batch of {len(jobs)} completions (first record "
                       f"{samples[jobs[0][0]].get('id')!r}): {type(err).__name__}: {err}")
            self._record_failure(entry.name, message, errors, count=len(jobs))
            return [None] * len(jobs)  # every candidate of the batch scores 0 on every dimension
        results = []
        for (i, _, cand), value in zip(jobs, out):
            if value is None:  # TRL: NaN, then nansum over functions -> no contribution
                results.append([0.0])
                continue
            (v,) = _in_range([float(value)], entry.name, samples[i], cand)
            if math.isnan(v):
                self._record_failure(entry.name, f"reward {entry.name!r} returned NaN on record "
                                     f"{samples[i].get('id')!r} (candidate {cand[:200]!r})", errors)
                results.append(None)  # an invalid value fails the candidate, as for our own rewards
                continue
            results.append([v])
        with self._lock:
            self.successes[entry.name] += sum(1 for v in out if v is not None)
        return results

    def _record_failure(self, name: str, message: str, errors: list[str], count: int = 1) -> None:
        """Count a failure; the first of each reward is printed (one line), the rest only counted."""
        with self._lock:
            errors.append(message)
            first = self.failures[name] == 0
            self.failures[name] += count
            self._last_error[name] = message
        if first:
            log.warning("%s; the candidate scores 0 on every dimension. Further failures of %r are counted "
                        "(train/reward/errors), not printed", message, name)

    def _check_broken(self) -> None:
        if self.fail_after is None:
            return
        for name, failed in self.failures.items():
            if failed >= self.fail_after and self.successes[name] == 0:
                raise BrokenRewardError(
                    f"reward {name!r} failed on all of its first {failed} calls, so it is broken rather than the "
                    f"model output being bad; fix it or remove it from rollout.rewards. Last error: "
                    f"{self._last_error.get(name, '')}"
                )

    def score(self, candidates: Sequence[Sequence[str | None]], samples: Sequence[Mapping[str, Any]]) -> RewardScores:
        """Score ``candidates[n][j]`` (None = absent) of chain n against its record ``samples[n]``; a candidate on
        which any reward fails scores 0 on every dimension."""
        if len(candidates) != len(samples):
            raise ValueError(f"candidates has {len(candidates)} chains but samples has {len(samples)}")
        n_chains, m = len(candidates), max((len(c) for c in candidates), default=0)
        rewards = torch.zeros(n_chains, m, self.dim)  # [N, m, D]
        mask = torch.zeros(n_chains, m, dtype=torch.bool)  # [N, m]
        jobs = [(i, j, c) for i, chain in enumerate(candidates) for j, c in enumerate(chain) if c]
        for i, j, _ in jobs:
            mask[i, j] = True
        errors: list[str] = []
        dim_mask = self.dim_mask(samples) if self.variable_dims else None  # [N, D]; bad records fail here, at once
        failed = torch.zeros(n_chains, m, dtype=torch.bool)  # [N, m]
        col = 0
        for entry in self.entries:
            width = len(entry.dims)
            if entry.batch:
                results = self._call_batch(entry, jobs, samples, errors) if jobs else []
            elif entry.parallel and len(jobs) > 1:
                with ThreadPoolExecutor(self.max_workers or torch.get_num_threads()) as pool:
                    results = list(pool.map(lambda job, e=entry: self._call(e, job[2], samples[job[0]], errors), jobs))
            else:
                results = [self._call(entry, c, samples[i], errors) for i, j, c in jobs]
            for (i, j, _), values in zip(jobs, results):
                if values is None:
                    failed[i, j] = True
                else:
                    rewards[i, j, col : col + width] = torch.tensor(values)
            col += width
        rewards[failed] = 0.0  # the whole candidate scores 0, not only the failing reward's dimensions
        self._check_broken()
        return RewardScores(rewards, mask, len(errors), errors[: self.MAX_REPORTS], dim_mask)
