"""The sharded step: each rank updates 1/k of the parameters (ZeRO stage 1's split of the update).

Each bucket of the gradient is reduce-scattered instead of all-reduced, rank r receiving chunk r of the
bucket's sum; each rank checks its chunks, updates those parameters and their optimizer state, and an
all-gather of the parameters, bucket by bucket, gives every rank the same new replica. The optimizer's
state buffers (momentum, Adam's moments) stay whole-sized, each rank keeping its own chunks current, so
checkpoints do not change; DataParallel gathers them before one is written. Element by element the
update is the replicated one, and with BLAS bit for bit (mpisgd.blas).

Two things need every rank: whether the averaged gradient is finite (each rank sees only its chunks:
one small all-reduce makes it every rank's verdict), and the whole-tensor norms some update rules ask
for (LARS, LAMB; and the gradient's global norm, for clipping): :class:`RankNorms` all-gathers each
rank's partial squared norms and sums them in rank order, so every rank applies the same ratios,
bitwise, whatever the MPI library's reduction order.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.blas import finite_sq_norm
from mpisgd.comm.base import Handle, Reducer
from mpisgd.exact import BlockNorms, block_boundaries
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim import TensorNorms


class RankNorms(TensorNorms):
    """TensorNorms over this rank's chunks, added up over every rank in rank order (collective)."""

    def __init__(self, offsets: list[int], ranges: list[tuple[int, int]], comm: Any, watchdog: Any,
                 step: int) -> None:
        super().__init__(offsets, ranges)
        self.comm, self.watchdog, self.step = comm, watchdog, step

    def squared(self, *quantities: Any) -> np.ndarray:
        mine = self.partial(*quantities)
        every = np.empty((self.comm.Get_size(), *mine.shape), dtype=mine.dtype)
        with self.watchdog.watching(f"tensor-norm all-gather of step {self.step}"):
            self.comm.Allgather(mine, every)
        return every.sum(axis=0)  # rank order, the same on every rank


def partition(lo: int, hi: int, k: int, cuts: list[int] | None = None) -> list[int]:
    """k + 1 bounds splitting [lo, hi) into k near-equal contiguous parts, in rank order; with ``cuts``,
    each bound is the allowed cut nearest its even share (parts may then be empty)."""
    if cuts is None:
        q, rem = divmod(hi - lo, k)
        bounds = [lo]
        for c in range(k):
            bounds.append(bounds[-1] + q + (1 if c < rem else 0))
        return bounds
    allowed = sorted({lo, hi, *(c for c in cuts if lo <= c <= hi)})
    bounds = [lo]
    for r in range(1, k):
        target = lo + (hi - lo) * r / k
        bounds.append(max(bounds[-1], min(allowed, key=lambda p: (abs(p - target), p))))
    return [*bounds, hi]


