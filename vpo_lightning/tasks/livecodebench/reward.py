"""Registers the ``lcb_tests`` reward (16 per-test dimensions; candidates run in the sandbox, so ``parallel``)."""

from __future__ import annotations

from vpo_lightning.rewards import register
from vpo_lightning.tasks.livecodebench import DIMS, lcb_reward

register("lcb_tests", dims=DIMS, parallel=True)(lcb_reward)

__all__ = ["lcb_reward"]
