"""``shared``: every rank on one node; buffers in node-shared memory are summed from the peers' copies.

:meth:`SharedReducer.shared_buffer` gives each rank n elements of one MPI-3
shared window that every rank maps. Data parallelism keeps its gradients there,
so a bucket (at the same offset on every rank) moves no data in messages:

1. "written": each rank sends its peers the bucket's (offset, size) and checks
   theirs, so ranks that start different buckets raise instead of adding
   the wrong memory;
2. rank r adds chunk r of all k buffers in rank order, x0 + x1 + ..., straight
   from the peers' memory, into its own chunk (all-reduce) or ``out``
   (reduce-scatter), then sends "summed";
3. all-reduce only: it copies every peer's reduced chunk into place, then
   sends "copied". An operation completes only when no peer will read this
   rank's buffer again, so the caller may then overwrite it.

``MPI_Win_sync`` on each side of every message is the memory fence between one
process's stores and another's loads. Later phases are posted when the handle
is tested. Buffers outside the window go to ``mpi`` (``deterministic`` with
``deterministic=True`` at k >= 3, so that every sum is in rank order). The window lives in
``/dev/shm``, where a full tmpfs kills the job with SIGBUS at a page's first
touch, so no rank gets a buffer unless every rank has twice its size free.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import (
    Array,
    Handle,
    Reducer,
    ScratchPool,
    add_in_rank_order,
    check_chunks,
    chunk_counts,
    on_one_node,
)
from mpisgd.comm.deterministic import DeterministicReducer
from mpisgd.comm.mpi import MpiReducer

TAG_BASE = 16_400
TAG_TRIPLES = 4_096  # operations in flight at once before a tag comes round again
SHM_DIR = "/dev/shm"  # where MPICH and Open MPI back shared windows on Linux


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Free bytes of the file system behind shared windows; None where there is none to ask."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class SharedOp:
    """One in-flight operation on a piece of the window (a Handle)."""

    def __init__(self, red: SharedReducer, off: int, counts: list[int], out: Array | None) -> None:
        k, r = red.size, red.rank
        self.red, self.out, self.gather = red, out, out is None
        self.bounds = [off]
        for c in counts:
            self.bounds.append(self.bounds[-1] + c)
        self.peers = [p for p in range(k) if p != r]
        red.seq += 1
        self.tag = TAG_BASE + 3 * (red.seq % TAG_TRIPLES)
        self.me = np.array([off, self.bounds[-1] - off], dtype=np.int64)
        self.theirs = np.zeros((len(self.peers), 2), dtype=np.int64)
        red.win.Sync()  # this bucket's stores, visible before "written" goes out
        self.reqs = [red.comm.Irecv(self.theirs[i], p, self.tag) for i, p in enumerate(self.peers)]
        self.reqs += [red.comm.Isend(self.me, p, self.tag) for p in self.peers]
        self.phase = 1  # 1: waiting for "written"; 2: for "summed"; 3: for "copied"; 4: done

    def _signal(self, tag: int) -> None:
        """Tell every peer we are past this phase, and post the receives of theirs."""
        comm = self.red.comm
        self.reqs = [comm.Irecv([None, 0, MPI.BYTE], p, tag) for p in self.peers]
        self.reqs += [comm.Isend([None, 0, MPI.BYTE], p, tag) for p in self.peers]

    def _sum(self) -> None:
        bad = [p for i, p in enumerate(self.peers) if (self.theirs[i] != self.me).any()]
        if bad:
            raise RuntimeError(f"shared-memory reduction: rank(s) {bad} reduce a different piece of the buffer "
                               f"(offset, size {dict(zip(self.peers, map(tuple, self.theirs.tolist())))}, "
                               f"this rank {tuple(self.me.tolist())}); ranks called different operations")
        red = self.red
        red.win.Sync()  # the peers' stores, visible to our loads
        lo, hi = self.bounds[red.rank], self.bounds[red.rank + 1]
        parts = [buf[lo:hi] for buf in red.bufs]  # rank order; parts[r] is our own chunk
        add_in_rank_order(parts, self.out if self.out is not None else parts[red.rank], red.scratch)
        red.win.Sync()
        self._signal(self.tag + 1)
        self.phase = 2

    def _copy(self) -> None:
        red, mine = self.red, self.red.mine
        assert mine is not None  # an operation runs on the buffer the reducer handed out
        red.win.Sync()
        for p in self.peers:  # every peer's reduced chunk, from its buffer into ours
            lo, hi = self.bounds[p], self.bounds[p + 1]
            mine[lo:hi] = red.bufs[p][lo:hi]
        self._signal(self.tag + 2)
        self.phase = 3

    def _advance(self, block: bool) -> bool:
        while self.phase < 4:
            if block:
                MPI.Request.Waitall(self.reqs)
            elif not MPI.Request.Testall(self.reqs):
                return False
            if self.phase == 1:
                self._sum()
            elif self.phase == 2 and self.gather:
                self._copy()
            else:
                self.phase = 4
        return True

    def test(self) -> bool:
        return self._advance(block=False)

    def wait(self) -> None:
        self._advance(block=True)


class SharedReducer(Reducer):
    """Pieces of :meth:`shared_buffer` are reduced in place from the peers' memory, in rank order; other
    buffers go to mpi, or with ``deterministic`` at k >= 3 to the deterministic strategy."""

    name = "shared"
    native_reduce_scatter = True

    def __init__(self, comm: Any, *, deterministic: bool = False) -> None:
        super().__init__(comm)
        if not on_one_node(self.comm):
            self.comm.Free()
            raise ValueError("the shared strategy needs every rank on one node; use auto, mpi or ring")
        self.other: Reducer = DeterministicReducer(self.comm) if deterministic and self.size > 2 \
            else MpiReducer(self.comm)
        self.win: Any = None
        self.bufs: list[Array] = []  # every rank's buffer, rank order, mapped here
        self.mine: Array | None = None
        self.scratch = ScratchPool()
        self.seq = 0
        self.refused = ""  # why shared_buffer() said no, for describe()

    def shared_buffer(self, n: int, dtype: Any) -> Array | None:
        """This rank's part of a window of n elements per rank (once per reducer; collective), or None."""
        if self.win is not None:
            return None
        dtype = np.dtype(dtype)
        need = self.size * n * dtype.itemsize
        free = shm_free_bytes()
        if not self.comm.allreduce(free is None or free >= 2 * need, op=MPI.LAND):
            self.refused = f"{need / 2**20:.0f} MiB wanted, twice that not free in {SHM_DIR} on some rank"
            return None
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each rank's part on its own pages, first touched by it
        self.win = MPI.Win.Allocate_shared(max(1, n) * dtype.itemsize, dtype.itemsize, info, comm=self.comm)
        info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch for the window's life: Sync() is the fence
        self.bufs = [np.frombuffer(self.win.Shared_query(p)[0], dtype=dtype, count=n) for p in range(self.size)]
        self.mine = self.bufs[self.rank]
        return self.mine

    def offset_of(self, view: Array) -> int | None:
        """Where ``view`` starts in this rank's window buffer (elements), if it is a contiguous piece of it."""
        mine = self.mine
        if mine is None or not isinstance(view, np.ndarray) or view.dtype != mine.dtype \
                or not view.flags.c_contiguous or view.size == 0:
            return None
        off, rem = divmod(view.ctypes.data - mine.ctypes.data, mine.itemsize)
        return off if rem == 0 and 0 <= off and off + view.size <= mine.size else None

    def allreduce_(self, buf: Array) -> None:
        self.start(buf).wait()

    def allreduce(self, src: Array, dst: Array) -> None:
        self.other.allreduce(src, dst)

    def start(self, buf: Array) -> Handle:
        off = self.offset_of(buf)
        if off is None:
            return self.other.start(buf)
        return SharedOp(self, off, chunk_counts(buf.size, self.size), None)

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        off = self.offset_of(buf)
        if off is None:
            return self.other.start_reduce_scatter(buf, out, counts)
        check_chunks(buf.size, out.size, counts, self.size, self.rank)
        return SharedOp(self, off, list(counts), out.reshape(-1))

    def describe(self) -> str:
        if self.win is not None:
            return "node-shared buffer on this node"
        return f"{self.other.name} (no node-shared buffer" + (f": {self.refused})" if self.refused else ")")

    def close(self) -> None:
        """Collective. Views of the shared buffer must not be used afterwards (data parallelism copies
        its gradients out first)."""
        self.bufs, self.mine = [], None
        self.scratch.clear()
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None
        self.other.close()
        super().close()
