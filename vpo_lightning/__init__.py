"""vpo-lightning: Vector Policy Optimization post-training on PyTorch Lightning.

The package is laid out by layer (docs/ARCHITECTURE.md): ``core/`` (pure maths, the chain protocol, the data
types), ``generation/`` (models and rollout engines), ``training/`` (Lightning), ``commands/`` (``vpo eval``,
``search``, ...), beside ``rewards/``, ``tasks/``, ``sandbox/``, ``serve/`` and ``sft/``. Class paths that run
configs saved before the layout hold (``engines.VLLMEngine`` at the top) are read under their new names
(``vpo_lightning.training.config.RENAMED_CLASS_PATHS``).
"""

__version__ = "0.1.0"
