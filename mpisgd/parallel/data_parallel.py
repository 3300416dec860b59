"""Synchronous data parallelism: same start, averaged gradients, the same step everywhere.

``DataParallel(model, optimizer, comm)``:
  1. checks that every rank built the same model (shapes and dtype), then
     broadcasts the parameters from rank 0, so all replicas start identical;
  2. per step, runs forward and backward on the local micro-batches; the loss
     gradient is pre-scaled by 1/(k*b*m), so the all-reduce SUM of the gradient
     buffer is the mean over the effective batch with no extra pass;
  3. reduces gradients in buckets (contiguous slices of the flat gradient
     buffer, filled in reverse layer order) and, with ``overlap``, starts each
     bucket's all-reduce as soon as backward has produced its last gradient;
  4. waits for all buckets, then (optionally) clips the averaged gradient by its global norm and
     applies the identical optimizer step.

With ``shard_optimizer`` (k > 1) the update is split across ranks instead (mpisgd.parallel.sharded): each
bucket is reduce-scattered, each rank updates its chunk, the parameters are all-gathered.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.agreement import ReplicaError, bcast_, differing_ranks, layout_digest, same_arithmetic, verify_same
from mpisgd.backend import arithmetic, is_device_array, to_numpy
from mpisgd.blas import finite_sq_norm
from mpisgd.comm import Handle, Reducer, create_reducer
from mpisgd.exact import BlockNorms, FixedPoint
from mpisgd.nn.loss import SoftmaxCrossEntropy
from mpisgd.nn.module import Model
from mpisgd.optim import Optimizer, Shards, TensorNorms, clip_grad_norm_
from mpisgd.parallel.sharded import ShardedStep
from mpisgd.timeline import NullTimeline
from mpisgd.watchdog import default_watchdog

FIRST_BUCKET_MB = 1.0  # as PyTorch DDP: a small first bucket starts communication early
CHECK_IN = 0x6D70_7367_645F_636B  # first word of a step check-in, so a peer in another collective shows
CHECK_IN_WORDS = 9  # marker, step, gradient size, itemsize, buckets, micro-batches, samples, stop, bad labels


class NonFiniteError(RuntimeError):
    """The averaged gradient holds NaN or Inf (every rank raises it at the same step)."""


@dataclass
class Bucket:
    start: int  # element range [start, stop) of the flat gradient buffer
    stop: int
    first_layer: int  # the lowest layer index in the bucket: done last in backward
    index: int = 0  # position in DataParallel.buckets
    name: str = ""  # for the timeline, made once (not per step)
    handle: Handle | None = None
    t_start: float = 0.0  # when its reduction started; 0 once it is seen complete


@dataclass
class StepStats:
    """Seconds spent and gradient statistics, summed over steps since the last reset; and when this rank
    reached each step's synchronisation points (perf_counter), for the straggler report (mpisgd.app.straggler).

    The gradient noise scale (mpisgd.noise) needs, on every ``noise_every``-th step, the squared norm of
    a small-batch gradient (each rank's own before the all-reduce; at k = 1 the first micro-batch's) and
    of the averaged one: ``small_sq`` sums this rank's (true units, not the 1/k-scaled buffer's),
    ``big_sq_share`` sums |G|^2 / k, so that the sums over ranks give the mean over ranks and |G|^2."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_total_s: float = 0.0  # from a bucket's start to its observed completion
    comm_exposed_s: float = 0.0  # time the step waited for communication
    optimizer_s: float = 0.0
    steps: int = 0
    bytes_reduced: int = 0
    noise_steps: int = 0  # steps whose gradient norms were measured
    small_sq: float = 0.0
    big_sq_share: float = 0.0
    b_small: int = 0  # samples behind one small-batch gradient (0: none measured)
    arrived_check_in: list[float] = field(default_factory=list)  # entering the step check-in
    arrived_gradients: list[float] = field(default_factory=list)  # backward done, waiting for the gradients


