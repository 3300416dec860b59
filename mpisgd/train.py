"""``python -m mpisgd.train`` and the ``mpisgd-train`` console script: the training CLI (mpisgd.app.train).

With ``--reproducible`` at the pinned level the process first replaces itself with one whose BLAS and
NumPy kernels are pinned (mpisgd.pinning): before NumPy loads and before MPI starts. Both entry points
pin alike; mpisgd.app.train's own ``main`` does not (a process that calls it may have loaded NumPy)."""

import sys

from mpisgd.pinning import reexec_pinned


def main() -> int:
    """The command line of this process (``sys.argv``), pinned first where it asks for the pinned level."""
    reexec_pinned(sys.argv[1:])
    from mpisgd.app.train import main as train  # noqa: PLC0415 - after the pinning: it must precede NumPy

    return train()


if __name__ == "__main__":
    sys.exit(main())
