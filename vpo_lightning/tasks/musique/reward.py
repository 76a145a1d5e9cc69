"""Registers the ``musique`` reward (D = 5: hop_1..hop_4, answer_f1; f weights 1, 1, 1, 1, 3)."""

from __future__ import annotations

from vpo_lightning.rewards import register
from vpo_lightning.tasks.musique import DIMS, F_WEIGHTS, musique_reward

register("musique", dims=DIMS, f_weights=F_WEIGHTS, vector_repeats=True)(musique_reward)

__all__ = ["musique_reward"]