class ShardedStep:
    """The sharded update of ``flat`` over ``comm``'s k ranks, for buckets given as [start, stop) ranges.

    Each bucket is split into k near-equal chunks in rank order (so every rank shares every bucket's
    reduction work as it arrives) and reduce-scattered; rank r updates its chunk of every bucket. The
    update calls BLAS on each chunk, whose kernels give every element the same bits wherever a call
    starts (mpisgd.blas), so the sharded step gives the replicated step's bits.

    ``exact`` (the reproducible mode, mpisgd.exact): the buckets hold fixed-point integers, reduce-
    scattered into an int64 buffer and converted into this rank's floats; the chunks end on the blocks
    of :class:`~mpisgd.exact.BlockNorms`, so whole-tensor norms do not depend on k."""

    def __init__(self, flat: FlatBuffer, buckets: list[tuple[int, int]], comm: Any, reducer: Reducer,
                 exact: bool = False) -> None:
        covered = sorted(buckets)
        if covered[0][0] != 0 or covered[-1][1] != flat.size or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
            raise ValueError(f"buckets {covered} do not tile the {flat.size} parameters")
        self.flat, self.comm, self.reducer, self.exact = flat, comm, reducer, exact
        self.k, self.rank = comm.Get_size(), comm.Get_rank()
        cuts = block_boundaries(flat.offsets) if exact else None
        bounds = [partition(a, b, self.k, cuts) for a, b in buckets]
        self.counts = [[bb[c + 1] - bb[c] for c in range(self.k)] for bb in bounds]  # per bucket, every rank's
        own = [(bb[self.rank], bb[self.rank + 1]) for bb in bounds]  # per bucket, this rank's chunk
        # this rank's chunks of the averaged gradient, back to back; (exact) their integers likewise
        self.grads = flat.xp.empty(sum(hi - lo for lo, hi in own), dtype=flat.dtype)
        self.recv = flat.xp.empty(self.grads.size, dtype=np.int64) if exact else self.grads
        self.shards: list[tuple[int, int, Any]] = []  # (lo, hi, its gradient): what step_shards takes
        self._out: list[Any] = []  # per bucket, where its reduce-scatter lands
        offset = 0
        for lo, hi in own:
            self.shards.append((lo, hi, self.grads[offset:offset + hi - lo]))
            self._out.append(self.recv[offset:offset + hi - lo])
            offset += hi - lo
        self.ranges = list(buckets)

    @property
    def own(self) -> list[tuple[int, int]]:
        """This rank's chunks of the flat buffer, one per bucket, as [(lo, hi), ...]."""
        return [(lo, hi) for lo, hi, _ in self.shards]

    def start(self, index: int, summed: Any) -> Handle:
        """Begin bucket ``index``'s reduce-scatter: this rank's chunk of the sum into its shard buffer."""
        return self.reducer.start_reduce_scatter(summed, self._out[index], self.counts[index])

    def finite(self, watchdog: Any, step: int) -> tuple[bool, float]:
        """Whether the whole averaged gradient is finite, and its squared norm: this rank's chunks, then
        every rank's (one small all-reduce: the count of non-finite chunks, the squared norms)."""
        ok, sq = finite_sq_norm(self.grads, self.flat.xp)
        votes = np.array([0.0 if ok else 1.0, sq if ok else 0.0])
        with watchdog.watching(f"finite-gradient vote of step {step}"):
            self.comm.Allreduce(MPI.IN_PLACE, votes, op=MPI.SUM)
        return bool(votes[0] == 0), float(votes[1])

    def decode(self, codec: Any, summed: Any) -> None:
        """Exact: this rank's integers to its floats, chunk by chunk."""
        for (lo, hi, g), q in zip(self.shards, self._out):
            codec.decode(q, g, lo, hi)

    def sq_norm_share(self, k: int) -> float:
        """This rank's part of |G|^2 (summed over the ranks: |G|^2)."""
        return finite_sq_norm(self.grads, self.flat.xp)[1]

    def norms(self, watchdog: Any, step: int) -> Any:
        """Whole-tensor norms over every rank's chunks (what an update rule that needs them is given)."""
        ranges = [(lo, hi) for lo, hi, _ in self.shards]
        if not self.exact:
            return RankNorms(self.flat.offsets, ranges, self.comm, watchdog, step)

        def gather(mine: Any) -> Any:
            with watchdog.watching(f"tensor-norm all-gather of step {step}"):
                return self.comm.allgather(mine)
        return BlockNorms(self.flat.offsets, ranges, gather)

    def apply(self, optimizer: Any, lr: float, watchdog: Any, step: int) -> None:
        """Update this rank's chunks (the optimizer may ask for whole-tensor norms: every rank's)."""
        optimizer.step_shards(lr, self.shards, self.norms(watchdog, step))

    def gather_(self, buf: Any, watchdog: Any, what: str) -> float:
        """Every rank's chunks of ``buf`` (parameters or momentum) to every rank, in place (collective):
        all buckets in flight at once, then wait. Returns the seconds it took."""
        t0 = time.perf_counter()
        with watchdog.watching(what):
            handles = [self.reducer.start_allgather(buf[a:b], counts)
                       for (a, b), counts in zip(self.ranges, self.counts)]
            for h in handles:
                h.wait()
        return time.perf_counter() - t0

    def nbytes(self) -> int:
        """The part's buffers' bytes (what this rank holds beyond the replicated step's state)."""
        return int(self.grads.nbytes) + (int(self.recv.nbytes) if self.exact else 0)
