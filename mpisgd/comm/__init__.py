"""Moving and reducing buffers between ranks: one interface (``base.Reducer``), strategies chosen by name.

=================  =====================  =====================================================
``--allreduce``    module, class          what it runs, and when to use it
=================  =====================  =====================================================
``auto``           auto, AutoReducer      the default. Every rank on one node: buffers in the
                                          node-shared window (data parallelism's gradients)
                                          are summed there (``shared``), all-reduce and
                                          reduce-scatter alike. Any other buffer: ``mpi`` or
                                          ``ring`` per operation, dtype and size class,
                                          whichever measured faster (the ring's reduce-scatter
                                          is a full all-reduce and a copy, measured too: MPI's
                                          algorithm can be the slower), decided by
                                          ``tune()`` or when the class is first seen, kept in
                                          the tuning file with its date and margin, re-checked
                                          or re-measured when old, close or timed on a busy
                                          machine. Not measured: one rank (``mpi``), a dtype
                                          MPI cannot sum (``ring``), ``deterministic`` at
                                          k >= 3 (``deterministic`` outside the window)
``mpi``            mpi, MpiReducer        the MPI library's Allreduce: lowest latency for small
                                          buffers, tuned for the network by vendor MPIs; the
                                          test oracle
``ring``           ring, RingReducer      our pipelined ring (reduce-scatter + all-gather) over
                                          point-to-point messages: bandwidth-optimal, large
                                          buffers; its reduce-scatter is a full all-reduce
``shared``         shared, SharedReducer  every rank on one node: buffers in a node-shared
                                          window summed in place from the peers' memory, in
                                          rank order (what ``auto`` does with the gradients);
                                          others: ``mpi``
``deterministic``  deterministic,         every element summed in rank order, whatever the
                   DeterministicReducer   buckets: bitwise reproducible (``--deterministic``)
``nccl``           nccl, NcclReducer      GPU buffers, one GPU per rank: NCCL, on its own stream
=================  =====================  =====================================================

Options of :func:`create_reducer`: ``deterministic`` (at k >= 3; at k <= 2 every
order gives the same bits, so nothing changes there) makes ``mpi`` and ``ring``
the ``deterministic`` strategy; ``auto`` keeps the node-shared window, whose sums
are in the same rank order (the same bits), and sends every other buffer to
``deterministic``, measuring nothing; ``shared`` sends its other buffers to
``deterministic`` instead of ``mpi``; ``nccl`` refuses it. (MPI libraries
already reduce within each node first, so there is no hierarchical strategy of
ours.)
``device=True`` (GPU buffers) puts the strategy behind ``cuda.CudaAwareReducer``
(device pointers to MPI) or ``cuda.StagedReducer`` (pinned host copies), as
``cuda_aware`` (auto|direct|staged) and the probe in ``cuda`` decide.
"""

from __future__ import annotations

from typing import Any

from mpisgd.comm.auto import AutoReducer
from mpisgd.comm.base import Done, Handle, Reducer
from mpisgd.comm.deterministic import DeterministicReducer
from mpisgd.comm.mpi import MpiReducer
from mpisgd.comm.ring import RingReducer
from mpisgd.comm.shared import SharedReducer

STRATEGIES = ("auto", "mpi", "ring", "shared", "deterministic", "nccl")
CUDA_AWARE = ("auto", "direct", "staged")
_CPU = {"auto": AutoReducer, "mpi": MpiReducer, "ring": RingReducer, "shared": SharedReducer,
        "deterministic": DeterministicReducer}


def create_reducer(name: str, comm: Any, *, deterministic: bool = False, device: bool = False,
                   cuda_aware: str = "auto") -> Reducer:
    """The strategy ``name`` over a duplicate of ``comm`` (collective; close() it on every rank).

    ``device``: the buffers will be CuPy arrays. ``deterministic``: a summation order fixed whatever
    the buffer boundaries. ``cuda_aware``: how device buffers reach MPI (see mpisgd.comm.cuda).
    """
    if name not in STRATEGIES:
        raise ValueError(f"all-reduce strategy {name!r} is not available; choose from {', '.join(STRATEGIES)}")
    if cuda_aware not in CUDA_AWARE:
        raise ValueError(f"cuda_aware must be one of {', '.join(CUDA_AWARE)}, got {cuda_aware!r}")
    if name == "nccl":
        if deterministic:
            raise ValueError("nccl has no deterministic mode (its order depends on the buffer size); "
                             "use --allreduce deterministic")
        if not device:
            raise ValueError("--allreduce nccl needs GPU buffers (--device gpu); use auto, ring or mpi on the CPU")
        from mpisgd.comm.nccl import NcclReducer  # noqa: PLC0415 - imports CuPy

        return NcclReducer(comm)
    if deterministic and name in ("mpi", "ring") and comm.Get_size() > 2:
        name = "deterministic"
    if name == "shared" and device:
        raise ValueError("the shared strategy reduces host buffers; use auto or nccl with --device gpu")
    red = _CPU[name](comm, deterministic=deterministic) if name in ("auto", "shared") else _CPU[name](comm)
    if not device:
        return red
    from mpisgd.comm.cuda import CudaAwareReducer, StagedReducer, probe_cuda_aware  # noqa: PLC0415

    direct, why = probe_cuda_aware(comm, cuda_aware)
    return CudaAwareReducer(red, why) if direct else StagedReducer(red, why)


__all__ = ["STRATEGIES", "AutoReducer", "DeterministicReducer", "Done", "Handle", "MpiReducer", "Reducer",
           "RingReducer", "SharedReducer", "create_reducer"]
