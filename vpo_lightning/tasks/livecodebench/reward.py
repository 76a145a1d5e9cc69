"""Registers the ``lcb_tests`` reward (one dimension per kept test, at most 16, the rest padding; candidates run in
the sandbox, so ``parallel``)."""

from __future__ import annotations

from vpo_lightning.rewards import register
from vpo_lightning.tasks.code import num_tests
from vpo_lightning.tasks.livecodebench import DIMS, lcb_reward

register("lcb_tests", dims=DIMS, parallel=True, real_dims=num_tests)(lcb_reward)

__all__ = ["lcb_reward"]
