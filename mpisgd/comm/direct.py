"""Direct reduce-scatter and all-reduce for ranks on one node: every rank exchanges chunks with every peer.

Reduce-scatter: rank r posts, for every peer p, a send of chunk p of its buffer
and a receive of p's contribution to chunk r; once they complete it adds the k
parts of chunk r in rank order, x0 + x1 + ... + x(k-1), so the result does not
depend on which rank owns the chunk, on arrival order or on bucketing (the
order of the deterministic ring). All-reduce: that, into the buffer's own
chunk, then every rank sends its reduced chunk to every peer.

Within one node MPICH moves each message with a single copy (CMA), so a
reduce-scatter is one copy and one add per peer. For the reference model's two
buckets it took 0.80x the time of ``MPI_Ireduce_scatter`` at k = 2 and 3
(benchmarks/reduce_scatter_calls.py, docs/allreduce.md). Across nodes it
would put k - 1 messages per rank in flight at once, which is why ``auto``
uses it only on one node.

Tags: each operation takes the next pair of tags from a counter that every
rank advances alike (the Reducer contract: the same operations in the same
order), so the chunks of two operations in flight never match each other's
receives, whichever of them reaches its second phase first on each rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import Array, ScratchPool, add_in_rank_order, check_chunks, chunk_bounds

TAG_BASE = 7_400
TAG_PAIRS = 4_096  # operations in flight at once before a tag comes round again: far more than buckets


class DirectOps:
    """Starts direct operations on ``comm`` (a communicator of its own: our tags meet no other messages)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.k, self.r = comm.Get_size(), comm.Get_rank()
        self.scratch = ScratchPool()  # receive buffers, taken per operation and given back once summed
        self.seq = 0

    def next_tags(self) -> int:
        self.seq += 1
        return TAG_BASE + 2 * (self.seq % TAG_PAIRS)

    def reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> DirectOp:
        """Begin out <- chunk r of the sum of buf (chunk c has counts[c] elements, rank order)."""
        check_chunks(buf.size, out.size, counts, self.k, self.r)
        return DirectOp(self, buf.reshape(-1), out.reshape(-1), counts, gather=False)

    def allreduce(self, buf: Array) -> DirectOp:
        """Begin buf <- the sum of buf over ranks, in place."""
        flat = buf.reshape(-1)
        bounds = chunk_bounds(flat.size, self.k)
        counts = [bounds[c + 1] - bounds[c] for c in range(self.k)]
        return DirectOp(self, flat, flat[bounds[self.r]:bounds[self.r + 1]], counts, gather=True)


class DirectOp:
    """One in-flight direct operation (a Handle): the exchange of raw chunks, the rank-order sum, and,
    for an all-reduce, the exchange of reduced chunks."""

    def __init__(self, ops: DirectOps, buf: Array, out: Array, counts: list[int], gather: bool) -> None:
        comm, k, r = ops.comm, ops.k, ops.r
        self.comm, self.buf, self.out, self.r, self.gather = comm, buf, out, r, gather
        self.bounds = [0]
        for c in counts:
            self.bounds.append(self.bounds[-1] + c)
        self.own = buf[self.bounds[r]:self.bounds[r + 1]]
        self.peers = [p for p in range(k) if p != r]
        rows, count = len(self.peers), counts[r]
        self.pool = ops.scratch
        self.scratch = self.pool.take(buf.dtype, rows * count, np).reshape(rows, count)
        self.tag = ops.next_tags()
        self.reqs = []
        for i, p in enumerate(self.peers):  # row i: peer p's part of chunk r
            self.reqs.append(comm.Irecv(self.scratch[i], p, self.tag))
            self.reqs.append(comm.Isend(buf[self.bounds[p]:self.bounds[p + 1]], p, self.tag))
        self.phase = 1  # 1: raw chunks in flight; 2: reduced chunks in flight; 3: done

    def _sum(self) -> None:
        parts = [self.scratch[i] for i in range(len(self.peers))]
        parts.insert(self.r, self.own)  # rank order
        add_in_rank_order(parts, self.out, self.r, self.pool)
        self.pool.give(self.scratch)
        if not self.gather:
            self.phase = 3
            return
        self.reqs = []
        for p in self.peers:  # every rank's reduced chunk to every rank, each into its place
            self.reqs.append(self.comm.Irecv(self.buf[self.bounds[p]:self.bounds[p + 1]], p, self.tag + 1))
            self.reqs.append(self.comm.Isend(self.out, p, self.tag + 1))
        self.phase = 2

    def test(self) -> bool:
        if self.phase == 1 and MPI.Request.Testall(self.reqs):
            self._sum()
        if self.phase == 2 and MPI.Request.Testall(self.reqs):
            self.phase = 3
        return self.phase == 3

    def wait(self) -> None:
        if self.phase == 1:
            MPI.Request.Waitall(self.reqs)
            self._sum()
        if self.phase == 2:
            MPI.Request.Waitall(self.reqs)
            self.phase = 3
