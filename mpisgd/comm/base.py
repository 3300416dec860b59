"""The one interface every all-reduce strategy implements, and the helpers strategies share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from mpisgd.backend import xp_of

Array = Any  # numpy.ndarray or cupy.ndarray


class Handle(Protocol):
    def test(self) -> bool:
        """Advance the operation; True once it is complete."""

    def wait(self) -> None:
        """Block until the buffer holds the result."""


class Done:
    """A handle for an operation that completed at start (blocking strategies, k = 1)."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class RequestHandle:
    """A Handle over one non-blocking MPI request, holding the buffers it reads and writes: MPI uses them
    until the request completes, so a temporary passed to ``start`` must outlive the call."""

    def __init__(self, req: Any, *buffers: Any) -> None:
        self.req, self.buffers = req, buffers

    def test(self) -> bool:
        return bool(self.req.Test())

    def wait(self) -> None:
        self.req.Wait()


def byte_spec(buf: Array, counts: list[int] | None = None, displs: list[int] | None = None) -> list[Any]:
    """A contiguous array as raw bytes for the MPI calls that move data without reducing it (any dtype,
    NumPy or CuPy): ``[bytes, MPI.BYTE]``, or with ``counts`` and ``displs`` given in elements of ``buf``,
    ``[bytes, byte counts, byte displacements, MPI.BYTE]`` (the v-collectives)."""
    raw = buf.reshape(-1).view(np.uint8)
    if counts is None:
        return [raw, MPI.BYTE]
    size = buf.itemsize
    displs = displs if displs is not None else [sum(counts[:c]) for c in range(len(counts))]
    return [raw, [c * size for c in counts], [d * size for d in displs], MPI.BYTE]


def flat_view(buf: Array, what: str = "buffer") -> Array:
    """``buf`` as a 1-D view (never a copy: a reduction into a copy would be lost)."""
    if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
        raise ValueError(f"{what} must be a contiguous array (got strides {buf.strides}); pass a copy")
    return buf.reshape(-1, order="A")


def chunk_bounds(n: int, k: int) -> list[int]:
    """k+1 offsets splitting n elements into k near-equal chunks (the first n % k one longer; some empty if n < k)."""
    q, rem = divmod(n, k)
    out = [0]
    for c in range(k):
        out.append(out[-1] + q + (1 if c < rem else 0))
    return out


def chunk_counts(n: int, k: int) -> list[int]:
    """The sizes of chunk_bounds(n, k)'s chunks: rank c's share of n elements."""
    b = chunk_bounds(n, k)
    return [b[c + 1] - b[c] for c in range(k)]


def check_chunks(n: int, out_size: int, counts: list[int], k: int, r: int) -> None:
    """A reduce-scatter's chunks must tile the n elements, one per rank, and ``out`` fit rank r's."""
    if len(counts) != k or sum(counts) != n or out_size != counts[r]:
        raise ValueError(f"reduce-scatter of {n} elements over {k} ranks: counts {counts} must be "
                         f"k chunks summing to the buffer, and out ({out_size}) this rank's chunk")


def on_one_node(comm: Any) -> bool:
    """Whether every rank of ``comm`` shares this node's memory (collective)."""
    return node_layout(comm)[3] == 1


def node_layout(comm: Any) -> tuple[int, int, int, int]:
    """(local_rank, local_size, node_index, n_nodes) from an MPI shared-memory split (collective).

    Read from MPI itself, not from launcher variables, so it is right under mpiexec, srun and any
    other launcher alike; nodes are numbered by their lowest rank.
    """
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        local_rank, local_size = local.Get_rank(), local.Get_size()
        leader = local.bcast(comm.Get_rank(), root=0)
    finally:
        local.Free()
    leaders = sorted(set(comm.allgather(leader)))
    return local_rank, local_size, leaders.index(leader), len(leaders)


