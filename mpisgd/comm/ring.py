"""Our own ring all-reduce: reduce-scatter then all-gather, segments pipelined with Isend/Irecv.

The buffer is cut into *slices* of ``k * segment`` elements; each slice is split
into k chunks and all-reduced around the ring in 2(k-1) steps. Up to ``window``
slices are in their reduce-scatter phase at once, so while one segment is being
added, the next ones are on the wire, and a segment is sent on as soon as it
has been reduced (NCCL's pipelining, with MPI point-to-point underneath).

Progress model: :meth:`RingReducer.start` posts the first sends and receives
and returns a :class:`RingOp`. Its ``test()`` processes every receive that has
already arrived, never blocking; ``wait()`` blocks until done. MPI moves data
only inside MPI calls, so an operation that is never tested progresses only in
``wait()`` (DataParallel tests open handles after every layer's backward).

Summation order. Ring: chunk c is summed along the ring starting at rank c, so
an element's order depends on where bucket boundaries put it (for k = 2 any
order gives the same bits, as a + b == b + a). Deterministic mode replaces the
reduce-scatter by an exchange of raw chunks (each rank receives its chunk from
every rank, the same volume) followed by a sum in rank order, x0 + x1 + ... +
x(k-1), for every element whatever the slicing or bucketing; small buffers take
one MPI Allgather and the same ordered sum, so the bits do not depend on size.

Reduce-scatter alone (the sharded optimizer step, ``start_reduce_scatter``):
:class:`RingReduceScatterOp` runs the same first half on another geometry, so
that rank r ends with the contiguous chunk r of the sum.

Messages carry a tag derived from (operation, slice, step), so receives may be
posted in any order and several operations may be in flight on one reducer.

Transport: when every rank shares one node, blocking calls on host buffers
below SHM_MAX_BYTES go through an MPI-3 shared-memory window instead of
messages (mpisgd.comm.shm: the same ring order, one copy per step fewer);
non-blocking ones (training buckets, overlapped with backward) keep messages,
which progress from either side (see ``uses_shm``). ``transport="shm"`` uses
the window for every call, ``"p2p"`` never. Device buffers and the
deterministic exchange (k >= 3) always use messages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.backend import is_device_array, xp_of
from mpisgd.comm.base import Array, Done, Handle, Reducer, ScratchPool, chunk_bounds
from mpisgd.comm.shm import SHM_CHUNK_BYTES, ShmTransport, single_node_comm

SEGMENT_BYTES = 4 << 20  # most bytes per chunk per slice: large, to amortise ~10 us of Python per message
MIN_SEGMENT_BYTES = 1 << 20  # ... but smaller for mid-size buffers, so that they still pipeline
PIPELINE_SLICES = 4  # ... aiming at this many slices per buffer between the two bounds
WINDOW = 8  # slices in their reduce-scatter phase at once; scratch = window * segment (per peer when deterministic)
SCRATCH_CAP_BYTES = 64 << 20  # fewer slices in flight rather than more scratch (deterministic needs k segments each)
TRANSPORTS = ("auto", "shm", "p2p")  # auto: shm when every rank shares one node (below SHM_MAX_BYTES), else p2p
# Above this, messages win even on one node (k = 2, 2026-11-30): the window's lock-stepped slices were
# 1.5-2.1x MPI from 32 MiB against 2.2-3.1x for the pipelined messages, and the two crossed between 8 and
# 24 MiB from run to run (docs/allreduce.md).
SHM_MAX_BYTES = 16 << 20
DET_ALLGATHER_BYTES = 1 << 20  # deterministic: k * nbytes up to this: one MPI Allgather + ordered sum (at k = 2 the
#                                same volume as the exchange, without its Python message rounds)


def _bytes(a: Array) -> list[Any]:
    """A contiguous array as raw bytes for point-to-point: the ring moves any dtype, MPI reduces none."""
    return [a.view(np.uint8), MPI.BYTE]  # CuPy's view accepts NumPy dtypes too


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and not nbytes % (1 << 20) else \
        f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 and not nbytes % (1 << 10) else f"{nbytes} B"


def _flat(buf: Array, what: str) -> Array:
    if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
        raise ValueError(f"{what} must be a contiguous array (got strides {buf.strides}); pass a copy")
    return buf.reshape(-1, order="A")


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
        self.sync: Callable[[], None] | None = (
            self.xp.cuda.get_current_stream().synchronize if is_device_array(dst) else None)
        self.seg_elems = max(1, min(red.segment_bytes, max(red.min_segment_bytes, -(-dst.nbytes // (
            self.k * PIPELINE_SLICES)))) // dst.itemsize)
        self._geometry(dst.size)
        per_slice = self.k if red.deterministic else 1  # scratch segments a slice holds
        fit = max(1, SCRATCH_CAP_BYTES // (per_slice * self.max_chunk * dst.itemsize))
        self.window = min(red.window, self.nslices, fit)
        self.base = red.tags.next_op()
        self.pending: deque[list[Any]] = deque()
        self.sends: list[Any] = []
        self.first_sends: dict[tuple[int, int], Any] = {}  # (slice, chunk) -> the first send reading that chunk
        self.next_slice = 0
        nslots = self.window * per_slice
        self.scratch = red.scratch.take(dst.dtype, nslots * self.max_chunk, self.xp)
        self.done = False
        for _ in range(self.window):
            self._admit()

    # -- geometry ------------------------------------------------------------------------
    def _geometry(self, n: int) -> None:
        """Slices of k segments; chunk c of a slice is its c-th near-equal part."""
        self.slice_elems = self.k * self.seg_elems
        self.nslices = -(-n // self.slice_elems)
        self.max_chunk = -(-min(n, self.slice_elems) // self.k)

    def _chunk(self, arr: Array, i: int, c: int) -> Array:
        lo = i * self.slice_elems
        b = chunk_bounds(min(self.slice_elems, arr.size - lo), self.k)
        return arr[lo + b[c]: lo + b[c + 1]]

    def _slot(self, i: int, j: int = 0) -> Array:
        """Scratch for slice i (peer j when deterministic), reused by slice i + window."""
        s = (i % self.window) * (self.k if self.red.deterministic else 1) + j
        return self.scratch[s * self.max_chunk:(s + 1) * self.max_chunk]

    def _isend(self, a: Array, dest: int, i: int, step: int) -> Any:
        req = self.red.comm.Isend(_bytes(a), dest, self.red.tags.tag(self.base, i, step))
        self.sends.append(req)
        return req

    def _irecv(self, a: Array, source: int, i: int, step: int) -> Any:
        return self.red.comm.Irecv(_bytes(a), source, self.red.tags.tag(self.base, i, step))

    # -- schedule ------------------------------------------------------------------------
    def _admit(self) -> None:
        """Start the next slice: its first sends and receives."""
        i = self.next_slice
        self.next_slice += 1
        k, r = self.k, self.r
        if self.red.deterministic:  # chunk c goes raw to rank c; we receive our chunk from every rank
            reqs = []
            for j in range(1, k):
                peer_in, peer_out = (r - j) % k, (r + j) % k
                mine = self._chunk(self.dst, i, r)
                reqs.append(self._irecv(self._slot(i, peer_in)[:mine.size], peer_in, i, 0))
                self.first_sends[(i, peer_out)] = self._isend(self._chunk(self.src, i, peer_out), peer_out, i, 0)
            self.pending.append([reqs, lambda: self._det_reduce(i)])
        else:
            c = (r - 1) % k
            recv = self._chunk(self.dst, i, c)
            req = self._irecv(self._slot(i)[:recv.size], self.left, i, 0)
            self.first_sends[(i, r)] = self._isend(self._chunk(self.src, i, r), self.right, i, 0)
            self.pending.append([[req], lambda: self._rs_step(i, 0)])

    def _rs_step(self, i: int, s: int) -> list[Any] | None:
        """Reduce-scatter step s of slice i has arrived: add it, pass it on."""
        k, r = self.k, self.r
        c = (r - s - 1) % k
        out = self._chunk(self.dst, i, c) if s + 1 < k - 1 else self._reduced(i, c)
        self.xp.add(self._chunk(self.src, i, c), self._slot(i)[:out.size], out=out)
        if self.sync is not None:
            self.sync()
        if s + 1 < k - 1:
            nc = (r - s - 2) % k
            req = self._irecv(self._slot(i)[:self._chunk(self.dst, i, nc).size], self.left, i, s + 1)
            self.first_sends[(i, c)] = self._isend(out, self.right, i, s + 1)
            self.pending.append([[req], lambda: self._rs_step(i, s + 1)])
        else:  # this rank now owns the reduced chunk (r + 1) % k: start the all-gather
            self._owned(i, out)
            if self.next_slice < self.nslices:
                self._admit()
        return None

    def _reduced(self, i: int, c: int) -> Array:
        """Where the last reduce-scatter step of slice i writes the fully reduced chunk c."""
        return self._chunk(self.dst, i, c)

    def _owned(self, i: int, out: Array) -> None:
        """Slice i's chunk is fully reduced here: pass it round the ring (the all-gather)."""
        self._isend(out, self.right, i, self.k - 1)
        self._post_ag(i, 0, owner_shift=1)

    def _det_reduce(self, i: int) -> list[Any] | None:
        """Every rank's copy of our chunk has arrived: sum it in rank order, then all-gather."""
        k, r = self.k, self.r
        out = self._chunk(self.dst, i, r)
        own = self._chunk(self.src, i, r)
        parts = [own if j == r else self._slot(i, j)[:out.size] for j in range(k)]
        if self.src is self.dst and r >= 2:  # out is overwritten by x0 + x1 before our own part is read
            parts[r] = self._slot(i, r)[:out.size]
            parts[r][...] = own
        self.xp.add(parts[0], parts[1], out=out)
        for j in range(2, k):
            self.xp.add(out, parts[j], out=out)
        if self.sync is not None:
            self.sync()
        self._isend(out, self.right, i, 1)
        self._post_ag(i, 0, owner_shift=0)
        if self.next_slice < self.nslices:
            self._admit()
        return None

    def _post_ag(self, i: int, s: int, owner_shift: int) -> None:
        """Post all-gather receive s of slice i: chunk (r - 1 + owner_shift - s) from the left.

        The receive overwrites a chunk that our first send of it may still be
        reading: wait for that send first (it has completed in practice, since
        what arrives depends on it) by queueing a gate before the receive.
        """
        k = self.k
        c = (self.r - 1 + owner_shift - s) % k
        step = (k - 1 if owner_shift else 1) + s
        gate = self.first_sends.pop((i, c), None)

        def post() -> list[Any]:
            req = self._irecv(self._chunk(self.dst, i, c), self.left, i, step)
            return [[req], lambda: self._ag_step(i, s, owner_shift)]

        if gate is None:
            self.pending.append(post())
        else:
            self.pending.append([[gate], post])

    def _ag_step(self, i: int, s: int, owner_shift: int) -> list[Any] | None:
        k = self.k
        if s + 1 < k - 1:  # pass the chunk just received on, receive the next
            c = (self.r - 1 + owner_shift - s) % k
            step = (k - 1 if owner_shift else 1) + s + 1
            self._isend(self._chunk(self.dst, i, c), self.right, i, step)
            self._post_ag(i, s + 1, owner_shift)
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
        self._finish()
        return True

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self.sends.clear()
            self.red.scratch.give(self.scratch)

    def test(self) -> bool:
        return self.done or self._advance(block=False)

    def wait(self) -> None:
        if not self.done:
            self._advance(block=True)


