"""``deterministic``: every element summed in rank order, x0 + x1 + ... + x(k-1), whatever the buffer.

The ring sums chunk c starting at rank c, and the MPI library in an order of
its own, so at k >= 3 the last bits of a float sum depend on the bucket
boundaries and the algorithm. Here the order is fixed per element: each rank
receives its chunk of the buffer from every rank (``MPI_Ialltoallv`` of raw
bytes, the data a ring's reduce-scatter moves), adds the k copies in rank
order, then every rank gathers the reduced chunks (``MPI_Iallgatherv``). Any
bucketing, any segment size, any chunk owner: the same bits. The cost is the
library's all-to-all instead of a pipelined ring (docs/allreduce.md).

The same rank order as the ``shared`` strategy, so the two agree bit for bit.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from mpisgd.backend import sync, xp_of
from mpisgd.comm.base import (
    Array,
    Handle,
    InOrder,
    Reducer,
    ScratchPool,
    add_in_rank_order,
    byte_spec,
    check_chunks,
    chunk_counts,
    flat_view,
)


class DeterministicOp:
    """One in-flight operation (a Handle): exchange, rank-order sum, and for an all-reduce the gather.

    MPI requires every rank to start its collectives on a communicator in one order. Were the exchange
    started at once, a rank whose previous exchange had completed would start that one's gather first,
    and a slower rank this exchange: a mismatch (Open MPI: MPI_ERR_TRUNCATE). So operations queue
    (``base.InOrder``): the one at the head starts its exchange, and on its completion its gather, then
    leaves the queue; the sequence is exchange 1, gather 1, exchange 2, ... on every rank."""

    def __init__(self, red: DeterministicReducer, buf: Array, counts: list[int], out: Array | None) -> None:
        k, r = red.size, red.rank
        self.red, self.buf, self.counts, self.gather = red, buf, counts, out is None
        self.displs = [sum(counts[:c]) for c in range(k)]
        self.out = buf[self.displs[r]:self.displs[r] + counts[r]] if out is None else out
        self.rows = red.scratch.take(buf.dtype, k * counts[r], xp_of(buf)).reshape(k, counts[r])
        sync(buf)
        self.req: Any = None
        self.summed = False
        red.order.queue.append(self)
        red.order.pump()

    def ready(self, block: bool) -> bool:
        """Called at the head of the queue: start the exchange the first time; whether it is complete
        (waiting for it when ``block``)."""
        if self.req is None:
            r = self.red.rank
            recv = byte_spec(self.rows, [self.counts[r]] * self.red.size,
                        [p * self.counts[r] for p in range(self.red.size)])
            self.req = self.red.comm.Ialltoallv(byte_spec(self.buf, self.counts, self.displs), recv)
        if block:
            self.req.Wait()
        return block or bool(self.req.Test())

    def begin(self) -> None:
        """Our chunk from every rank has arrived: add the copies in rank order, then start the gather."""
        add_in_rank_order(list(self.rows), self.out, self.red.scratch)
        self.red.scratch.give(self.rows)
        self.summed = True
        if self.gather:
            sync(self.out)
            self.req = self.red.comm.Iallgatherv(MPI.IN_PLACE, byte_spec(self.buf, self.counts, self.displs))

    def test(self) -> bool:
        self.red.order.pump()
        return self.summed and (not self.gather or bool(self.req.Test()))

    def wait(self) -> None:
        self.red.order.pump(until=self)
        if self.gather:
            self.req.Wait()


class DeterministicReducer(Reducer):
    """Rank-order sums: bitwise reproducible across bucket sizes, strategies and runs."""

    name = "deterministic"
    native_reduce_scatter = True

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        self.scratch = ScratchPool()
        self.order = InOrder()

    def allreduce_(self, buf: Array) -> None:
        self.start(buf).wait()

    def start(self, buf: Array) -> Handle:
        flat = flat_view(buf)
        return DeterministicOp(self, flat, chunk_counts(flat.size, self.size), None)

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        check_chunks(buf.size, out.size, counts, self.size, self.rank)
        return DeterministicOp(self, flat_view(buf), list(counts), flat_view(out, "out"))

    def describe(self) -> str:
        return "deterministic (rank-order sums: exchange, sum, gather)"

    def close(self) -> None:
        self.scratch.clear()
        super().close()
