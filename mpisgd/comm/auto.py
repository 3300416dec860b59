"""``auto``: the MPI library's Allreduce below a measured size crossover, our ring above it."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from mpisgd.comm.base import Array, Handle, Reducer
from mpisgd.comm.mpi import MpiReducer, mpi_sum_type
from mpisgd.comm.ring import RingReducer

# Measured with benchmarks/allreduce_bw.py at k = 2 (MPICH 5.0.2; docs/allreduce.md). Below the crossover
# MPICH's Allreduce wins (latency: our ring pays Python per step); above it our ring is faster. MPICH's
# in-place path is its quicker one at mid sizes, so in place and out of place cross at different sizes.
# Ring through the shared-memory window (every rank on one node), 2026-11-30: in place ring/mpi was 0.87-0.88
# at 256 KiB and 1.22-1.31 at 512 KiB; out of place 0.70-0.80 at 32 KiB and 1.20-1.58 at 64 KiB.
CROSSOVER_BYTES = 512 << 10
OUT_OF_PLACE_CROSSOVER_BYTES = 64 << 10
# Ring over messages (ranks on several nodes, and every non-blocking start), two runs of 2026-11-29 on
# one node: in place 0.88-0.94 at 512 KiB and 1.03-1.04 at 1 MiB; out of place 0.73-0.77 at 128 KiB and
# 1.03-1.05 at 256 KiB. Iallreduce measured the same as Allreduce at 64 KiB-16 MiB.
P2P_CROSSOVER_BYTES = 1 << 20
P2P_OUT_OF_PLACE_CROSSOVER_BYTES = 256 << 10


class AutoReducer(Reducer):
    """Per buffer: ``mpi`` below the crossover, else ``ring``; one size test of overhead.

    Three crossovers, because the ring's transport differs by call (RingReducer.uses_shm): blocking
    in place (``crossover_bytes``), blocking out of place (``out_of_place_crossover_bytes``) and
    non-blocking ``start`` (``start_crossover_bytes``: always messages). Left out, each is the value
    measured for its transport; an explicit ``crossover_bytes`` alone sets all three."""

    name = "auto"

    def __init__(self, comm: Any, *, crossover_bytes: int | None = None,
                 out_of_place_crossover_bytes: int | None = None, start_crossover_bytes: int | None = None,
                 ring: RingReducer | None = None) -> None:
        super().__init__(comm)
        self.mpi = MpiReducer(comm)
        self.ring = ring or RingReducer(comm)
        shm = self.ring.shm is not None and self.ring.shm_max_bytes is not None  # auto transport on one node
        if crossover_bytes is None:
            crossover_bytes = CROSSOVER_BYTES if shm else P2P_CROSSOVER_BYTES
            out_of_place_crossover_bytes = out_of_place_crossover_bytes or \
                (OUT_OF_PLACE_CROSSOVER_BYTES if shm else P2P_OUT_OF_PLACE_CROSSOVER_BYTES)
            start_crossover_bytes = start_crossover_bytes or P2P_CROSSOVER_BYTES
        self.crossover_bytes = crossover_bytes
        self.oop_crossover_bytes = out_of_place_crossover_bytes or crossover_bytes
        self.start_crossover_bytes = start_crossover_bytes or crossover_bytes

    def _pick(self, buf: Array, crossover_bytes: int) -> Reducer:
        if buf.nbytes < crossover_bytes and mpi_sum_type(buf.dtype) is not None:
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
        if dst.nbytes < self.oop_crossover_bytes and self.size > 1:  # inlined, as in allreduce_
            dt = mpi_sum_type(dst.dtype)
            if dt is not None:
                self.comm.Allreduce([src, dt], [dst, dt], MPI.SUM)
                return
        self._pick(dst, self.oop_crossover_bytes).allreduce(src, dst)

    def start(self, buf: Array) -> Handle:
        return self._pick(buf, self.start_crossover_bytes).start(buf)

    def describe(self) -> str:
        return (f"auto (mpi below {self.crossover_bytes / 2**20:g} MiB in place, "
                f"{self.oop_crossover_bytes / 2**20:g} MiB out of place, "
                f"{self.start_crossover_bytes / 2**20:g} MiB non-blocking; else {self.ring.describe()})")

    def close(self) -> None:
        self.ring.close()
        self.mpi.close()
