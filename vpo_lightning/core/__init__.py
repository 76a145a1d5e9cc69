"""The pure core: VPO's maths, the chain protocol and the data types that cross layers.

Plain Python and torch only: nothing here imports Lightning, transformers, peft or vLLM (tests/test_layers.py
imports every module of this package with those blocked). Only the reward registry (:mod:`vpo_lightning.rewards`)
sits beside it. docs/ARCHITECTURE.md lists the modules.
"""
