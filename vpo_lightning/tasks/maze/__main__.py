"""``python -m vpo_lightning.tasks.maze``: draw one maze with routes into a PNG (see :func:`draw_main`)."""

from vpo_lightning.tasks.maze.draw import draw_main

raise SystemExit(draw_main())