class ScratchPool:
    """Scratch buffers reused across operations, so their pages are touched once: ``take`` one of at
    least n elements (a view of a kept one when it fits), ``give`` it back when the operation is done;
    at most ``keep`` are kept."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.free: list[Array] = []

    def take(self, dtype: Any, n: int, xp: Any) -> Array:
        for idx, s in enumerate(self.free):
            if s.dtype == dtype and s.size >= n and xp_of(s) is xp:
                return self.free.pop(idx)[:n]
        return xp.empty(n, dtype=dtype)

    def give(self, s: Array) -> None:
        if len(self.free) < self.keep:
            self.free.append(s.base if s.base is not None else s)

    def clear(self) -> None:
        self.free.clear()


def add_in_rank_order(parts: list[Array], dst: Array, pool: ScratchPool) -> None:
    """dst <- parts[0] + parts[1] + ... in that order: the deterministic order, whoever owns the chunk.
    dst may be one of the parts (a rank's own chunk, summed in place); when it is a part after the first
    two, the first add would overwrite it before it is read, so the sum then goes through a spare buffer."""
    xp = xp_of(dst)
    spare = pool.take(dst.dtype, dst.size, xp) if any(xp.may_share_memory(dst, p) for p in parts[2:]) else None
    acc = dst if spare is None else spare
    if len(parts) == 1:
        acc[...] = parts[0]
    else:
        xp.add(parts[0], parts[1], out=acc)
        for part in parts[2:]:
            xp.add(acc, part, out=acc)
    if spare is not None:
        dst[...] = spare
        pool.give(spare)


class InOrder:
    """Operations whose collectives must start in one order on every rank (MPI's rule per communicator),
    whatever order their handles are tested in and however fast each rank is. An operation offers
    ``ready(block) -> bool`` (called only at the head of the queue: it may start its first step there;
    whether that step is complete) and ``begin()`` (the next step; the operation then leaves the queue)."""

    def __init__(self) -> None:
        self.queue: deque[Any] = deque()

    def pump(self, until: Any = None) -> None:
        """Begin queued operations, oldest first, while their first step is complete; with ``until``,
        block until that one has begun."""
        block = until is not None and until in self.queue
        while self.queue and self.queue[0].ready(block):
            head = self.queue.popleft()
            head.begin()
            block = block and head is not until


class _OwnChunk:
    """Reduce-scatter through a full all-reduce: when it completes, copy this rank's chunk out (once)."""

    def __init__(self, inner: Handle, chunk: Array, out: Array) -> None:
        self.inner, self.chunk, self.out, self.copied = inner, chunk, out, False

    def test(self) -> bool:
        if not self.copied and self.inner.test():
            self.out[...] = self.chunk
            self.copied = True
        return self.copied

    def wait(self) -> None:
        if not self.copied:
            self.inner.wait()
            self.out[...] = self.chunk
            self.copied = True


class Reducer(ABC):
    """In-place SUM all-reduce of contiguous buffers over a communicator.

    A reducer never sees models or optimizers, only buffers. It works on its own duplicate of the
    communicator it is given (freed by :meth:`close`), so its messages never meet the caller's.
    Every rank must call the same operations on buffers of the same size and dtype, in the same
    order; implementations rely on that (tags, plans, windows).
    """

    name = "base"
    native_reduce_scatter = False  # whether start_reduce_scatter moves only the chunks (else: all-reduce + copy)
    device = False  # whether it takes GPU buffers (waiting for the kernels that write them before MPI reads)

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()

    @abstractmethod
    def allreduce_(self, buf: Array) -> None:
        """buf <- sum over ranks of buf, in place; blocks."""

    def allreduce(self, src: Array, dst: Array) -> None:
        """dst <- sum over ranks of src (out of place); blocks. The default copies, then reduces in place."""
        dst[...] = src
        self.allreduce_(dst)

    def start(self, buf: Array) -> Handle:
        """Non-blocking form of allreduce_; the default runs the blocking one at once.

        The handle's ``test()`` may advance the operation (MPI progresses only inside MPI calls): call
        it now and then while computing, ``wait()`` before reading the buffer. With several handles
        open, wait for them in the same order on every rank (or test them all until done): some
        strategies post an operation's later steps only when its own handle is tested.
        """
        self.allreduce_(buf)
        return Done()

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        """Begin out <- this rank's chunk of the sum over ranks of buf; chunk c holds ``counts[c]``
        elements, in rank order. buf may be overwritten. The default runs :meth:`start` (a full
        all-reduce) and copies the chunk out; strategies with a true reduce-scatter move half the data."""
        check_chunks(buf.size, out.size, counts, self.size, self.rank)
        lo = sum(counts[:self.rank])
        return _OwnChunk(self.start(buf), buf.reshape(-1)[lo:lo + counts[self.rank]], out)

    def start_allgather(self, buf: Array, counts: list[int]) -> Handle:
        """In place: every rank's chunk (``counts`` elements each, rank order) of ``buf`` to every rank:
        ``MPI_Iallgatherv`` on bytes (any dtype), non-blocking even when waited for at once (why: docs/concepts.md,
        "The sharded optimizer step")."""
        if self.size == 1:
            return Done()
        return RequestHandle(self.comm.Iallgatherv(MPI.IN_PLACE, byte_spec(buf, counts)), buf)

    def shared_buffer(self, n: int, dtype: Any) -> Array | None:
        """A buffer of n elements that this reducer reduces faster than private memory (node-shared
        memory its peers read in place), for data parallelism to keep its gradients in; None when it
        has none (the default). Collective where it returns one; valid until :meth:`close`."""
        return None

    def tune(self, bufs: list[Array], *, reduce_scatter: bool = False) -> None:
        """Collective: prepare for non-blocking operations on buffers like these, all-reduces or (with
        ``reduce_scatter``) reduce-scatters (``auto`` picks its strategy for their sizes now rather than
        in the middle of a step). The default does nothing."""
        return None

    def describe(self) -> str:
        """What this reducer runs, in a few plain words (the banner's all-reduce line)."""
        return self.name

    def close(self) -> None:
        """Collective: free the communicator and any window. The reducer is unusable afterwards."""
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
