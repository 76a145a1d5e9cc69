"""VPO-SPEC section 3's public API at the path the spec names (``vpo_lightning/advantages.py``): the set reward and
VPO's advantage, pure torch. The code lives in :mod:`vpo_lightning.core.advantages`; this module only names it."""

from vpo_lightning.core.advantages import group_normalize, sample_weights, set_rewards, vpo_advantages

__all__ = ["group_normalize", "sample_weights", "set_rewards", "vpo_advantages"]
