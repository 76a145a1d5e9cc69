"""Registers the ``eureqa`` reward (D = 5: entity_A..entity_E exact match; f = mean)."""

from __future__ import annotations

from vpo_lightning.rewards import register
from vpo_lightning.tasks.eureqa import DIMS, eureqa_reward

register("eureqa", dims=DIMS)(eureqa_reward)

__all__ = ["eureqa_reward"]
