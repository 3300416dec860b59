"""``python -m mpisgd.train``: the training CLI (mpisgd.app.train).

With ``--reproducible`` at the pinned level the process first replaces itself with one whose BLAS and
NumPy kernels are pinned (mpisgd.pinning): before NumPy loads and before MPI starts."""

import sys

from mpisgd.pinning import reexec_pinned

if __name__ == "__main__":
    reexec_pinned(sys.argv[1:])

from mpisgd.app.train import main  # noqa: E402 - after the pinning: it must precede NumPy

if __name__ == "__main__":
    sys.exit(main())
