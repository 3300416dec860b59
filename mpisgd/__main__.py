import sys

from mpisgd.app.train import main

sys.exit(main())
