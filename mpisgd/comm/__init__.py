"""Moving and reducing buffers between ranks: strategies behind one interface, chosen by name.

================  ==============================================================
strategy          when to use it
================  ==============================================================
``auto``          the default: ``mpi`` below a measured size crossover (latency
                  wins), ``ring`` from it on (bandwidth wins); see
                  docs/allreduce.md for the measurement. On one node it
                  also offers a node-shared buffer whose pieces it reduces
                  in place (data parallelism keeps its gradients there)
``mpi``           the MPI library's ``Allreduce``; the test oracle; lowest
                  latency for small buffers, and the right choice when the
                  library is tuned for the network (vendor MPI on a cluster)
``ring``          our ring (reduce-scatter + all-gather): through a shared-
                  memory window when every rank is on one node, else
                  pipelined messages; large buffers
``hierarchical``  several ranks per node and a slow network between nodes:
                  reduce inside the node, ring among node leaders, broadcast
``nccl``          GPU buffers with NCCL (CuPy); fastest between GPUs
================  ==============================================================

Options: ``deterministic`` fixes the summation order (rank order, whatever the
buffer boundaries) so results are bitwise reproducible across bucket sizes;
``mpi``, ``ring`` and ``auto`` then all use the deterministic ring (except at
k <= 2, where any order gives the same bits and nothing changes), and
``nccl`` refuses. ``compress="fp16"`` sends float16 on the wire. With GPU
buffers, ``cuda_aware`` (auto|direct|staged) decides whether MPI gets device
pointers or pinned host copies; ``auto`` probes (see mpisgd.comm.cuda).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.comm.auto import CROSSOVER_BYTES, AutoReducer
from mpisgd.comm.base import Done, Handle, Reducer
from mpisgd.comm.compress import CompressedReducer
from mpisgd.comm.hierarchical import HierarchicalReducer
from mpisgd.comm.mpi import MpiReducer, mpi_sum_type
from mpisgd.comm.ring import RingReducer

STRATEGIES = ("auto", "mpi", "ring", "hierarchical", "nccl")
COMPRESSIONS = ("none", "fp16")
CUDA_AWARE = ("auto", "direct", "staged")


def _mpi_sums_fp16() -> bool:
    return mpi_sum_type(np.float16) is not None


def create_reducer(name: str, comm: Any, *, backend: Any = None, deterministic: bool = False,
                   compress: str = "none", cuda_aware: str = "auto") -> Reducer:
    """The all-reduce strategy ``name`` over ``comm`` (which the caller owns; collective over it).

    ``backend`` (mpisgd.backend.Backend) says whether buffers live on a GPU;
    ``deterministic`` asks for a summation order that is fixed whatever the
    buffer boundaries; ``compress`` casts buffers for the wire; ``cuda_aware``
    chooses how device buffers reach MPI.
    """
    if name not in STRATEGIES:
        raise ValueError(f"all-reduce strategy {name!r} is not available; choose from {', '.join(STRATEGIES)}")
    if compress not in COMPRESSIONS:
        raise ValueError(f"compress must be one of {', '.join(COMPRESSIONS)}, got {compress!r}")
    if cuda_aware not in CUDA_AWARE:
        raise ValueError(f"cuda_aware must be one of {', '.join(CUDA_AWARE)}, got {cuda_aware!r}")
    gpu = backend is not None and getattr(backend, "is_gpu", False)
    if name == "nccl":
        if deterministic:
            raise ValueError("nccl has no deterministic mode (its order depends on the buffer size); "
                             "use --allreduce ring with --deterministic")
        if not gpu:
            raise ValueError("--allreduce nccl needs GPU buffers (--device gpu); use ring or mpi on the CPU")
        from mpisgd.comm.nccl import NcclReducer  # noqa: PLC0415 - imports CuPy

        red: Reducer = NcclReducer(comm)
        return CompressedReducer(red) if compress == "fp16" else red
    if deterministic and comm.Get_size() <= 2 and name in ("auto", "mpi", "ring"):
        deterministic = False  # two operands: a + b == b + a bitwise, every algorithm is already deterministic
    if name == "hierarchical":
        red = HierarchicalReducer(comm, deterministic=deterministic)
    elif deterministic or name == "ring" or (name == "mpi" and compress == "fp16" and not _mpi_sums_fp16()):
        red = RingReducer(comm, deterministic=deterministic)
    elif name == "mpi":
        red = MpiReducer(comm)
    else:
        red = AutoReducer(comm)
    if gpu:
        from mpisgd.comm.cuda import DirectReducer, StagedReducer, probe_cuda_aware  # noqa: PLC0415

        direct, why = probe_cuda_aware(comm, cuda_aware)
        red = DirectReducer(red, why) if direct else StagedReducer(red, why)
    return CompressedReducer(red) if compress == "fp16" else red


__all__ = ["CROSSOVER_BYTES", "STRATEGIES", "AutoReducer", "CompressedReducer", "Done", "Handle",
           "HierarchicalReducer", "MpiReducer", "Reducer", "RingReducer", "create_reducer"]
