"""Reductions of buffers that live in node-shared memory: every rank reads its peers' buffers in place.

``SharedArena(node, n, dtype)`` gives each rank of one node a buffer of n
elements in one MPI-3 shared window (``MPI_Win_allocate_shared``) and maps
every peer's. Data parallelism keeps its gradient buffer there (see
``Reducer.shared_buffer``); then a bucket, which sits at the same offset on
every rank, needs no message carrying data at all:

- reduce-scatter: once every peer says its bucket is written, rank r adds
  chunk r of all k buffers in rank order, x0 + x1 + ... + x(k-1), reading the
  peers' memory directly: one add, where the direct operations
  (mpisgd.comm.direct) first copy each peer's chunk into scratch;
- all-reduce: that, into its own chunk, then each rank copies every peer's
  reduced chunk into place (one copy, as in the direct all-reduce).

Ranks tell each other where they are with small messages (the bucket's
offset and size, checked on arrival, so ranks that disagree raise instead of
adding the wrong memory): "written" (phase 1), "summed, done reading yours"
(phase 2) and, for an all-reduce, "copied" (phase 3). An operation completes
only when no peer will read this rank's buffer again, so the caller may then
overwrite it. A ``MPI_Win_sync`` on each side of every message is the memory
fence the MPI standard asks for between the stores of one process and the
loads of another.

Same summation order as the direct operations and the deterministic ring, so
the same bits. Like them, a later phase is posted only when the handle is
tested (the Reducer contract on several open handles applies).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import Array, ScratchPool, add_in_rank_order, check_chunks, chunk_bounds

TAG_BASE = 16_400
TAG_TRIPLES = 4_096  # operations in flight at once before a tag comes round again
SHM_DIR = "/dev/shm"  # where MPICH and Open MPI back shared windows on Linux: a tmpfs, often small in containers


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Free bytes of the file system behind shared windows; None where there is none to ask."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class SharedArena:
    """One buffer of n elements per rank of ``node`` in a shared window; ``mine`` is this rank's."""

    def __init__(self, node: Any, n: int, dtype: Any) -> None:
        self.node = node  # owned: freed in close()
        self.k, self.r = node.Get_size(), node.Get_rank()
        self.dtype = np.dtype(dtype)
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each rank's part on its own pages, first touched by it
        self.win = MPI.Win.Allocate_shared(max(1, n) * self.dtype.itemsize, self.dtype.itemsize, info, comm=node)
        info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch for the window's life: Sync() is the fence
        self.bufs = [np.frombuffer(self.win.Shared_query(p)[0], dtype=self.dtype, count=n) for p in range(self.k)]
        self.mine = self.bufs[self.r]
        self.n = n
        self.scratch = ScratchPool()
        self.seq = 0

    def offset_of(self, view: Array) -> int | None:
        """Where ``view`` starts in ``mine`` (elements), if it is a contiguous piece of it; else None."""
        if not isinstance(view, np.ndarray) or view.dtype != self.dtype or not view.flags.c_contiguous \
                or view.size == 0:
            return None
        delta = view.ctypes.data - self.mine.ctypes.data
        off, rem = divmod(delta, self.dtype.itemsize)
        return off if rem == 0 and 0 <= off and off + view.size <= self.n else None

    def next_tag(self) -> int:
        self.seq += 1
        return TAG_BASE + 3 * (self.seq % TAG_TRIPLES)

    def allreduce(self, view: Array) -> SharedOp:
        """Begin view <- the sum over ranks of the same piece of every rank's buffer, in place."""
        flat = view.reshape(-1)
        bounds = chunk_bounds(flat.size, self.k)
        return SharedOp(self, flat, [bounds[c + 1] - bounds[c] for c in range(self.k)], None)

    def reduce_scatter(self, view: Array, out: Array, counts: list[int]) -> SharedOp:
        """Begin out <- chunk r of that sum (chunk c has counts[c] elements, rank order)."""
        check_chunks(view.size, out.size, counts, self.k, self.r)
        return SharedOp(self, view.reshape(-1), list(counts), out.reshape(-1))

    def close(self) -> None:
        """Collective. Views of ``mine`` must not be used afterwards (data parallelism copies its
        gradients out first)."""
        self.bufs, self.mine = [], None
        self.scratch.clear()
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()


class SharedOp:
    """One in-flight operation on a piece of the arena (a Handle)."""

    def __init__(self, arena: SharedArena, view: Array, counts: list[int], out: Array | None) -> None:
        off = arena.offset_of(view)
        if off is None:
            raise ValueError("a shared-memory reduction needs a contiguous piece of this rank's arena buffer")
        self.arena, self.out, self.gather = arena, out, out is None
        k, r = arena.k, arena.r
        self.bounds = [off]
        for c in counts:
            self.bounds.append(self.bounds[-1] + c)
        self.peers = [p for p in range(k) if p != r]
        self.tag = arena.next_tag()
        self.me = np.array([off, view.size], dtype=np.int64)
        self.theirs = np.zeros((len(self.peers), 2), dtype=np.int64)
        arena.win.Sync()  # this bucket's stores, visible before "written" goes out
        self.reqs = [arena.node.Irecv(self.theirs[i], p, self.tag) for i, p in enumerate(self.peers)]
        self.reqs += [arena.node.Isend(self.me, p, self.tag) for p in self.peers]
        self.phase = 1  # 1: waiting for "written"; 2: for "summed"; 3: for "copied"; 4: done

    def _signal(self, tag: int) -> None:
        """Tell every peer we are past this phase, and post the receives of theirs."""
        node = self.arena.node
        self.reqs = [node.Irecv([None, 0, MPI.BYTE], p, tag) for p in self.peers]
        self.reqs += [node.Isend([None, 0, MPI.BYTE], p, tag) for p in self.peers]

    def _sum(self) -> None:
        bad = [p for i, p in enumerate(self.peers) if (self.theirs[i] != self.me).any()]
        if bad:
            raise RuntimeError(f"shared-memory reduction: rank(s) {bad} reduce a different piece of the buffer "
                               f"(offset, size {dict(zip(self.peers, map(tuple, self.theirs.tolist())))}, "
                               f"this rank {tuple(self.me.tolist())}); ranks called different operations")
        a = self.arena
        a.win.Sync()  # the peers' stores, visible to our loads
        lo, hi = self.bounds[a.r], self.bounds[a.r + 1]
        parts = [buf[lo:hi] for buf in a.bufs]  # rank order; parts[r] is our own chunk
        add_in_rank_order(parts, self.out if self.out is not None else parts[a.r], a.r, a.scratch)
        a.win.Sync()
        self._signal(self.tag + 1)
        self.phase = 2

    def _copy(self) -> None:
        a = self.arena
        a.win.Sync()
        for p in self.peers:  # every peer's reduced chunk, from its buffer into ours
            lo, hi = self.bounds[p], self.bounds[p + 1]
            a.mine[lo:hi] = a.bufs[p][lo:hi]
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
