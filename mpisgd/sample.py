"""``python -m mpisgd.sample``: text from a trained language model (mpisgd.app.sample)."""

import sys

from mpisgd.app.sample import main

if __name__ == "__main__":
    sys.exit(main())
