"""``mpi``: the MPI library's own Allreduce, blocking and non-blocking, host or CUDA-aware buffers."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import Array, Handle, Reducer, RequestHandle, check_chunks

_SUMMABLE: dict[Any, MPI.Datatype | None] = {}  # on the latency path of every small all-reduce


def mpi_sum_type(dtype: Any) -> MPI.Datatype | None:
    """The *predefined* MPI datatype of a NumPy dtype (reductions are defined only on those), or None
    where the library has none (float16 outside MPICH): callers then pick the ring.

    mpi4py.util.dtlib builds a derived (duplicated) type, on which MPICH refuses MPI_SUM.
    """
    if dtype not in _SUMMABLE:
        # Datatype.fromcode is mpi4py >= 4; 3.x (Debian's python3-mpi4py) keeps the same table private
        fromcode = getattr(MPI.Datatype, "fromcode", None) or MPI._typedict.__getitem__
        try:
            _SUMMABLE[dtype] = fromcode(np.dtype(dtype).char)
        except (KeyError, ValueError):
            _SUMMABLE[dtype] = None
    return _SUMMABLE[dtype]


def mpi_buffer(buf: Array) -> list[Any]:
    """[buffer, MPI datatype] with the datatype derived from the dtype, never a guessed itemsize."""
    dt = _SUMMABLE.get(buf.dtype) or mpi_sum_type(buf.dtype)
    if dt is None:
        raise TypeError(f"this MPI library has no predefined datatype for {buf.dtype}, so it cannot sum it; "
                        "use the ring or auto strategy")
    return [buf, dt]


class MpiReducer(Reducer):
    """``MPI_Allreduce(MPI_IN_PLACE, SUM)``: the simplest strategy and the test oracle."""

    name = "mpi"
    native_reduce_scatter = True

    def allreduce_(self, buf: Array) -> None:
        dt = _SUMMABLE.get(buf.dtype)  # inline: this call is the latency of every small all-reduce
        self.comm.Allreduce(MPI.IN_PLACE, [buf, dt] if dt is not None else mpi_buffer(buf), op=MPI.SUM)

    def allreduce(self, src: Array, dst: Array) -> None:
        self.comm.Allreduce(mpi_buffer(src), mpi_buffer(dst), op=MPI.SUM)

    def start(self, buf: Array) -> Handle:
        return RequestHandle(self.comm.Iallreduce(MPI.IN_PLACE, mpi_buffer(buf), op=MPI.SUM), buf)

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        """``MPI_Ireduce_scatter``: each rank receives only its chunk of the sum (half an all-reduce's traffic)."""
        check_chunks(buf.size, out.size, counts, self.size, self.rank)
        return RequestHandle(self.comm.Ireduce_scatter(mpi_buffer(buf), mpi_buffer(out), counts, op=MPI.SUM),
                             buf, out)

    def describe(self) -> str:
        return "mpi (the MPI library's Allreduce)"
