"""``python -m vpo_lightning.cli ...``: the ``vpo`` command under its old module path (:mod:`vpo_lightning.launcher`).

The LightningCLI of ``vpo fit`` moved to :mod:`vpo_lightning.training.cli`; its names are re-exported here.
"""

import sys

from vpo_lightning.launcher import main
from vpo_lightning.training.cli import OUTPUT_ROOT, TRAINER_DEFAULTS, VPOCLI, run_lightning  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
