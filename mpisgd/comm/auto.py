"""``auto``: the MPI library's Allreduce below a measured size crossover, our ring above it."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import Array, Handle, Reducer
from mpisgd.comm.direct import DirectOps
from mpisgd.comm.mpi import MpiReducer, mpi_sum_type
from mpisgd.comm.ring import RingReducer
from mpisgd.comm.shared import SHM_DIR, SharedArena, shm_free_bytes
from mpisgd.comm.shm import single_node_comm

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
    native_reduce_scatter = True

    def __init__(self, comm: Any, *, crossover_bytes: int | None = None,
                 out_of_place_crossover_bytes: int | None = None, start_crossover_bytes: int | None = None,
                 ring: RingReducer | None = None) -> None:
        super().__init__(comm)
        self.mpi = MpiReducer(comm)
        self.ring = ring or RingReducer(comm)
        shm = self.ring.shm is not None and self.ring.shm_max_bytes is not None  # auto transport on one node
        measured = (CROSSOVER_BYTES, OUT_OF_PLACE_CROSSOVER_BYTES, P2P_CROSSOVER_BYTES) if shm else \
            (P2P_CROSSOVER_BYTES, P2P_OUT_OF_PLACE_CROSSOVER_BYTES, P2P_CROSSOVER_BYTES)
        defaults = measured if crossover_bytes is None else (crossover_bytes,) * 3
        given = (crossover_bytes, out_of_place_crossover_bytes, start_crossover_bytes)
        self.crossover_bytes, self.oop_crossover_bytes, self.start_crossover_bytes = (
            d if g is None else g for g, d in zip(given, defaults))
        # every rank on this node: the direct operations, over this private copy of comm (same ranks, same
        # order) so that their tags never meet anyone else's messages
        node = single_node_comm(comm) if self.size > 1 else None
        self.direct = DirectOps(node) if node is not None else None
        self.arena: SharedArena | None = None  # made by shared_buffer(), on one node only
        self.arena_refused = ""  # why shared_buffer() said no, for the banner

    def shared_buffer(self, n: int, dtype: Any) -> Array | None:
        """On one node (host buffers), a buffer in a window every rank maps: buckets of it are reduced
        in place from the peers' memory (mpisgd.comm.shared). One per reducer."""
        if self.direct is None or self.arena is not None:
            return None
        # every rank's part lives in the node's tmpfs: a full one would kill the job with SIGBUS when a page
        # is first touched, so all ranks decline together unless it has room for twice the window
        need = self.size * n * np.dtype(dtype).itemsize
        free = shm_free_bytes()
        room = free is None or free >= 2 * need
        if not self.direct.comm.allreduce(room, op=MPI.LAND):
            self.arena_refused = (f"gradients kept private: {need / 2**20:.0f} MiB of node-shared memory wanted, "
                                  f"twice that not free in {SHM_DIR} on some rank")
            return None
        self.arena = SharedArena(self.direct.comm.Dup(), n, dtype)
        return self.arena.mine

    def _pick(self, buf: Array, crossover_bytes: int) -> Reducer:
        if buf.nbytes < crossover_bytes and mpi_sum_type(buf.dtype) is not None:
            return self.mpi
        return self.ring  # large, or a dtype the library cannot sum

    def _mpi_if_small(self, src: Array, dst: Array, crossover_bytes: int) -> bool:
        """Below the crossover, MPI_Allreduce straight away (True); inlined rather than through
        ``self.mpi``: at 4 B every 100 ns is a few percent of the latency."""
        if dst.nbytes >= crossover_bytes:
            return False
        dt = mpi_sum_type(dst.dtype)
        if dt is None:
            return False  # a dtype the library cannot sum: the ring
        if self.size > 1:
            self.comm.Allreduce(MPI.IN_PLACE if src is dst else [src, dt], [dst, dt], MPI.SUM)
        elif src is not dst:
            dst[...] = src
        return True

    def allreduce_(self, buf: Array) -> None:
        if not self._mpi_if_small(buf, buf, self.crossover_bytes):
            self.ring.allreduce_(buf)

    def allreduce(self, src: Array, dst: Array) -> None:
        if not self._mpi_if_small(src, dst, self.oop_crossover_bytes):
            self.ring.allreduce(src, dst)

    def start(self, buf: Array) -> Handle:
        """A piece of the shared buffer (see :meth:`shared_buffer`): reduced in place from the peers'
        memory, any size. Otherwise below the crossover the library's ``Iallreduce``; above it, on one
        node, the direct all-reduce (mpisgd.comm.direct), else the ring over messages."""
        if self.arena is not None and self.arena.offset_of(buf) is not None:
            return self.arena.allreduce(buf)
        red = self._pick(buf, self.start_crossover_bytes)
        if red is self.ring and self.direct is not None and isinstance(buf, np.ndarray):
            return self.direct.allreduce(buf)
        return red.start(buf)

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        """A piece of the shared buffer: reduced in place from the peers' memory (mpisgd.comm.shared:
        0.64x the direct reduce-scatter's time for the reference buckets at k = 2). Other buffers on one
        node: the direct reduce-scatter (mpisgd.comm.direct: 0.8x the library's time); else the library's
        ``Ireduce_scatter`` (in training at k = 2 it tied with the ring's own reduce-scatter), or the ring
        where the library cannot sum the dtype."""
        if self.arena is not None and self.arena.offset_of(buf) is not None:
            return self.arena.reduce_scatter(buf, out, counts)
        if self.direct is not None and isinstance(buf, np.ndarray):
            return self.direct.reduce_scatter(buf, out, counts)
        if mpi_sum_type(buf.dtype) is not None:
            return self.mpi.start_reduce_scatter(buf, out, counts)
        return self.ring.start_reduce_scatter(buf, out, counts)

    def describe(self) -> str:
        return (f"auto (mpi below {self.crossover_bytes / 2**20:g} MiB in place, "
                f"{self.oop_crossover_bytes / 2**20:g} MiB out of place, "
                f"{self.start_crossover_bytes / 2**20:g} MiB non-blocking; else {self.ring.describe()}"
                + ("; on this node the direct operations for non-blocking buffers from the crossover and "
                   "every reduce-scatter" if self.direct is not None else "")
                + ("; a node-shared buffer reduced in place from the peers' memory" if self.arena is not None
                   else "") + (f"; {self.arena_refused}" if self.arena_refused else "") + ")")

    def close(self) -> None:
        self.ring.close()
        self.mpi.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self.direct is not None:
            self.direct.comm.Free()
            self.direct = None
