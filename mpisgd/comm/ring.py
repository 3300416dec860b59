"""``ring``: our own ring all-reduce, reduce-scatter then all-gather, segments pipelined with Isend/Irecv.

The buffer is cut into *slices* of k segments. Each slice is all-reduced
round the ring in 2(k-1) steps: k-1 steps of reduce-scatter (receive a
partial sum from the left, add our part, pass it right) leave each rank one
reduced chunk, then k-1 steps of all-gather pass those round. Each rank sends
2(k-1)/k of the buffer whatever k, the bandwidth-optimal all-reduce; up to
``window`` slices are in flight, so while one segment is added the next are on
the wire (NCCL's pipelining, over MPI point-to-point). Chunk c of a slice is
summed starting at rank c, so at k >= 3 the bits depend on the slicing (the
``deterministic`` strategy fixes the order).

Progress: ``start`` posts the first messages; the handle's ``test()`` handles
whatever has arrived, never blocking, and ``wait()`` blocks. MPI moves data
only inside MPI calls, so DataParallel tests open handles after every layer.
Tags derive from (operation, slice, step): several operations may be in flight.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from mpi4py import MPI

from mpisgd.backend import sync, xp_of
from mpisgd.comm.base import Array, Done, Handle, Reducer, ScratchPool, byte_spec, chunk_bounds, flat_view

# The ring's slices (why these sizes: docs/allreduce.md, "How the ring works")
SEGMENT_BYTES = 4 << 20  # most bytes per chunk per slice: large, to amortise Python's cost per message
MIN_SEGMENT_BYTES = 1 << 20  # ... but smaller for mid-size buffers, so that they still pipeline
PIPELINE_SLICES = 4  # ... aiming at this many slices per buffer between the two bounds
WINDOW = 8  # slices in their reduce-scatter phase at once; scratch = window * segment
SCRATCH_CAP_BYTES = 64 << 20  # fewer slices in flight rather than more scratch


class _Tags:
    """Distinct tags for (operation, slice, step), wrapping far apart within MPI_TAG_UB."""

    def __init__(self, comm: Any, nsteps: int) -> None:
        ub = comm.Get_attr(MPI.TAG_UB) or 32767
        self.nsteps = nsteps
        self.slice_mod = max(1, min(4096, (ub + 1) // (nsteps * 16)))
        self.op_mod = max(1, (ub + 1) // (nsteps * self.slice_mod))
        self.seq = 0

    def next_op(self) -> int:
        self.seq += 1
        return (self.seq % self.op_mod) * self.slice_mod * self.nsteps

    def tag(self, base: int, i: int, step: int) -> int:
        return base + (i % self.slice_mod) * self.nsteps + step


class RingOp:
    """One in-flight ring all-reduce of ``src`` into ``dst`` (the same array when in place).

    Work is a FIFO of entries [requests, on_done]; on_done may return an entry
    that replaces the head (a receive posted once the send it overwrites is complete).
    """

    def __init__(self, red: RingReducer, src: Array, dst: Array) -> None:
        self.red = red
        self.src, self.dst = src, dst
        self.k, self.r = red.size, red.rank
        self.left, self.right = (self.r - 1) % self.k, (self.r + 1) % self.k
        self.xp = xp_of(dst)
        self.seg_elems = max(1, min(red.segment_bytes, max(red.min_segment_bytes, -(-dst.nbytes // (
            self.k * PIPELINE_SLICES)))) // dst.itemsize)
        self.slice_elems = self.k * self.seg_elems
        self.nslices = -(-dst.size // self.slice_elems)
        self.max_chunk = -(-min(dst.size, self.slice_elems) // self.k)
        fit = max(1, SCRATCH_CAP_BYTES // (self.max_chunk * dst.itemsize))
        self.window = min(red.window, self.nslices, fit)
        self.base = red.tags.next_op()
        self.pending: deque[list[Any]] = deque()
        self.sends: list[Any] = []
        self.first_sends: dict[tuple[int, int], Any] = {}  # (slice, chunk) -> the first send reading that chunk
        self.next_slice = 0
        self.scratch = red.scratch.take(dst.dtype, self.window * self.max_chunk, self.xp)
        self.done = False
        for _ in range(self.window):
            self._admit()

    def _chunk(self, arr: Array, i: int, c: int) -> Array:
        """Chunk c of slice i: the slice's c-th near-equal part."""
        lo = i * self.slice_elems
        b = chunk_bounds(min(self.slice_elems, arr.size - lo), self.k)
        return arr[lo + b[c]: lo + b[c + 1]]

    def _slot(self, i: int) -> Array:
        """Scratch for slice i, reused by slice i + window."""
        s = i % self.window
        return self.scratch[s * self.max_chunk:(s + 1) * self.max_chunk]

    def _isend(self, a: Array, dest: int, i: int, step: int) -> Any:
        req = self.red.comm.Isend(byte_spec(a), dest, self.red.tags.tag(self.base, i, step))
        self.sends.append(req)
        return req

    def _irecv(self, a: Array, source: int, i: int, step: int) -> Any:
        return self.red.comm.Irecv(byte_spec(a), source, self.red.tags.tag(self.base, i, step))

    # -- schedule ------------------------------------------------------------------------
    def _admit(self) -> None:
        """Start the next slice: send our chunk r right, receive chunk r - 1's partial sum from the left."""
        i = self.next_slice
        self.next_slice += 1
        recv = self._chunk(self.dst, i, (self.r - 1) % self.k)
        req = self._irecv(self._slot(i)[:recv.size], self.left, i, 0)
        self.first_sends[(i, self.r)] = self._isend(self._chunk(self.src, i, self.r), self.right, i, 0)
        self.pending.append([[req], lambda: self._rs_step(i, 0)])

    def _rs_step(self, i: int, s: int) -> list[Any] | None:
        """Reduce-scatter step s of slice i has arrived: add it, pass it on."""
        k, r = self.k, self.r
        c = (r - s - 1) % k
        out = self._chunk(self.dst, i, c)
        self.xp.add(self._chunk(self.src, i, c), self._slot(i)[:out.size], out=out)
        sync(out)  # a device buffer must be written before MPI reads it
        if s + 1 < k - 1:
            nc = (r - s - 2) % k
            req = self._irecv(self._slot(i)[:self._chunk(self.dst, i, nc).size], self.left, i, s + 1)
            self.first_sends[(i, c)] = self._isend(out, self.right, i, s + 1)
            self.pending.append([[req], lambda: self._rs_step(i, s + 1)])
        else:  # this rank now owns the reduced chunk (r + 1) % k: pass it round (the all-gather)
            self._isend(out, self.right, i, k - 1)
            self._post_ag(i, 0)
            if self.next_slice < self.nslices:
                self._admit()
        return None

    def _post_ag(self, i: int, s: int) -> None:
        """Post all-gather receive s of slice i (tag step k - 1 + s): chunk (r - s) from the left.

        The receive overwrites a chunk that our first send of it may still be
        reading: wait for that send first (it has completed in practice, since
        what arrives depends on it) by queueing a gate before the receive.
        """
        c = (self.r - s) % self.k
        gate = self.first_sends.pop((i, c), None)

        def post() -> list[Any]:
            req = self._irecv(self._chunk(self.dst, i, c), self.left, i, self.k - 1 + s)
            return [[req], lambda: self._ag_step(i, s)]

        self.pending.append(post() if gate is None else [[gate], post])

    def _ag_step(self, i: int, s: int) -> list[Any] | None:
        if s + 1 < self.k - 1:  # pass the chunk just received on, receive the next
            self._isend(self._chunk(self.dst, i, (self.r - s) % self.k), self.right, i, self.k + s)
            self._post_ag(i, s + 1)
        return None

    # -- progress ------------------------------------------------------------------------
    def _advance(self, block: bool) -> bool:
        while self.pending:
            head = self.pending[0]
            if block:
                MPI.Request.Waitall(head[0])
            elif not MPI.Request.Testall(head[0]):
                return False
            self.pending.popleft()
            nxt = head[1]()
            if nxt is not None:
                self.pending.appendleft(nxt)
        if block:
            MPI.Request.Waitall(self.sends)
        elif not MPI.Request.Testall(self.sends):
            return False
        if not self.done:
            self.done = True
            self.sends.clear()
            self.red.scratch.give(self.scratch)
        return True

    def test(self) -> bool:
        return self.done or self._advance(block=False)

    def wait(self) -> None:
        if not self.done:
            self._advance(block=True)


