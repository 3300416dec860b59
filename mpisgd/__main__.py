"""``python -m mpisgd``: the training CLI, as ``python -m mpisgd.train``."""

import sys

from mpisgd.train import main

sys.exit(main())
