"""The maze reward ``[exit, gold, diamond, safety]`` of one route answer (VPO-SPEC section 8).

The candidate is one route: the content of a ``<route_i>`` block, or a single answer (its first closed ``<route>`` or
``<answer>`` block, else the whole text). Identical routes of one training chain count once (``answer_key``). See
:mod:`vpo_lightning.tasks.maze` for parsing and the simulation rules.
"""

from __future__ import annotations

from vpo_lightning.rewards import register
from vpo_lightning.tasks.maze import DIMS, maze_reward, route_key

register("maze", dims=DIMS, answer_key=route_key)(maze_reward)

__all__ = ["maze_reward"]
