"""Producing the averaged gradient with float sums (the default): each micro-batch's backward adds into
the gradient buffer, and each bucket's reduction starts as soon as backward has finished it (overlap).
The other strategy, int64 fixed point (``--reproducible``), is mpisgd.parallel.fixed_point.

The loss is pre-scaled by 1/(k * the targets on this rank), so the SUM over ranks is the mean over the
effective batch with no pass after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from mpisgd.blas import finite_sq_norm
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.base import Optimizer
from mpisgd.optim.norms import native_block_sums
from mpisgd.parallel.buckets import Bucket, BucketSchedule
from mpisgd.parallel.protocols import Array, MicroPass, Produced, ReplicaModel, Update, Verdict, Watchdog


class FloatGradients:
    """The gradients summed as floats in the model's own gradient buffer (moved into the reducer's
    node-shared memory when ``shared`` is given, so a bucket's reduction reads it where backward wrote it).

    Noise statistics (``measure``): the small batch is this rank's gradient before the reduction, bucket
    by bucket as they start; at k = 1 the first micro-batch's."""

    block_sums = staticmethod(native_block_sums)  # norms' blocks in the gradients' own dtype

    @staticmethod
    def reduced_dtype(dtype: np.dtype) -> np.dtype:
        """The buckets hold the gradients themselves."""
        return np.dtype(dtype)

    @staticmethod
    def check(optimizer: Optimizer) -> None:
        """Any update rule will do."""
        return None

    def __init__(self, model: ReplicaModel, flat: FlatBuffer, comm: MPI.Intracomm, update: Update,
                 schedule: BucketSchedule, watchdog: Watchdog, *, overlap: bool, shared: Array | None) -> None:
        self.model, self.flat, self.comm, self.update = model, flat, comm, update
        self.schedule, self.watchdog, self.overlap = schedule, watchdog, overlap
        self.k = comm.Get_size()
        self.shared = shared is not None
        if shared is not None:
            model.move_grads(shared)
        self.reduced = flat.grads  # what the buckets reduce: the gradients themselves
        self._measure = False  # this step measures each bucket before it is reduced
        self._local_sq = 0.0
        schedule.bind(self.reduced, update.start, self._on_start)

    def _on_start(self, bucket: Bucket) -> None:
        if self._measure:  # this rank's own gradient, before the reduction sums it away
            self._local_sq += finite_sq_norm(self.flat.grads[bucket.start:bucket.stop], self.flat.xp)[1]

    def produce(self, run: MicroPass, counts: Sequence[int], step: int, measure: bool) -> Produced:
        """Backward over the micro-batches, adding their gradients in place; each bucket's reduction
        starts as soon as the last micro-batch's backward has finished it, the rest after."""
        m, loss_sum, out = len(counts), None, Produced(None)
        self._measure, self._local_sq = measure and self.k > 1, 0.0
        for i in range(m):
            self.model.set_accumulate(i > 0)  # micro-batch 0 overwrites, later ones add
            hooked = i == m - 1 and self.overlap and self.k > 1
            loss = run(i, self.schedule.armed() if hooked else None)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            if measure and self.k == 1 and i == 0 and m > 1:  # the small batch: micro-batch 0
                out.small_sq, out.b_small = finite_sq_norm(self.flat.grads, self.flat.xp)[1], counts[0]
        self.model.set_accumulate(False)
        self.schedule.finish(self.update.what, step)
        if self._measure:
            out.small_sq, out.b_small = self._local_sq, sum(counts)
        out.loss_sum = loss_sum
        return out

    def verdict(self, step: int, measure: bool) -> Verdict:
        """Decided on the reduced gradient, so every rank takes the same branch; the check's one pass gives
        |G|^2 too."""
        finite, sq = self.update.finite(self.watchdog, step)
        return Verdict(finite, sq)

    def mean_stats(self, rows: np.ndarray) -> np.ndarray:
        """This rank's rows summed, one small all-reduce, divided by every rank's micro-batches."""
        total = np.ascontiguousarray(rows.sum(axis=0), dtype=np.float64)
        with self.watchdog.watching("model statistics all-reduce"):
            self.comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return total / (self.k * rows.shape[0])

    @property
    def exponents(self) -> np.ndarray | None:
        return None

    def restore(self, exponents: Sequence[int] | np.ndarray | None) -> None:
        return None

    def describe(self) -> str:
        return ""

    def nbytes(self) -> int:
        return 0

    def close(self) -> None:
        """The node-shared window goes with the reducer: the model gets private gradients, values kept."""
        if self.shared:
            self.model.move_grads(np.empty_like(self.flat.grads))
        self.shared = False
