import sys

from mpisgd.train import main

sys.exit(main())
