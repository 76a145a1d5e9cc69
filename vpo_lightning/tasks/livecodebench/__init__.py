"""LiveCodeBench code generation (VPO-SPEC section 8, case study): per-test rewards, 16 smallest tests, 6 s each.

* :mod:`.task`: public-record decoding, prompt, candidate programs, test running in the sandbox, the reward;
* :mod:`.rewards`: registers the ``lcb_tests`` reward;
* :mod:`.build`: ``python -m vpo_lightning.tasks.livecodebench.build`` writes the date-split JSONL files.
"""
