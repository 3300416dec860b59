import sys

from mpisgd.pinning import reexec_pinned

reexec_pinned(sys.argv[1:])  # before NumPy loads (mpisgd.train)

from mpisgd.app.train import main  # noqa: E402

sys.exit(main())
