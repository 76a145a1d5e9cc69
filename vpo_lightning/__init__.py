"""vpo-lightning: Vector Policy Optimization post-training on PyTorch Lightning.

The package is laid out by layer (docs/ARCHITECTURE.md): ``core/`` (pure maths, the chain protocol, the data
types), ``generation/`` (models and rollout engines), ``training/`` (Lightning), ``commands/`` (``vpo eval``,
``search``, ...), beside ``rewards/``, ``tasks/``, ``sandbox/``, ``serve/`` and ``sft/``. The modules that used to sit
at the top keep their old import paths (``vpo_lightning.advantages``, VPO-SPEC section 3; class paths such as
``vpo_lightning.engines.VLLMEngine`` in older run configs; pickled checkpoints): :data:`MOVED` maps each old path
to the module it now is, the very same module object.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__version__ = "0.1.0"

MOVED = {  # old module -> new module (vpo_lightning.<old> is vpo_lightning.<new>)
    **{name: f"core.{name}" for name in
       ("advantages", "chains", "losses", "metrics", "packing", "dynamic_sampling", "protocol")},
    **{name: f"generation.{name}" for name in ("engines", "decoding", "attention", "fused_decode", "models")},
    **{name: f"training.{name}" for name in ("module", "rollout", "datamodule", "checkpointing", "progress",
                                              "runtime", "config_check", "run_folders", "records")},
    **{name: f"commands.{name}" for name in ("evaluate", "search", "compare", "plan", "replicates", "runs", "tools",
                                              "export")},
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``vpo_lightning.<old>`` as the module it moved to, so that old paths name the same objects."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.partition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system sets module.__spec__ = spec next: undone below
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran under its new name); give it back its own spec."""
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # before an editable install's finder, which may map the old names