class RingReducer(Reducer):
    """The pipelined ring over point-to-point messages."""

    name = "ring"

    def __init__(self, comm: Any, *, segment_bytes: int = SEGMENT_BYTES, window: int = WINDOW) -> None:
        if segment_bytes < 1 or window < 1:
            raise ValueError(f"segment_bytes and window must be >= 1, got {segment_bytes} and {window}")
        super().__init__(comm)
        self.segment_bytes = segment_bytes
        self.min_segment_bytes = min(segment_bytes, MIN_SEGMENT_BYTES)
        self.window = window
        self.tags = _Tags(self.comm, 2 * self.size)
        self.scratch = ScratchPool()

    def describe(self) -> str:
        return "ring (our pipelined ring over MPI messages)"

    def allreduce_(self, buf: Array) -> None:
        self.start_out(buf, buf).wait()

    def allreduce(self, src: Array, dst: Array) -> None:
        self.start_out(src, dst).wait()

    def start(self, buf: Array) -> Handle:
        return self.start_out(buf, buf)

    def start_out(self, src: Array, dst: Array) -> Handle:
        """Begin dst <- sum over ranks of src (src may be dst); returns the progress handle."""
        inplace = src is dst
        dst = flat_view(dst, "dst")
        src = dst if inplace else flat_view(src, "src")
        if src.size != dst.size or src.dtype != dst.dtype:
            raise ValueError(f"src and dst differ: {src.size} {src.dtype} vs {dst.size} {dst.dtype}")
        if self.size == 1 or dst.size == 0:
            if src is not dst and dst.size:
                dst[...] = src
            return Done()
        return RingOp(self, src, dst)

    def close(self) -> None:
        self.scratch.clear()
        super().close()
