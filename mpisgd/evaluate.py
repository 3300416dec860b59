"""``python -m mpisgd.evaluate``: scoring a saved model or checkpoint (mpisgd.app.evaluate)."""

import sys

from mpisgd.app.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
