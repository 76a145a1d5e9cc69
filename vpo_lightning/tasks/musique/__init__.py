"""MuSiQue multi-hop question answering (VPO-SPEC section 8): D = 5 reward [hop_1, hop_2, hop_3, hop_4, answer_f1].

* :mod:`.task`: prompt, answer parsing and the reward (pure Python);
* :mod:`.rewards`: registers the ``musique`` reward;
* :mod:`.build`: ``python -m vpo_lightning.tasks.musique.build`` writes the JSONL splits from the public files.
"""
