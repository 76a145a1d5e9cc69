"""EUREQA chain reasoning (VPO-SPEC section 8): D = 5 exact-match reward on the entities A..E of a 5-entity chain.

* :mod:`.task`: prompt, answer parsing and the reward (pure Python);
* :mod:`.rewards`: registers the ``eureqa`` reward;
* :mod:`.build`: ``python -m vpo_lightning.tasks.eureqa.build`` writes the JSONL splits from the public files.
"""
