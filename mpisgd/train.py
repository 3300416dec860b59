"""``python -m mpisgd.train``: the training CLI (mpisgd.app.train)."""

import sys

from mpisgd.app.train import main

if __name__ == "__main__":
    sys.exit(main())
