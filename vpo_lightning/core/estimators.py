"""The estimator table: every advantage estimator, once, with what the rollout must know to call it. Pure torch.

An entry holds the function (:mod:`vpo_lightning.core.advantages`) and its traits: whether it asks for m answers
per chain, how its Dirichlet weights are keyed, whether the prompt shows them, whether it scores the task's scalar
f, and which extra keyword arguments the rollout supplies. Nothing else in the package branches on an estimator's
name (``tests/test_estimators.py`` checks it): code asks the entry, ``ESTIMATORS[name].chained``. Adding an
estimator is one entry here plus its tests (docs/ADDING_A_TASK.md, "Adding an estimator").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from vpo_lightning.core import advantages

__all__ = ["CHAIN_ESTIMATORS", "DEFAULT_ESTIMATOR", "ESTIMATORS", "WEIGHTED_ESTIMATORS", "Estimator",
           "EstimatorName", "get_estimator"]

# What the rollout can hand an estimator beyond the shared signature (rewards, mask, weights, num_weights, alpha,
# eps, generator, dim_mask): max@k's subset size, Multi-RLVR's repeats by reward vector, GDPO's token counts.
Extra = Literal["k", "vector_repeats", "token_counts"]


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: ``rewards [B, G, m, D]`` (+ mask, weights, ...) -> ``[B, G]``, and its traits.

    Args:
        fn: the function, with the shared signature of :mod:`~vpo_lightning.core.advantages`.
        chained: asks for m answers per chain (the m-answer instruction, candidates split by tags); else m = 1.
        weights: how its Dirichlet weights are keyed (:meth:`~vpo_lightning.core.protocol.ChainProtocol.step_weights`):
            ``"step"`` = ``num_weights`` fresh draws per (seed, step, prompt index); ``"row"`` = one draw per
            (seed, record id), the same at every step and epoch; None = no weights.
        shows_weights: the prompt lists the row's weights (goal-conditioned training).
        scalar_view: scores the task's scalar f; for a task whose f is a weighted mean (rewards registered with
            ``f_weights``) the rollout hands it f as a single dimension.
        set_reward: the rollout logs ``reward/set``, the VPO set reward under the step's weights.
        extras: the extra keyword arguments the rollout supplies (:data:`Extra`).
    """

    fn: Callable[..., Tensor]
    chained: bool = False
    weights: Literal["step", "row"] | None = None
    shows_weights: bool = False
    scalar_view: bool = False
    set_reward: bool = False
    extras: tuple[Extra, ...] = ()

    def __call__(self, rewards: Tensor, mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        return self.fn(rewards, mask, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:  # inspect.signature(entry) is the function's
        return inspect.signature(self.fn)

    def extra_kwargs(self, available: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
        """``{name: value}`` of this estimator's extras, each computed by ``available[name]()`` only if needed."""
        return {name: available[name]() for name in self.extras}


ESTIMATORS: dict[str, Estimator] = {
    "vpo": Estimator(advantages.vpo, chained=True, weights="step", set_reward=True),
    "grpo": Estimator(advantages.grpo, scalar_view=True),
    "multi_rlvr": Estimator(advantages.multi_rlvr, chained=True, extras=("vector_repeats",)),
    "random_weight_grpo": Estimator(advantages.random_weight_grpo, weights="row"),
    "goal_conditioned_grpo": Estimator(advantages.goal_conditioned_grpo, weights="row", shows_weights=True),
    "max_at_k": Estimator(advantages.max_at_k, scalar_view=True, extras=("k",)),
    "gdpo": Estimator(advantages.gdpo, extras=("token_counts",)),
}
DEFAULT_ESTIMATOR = next(iter(ESTIMATORS))  # the first entry: VPO
# The config's type: jsonargparse lists and checks the choices. Built from the table, so the names exist once.
EstimatorName = Literal[tuple(ESTIMATORS)]  # type: ignore[valid-type]
CHAIN_ESTIMATORS = frozenset(name for name, e in ESTIMATORS.items() if e.chained)  # m-answer chains
WEIGHTED_ESTIMATORS = frozenset(name for name, e in ESTIMATORS.items() if e.weights == "row")  # drawn before rollout


def get_estimator(name: str) -> Estimator:
    """The table's entry for ``name``; a ValueError naming the known ones otherwise."""
    if name not in ESTIMATORS:
        raise ValueError(f"rollout.estimator={name!r} is not one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]