class RingReduceScatterOp(RingOp):
    """The ring's reduce-scatter alone, into contiguous per-rank chunks: rank r ends with chunk r
    (``counts`` elements each, rank order) of the sum in ``out``; ``buf`` is scratch.

    Same pipeline as :class:`RingOp`, another geometry: the buffer is k contiguous chunks, each cut
    into ``nslices`` segments, and slice i is segment i of every chunk. The ring leaves its chunk
    (r + 1) % k with rank r, so ring chunk c of a slice is a segment of global chunk (c - 1) % k.
    """

    def __init__(self, red: RingReducer, buf: Array, out: Array, counts: list[int]) -> None:
        self.counts, self.out = counts, out
        self.starts = [sum(counts[:g]) for g in range(len(counts))]
        super().__init__(red, buf, buf)

    def _geometry(self, n: int) -> None:
        self.nslices = max(1, -(-max(self.counts) // self.seg_elems))
        self.segs = [chunk_bounds(c, self.nslices) for c in self.counts]
        self.max_chunk = max(1, -(-max(self.counts) // self.nslices))

    def _chunk(self, arr: Array, i: int, c: int) -> Array:
        g = (c - 1) % self.k
        lo = self.starts[g]
        return arr[lo + self.segs[g][i]: lo + self.segs[g][i + 1]]

    def _reduced(self, i: int, c: int) -> Array:
        segs = self.segs[self.r]  # c == (r + 1) % k: global chunk r, ours
        return self.out[segs[i]: segs[i + 1]]

    def _owned(self, i: int, out: Array) -> None:
        return None  # no all-gather


class _GatherSumOp:
    """Deterministic small-buffer path: MPI Allgather of whole buffers, then the rank-order sum."""

    def __init__(self, red: RingReducer, src: Array, dst: Array) -> None:
        xp = xp_of(dst)
        k = red.size
        gathered = red.gather_buffer(k * dst.nbytes, xp).view(dst.dtype).reshape(k, dst.size)
        red.comm.Allgather(_bytes(src), _bytes(gathered.reshape(-1)))
        xp.add(gathered[0], gathered[1], out=dst)
        for j in range(2, k):
            xp.add(dst, gathered[j], out=dst)
        if is_device_array(dst):  # complete means complete: the next MPI call may read dst
            xp.cuda.get_current_stream().synchronize()

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class RingReducer(Reducer):
    """The pipelined ring (or, with ``deterministic``, exchange + rank-order sum + ring all-gather)."""

    name = "ring"

    def __init__(self, comm: Any, *, deterministic: bool = False, segment_bytes: int = SEGMENT_BYTES,
                 window: int = WINDOW, det_gather_bytes: int = DET_ALLGATHER_BYTES, transport: str = "auto",
                 shm_chunk_bytes: int = SHM_CHUNK_BYTES) -> None:
        if segment_bytes < 1 or window < 1:
            raise ValueError(f"segment_bytes and window must be >= 1, got {segment_bytes} and {window}")
        if transport not in TRANSPORTS:
            raise ValueError(f"ring transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        super().__init__(comm.Dup())  # our own tag space: never matches the caller's messages
        # host buffers on one node go through a shared window (mpisgd.comm.shm); the deterministic ring's
        # exchange stays on messages (at k <= 2 create_reducer drops deterministic: any order is exact)
        self.shm: ShmTransport | None = None
        self.shm_max_bytes = SHM_MAX_BYTES if transport == "auto" else None
        if transport != "p2p" and self.size > 1 and not (deterministic and self.size > 2):
            node = single_node_comm(self.comm)
            if node is not None:
                self.shm = ShmTransport(node, shm_chunk_bytes)
            elif transport == "shm":
                self.comm.Free()
                raise ValueError("ring transport 'shm' needs every rank on one node; use 'auto' or 'p2p'")
        self.deterministic = deterministic
        self.det_gather_bytes = det_gather_bytes
        self.segment_bytes = segment_bytes
        self.min_segment_bytes = min(segment_bytes, MIN_SEGMENT_BYTES)
        self.window = window
        self.tags = _Tags(self.comm, 2 * self.size)
        self.scratch = ScratchPool()
        self._gather: dict[str, Array] = {}

    def describe(self) -> str:
        det = ", deterministic" if self.deterministic else ""
        seg = f"{_human(self.min_segment_bytes)}-{_human(self.segment_bytes)}"
        if self.shm is not None:
            upto = "" if self.shm_max_bytes is None else \
                f" for blocking calls below {_human(self.shm_max_bytes)}; else messages in segments of {seg}"
            return f"ring (shared-memory window, chunks of {_human(self.shm.slot_bytes)}{upto}{det})"
        return f"ring (segments of {seg}, window {self.window}{det})"

    def gather_buffer(self, nbytes: int, xp: Any) -> Array:
        """Bytes for the deterministic small path; grows only, so its pages are touched once (blocking use only)."""
        buf = self._gather.get(xp.__name__)
        if buf is None or buf.nbytes < nbytes:
            buf = self._gather[xp.__name__] = xp.empty(max(nbytes, 4096), dtype=np.uint8)
        return buf[:nbytes]

    def allreduce_(self, buf: Array) -> None:
        self.start_out(buf, buf, blocking=True).wait()

    def allreduce(self, src: Array, dst: Array) -> None:
        self.start_out(src, dst, blocking=True).wait()

    def start(self, buf: Array) -> Handle:
        return self.start_out(buf, buf)

    @property
    def native_reduce_scatter(self) -> bool:  # type: ignore[override]
        return not self.deterministic  # the deterministic ring's order needs its exchange: full all-reduce

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        """The ring's reduce-scatter over messages (the k - 1 steps of the all-reduce's first half), into
        contiguous per-rank chunks. Deterministic mode runs its full all-reduce and copies the chunk out."""
        if self.deterministic or self.size == 1:
            return super().start_reduce_scatter(buf, out, counts)
        buf = _flat(buf, "buf")
        if sum(counts) != buf.size or len(counts) != self.size or out.size != counts[self.rank]:
            raise ValueError(f"counts {counts} do not split {buf.size} elements over {self.size} ranks "
                             f"into out of {out.size}")
        return RingReduceScatterOp(self, buf, out, counts)

    def uses_shm(self, buf: Array, blocking: bool) -> bool:
        """Whether this buffer goes through the shared window rather than messages.

        With transport "auto", only blocking calls below ``shm_max_bytes`` do: the
        window's steps are lock-stepped barriers that both ranks must reach, while
        messages progress from whichever side polls. Overlapped with backward (k = 2,
        the reference MLP, four interleaved pairs), messages exposed 0.6-2 ms per step
        against 2-3 ms for the window, and trained faster in three pairs of four.
        """
        if self.shm is None or is_device_array(buf):
            return False
        return self.shm_max_bytes is None or (blocking and buf.nbytes < self.shm_max_bytes)

    def start_out(self, src: Array, dst: Array, blocking: bool = False) -> Handle:
        """Begin dst <- sum over ranks of src (src may be dst); returns the progress handle.

        ``blocking``: the caller waits at once (picks the transport, see :meth:`uses_shm`)."""
        inplace = src is dst
        dst = _flat(dst, "dst")
        src = dst if inplace else _flat(src, "src")
        if src.size != dst.size or src.dtype != dst.dtype:
            raise ValueError(f"src and dst differ: {src.size} {src.dtype} vs {dst.size} {dst.dtype}")
        if self.size == 1 or dst.size == 0:
            if src is not dst and dst.size:
                dst[...] = src
            return Done()
        if self.deterministic and dst.nbytes * self.size <= self.det_gather_bytes:
            return _GatherSumOp(self, src, dst)
        if self.uses_shm(dst, blocking):
            return self.shm.start(src, dst)  # type: ignore[union-attr]
        return RingOp(self, src, dst)

    def close(self) -> None:
        self.scratch.clear()
        self._gather.clear()
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
