"""``python -m mpisgd.plan``: the planner (mpisgd.app.plan)."""

import sys

from mpisgd.app.plan import main

if __name__ == "__main__":
    sys.exit(main())
