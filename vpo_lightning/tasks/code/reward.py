"""The code reward: per-test pass/fail of a candidate program on its HumanEval problem (D = its tests, at most 16).

See :mod:`vpo_lightning.tasks.code` for how tests are split and how a problem with fewer than 16 tests pads, and
:mod:`vpo_lightning.sandbox` for how the candidate runs. Registered ``parallel=True``: each call waits on a sandbox
subprocess.
"""

from __future__ import annotations

from vpo_lightning.rewards import register
from vpo_lightning.tasks.code import NUM_TEST_DIMS, code_tests_reward, num_tests

register("code_tests", dims=tuple(f"test_{i}" for i in range(NUM_TEST_DIMS)), parallel=True,
         real_dims=num_tests)(code_tests_reward)

__all__ = ["code_tests_reward"]
