"""Start-up: where this rank is (node, local rank), which device it drives.

``init(comm, device)`` is the Horovod-style entry point of the library API;
the communicator is passed in, never taken from a global.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from mpisgd.agreement import AgreedError, agree
from mpisgd.backend import Backend, select_backend
from mpisgd.comm.base import node_layout
from mpisgd.config import MAX_THREADS
from mpisgd.errors import UsageError


@dataclass
class Context:
    comm: Any  # the communicator training runs over (the caller's)
    rank: int
    size: int  # k
    local_rank: int  # rank among the ranks sharing this node's memory
    local_size: int
    node_index: int  # index of this node among the nodes (by lowest world rank)
    n_nodes: int
    host: str
    backend: Backend
    backend_note: str  # why the CPU was chosen under --device auto, for the banner

    @property
    def xp(self) -> Any:
        return self.backend.xp


def init(comm: Any = None, device: str = "auto") -> Context:
    """Find this rank's place and bind its device (GPU ``local_rank % n_gpus``).

    All ranks must call it. ``comm`` defaults to ``MPI.COMM_WORLD`` only here,
    at the application's entry point. Every rank ends on the same kind of device, or every rank raises
    :class:`AgreedError` (a rank whose CuPy fails must not leave the others waiting in a collective).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    local_rank, local_size, node, n_nodes = node_layout(comm)
    error, backend, note = None, None, ""
    try:
        backend, note = select_backend(device, local_rank)
    except UsageError as exc:
        error = exc
    agree(comm, error)
    assert backend is not None  # agreed: no rank failed
    kinds = comm.allgather(backend.device)
    if len(set(kinds)) > 1:
        gpu = [r for r, d in enumerate(kinds) if d == "gpu"]
        agree(comm, UsageError(f"ranks {gpu} found a GPU and the others none; every rank must use the same "
                               "kind of device: pass --device cpu, or make the GPUs visible on every node"))
    return Context(comm, comm.Get_rank(), comm.Get_size(), local_rank, local_size, node, n_nodes,
                   socket.gethostname(), backend, note)


def blas_threads(requested: int | None, local_size: int) -> tuple[int, str]:
    """BLAS threads per rank and where the number came from: ``--threads``, else $OMP_NUM_THREADS when
    the user set it, else this node's cores shared evenly among its ranks (at least 1)."""
    if requested:
        return requested, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and 1 <= int(env) <= MAX_THREADS:
        return int(env), "OMP_NUM_THREADS"
    if env.isdigit() and int(env) >= 1:
        raise UsageError(f"OMP_NUM_THREADS={env[:24]}: at most {MAX_THREADS} BLAS threads per rank; set it lower, "
                         "or pass --threads")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_size)), f"{cores} core(s) / {local_size} rank(s) on this node"



__all__ = ["AgreedError", "Context", "agree", "blas_threads", "init"]
