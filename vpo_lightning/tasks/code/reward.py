"""The code reward: per-test pass/fail of a candidate program on its HumanEval problem (16 dimensions).

See :mod:`vpo_lightning.tasks.code` for how tests are split and how dimensions are filled when a problem has fewer
than 16 tests, and :mod:`vpo_lightning.sandbox` for how the candidate runs. Registered ``parallel=True``: each call
waits on a sandbox subprocess.
"""

from __future__ import annotations

from vpo_lightning.rewards import register
from vpo_lightning.tasks.code import NUM_TEST_DIMS, code_tests_reward

register("code_tests", dims=tuple(f"test_{i}" for i in range(NUM_TEST_DIMS)), parallel=True)(code_tests_reward)

__all__ = ["code_tests_reward"]
