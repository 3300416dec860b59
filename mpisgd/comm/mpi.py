"""The MPI library's own Allreduce, blocking and non-blocking, host or CUDA-aware."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import Array, Handle, Reducer, RequestHandle

_PREDEFINED: dict[np.dtype, MPI.Datatype] = {}  # on the latency path of every small all-reduce


def mpi_datatype(dtype: Any) -> MPI.Datatype:
    """The *predefined* MPI datatype of a NumPy dtype (reductions are defined only on those).

    mpi4py.util.dtlib builds a derived (duplicated) type, on which MPICH refuses MPI_SUM.
    """
    dt = _PREDEFINED.get(dtype)
    if dt is None:
        dtype = np.dtype(dtype)
        try:
            # Datatype.fromcode is mpi4py >= 4; 3.x (Debian's python3-mpi4py) keeps the same table private
            fromcode = getattr(MPI.Datatype, "fromcode", None) or MPI._typedict.__getitem__
            dt = _PREDEFINED[dtype] = fromcode(dtype.char)
        except (KeyError, ValueError):
            raise TypeError(f"no predefined MPI datatype for {dtype}, so this MPI cannot sum it; "
                            "use the ring or auto strategy") from None
    return dt


_SUMMABLE: dict[Any, MPI.Datatype | None] = {}


def mpi_sum_type(dtype: Any) -> MPI.Datatype | None:
    """mpi_datatype, or None where the library has none (float16 outside MPICH): callers pick the ring."""
    if dtype not in _SUMMABLE:
        try:
            _SUMMABLE[dtype] = mpi_datatype(dtype)
        except TypeError:
            _SUMMABLE[dtype] = None
    return _SUMMABLE[dtype]


def mpi_buffer(buf: Array) -> list[Any]:
    """[buffer, MPI datatype] with the datatype derived from the dtype, never a guessed itemsize."""
    return [buf, mpi_datatype(buf.dtype)]


class MpiReducer(Reducer):
    """``MPI_Allreduce(MPI_IN_PLACE, SUM)``: the simplest strategy and the test oracle."""

    name = "mpi"
    native_reduce_scatter = True

    def allreduce_(self, buf: Array) -> None:
        if self.size > 1:
            self.comm.Allreduce(MPI.IN_PLACE, mpi_buffer(buf), op=MPI.SUM)

    def allreduce(self, src: Array, dst: Array) -> None:
        if self.size > 1:
            self.comm.Allreduce(mpi_buffer(src), mpi_buffer(dst), op=MPI.SUM)
        else:
            dst[...] = src

    def start(self, buf: Array) -> Handle:
        return RequestHandle(self.comm.Iallreduce(MPI.IN_PLACE, mpi_buffer(buf), op=MPI.SUM))

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        """``MPI_Ireduce_scatter``: each rank receives only its chunk of the sum (half the traffic of an
        all-reduce)."""
        dt = mpi_datatype(buf.dtype)
        return RequestHandle(self.comm.Ireduce_scatter([buf, dt], [out, dt], counts, op=MPI.SUM))