def make_buckets(model: Model, itemsize: int, bucket_cap_mb: float) -> list[Bucket]:
    """Group layers' parameter ranges into buckets of about ``bucket_cap_mb``, last layer first."""
    ranges = [(i, a, b) for i, (a, b) in enumerate(model.layer_param_ranges()) if a >= 0]
    buckets: list[Bucket] = []
    cap = min(FIRST_BUCKET_MB, bucket_cap_mb) * 2**20
    current: list[tuple[int, int, int]] = []
    for layer, a, b in reversed(ranges):
        current.append((layer, a, b))
        if sum(y - x for _, x, y in current) * itemsize >= cap:
            buckets.append(Bucket(current[-1][1], current[0][2], current[-1][0]))
            current, cap = [], bucket_cap_mb * 2**20
    if current:
        buckets.append(Bucket(current[-1][1], current[0][2], current[-1][0]))
    for i, bucket in enumerate(buckets):
        bucket.index, bucket.name = i, f"allreduce b{i}"
    return buckets


def model_layout(model: Model) -> str:
    """What every rank's replica must share: its layers, their parameter shapes and the dtype."""
    assert model.flat is not None
    return f"{model!r} {model.flat.shapes} {model.flat.dtype}"


def optimizer_layout(optimizer: Optimizer) -> str:
    """What every rank's optimizer must share: its kind and its state buffers (broadcast and gathered
    by name, so a rank with other buffers would mismatch those collectives)."""
    return f" {type(optimizer).__name__} {sorted(optimizer.state_buffers())}"


class ReplicatedStep:
    """The plain update: every bucket all-reduced in place, every rank updating every parameter."""

    def __init__(self, flat: Any, reducer: Reducer, norms: Any = None) -> None:
        self.flat, self.reducer = flat, reducer
        self._norms = norms or TensorNorms(flat.offsets, [(0, flat.size)])

    def start(self, index: int, grads: Any) -> Handle:
        return self.reducer.start(grads)

    def finite(self, watchdog: Any, step: int) -> tuple[bool, float]:
        """Whether the averaged gradient is finite, and its squared norm: the reduced buffer is the same
        on every rank, so is the verdict."""
        return finite_sq_norm(self.flat.grads, self.flat.xp)

    def decode(self, codec: FixedPoint, summed: Any) -> None:
        codec.decode(summed, self.flat.grads, 0, self.flat.size)

    def sq_norm_share(self, k: int) -> float:
        """|G|^2 / k of the averaged gradient (summed over the ranks: |G|^2)."""
        return finite_sq_norm(self.flat.grads, self.flat.xp)[1] / k

    @property
    def shards(self) -> Shards:
        """The averaged gradient as (lo, hi, g) pieces: here all of it, on every rank."""
        return [(0, self.flat.size, self.flat.grads)]

    def norms(self, watchdog: Any, step: int) -> Any:
        """Whole-tensor norms of the averaged gradient (what an update rule, or clipping, is given): this
        rank holds every tensor whole."""
        return self._norms

    def apply(self, optimizer: Any, lr: float, watchdog: Any, step: int) -> None:
        optimizer.step_shards(lr, self.shards, self._norms)

    def nbytes(self) -> int:
        return 0


