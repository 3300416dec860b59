"""Producing the averaged gradient in int64 fixed point (``--reproducible``): the driver of the codec
mpisgd.exact, so that the parameters are the same bits for any k, strategy, bucket layout and overlap.

Each micro-batch's gradient is measured and converted into the integers (per tensor, at exponents the
ranks agreed at the end of the previous step), the integers are added over micro-batches and reduced by
the same strategies as floats, one small MAX all-reduce after the reduction agrees the next exponents
(and whether any rank overflowed or saw NaN), and the sum is converted back. The first step, which has
no exponents yet, and a step that would overflow are computed again at the step's own exponents.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from mpisgd.exact import FixedPoint
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.base import Optimizer
from mpisgd.optim.norms import float64_block_sums
from mpisgd.parallel.buckets import Bucket, BucketSchedule
from mpisgd.parallel.protocols import Array, MicroPass, Produced, ReplicaModel, Update, Verdict, Watchdog
from mpisgd.parallel.stats import Meter


class ExactGradients:
    """The gradients summed as int64 fixed point in ``reduced`` (the reducer's node-shared memory when
    ``shared`` is given, a private buffer otherwise); the model's gradient buffer holds one micro-batch's.

    Noise statistics: the small batch is each micro-batch (whatever k), their mean squared norm."""

    block_sums = staticmethod(float64_block_sums)  # float64 block sums: the norms do not depend on k

    @staticmethod
    def reduced_dtype(dtype: np.dtype) -> np.dtype:
        """The buckets hold int64 integers."""
        return np.dtype(np.int64)

    @staticmethod
    def check(optimizer: Optimizer) -> None:
        """The update must round every element alike wherever a range starts: NumPy's ufuncs, not BLAS."""
        if getattr(optimizer, "blas", None) is not None:
            raise ValueError("reproducible=True needs the optimizer's ufunc update (level1=False): a BLAS "
                             "kernel may round a range's last elements otherwise, so bits would depend on k")

    def __init__(self, model: ReplicaModel, flat: FlatBuffer, comm: MPI.Intracomm, update: Update,
                 schedule: BucketSchedule, watchdog: Watchdog, *, overlap: bool, shared: Array | None) -> None:
        self.model, self.flat, self.comm, self.update = model, flat, comm, update
        self.schedule, self.watchdog, self.overlap = schedule, watchdog, overlap
        self.meter: Meter = schedule.meter
        self.k = comm.Get_size()
        self.codec = FixedPoint(flat.offsets, 1)
        self.reduced = shared if shared is not None else flat.xp.zeros(flat.size, dtype=np.int64)
        self._scratch: Array = None  # int64, for adding a micro-batch's integers (m > 1)
        self._micro = 0  # the micro-batch whose backward is running
        self._encode_on_start = False  # a bucket is converted just before its reduction starts
        self._finite = True
        schedule.bind(self.reduced, update.start, self._on_start)

    def _on_start(self, bucket: Bucket) -> None:
        """The last micro-batch's part of the bucket, to fixed point first (the earlier ones are in)."""
        if not self._encode_on_start:
            return
        a, b = bucket.start, bucket.stop
        g = self.flat.grads[a:b]
        self.codec.measure(g, a, b)
        with np.errstate(invalid="ignore"):  # an overflow is seen by measure; the step is redone
            self.codec.encode_(g, self.reduced[a:b], a, b, self._micro > 0,
                               None if self._scratch is None else self._scratch[a:b])

    def produce(self, run: MicroPass, counts: Sequence[int], step: int, measure: bool) -> Produced:
        """Each micro-batch's gradient to fixed point, the integers added over micro-batches and ranks, the
        sum back to floats. Exponents come from the previous step; the first step, and a step that would
        overflow, is computed again with its own (the same on every rank: a MAX over the ranks after the
        reduction)."""
        codec, m, n = self.codec, len(counts), self.flat.size
        codec.set_terms(self.k * m)
        if m > 1 and self._scratch is None:
            self._scratch = self.flat.xp.empty(n, dtype=np.int64)
        arrivals = len(self.meter.times.arrived_gradients)
        while True:
            calibrate = codec.exponents is None  # no scale yet: measure only, then compute the step again
            codec.start_step()
            loss_sum = None
            self.model.set_accumulate(False)  # each micro-batch's gradient is converted on its own
            for i in range(m):
                self._micro = i
                hooked = self._encode_on_start = i == m - 1 and self.overlap and self.k > 1 and not calibrate
                loss = run(i, self.schedule.armed() if hooked else None)
                loss_sum = loss if loss_sum is None else loss_sum + loss
                if not hooked:  # the whole gradient at once (bucket by bucket as they start otherwise)
                    codec.measure(self.flat.grads, 0, n)
                    if not calibrate:
                        with np.errstate(invalid="ignore"):
                            codec.encode_(self.flat.grads, self.reduced, 0, n, i > 0, self._scratch)
            if not calibrate:
                self.schedule.finish(self.update.what, step)
            self._encode_on_start = False
            flags = np.concatenate([np.array([codec.nonfinite, codec.overflow], dtype=np.int64), codec.needed])
            with self.watchdog.watching(f"fixed-point exponents of step {step}"):
                self.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
            if flags[0]:
                self._one_arrival(arrivals)
                self._finite = False
                return Produced(loss_sum)
            if not (calibrate or flags[1]):
                break
            codec.set_exponents(flags[2:])  # this step's own: compute it again at these scales
        self._one_arrival(arrivals)
        for lo, hi, q, g in self.update.landed(self.reduced):  # at the scales it was encoded with
            codec.decode(q, g, lo, hi)
        codec.set_exponents(flags[2:])  # this step's own: the next step's scales
        self._finite = True
        if measure:  # the mean over this rank's micro-batches
            return Produced(loss_sum, codec.sq_sum / m, counts[0])
        return Produced(loss_sum)

    def _one_arrival(self, before: int) -> None:
        """One arrival at the gradients per step for the straggler report, however often the step was
        computed (a first step or an overflow again): the first."""
        seen = self.meter.times.arrived_gradients
        del seen[before + 1:]
        if self.k > 1 and len(seen) == before:
            seen.append(time.perf_counter())

    def verdict(self, step: int, measure: bool) -> Verdict:
        """Known from the agreed flags; |G|^2 (collective when sharded) only where measured."""
        if not (self._finite and measure):
            return Verdict(self._finite)
        return Verdict(True, self.update.sq_norm(self.watchdog, step))

    def mean_stats(self, rows: np.ndarray) -> np.ndarray:
        """Every rank's rows to every rank, added in global micro-batch order (rank r's micro-batch i is
        number r*m + i) in float64, then divided: the same bits at any k for the same global batch."""
        m = rows.shape[0]
        every = np.empty((self.k * m, rows.shape[1]), dtype=np.float64)
        with self.watchdog.watching("model statistics all-gather"):
            self.comm.Allgather(np.ascontiguousarray(rows, dtype=np.float64), every)
        total = every[0].copy()
        for row in every[1:]:
            total += row
        return total / (self.k * m)

    @property
    def exponents(self) -> np.ndarray | None:
        return self.codec.exponents

    def restore(self, exponents: Sequence[int] | np.ndarray | None) -> None:
        if exponents is not None:
            self.codec.set_exponents(exponents)

    def describe(self) -> str:
        return "int64 fixed-point sums, "

    def nbytes(self) -> int:
        """The integers (and the scratch for adding them)."""
        return int(self.reduced.nbytes) + (0 if self._scratch is None else int(self._scratch.nbytes))

    def close(self) -> None:
        """The model's gradients never left its own memory."""
        return None
