"""``python -m mpisgd.plot``: plots of a run's metrics (mpisgd.app.plot)."""

import sys

from mpisgd.app.plot import main

if __name__ == "__main__":
    sys.exit(main())
