"""The commands beside ``vpo fit``: ``vpo eval``, ``search``, ``compare``, ``replicates``, ``plan``, ``export``.

Each module has a ``main(argv) -> int`` listed in :data:`vpo_lightning.launcher.COMMANDS` (``vpo serve`` is the
package :mod:`vpo_lightning.serve`). docs/ARCHITECTURE.md lists the modules.
"""
