"""``auto``: the MPI library's Allreduce below a measured size crossover, our ring above it."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from mpisgd.comm.base import Array, Handle, Reducer
from mpisgd.comm.mpi import MpiReducer, mpi_sum_type
from mpisgd.comm.ring import RingReducer

# Measured with benchmarks/allreduce_bw.py at k = 2 (MPICH 5.0.2; docs/allreduce.md): below 512 KiB
# MPICH's Allreduce wins (latency: our ring pays 2(k-1) message rounds of Python); from 512 KiB our
# ring is as fast or faster, and 2-3x faster from 32 MiB, where MPICH's large-message path drops.
CROSSOVER_BYTES = 512 << 10


class AutoReducer(Reducer):
    """Per buffer: ``mpi`` when ``nbytes < crossover_bytes``, else ``ring``; one size test of overhead."""

    name = "auto"

    def __init__(self, comm: Any, *, crossover_bytes: int = CROSSOVER_BYTES, ring: RingReducer | None = None) -> None:
        super().__init__(comm)
        self.crossover_bytes = crossover_bytes
        self.mpi = MpiReducer(comm)
        self.ring = ring or RingReducer(comm)

    def _pick(self, buf: Array) -> Reducer:
        if buf.nbytes < self.crossover_bytes and mpi_sum_type(buf.dtype) is not None:
            return self.mpi
        return self.ring  # large, or a dtype the library cannot sum

    def allreduce_(self, buf: Array) -> None:
        if buf.nbytes < self.crossover_bytes:  # inlined: at 4 B every 100 ns is a few percent of the latency
            dt = mpi_sum_type(buf.dtype)
            if dt is not None:
                if self.size > 1:
                    self.comm.Allreduce(MPI.IN_PLACE, [buf, dt], MPI.SUM)
                return
        self.ring.allreduce_(buf)

    def allreduce(self, src: Array, dst: Array) -> None:
        self._pick(dst).allreduce(src, dst)

    def start(self, buf: Array) -> Handle:
        return self._pick(buf).start(buf)

    def describe(self) -> str:
        return f"auto (mpi below {self.crossover_bytes / 2**20:g} MiB, else {self.ring.describe()})"

    def close(self) -> None:
        self.ring.close()
        self.mpi.close()
