"""Built-in tasks, one package each: ``<name>/__init__.py`` (prompt, parser, reward functions), ``<name>/reward.py``
(registers the task's rewards; imported by the registry on first lookup) and ``<name>/build.py`` (the data builder,
``python -m vpo_lightning.tasks.<name>.build``). Every package in this folder is a built-in task: see
docs/ADDING_A_TASK.md.
"""
