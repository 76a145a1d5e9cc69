"""Training: the Lightning side of ``vpo fit`` (module, rollout callback, data, checkpoints, run folders, CLI).

docs/ARCHITECTURE.md lists the modules.
"""