class DataParallel:
    """Wrap a model replica and its optimizer so that each step averages gradients over ``comm``.

    ``comm`` is duplicated (and freed by :meth:`close`), so our traffic never mixes with the caller's.
    ``reducer`` is the all-reduce strategy (``mpisgd.comm.create_reducer``; ``auto`` over ``comm``
    when None); DataParallel owns it and closes it. ``loss`` (default softmax cross-entropy) must
    offer ``forward_array(logits, labels)`` and ``backward(scale)``. ``check_in``: the per-step
    check-in that every rank is at the same step with the same number of samples (:meth:`check_in_step`)
    runs inside each :meth:`train_step`; a caller that checks in itself (the CLI's loop) turns it off.
    ``reproducible``: gradients summed exactly in fixed point (mpisgd.exact), so that the parameters
    are the same bits for any number of ranks, strategy and bucket layout given the same micro-batches.
    ``noise_every``: measure the gradient-noise statistics every that many steps (0: never).
    ``clip_grad_norm``: clip the averaged gradient to this global L2 norm before the optimizer's step
    (None or 0: off); ``measure_grad_norm``: compute that norm (:attr:`last_grad_norm`) even without.
    ``watchdog``: the stall watchdog its collectives report to (DataParallel closes it); without one, its
    own: a wait of ``stall_timeout_s`` names the ranks that have not arrived, one of ``stall_abort_s``
    ends the job (0: never; both 0: no watchdog).
    """

    def __init__(self, model: Model, optimizer: Optimizer, comm: Any, *, reducer: Reducer | None = None,
                 loss: Any = None, bucket_cap_mb: float = 25.0, overlap: bool = True, on_nan: str = "stop",
                 shard_optimizer: bool = False, shared_grads: bool = True, watchdog: Any = None,
                 timeline: Any = None, check_in: bool = True, reproducible: bool = False,
                 noise_every: int = 0, stall_timeout_s: float = 300.0, stall_abort_s: float = 1800.0,
                 clip_grad_norm: float | None = None, measure_grad_norm: bool = False) -> None:
        if on_nan not in ("stop", "skip"):
            raise ValueError(f"on_nan must be stop or skip, got {on_nan!r}")
        if clip_grad_norm is not None and not (math.isfinite(clip_grad_norm) and clip_grad_norm >= 0):
            raise ValueError(f"clip_grad_norm must be a finite number >= 0 (0 or None: no clipping), got "
                             f"{clip_grad_norm}")
        if model.flat is None:
            raise ValueError("materialize() the model before wrapping it")
        if noise_every < 0:
            raise ValueError(f"noise_every must be >= 0, got {noise_every}")
        device = is_device_array(model.flat.params)
        if shard_optimizer and device:
            raise ValueError("the sharded optimizer step runs on host buffers only; drop --shard-optimizer "
                             "or use --device cpu")
        if reducer is not None and device and not reducer.device:
            raise ValueError("GPU parameters need a reducer made for device buffers: "
                             "create_reducer(name, comm, device=True)")
        if reproducible and getattr(optimizer, "blas", None) is not None:
            raise ValueError("reproducible=True needs the optimizer's ufunc update (level1=False): a BLAS "
                             "kernel may round a range's last elements otherwise, so bits would depend on k")
        self.model, self.optimizer, self.flat = model, optimizer, model.flat
        self.comm = comm.Dup()
        self.k, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.overlap, self.on_nan, self.check_in = overlap, on_nan, check_in
        self.noise_every = noise_every
        self.clip_grad_norm = clip_grad_norm or None  # the averaged gradient's largest global L2 norm
        self.measure_grad_norm = measure_grad_norm  # compute last_grad_norm even without clipping
        self._grad_norm: float | None = None
        self.skipped_steps = 0
        self.step_skipped = False  # whether the last train_step skipped its update (--on-nan skip)
        self.step_count = 0
        self.timeline = timeline or NullTimeline()
        self.watchdog = watchdog or default_watchdog(comm, stall_timeout_s, stall_abort_s)
        self.reducer = reducer if reducer is not None else create_reducer("auto", self.comm, device=device)
        self.buckets = make_buckets(model, self.flat.dtype.itemsize, bucket_cap_mb)
        self._bucket_of_layer = {b.first_layer: b for b in self.buckets}
        self.sharded = shard_optimizer and self.k > 1
        self.exact = FixedPoint(self.flat.offsets, 1) if reproducible else None
        self.loss = loss or SoftmaxCrossEntropy()
        self.times = StepStats()
        self._n_classes: int | None = None  # the model's outputs, known after the first forward
        self._measure = False  # this step's noise statistics are being gathered
        self._local_sq = 0.0
        self._micro = 0  # the micro-batch whose backward is running
        verify_same(self.comm, layout_digest(model_layout(model) + optimizer_layout(optimizer)),
                    "the model (layers, shapes or dtype) or the optimizer (its kind and state buffers)")
        same_arithmetic(self.comm, arithmetic(self.flat.params, getattr(optimizer, "blas", None) is not None))
        # same shapes everywhere: the reduced buffer (the gradients, or their fixed-point integers) into
        # memory the reducer reads in place, where it has any (auto or shared, one node: mpisgd.comm.shared)
        red_dtype = self.flat.dtype if self.exact is None else np.dtype(np.int64)
        shared = self.reducer.shared_buffer(self.flat.size, red_dtype) \
            if shared_grads and self.k > 1 and not device else None
        self.shared_grads = shared is not None
        if self.exact is None:
            if shared is not None:
                model.move_grads(shared)
            self.summed = self.flat.grads  # what the buckets reduce: the gradients themselves
        else:
            self.summed = shared if shared is not None else self.flat.xp.zeros(self.flat.size, dtype=np.int64)
        self._scratch: Any = None  # int64 for adding a micro-batch's integers (reproducible, m > 1)
        ranges = [(b.start, b.stop) for b in self.buckets]
        norms = None if self.exact is None else BlockNorms(self.flat.offsets, [(0, self.flat.size)])
        self.update: ReplicatedStep | ShardedStep = \
            ShardedStep(self.flat, ranges, self.comm, self.reducer, exact=self.exact is not None) \
            if self.sharded else ReplicatedStep(self.flat, self.reducer, norms)
        self.broadcast_parameters()
        if self.k > 1:  # auto picks its strategy for these sizes now, not mid-step
            self.reducer.tune([self.summed[b.start:b.stop] for b in self.buckets], reduce_scatter=self.sharded)

    # -- start identical, check identical, continue -----------------------------------------
    def broadcast_parameters(self, root: int = 0) -> None:
        """Every rank takes ``root``'s parameters and optimizer state buffers (momentum, moments)."""
        bcast_(self.comm, self.flat.params, root)
        for _, buf in sorted(self.optimizer.state_buffers().items()):
            bcast_(self.comm, buf, root)

    def replica_checksums(self) -> list[str]:
        """Every rank's parameter digest (collective)."""
        digest = hashlib.blake2b(to_numpy(self.flat.params).tobytes(), digest_size=8).hexdigest()
        with self.watchdog.watching(f"replica check at step {self.step_count}"):
            return self.comm.allgather(digest)

    def check_replicas(self) -> None:
        """Raise ReplicaError on every rank, naming the diverged ranks, if parameters differ."""
        sums = self.replica_checksums()
        bad = differing_ranks(sums)
        if bad:
            raise ReplicaError(f"replicas diverged at step {self.step_count}: rank(s) {bad} hold parameters "
                               f"that differ from the other ranks (checksums {dict(enumerate(sums))})")

    def restore(self, step_count: int, skipped_steps: int, exponents: Any = None) -> None:
        """Continue a run from a checkpoint: its step number, the steps it skipped so far and, reproducible,
        the fixed-point exponents its next step uses."""
        self.step_count, self.skipped_steps = step_count, skipped_steps
        if self.exact is not None and exponents is not None:
            self.exact.set_exponents(exponents)

    @property
    def exponents(self) -> Any:
        """Reproducible: the fixed-point exponents the next step uses (None before the first step)."""
        return None if self.exact is None else self.exact.exponents

    def reset_times(self) -> StepStats:
        """Start new timings and statistics (an epoch's); returns the ones gathered since the last reset."""
        done, self.times = self.times, StepStats()
        return done

    # -- the step ------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[tuple[Any, Any]], lr: float) -> Any:
        """One optimizer step over this rank's micro-batches; returns the local mean loss (0-d array)."""
        m = len(micro_batches)
        if m < 1:
            raise ValueError("train_step needs at least one micro-batch")
        if self.check_in and self.k > 1:
            self.check_in_step(micro=micro_batches)
        n = sum(len(y) for _, y in micro_batches)
        # every sample weighs 1/(k*n): with the same n on every rank (the check-in compares it) the
        # all-reduce SUM is the mean over the effective batch B = k*n, with no pass after it
        scale = 1.0 / (self.k * n)
        self._measure = self.noise_every > 0 and self.step_count % self.noise_every == 0
        self._local_sq = 0.0
        if self.exact is None:
            loss_sum = self._float_gradients(micro_batches, scale)
        else:
            loss_sum, finite = self._exact_gradients(micro_batches, scale)
        t0 = time.perf_counter()
        with self.timeline.span("optimizer"):
            # decided on the reduced gradient, so every rank takes the same branch
            if self.exact is None:
                finite, sq = self.update.finite(self.watchdog, self.step_count)
                share = sq / self.k
            else:
                share = self.update.sq_norm_share(self.k) if finite and self._measure else 0.0
            self._grad_norm = None
            if finite:
                self._update(lr)
            elif self.on_nan == "stop":
                raise NonFiniteError(f"non-finite gradient at step {self.step_count} (after the all-reduce); "
                                     "lower --lr, or pass --on-nan skip to skip such steps")
            self.step_skipped = not finite
            self.skipped_steps += not finite
        self.times.optimizer_s += time.perf_counter() - t0
        if finite and self._measure:
            self._note_noise(micro_batches, share)
        if finite and self.sharded:
            self._gather(self.flat.params, f"parameter all-gather of step {self.step_count}")
        self.times.steps += 1
        self.step_count += 1
        return loss_sum / m

    def _update(self, lr: float) -> None:
        """The step on the averaged gradient: first its global norm, when clipping or asked (from the
        step's TensorNorms: sharded, every rank's pieces, so every rank clips alike; reproducible, block
        norms, so the clipping does not depend on k), then the optimizer."""
        if self.clip_grad_norm or self.measure_grad_norm:
            norms = self.update.norms(self.watchdog, self.step_count)
            self._grad_norm = clip_grad_norm_(self.update.shards, norms, self.clip_grad_norm)
        self.update.apply(self.optimizer, lr, self.watchdog, self.step_count)

    @property
    def last_grad_norm(self) -> float | None:
        """The global L2 norm of the last step's averaged gradient, before clipping (the same on every
        rank); None where it was not computed: neither clipping nor ``measure_grad_norm``, or a step
        skipped for a non-finite gradient."""
        return self._grad_norm

    def _forward_backward(self, x: Any, y: Any, scale: float, hook: Any) -> Any:
        t0 = time.perf_counter()
        with self.timeline.span("forward"):
            logits = self.model.forward(x)
            loss = self.loss.forward_array(logits, y)
        self._n_classes = logits.shape[1] if logits.ndim == 2 else None
        t1 = time.perf_counter()
        with self.timeline.span("backward"):
            self.model.backward(self.loss.backward(scale), hook)
        self.times.forward_s += t1 - t0
        self.times.backward_s += time.perf_counter() - t1
        return loss

    def _float_gradients(self, micro_batches: Sequence[tuple[Any, Any]], scale: float) -> Any:
        """Backward over the micro-batches, adding their gradients in place; each bucket's all-reduce
        starts as soon as backward has finished it (overlap), the rest after."""
        m, loss_sum = len(micro_batches), None
        for i, (x, y) in enumerate(micro_batches):
            last = i == m - 1
            self.model.set_accumulate(i > 0)  # micro-batch 0 overwrites, later ones add
            hook = self._on_layer_done if (last and self.overlap and self.k > 1) else None
            loss = self._forward_backward(x, y, scale, hook)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            if self._measure and self.k == 1 and i == 0 and m > 1:  # the small batch: micro-batch 0
                self._local_sq = finite_sq_norm(self.flat.grads, self.flat.xp)[1]
        self.model.set_accumulate(False)
        self.finish_gradients()
        return loss_sum

    def _exact_gradients(self, micro_batches: Sequence[tuple[Any, Any]], scale: float) -> tuple[Any, bool]:
        """Reproducible: each micro-batch's gradient to fixed point (mpisgd.exact), the integers added
        over micro-batches and ranks, the sum back to floats. Exponents come from the previous step; the
        first step, and a step that would overflow, is computed again with its own (the same on every
        rank: a MAX over the ranks after the reduction). Returns (loss sum, whether finite)."""
        codec, m, n = self.exact, len(micro_batches), self.flat.size
        assert codec is not None
        codec.set_terms(self.k * m)
        if m > 1 and self._scratch is None:
            self._scratch = self.flat.xp.empty(n, dtype=np.int64)
        arrivals = len(self.times.arrived_gradients)
        while True:
            calibrate = codec.exponents is None  # no scale yet: measure only, then compute the step again
            codec.start_step()
            loss_sum = None
            self.model.set_accumulate(False)
            for i, (x, y) in enumerate(micro_batches):
                self._micro, last = i, i == m - 1
                hook = self._on_layer_done if (last and self.overlap and self.k > 1 and not calibrate) else None
                loss = self._forward_backward(x, y, scale, hook)
                loss_sum = loss if loss_sum is None else loss_sum + loss
                if hook is None:  # the whole gradient at once (the hook did it bucket by bucket otherwise)
                    codec.measure(self.flat.grads, 0, n)
                    if not calibrate:
                        with np.errstate(invalid="ignore"):  # an overflow is seen by measure; the step is redone
                            codec.encode_(self.flat.grads, self.summed, 0, n, i > 0, self._scratch)
            if not calibrate:
                self.finish_gradients()
            flags = np.concatenate([np.array([codec.nonfinite, codec.overflow], dtype=np.int64), codec.needed])
            with self.watchdog.watching(f"fixed-point exponents of step {self.step_count}"):
                self.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
            if flags[0]:
                self._one_arrival(arrivals)
                return loss_sum, False
            if not (calibrate or flags[1]):
                break
            codec.set_exponents(flags[2:])  # this step's own: compute it again at these scales
        self._one_arrival(arrivals)
        self.update.decode(codec, self.summed if not self.sharded else None)  # at the scales it was encoded with
        codec.set_exponents(flags[2:])  # this step's own: the next step's scales
        if self._measure:
            self._local_sq = codec.sq_sum / m  # the mean over this rank's micro-batches (b samples each)
        return loss_sum, True

    def _one_arrival(self, before: int) -> None:
        """One arrival at the gradients per step for the straggler report, however often the step was
        computed (reproducible: a first step or an overflow again): the first."""
        seen = self.times.arrived_gradients
        del seen[before + 1:]
        if self.k > 1 and len(seen) == before:
            seen.append(time.perf_counter())

    def _note_noise(self, micro_batches: Sequence[tuple[Any, Any]], big_sq_share: float) -> None:
        """Add this step's squared norms to the noise statistics, in true units: the buffer holds each
        small-batch gradient times b_small / B."""
        n = sum(len(y) for _, y in micro_batches)
        b_small = len(micro_batches[0][1]) if (self.exact is not None or self.k == 1) else n
        if self.k * n == b_small or not np.isfinite(self._local_sq) or not np.isfinite(big_sq_share):
            return  # one small batch is the whole batch (k = 1, m = 1): nothing to compare
        t = self.times
        t.noise_steps += 1
        t.small_sq += self._local_sq * (self.k * n / b_small) ** 2
        t.big_sq_share += big_sq_share
        t.b_small = b_small

    def check_in_step(self, stop: int = 0, micro: Sequence[tuple[Any, Any]] = ()) -> int:
        """Collective, once per step before any bucket: every rank must be at the same step with the same
        buffers (and, given its ``micro`` batches, as many micro-batches and samples, with labels the
        model can score), and at a check-in (not in another collective). A rank out of step is named on
        every rank instead of reducing the wrong data or hanging in a mismatched bucket (one small
        Allgather). Returns the largest ``stop`` any rank passed (0: none; a SIGTERM to stop at this step)."""
        if self.k == 1:
            return stop
        labels = [y for _, y in micro]
        low = min((int(y.min()) for y in labels if len(y)), default=0)
        high = max((int(y.max()) for y in labels if len(y)), default=0)
        bad = low < 0 or (self._n_classes is not None and high >= self._n_classes)
        mine = np.array([CHECK_IN, self.step_count, self.flat.size, self.flat.dtype.itemsize, len(self.buckets),
                         len(micro), sum(len(y) for y in labels), int(stop), int(bad)], dtype=np.int64)
        assert mine.size == CHECK_IN_WORDS
        every = np.zeros((self.k, mine.size), dtype=np.int64)
        self.times.arrived_check_in.append(time.perf_counter())
        self.timeline.instant("arrive: step check-in")
        # watched like every blocking collective: a rank stopped between steps waits here
        with self.watchdog.watching(f"step check-in of step {self.step_count}"):
            try:
                self.comm.Allgather(mine, every)
            except MPI.Exception as exc:  # a peer in another collective whose message does not fit
                raise ReplicaError(f"the check-in of step {self.step_count} failed ({exc.Get_error_string()}): "
                                   "a rank is in another collective; every rank must call DataParallel's methods "
                                   "in the same order") from None
        strangers = [r for r in range(self.k) if every[r, 0] != CHECK_IN]
        if strangers:
            raise ReplicaError(f"rank(s) {strangers} are not at the check-in of step {self.step_count} but in another "
                               "collective (a replica check, a checkpoint, close...): every rank must call "
                               "DataParallel's methods in the same order")
        rows = [tuple(int(v) for v in row[1:5]) for row in every]
        if len(set(rows)) > 1:
            raise ReplicaError(f"rank(s) {differing_ranks(rows)} out of step: (step, gradient size, itemsize, "
                               f"buckets) per rank {dict(enumerate(rows))}")
        sizes = [tuple(int(v) for v in row[5:7]) for row in every]
        if len(set(sizes)) > 1:
            raise ReplicaError(f"rank(s) {differing_ranks(sizes)} passed other batches: (micro-batches, samples) "
                               f"per rank {dict(enumerate(sizes))}; every rank must train on as many of each, "
                               "or the average would weigh the ranks' samples unequally")
        if every[:, 8].any():
            raise ReplicaError(f"rank(s) {[r for r in range(self.k) if every[r, 8]]} passed labels outside "
                               f"0..{(self._n_classes or 0) - 1 if self._n_classes else 'C-1'} (a negative label "
                               "would silently score the last class)")
        return int(every[:, 7].max())

    def _on_layer_done(self, layer: int) -> None:
        bucket = self._bucket_of_layer.get(layer)
        if bucket is not None:
            if self.exact is not None:  # this micro-batch's part of the bucket, to fixed point first
                self.exact.measure(self.flat.grads[bucket.start:bucket.stop], bucket.start, bucket.stop)
                with np.errstate(invalid="ignore"):
                    self.exact.encode_(self.flat.grads[bucket.start:bucket.stop], self.summed[bucket.start:bucket.stop],
                                       bucket.start, bucket.stop, self._micro > 0,
                                       None if self._scratch is None else self._scratch[bucket.start:bucket.stop])
            self._start(bucket)
        for b in self.buckets:  # MPI progresses only inside MPI calls: poke the open ones
            if b.handle is not None and b.t_start and b.handle.test():
                self._done(b)

    def _start(self, bucket: Bucket) -> None:
        if self._measure and self.exact is None:  # this rank's own gradient, before the reduction sums it away
            self._local_sq += finite_sq_norm(self.flat.grads[bucket.start:bucket.stop], self.flat.xp)[1]
        self.timeline.begin(bucket.name, cat="comm")
        bucket.t_start = time.perf_counter()
        bucket.handle = self.update.start(bucket.index, self.summed[bucket.start:bucket.stop])

    def _done(self, bucket: Bucket) -> None:
        self.times.comm_total_s += time.perf_counter() - bucket.t_start
        self.times.bytes_reduced += (bucket.stop - bucket.start) * self.summed.dtype.itemsize
        self.timeline.end(bucket.name, cat="comm")
        bucket.t_start = 0.0  # marks it complete

    def finish_gradients(self) -> None:
        """Start the buckets not yet started, wait for all; afterwards the reduced buffer holds the sum
        (sharded: this rank's chunks of it are in the shard buffer)."""
        if self.k == 1:
            return
        t0 = time.perf_counter()
        self.times.arrived_gradients.append(t0)
        self.timeline.instant("arrive: gradients")
        what = "reduce-scatter" if self.sharded else "all-reduce"
        with self.watchdog.watching(f"gradient {what} of step {self.step_count}"), \
                self.timeline.span("wait comm", cat="comm"):
            for b in self.buckets:
                if b.handle is None:
                    self._start(b)
            for b in self.buckets:
                assert b.handle is not None
                b.handle.wait()
                if b.t_start:
                    self._done(b)
                b.handle = None
        self.times.comm_exposed_s += time.perf_counter() - t0

    def grads_finite(self) -> bool:
        """Whether the reduced gradient is finite: the same answer on every rank (collective when sharded)."""
        return self.update.finite(self.watchdog, self.step_count)[0]

    def _gather(self, buf: Any, what: str) -> None:
        assert isinstance(self.update, ShardedStep)
        with self.timeline.span("all-gather", cat="comm"):
            elapsed = self.update.gather_(buf, self.watchdog, what)
        self.times.comm_exposed_s += elapsed  # nothing overlaps it
        self.times.comm_total_s += elapsed

    def gather_optimizer_state(self) -> None:
        """Collective: make every optimizer state buffer whole on every rank (sharded: each rank updated
        only its chunks). Needed before a checkpoint is written; a no-op when the step is not sharded."""
        if self.sharded:
            for name, buf in sorted(self.optimizer.state_buffers().items()):
                self._gather(buf, f"optimizer state ({name}) all-gather at step {self.step_count}")

    # -- what it holds, what it runs ---------------------------------------------------------
    def buffer_nbytes(self) -> int:
        """Bytes of this rank's training state: parameters, gradients, the optimizer's buffers and, sharded,
        the chunk of the averaged gradient it receives; reproducible, the integers."""
        held = {id(b): int(b.nbytes) for b in (self.flat.params, self.flat.grads, self.summed, self._scratch)
                if b is not None}
        return sum(held.values()) + self.update.nbytes() + self.optimizer.buffer_nbytes()

    def describe(self) -> str:
        """The banner's all-reduce line: what runs, the buckets, overlap."""
        mib = ", ".join(f"{(b.stop - b.start) * self.summed.dtype.itemsize / 2**20:.2f}" for b in self.buckets)
        when = "overlapped with backward" if self.overlap else "after backward"
        what = "" if self.exact is None else "int64 fixed-point sums, "
        return f"{self.reducer.describe()} ({what}{len(self.buckets)} bucket(s): {mib} MiB), {when}"

    def close(self) -> None:
        """Collective: every rank calls it together. A rank that fails alone must not call it (with a
        watchdog, rank 0 would wait for the others' close); abort the job instead."""
        self.watchdog.close()
        if self.shared_grads and self.exact is None:  # the window goes with the reducer: keep the gradients
            self.model.move_grads(np.empty_like(self.flat.grads))
        self.shared_grads = False
        self.reducer.close()
        self.comm.Free()
