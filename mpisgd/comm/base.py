"""The one interface every all-reduce strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from mpisgd.backend import xp_of

Array = Any


class Handle(Protocol):
    def test(self) -> bool:
        """Advance the operation; True once it is complete."""

    def wait(self) -> None:
        """Block until the buffer holds the result."""


def chunk_bounds(n: int, k: int) -> list[int]:
    """k+1 offsets splitting n elements into k near-equal chunks (the first n % k one longer; some empty if n < k)."""
    q, rem = divmod(n, k)
    out = [0]
    for c in range(k):
        out.append(out[-1] + q + (1 if c < rem else 0))
    return out


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


def check_chunks(n: int, out_size: int, counts: list[int], k: int, r: int) -> None:
    """A reduce-scatter's chunks must tile the n elements, one per rank, and ``out`` fit rank r's."""
    if len(counts) != k or sum(counts) != n or out_size != counts[r]:
        raise ValueError(f"reduce-scatter of {n} elements over {k} ranks: counts {counts} must be "
                         f"k chunks summing to the buffer, and out ({out_size}) this rank's chunk")


def add_in_rank_order(parts: list[Array], dst: Array, r: int, pool: ScratchPool) -> None:
    """dst <- parts[0] + parts[1] + ... in that order (host arrays), the deterministic ring's order.
    parts[r] may be dst itself (this rank's own chunk, summed in place): at r >= 2 it is added after
    x0 + x1 would have overwritten it, so the sum then goes through a spare buffer."""
    spare = pool.take(dst.dtype, dst.size, np) if r >= 2 and np.may_share_memory(dst, parts[r]) else None
    acc = dst if spare is None else spare
    if len(parts) == 1:
        acc[...] = parts[0]
    else:
        np.add(parts[0], parts[1], out=acc)
        for part in parts[2:]:
            np.add(acc, part, out=acc)
    if spare is not None:
        dst[...] = spare
        pool.give(spare)


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


class RequestHandle:
    """A Handle over one non-blocking MPI request."""

    def __init__(self, req: Any) -> None:
        self.req = req

    def test(self) -> bool:
        return bool(self.req.Test())

    def wait(self) -> None:
        self.req.Wait()


class Done:
    """A handle for an operation that completed at start (blocking strategies, k = 1)."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Reducer(ABC):
    """In-place SUM all-reduce of contiguous buffers over a communicator.

    A reducer never sees models or optimizers: only buffers. Every rank must
    call the same operations on buffers of the same size and dtype, in the
    same order; implementations may rely on that.
    """

    name = "base"
    # whether start_reduce_scatter moves only the chunks (False: a full all-reduce, then a copy)
    native_reduce_scatter = False

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()

    @abstractmethod
    def allreduce_(self, buf: Array) -> None:
        """buf <- sum over ranks of buf, in place; blocks."""

    def allreduce(self, src: Array, dst: Array) -> None:
        """dst <- sum over ranks of src (out of place); blocks. The default copies, then reduces in place."""
        dst[...] = src
        self.allreduce_(dst)

    def start(self, buf: Array) -> Handle:
        """Non-blocking form of allreduce_; the default runs the blocking one at once.

        The handle's ``test()`` may advance the operation (MPI progresses only
        inside MPI calls): call it now and then while computing, ``wait()`` before
        reading the buffer. With several handles open, wait for them in the same
        order on every rank (or test them all until done): the ring's and the direct
        operations' later steps are posted only when their own handle is tested, so a
        rank blocked in another handle's ``wait()`` would wait for ever.
        """
        self.allreduce_(buf)
        return Done()

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        """Begin out <- this rank's chunk of the sum over ranks of buf; chunk c holds ``counts[c]``
        elements, in rank order. buf may be overwritten. The default runs :meth:`start` (a full
        all-reduce, so any strategy and option works) and copies the chunk out when it completes;
        strategies with a true reduce-scatter (``mpi``) move half the data."""
        lo = sum(counts[:self.rank])
        return _OwnChunk(self.start(buf), buf[lo:lo + counts[self.rank]], out)

    def allgather_(self, buf: Array, counts: list[int]) -> None:
        """In place: every rank's chunk (``counts`` elements each, rank order) of ``buf`` reaches every
        rank; blocks. Host buffers only."""
        self.start_allgather(buf, counts).wait()

    def start_allgather(self, buf: Array, counts: list[int]) -> Handle:
        """Non-blocking :meth:`allgather_`: ``MPI_Iallgatherv`` on bytes (moving needs no reduction, so
        any dtype goes). Also the faster call when blocking: MPICH 5.0.2's blocking ``Allgatherv`` took
        1.7 ms for the reference model's two buckets at k = 2, ``Iallgatherv`` + wait 0.65 ms."""
        if self.size == 1:
            return Done()
        nbytes = [c * buf.itemsize for c in counts]
        displs = [sum(nbytes[:c]) for c in range(len(nbytes))]
        raw = buf.reshape(-1).view(np.uint8)
        return RequestHandle(self.comm.Iallgatherv(MPI.IN_PLACE, [raw, nbytes, displs, MPI.BYTE]))

    def shared_buffer(self, n: int, dtype: Any) -> Array | None:
        """A buffer of n elements that this reducer reduces faster than private memory (node-shared
        memory its peers read in place), for data parallelism to keep its gradients in; None when it
        has none (the default). Collective where it returns one; valid until :meth:`close`."""
        return None

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        return None
