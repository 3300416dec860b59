"""The ring's transport between ranks of one node: an MPI-3 shared-memory window instead of messages.

A point-to-point message between two processes of one node is copied twice
(the sender into a shared cell, the receiver out of it). Here every rank of
the node maps every rank's window slots (``MPI_Win_allocate_shared``): a rank
"sends" a chunk by writing it into its own slot, and its right neighbour adds
it straight out of that slot, one copy fewer per step. Steps are separated by
a barrier of the node, posted non-blocking, so an operation advances in
``test()`` as the point-to-point ring does.

Per slice of k chunks (one chunk = one slot, ``chunk_bytes``):

- reduce-scatter, k - 1 ring steps: at step s rank r adds the partial sum of
  chunk (r - s) that its left neighbour left in its slot to its own part and
  leaves the result in its own slot (two slots, alternating, so a step never
  overwrites what the right neighbour is still reading); after the last step
  it owns the reduced chunk (r + 1), in its result slot;
- all-gather: every rank copies each reduced chunk from its owner's result
  slot (one copy per chunk instead of the ring's two per step).

Summation order is the point-to-point ring's (chunk c starts at rank c), so
both transports give the same bits where they cut the buffer alike (at k = 2,
always). No barrier closes a slice: the next
slice (or operation) writes a result slot only after a barrier that every
rank reaches after its all-gather reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import Array, chunk_bounds

SHM_CHUNK_BYTES = 1 << 20  # one slot; a slice is k of them (measured best of 512 KiB, 1 MiB, 4 MiB at k = 2)
_ALIGN = 64


def single_node_comm(comm: Any) -> Any | None:
    """A communicator over the same ranks (same order) if they all share memory, else None (collective)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    if node.Get_size() == comm.Get_size():
        return node
    node.Free()
    return None


class ShmTransport:
    """Three slots per rank in a shared window; operations run one after another, FIFO."""

    def __init__(self, node: Any, chunk_bytes: int = SHM_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.node = node  # owned: freed in close()
        self.k, self.r = node.Get_size(), node.Get_rank()
        self.slot_bytes = -(-chunk_bytes // _ALIGN) * _ALIGN
        self.win: Any = None  # mapped at the first operation: a process that never uses it never holds one
        self.mem: list[Array] = []
        self.queue: deque[ShmRingOp] = deque()

    def _map(self) -> None:
        """Allocate and map the window (collective: every rank starts the same first operation)."""
        self.win = MPI.Win.Allocate_shared(3 * self.slot_bytes, 1, comm=self.node)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for the whole life: Sync() is then the memory fence
        self.mem = [np.frombuffer(self.win.Shared_query(j)[0], dtype=np.uint8) for j in range(self.k)]

    def slot(self, rank: int, s: int, dtype: Any, n: int) -> Array:
        """The first n elements of slot s (0, 1: reduce-scatter; 2: result) of ``rank``."""
        lo = s * self.slot_bytes
        return self.mem[rank][lo: lo + n * np.dtype(dtype).itemsize].view(dtype)

    def start(self, src: Array, dst: Array) -> ShmRingOp:
        if self.win is None:
            self._map()
        op = ShmRingOp(self, src, dst)
        self.queue.append(op)
        self.progress(op, block=False)  # the first step now: overlap starts at once
        return op

    def progress(self, until: ShmRingOp, block: bool) -> bool:
        """Advance the queue head by head until ``until`` is done (True) or, not blocking, a barrier is pending."""
        while self.queue:
            head = self.queue[0]
            if not head.advance(block):
                return False
            self.queue.popleft()
            if head is until:
                return True
        return until.done

    def close(self) -> None:
        for op in list(self.queue):  # complete what was started: every rank started the same operations
            self.progress(op, block=True)
        self.mem.clear()
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None
        self.node.Free()


class ShmRingOp:
    """One all-reduce of ``src`` into ``dst`` (flat host arrays, possibly the same) through the window."""

    def __init__(self, shm: ShmTransport, src: Array, dst: Array) -> None:
        self.shm, self.src, self.dst = shm, src, dst
        self.chunk_elems = max(1, shm.slot_bytes // dst.itemsize)
        self.steps = self._steps()
        self.barrier: Any = None
        self.done = False

    def _steps(self) -> Iterator[None]:
        """The schedule; each ``yield`` is a barrier of the node between two steps."""
        shm, src, dst = self.shm, self.src, self.dst
        k, r, dt = shm.k, shm.r, dst.dtype
        left = (r - 1) % k
        per_slice = k * self.chunk_elems
        for lo in range(0, dst.size, per_slice):
            b = [lo + x for x in chunk_bounds(min(per_slice, dst.size - lo), k)]
            size = [b[c + 1] - b[c] for c in range(k)]
            shm.slot(r, 0, dt, size[r])[...] = src[b[r]:b[r + 1]]
            yield
            for s in range(1, k):
                c = (r - s) % k
                out = shm.slot(r, s % 2 if s < k - 1 else 2, dt, size[c])
                np.add(shm.slot(left, (s - 1) % 2, dt, size[c]), src[b[c]:b[c + 1]], out=out)
                yield
            for c in range(k):  # chunk c was reduced by rank c - 1
                dst[b[c]:b[c + 1]] = shm.slot((c - 1) % k, 2, dt, size[c])

    def advance(self, block: bool) -> bool:
        while not self.done:
            if self.barrier is not None:
                if block:
                    self.barrier.Wait()
                elif not self.barrier.Test():
                    return False
                self.barrier = None
                self.shm.win.Sync()  # see what the others wrote before the barrier
            try:
                next(self.steps)
            except StopIteration:
                self.done = True
                break
            self.shm.win.Sync()  # our writes, visible before the barrier completes
            self.barrier = self.shm.node.Ibarrier()
        return True

    def test(self) -> bool:
        return self.done or self.shm.progress(self, block=False)

    def wait(self) -> None:
        if not self.done:
            self.shm.progress(self, block=True)
