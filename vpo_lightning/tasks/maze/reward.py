"""The maze reward ``[exit, gold, diamond, safety]`` of one route answer (VPO-SPEC section 8).

The candidate is one route: the content of a ``<route_i>`` block, or a single answer with a ``<route>`` tag (then
only the tag's content is read). See :mod:`vpo_lightning.tasks.maze` for parsing and the simulation rules.
"""

from __future__ import annotations

from vpo_lightning.rewards import register
from vpo_lightning.tasks.maze import DIMS, maze_reward

register("maze", dims=DIMS)(maze_reward)

__all__ = ["maze_reward"]
