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

from mpisgd.backend import Backend, select_backend


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
    backend_note: str  # why CPU was chosen, for the banner

    @property
    def xp(self) -> Any:
        return self.backend.xp


def node_layout(comm: Any) -> tuple[int, int, int, int]:
    """(local_rank, local_size, node_index, n_nodes) from an MPI shared-memory split.

    Read from MPI itself, not from launcher variables, so it is right under
    mpiexec, srun and any other launcher alike.
    """
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        local_rank, local_size = local.Get_rank(), local.Get_size()
        leader = local.bcast(comm.Get_rank(), root=0)  # lowest world rank on the node
    finally:
        local.Free()
    leaders = sorted(set(comm.allgather(leader)))
    return local_rank, local_size, leaders.index(leader), len(leaders)


def init(comm: Any = None, device: str = "auto") -> Context:
    """Find this rank's place and bind its device (GPU ``local_rank % n_gpus``).

    All ranks must call it. ``comm`` defaults to ``MPI.COMM_WORLD`` only here,
    at the application's entry point.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    local_rank, local_size, node, n_nodes = node_layout(comm)
    backend, note = select_backend(device, local_rank)
    return Context(comm, comm.Get_rank(), comm.Get_size(), local_rank, local_size, node, n_nodes,
                   socket.gethostname(), backend, note)


def default_threads(local_size: int) -> int:
    """BLAS threads per rank: this node's cores shared evenly among its ranks (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_size))


class AgreedError(Exception):
    """An error every rank raises together (after :func:`agree`): exit cleanly, no abort needed."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def agree(comm: Any, error: BaseException | None, exit_code: int = 2) -> None:
    """Collective: if any rank had an error, raise AgreedError on every rank.

    The message is the lowest failing rank's, prefixed with its rank when not
    every rank failed, so that rank 0 can print what the failing rank saw.
    """
    errors = comm.allgather(None if error is None else str(error))
    failed = [r for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    first = failed[0]
    prefix = "" if len(failed) == len(errors) else f"rank {first}: "
    raise AgreedError(prefix + str(errors[first]), exit_code)
