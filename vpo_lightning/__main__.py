"""``python -m vpo_lightning ...`` = the ``vpo`` command (:mod:`vpo_lightning.launcher`)."""

import sys

from vpo_lightning.launcher import main

sys.exit(main())
