"""The sharded step: each rank updates 1/k of the parameters and keeps 1/k of the optimizer state (ZeRO
stage 1).

Each bucket of the gradient is reduce-scattered instead of all-reduced, rank r receiving chunk r of the
bucket's sum; each rank checks its chunks, updates those parameters and their optimizer state, and an
all-gather of the parameters, bucket by bucket, gives every rank the same new replica. The optimizer
keeps state only for this rank's chunks (``Optimizer.keep_state``): momentum, Adam's moments and the
update's scratch shrink to 1/k. A checkpoint gathers the whole buffers on one rank
(:meth:`ShardedStep.gather_state`), resuming scatters them back (:meth:`ShardedStep.scatter_state`), so
checkpoints are the replicated step's and resume on any k.

Element by element the update is the replicated one: BLAS runs every element through its kernel's
vector body wherever a chunk is cut (mpisgd.blas), the ufuncs round each element alike. Two things need
every rank: whether the averaged gradient is finite (each rank sees only its chunks: one small
all-reduce makes it every rank's verdict), and the whole-tensor norms some update rules ask for (LARS,
LAMB; and the gradient's global norm, for clipping): :class:`~mpisgd.optim.norms.BlockNorms` over every
rank's blocks, which the chunks never cut, so every rank applies the replicated step's ratios, bitwise.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
from mpi4py import MPI

from mpisgd.agreement import agree
from mpisgd.blas import finite_sq_norm
from mpisgd.comm.base import Handle, Reducer, byte_spec
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.base import Optimizer
from mpisgd.optim.norms import BlockNorms, Blocks, BlockSums, block_boundaries
from mpisgd.parallel.protocols import Array, Timeline, Watchdog


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

    Each bucket is split into k near-equal chunks in rank order, cut only on the blocks of the norms
    (mpisgd.optim.norms.block_boundaries), and reduce-scattered; rank r updates its chunk of every
    bucket. ``reduced_dtype``: what the buckets hold (the gradients' dtype, or int64 fixed point in the
    reproducible mode: reduce-scattered into an int64 buffer, then converted into this rank's floats);
    ``block_sums``: how the norms' blocks are summed (the gradient strategy's)."""

    what = "reduce-scatter"

    def __init__(self, flat: FlatBuffer, buckets: list[tuple[int, int]], comm: MPI.Intracomm, reducer: Reducer,
                 reduced_dtype: np.dtype, block_sums: BlockSums) -> None:
        covered = sorted(buckets)
        if covered[0][0] != 0 or covered[-1][1] != flat.size or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
            raise ValueError(f"buckets {covered} do not tile the {flat.size} parameters")
        self.flat, self.comm, self.reducer, self.block_sums = flat, comm, reducer, block_sums
        self.k, self.rank = comm.Get_size(), comm.Get_rank()
        cuts = block_boundaries(flat.offsets)
        self.bounds = [partition(a, b, self.k, cuts) for a, b in buckets]  # per bucket, every rank's chunk
        self.counts = [[bb[c + 1] - bb[c] for c in range(self.k)] for bb in self.bounds]
        own = self.chunks(self.rank)
        # this rank's chunks of the averaged gradient, back to back; (int64 sums) their integers likewise
        self.grads = flat.xp.empty(sum(hi - lo for lo, hi in own), dtype=flat.dtype)
        exact = np.dtype(reduced_dtype) != flat.dtype
        self.recv = flat.xp.empty(self.grads.size, dtype=reduced_dtype) if exact else self.grads
        self.shards: list[tuple[int, int, Array]] = []  # (lo, hi, its gradient): what step_shards takes
        self._out: list[Array] = []  # per bucket, where its reduce-scatter lands
        offset = 0
        for lo, hi in own:
            self.shards.append((lo, hi, self.grads[offset:offset + hi - lo]))
            self._out.append(self.recv[offset:offset + hi - lo])
            offset += hi - lo
        self.ranges = list(buckets)

    def chunks(self, rank: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s chunks of the flat buffer, one per bucket (possibly empty), in bucket order."""
        return [(bb[rank], bb[rank + 1]) for bb in self.bounds]

    @property
    def own(self) -> list[tuple[int, int]]:
        """This rank's chunks, as [(lo, hi), ...]: where its optimizer state lies, back to back."""
        return self.chunks(self.rank)

    def start(self, index: int, buf: Array) -> Handle:
        """Begin bucket ``index``'s reduce-scatter: this rank's chunk of the sum into its shard buffer."""
        return self.reducer.start_reduce_scatter(buf, self._out[index], self.counts[index])

    def landed(self, reduced: Array) -> list[tuple[int, int, Array, Array]]:
        """This rank's chunks of the sum, and the gradient pieces they become."""
        return [(lo, hi, q, g) for (lo, hi, g), q in zip(self.shards, self._out)]

    def finite(self, watchdog: Watchdog, step: int) -> tuple[bool, float]:
        """Whether the whole averaged gradient is finite, and its squared norm: this rank's chunks, then
        every rank's (one small all-reduce: the count of non-finite chunks, the squared norms)."""
        ok, sq = finite_sq_norm(self.grads, self.flat.xp)
        votes = np.array([0.0 if ok else 1.0, sq if ok else 0.0])
        with watchdog.watching(f"finite-gradient vote of step {step}"):
            self.comm.Allreduce(MPI.IN_PLACE, votes, op=MPI.SUM)
        return bool(votes[0] == 0), float(votes[1])

    def sq_norm(self, watchdog: Watchdog, step: int) -> float:
        """|G|^2: this rank's chunks' squared norm, added over the ranks (one small all-reduce)."""
        sq = np.array([finite_sq_norm(self.grads, self.flat.xp)[1]])
        with watchdog.watching(f"gradient norm of step {step}"):
            self.comm.Allreduce(MPI.IN_PLACE, sq, op=MPI.SUM)
        return float(sq[0])

    def norms(self, watchdog: Watchdog, step: int) -> BlockNorms:
        """Whole-tensor norms over every rank's chunks (what an update rule that needs them is given)."""

        def gather(mine: list[Blocks]) -> list[list[Blocks]]:
            with watchdog.watching(f"tensor-norm all-gather of step {step}"):
                return self.comm.allgather(mine)

        return BlockNorms(self.flat.offsets, self.own, gather, self.block_sums)

    def apply(self, optimizer: Optimizer, lr: float, watchdog: Watchdog, step: int) -> None:
        """Update this rank's chunks (the optimizer may ask for whole-tensor norms: every rank's)."""
        optimizer.step_shards(lr, self.shards, self.norms(watchdog, step))

    def after_step(self, watchdog: Watchdog, timeline: Timeline, step: int) -> float:
        """Every rank's new parameters to every rank (the all-gather); its seconds."""
        with timeline.span("all-gather", cat="comm"):
            return self.gather_(self.flat.params, watchdog, f"parameter all-gather of step {step}")

    def gather_(self, buf: Array, watchdog: Watchdog, what: str) -> float:
        """Every rank's chunks of the flat-sized ``buf`` to every rank, in place (collective): all buckets in
        flight at once, then wait. Returns the seconds it took."""
        t0 = time.perf_counter()
        with watchdog.watching(what):
            handles = [self.reducer.start_allgather(buf[a:b], counts)
                       for (a, b), counts in zip(self.ranges, self.counts)]
            for h in handles:
                h.wait()
        return time.perf_counter() - t0

    # -- the optimizer state: 1/k on each rank, whole in checkpoints ---------------------------------
    def own_state(self, optimizer: Optimizer) -> None:
        """The optimizer keeps state for this rank's chunks only."""
        optimizer.keep_state(self.own)

    def broadcast_state(self, optimizer: Optimizer, root: int) -> None:
        """Nothing: each rank's chunks of the state are its own (:meth:`scatter_state` distributes a whole one)."""
        return None

    def _packed(self) -> tuple[list[int], list[int]]:
        """Elements per rank of its chunks back to back (its state buffers' size), and their displacements."""
        counts = [sum(hi - lo for lo, hi in self.chunks(r)) for r in range(self.k)]
        return counts, [sum(counts[:r]) for r in range(self.k)]

    def gather_state(self, optimizer: Optimizer, watchdog: Watchdog, root: int) -> dict[str, np.ndarray]:
        """The whole state buffers on ``root`` (one Gatherv per buffer, by name); {} on the other ranks."""
        counts, displs = self._packed()
        out = {}
        for name, local in sorted(optimizer.state_buffers().items()):
            packed = np.empty(self.flat.size, dtype=local.dtype) if self.rank == root else None
            with watchdog.watching(f"optimizer state ({name}) gather"):
                self.comm.Gatherv(byte_spec(local), byte_spec(packed, counts, displs) if packed is not None else None,
                                  root=root)
            if packed is not None:
                whole, at = np.empty_like(packed), 0
                for r in range(self.k):
                    for lo, hi in self.chunks(r):
                        whole[lo:hi] = packed[at:at + hi - lo]
                        at += hi - lo
                out[name] = whole
        return out

    def scatter_state(self, optimizer: Optimizer, buffers: Mapping[str, Array] | None, watchdog: Watchdog,
                      root: int) -> None:
        """``root``'s whole buffers (None elsewhere) into every rank's chunks (one Scatterv per buffer, by
        name); a buffer ``root`` lacks stays as it is. A whole buffer of the wrong size is an error on every rank."""
        mine, given = optimizer.state_buffers(), dict(buffers or {})
        error = None
        if self.rank == root:
            size = (self.flat.size,)
            wrong = [f"{n!r}: {given[n].shape}" for n in sorted(mine) if n in given and given[n].shape != size]
            if wrong:
                error = ValueError(f"optimizer state {', '.join(wrong)} elements for buffers of ({self.flat.size},)")
        with watchdog.watching("optimizer state: the names to scatter"):
            agree(self.comm, error)
            names = self.comm.bcast(sorted(n for n in given if n in mine) if self.rank == root else None, root=root)
        counts, displs = self._packed()
        for name in names:
            local = mine[name]
            packed = None
            if self.rank == root:
                whole = np.asarray(given[name], dtype=local.dtype)
                packed = np.concatenate([whole[lo:hi] for r in range(self.k) for lo, hi in self.chunks(r)])
            with watchdog.watching(f"optimizer state ({name}) scatter"):
                self.comm.Scatterv(byte_spec(packed, counts, displs) if packed is not None else None, byte_spec(local),
                                   root=root)

    def nbytes(self) -> int:
        """The chunks' buffers' bytes (what this rank holds beyond the replicated step's state)."""
        return int(self.grads.nbytes) + (int(self.recv.nbytes) if self.recv is not self.grads else 0)
