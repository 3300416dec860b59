"""Moving and reducing buffers between ranks: strategies behind one interface, chosen by name.

=============  =================================================================
strategy       when to use it
=============  =================================================================
``mpi``        the MPI library's ``Allreduce``; the oracle the others are tested
               against; best for small buffers (lowest latency)
``auto``       the default: ``mpi`` below a size crossover, ``ring`` above it
=============  =================================================================
"""

from __future__ import annotations

from typing import Any

from mpisgd.comm.base import Done, Handle, Reducer
from mpisgd.comm.mpi import MpiReducer

STRATEGIES = ("auto", "mpi")


def create_reducer(name: str, comm: Any, *, backend: Any = None, deterministic: bool = False,
                   compress: str = "none", cuda_aware: str = "auto") -> Reducer:
    """The all-reduce strategy ``name`` over ``comm`` (which the caller owns).

    ``backend`` (mpisgd.backend.Backend) says whether buffers live on a GPU;
    ``deterministic`` asks for a summation order that is fixed whatever the
    buffer boundaries; ``compress`` casts buffers for the wire; ``cuda_aware``
    chooses how device buffers reach MPI.
    """
    if name in ("auto", "mpi"):
        return MpiReducer(comm)
    raise ValueError(f"all-reduce strategy {name!r} is not available; choose from {', '.join(STRATEGIES)}")


__all__ = ["Done", "Handle", "MpiReducer", "Reducer", "STRATEGIES", "create_reducer"]
