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

With ``shard_optimizer`` (k > 1) the update is split across ranks instead (mpisgd.sharded): each
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

from mpisgd.agreement import ReplicaError, bcast_, differing_ranks, layout_digest, verify_same
from mpisgd.backend import is_device_array, to_numpy
from mpisgd.blas import all_finite
from mpisgd.comm import Handle, Reducer, create_reducer
from mpisgd.nn.loss import SoftmaxCrossEntropy
from mpisgd.nn.sequential import Sequential
from mpisgd.optim import Optimizer, Shards, TensorNorms, clip_grad_norm_
from mpisgd.sharded import ShardedStep
from mpisgd.timeline import NullTimeline
from mpisgd.watchdog import NullWatchdog

FIRST_BUCKET_MB = 1.0  # as PyTorch DDP: a small first bucket starts communication early
CHECK_IN = 0x6D70_7367_645F_636B  # first word of a step check-in, so a peer in another collective shows


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
class StepTimes:
    """Seconds spent, summed over steps since the last reset; and when this rank reached each step's
    synchronisation points (perf_counter), for the straggler report (mpisgd.straggler)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_total_s: float = 0.0  # from a bucket's start to its observed completion
    comm_exposed_s: float = 0.0  # time the step waited for communication
    optimizer_s: float = 0.0
    steps: int = 0
    bytes_reduced: int = 0
    arrived_check_in: list[float] = field(default_factory=list)  # entering the step check-in
    arrived_gradients: list[float] = field(default_factory=list)  # backward done, waiting for the gradients


def make_buckets(model: Sequential, itemsize: int, bucket_cap_mb: float) -> list[Bucket]:
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


def model_layout(model: Sequential) -> str:
    """What every rank's replica must share: its layers, their parameter shapes and the dtype."""
    assert model.flat is not None
    return f"{model!r} {model.flat.shapes} {model.flat.dtype}"


def optimizer_layout(optimizer: Optimizer) -> str:
    """What every rank's optimizer must share: its kind and its state buffers (broadcast and gathered
    by name, so a rank with other buffers would mismatch those collectives)."""
    return f" {type(optimizer).__name__} {sorted(optimizer.state_buffers())}"


class ReplicatedStep:
    """The plain update: every bucket all-reduced in place, every rank updating every parameter."""

    def __init__(self, flat: Any, reducer: Reducer) -> None:
        self.flat, self.reducer = flat, reducer

    def start(self, index: int, grads: Any) -> Handle:
        return self.reducer.start(grads)

    def finite(self, watchdog: Any, step: int) -> bool:
        return all_finite(self.flat.grads, self.flat.xp)  # the reduced buffer: the same verdict everywhere

    @property
    def shards(self) -> Shards:
        """The averaged gradient as (lo, hi, g) pieces: here all of it, on every rank."""
        return [(0, self.flat.size, self.flat.grads)]

    def norms(self, watchdog: Any, step: int) -> TensorNorms:
        """Where whole-tensor norms of the averaged gradient come from: this rank holds it all."""
        return TensorNorms(self.flat.offsets, [(0, self.flat.size)])

    def apply(self, optimizer: Any, lr: float, watchdog: Any, step: int) -> None:
        optimizer.step(lr)

    def nbytes(self) -> int:
        return 0


class DataParallel:
    """Wrap a model replica and its optimizer so that each step averages gradients over ``comm``.

    ``comm`` is duplicated (and freed by :meth:`close`), so our traffic never mixes with the caller's.
    ``reducer`` is the all-reduce strategy (``mpisgd.comm.create_reducer``; ``auto`` over ``comm``
    when None); DataParallel owns it and closes it. ``loss`` (default softmax cross-entropy) must
    offer ``forward_array(logits, labels)`` and ``backward(scale)``. ``check_in``: the per-step
    check-in that every rank is at the same step (:meth:`check_in_step`) runs inside each
    :meth:`train_step`; a caller that checks in itself (the CLI's loop) turns it off.
    """

    def __init__(self, model: Sequential, optimizer: Optimizer, comm: Any, *, reducer: Reducer | None = None,
                 loss: Any = None, bucket_cap_mb: float = 25.0, overlap: bool = True, on_nan: str = "stop",
                 shard_optimizer: bool = False, shared_grads: bool = True, watchdog: Any = None,
                 timeline: Any = None, check_in: bool = True, clip_grad_norm: float | None = None,
                 measure_grad_norm: bool = False) -> None:
        if on_nan not in ("stop", "skip"):
            raise ValueError(f"on_nan must be stop or skip, got {on_nan!r}")
        if clip_grad_norm is not None and not (math.isfinite(clip_grad_norm) and clip_grad_norm >= 0):
            raise ValueError(f"clip_grad_norm must be a finite number >= 0 (0 or None: no clipping), got "
                             f"{clip_grad_norm}")
        if model.flat is None:
            raise ValueError("materialize() the model before wrapping it")
        device = is_device_array(model.flat.params)
        if shard_optimizer and device:
            raise ValueError("the sharded optimizer step runs on host buffers only; drop --shard-optimizer "
                             "or use --device cpu")
        if reducer is not None and device and not reducer.device:
            raise ValueError("GPU parameters need a reducer made for device buffers: "
                             "create_reducer(name, comm, device=True)")
        self.model, self.optimizer, self.flat = model, optimizer, model.flat
        self.comm = comm.Dup()
        self.k, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.overlap, self.on_nan, self.check_in = overlap, on_nan, check_in
        self.clip_grad_norm = clip_grad_norm or None  # the averaged gradient's largest global L2 norm
        self.measure_grad_norm = measure_grad_norm  # compute last_grad_norm even without clipping
        self._grad_norm: float | None = None
        self.skipped_steps = 0
        self.step_skipped = False  # whether the last train_step skipped its update (--on-nan skip)
        self.step_count = 0
        self.timeline = timeline or NullTimeline()
        self.watchdog = watchdog or NullWatchdog()
        self.reducer = reducer if reducer is not None else create_reducer("auto", self.comm, device=device)
        self.buckets = make_buckets(model, self.flat.dtype.itemsize, bucket_cap_mb)
        self._bucket_of_layer = {b.first_layer: b for b in self.buckets}
        self.sharded = shard_optimizer and self.k > 1
        self.update: ReplicatedStep | ShardedStep = \
            ShardedStep(self.flat, [(b.start, b.stop) for b in self.buckets], self.comm, self.reducer) \
            if self.sharded else ReplicatedStep(self.flat, self.reducer)
        self.loss = loss or SoftmaxCrossEntropy()
        self.times = StepTimes()
        verify_same(self.comm, layout_digest(model_layout(model) + optimizer_layout(optimizer)),
                    "the model (layers, shapes or dtype) or the optimizer (its kind and state buffers)")
        # same shapes everywhere: gradients into memory the reducer reads in place, where it has any
        # (auto or shared with every rank on one node: mpisgd.comm.shared)
        shared = self.reducer.shared_buffer(self.flat.size, self.flat.dtype) \
            if shared_grads and self.k > 1 and not device else None
        self.shared_grads = shared is not None
        if shared is not None:
            model.move_grads(shared)
        self.broadcast_parameters()
        if self.k > 1 and not self.sharded:  # auto picks its strategy for these sizes now, not mid-step
            self.reducer.tune([self.flat.grads[b.start:b.stop] for b in self.buckets])

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

    def restore(self, step_count: int, skipped_steps: int) -> None:
        """Continue a run from a checkpoint: its step number and the steps it skipped so far."""
        self.step_count, self.skipped_steps = step_count, skipped_steps

    def reset_times(self) -> StepTimes:
        """Start new phase timings (an epoch's); returns the ones gathered since the last reset."""
        done, self.times = self.times, StepTimes()
        return done

    # -- the step ------------------------------------------------------------------------
    def grad_scale(self, local_batch: int, accum_steps: int) -> float:
        """Loss-gradient factor making the all-reduce SUM the effective-batch mean: 1/(k*b*m)."""
        return 1.0 / (local_batch * accum_steps * self.k)

    def train_step(self, micro_batches: Sequence[tuple[Any, Any]], lr: float) -> Any:
        """One optimizer step over this rank's micro-batches; returns the local mean loss (0-d array)."""
        m = len(micro_batches)
        if m < 1:
            raise ValueError("train_step needs at least one micro-batch")
        if self.check_in and self.k > 1:
            self.check_in_step()
        tl, times = self.timeline, self.times
        loss_sum = None
        for i, (x, y) in enumerate(micro_batches):
            last = i == m - 1
            self.model.set_accumulate(i > 0)  # micro-batch 0 overwrites, later ones add
            t0 = time.perf_counter()
            with tl.span("forward"):
                logits = self.model.forward(x)
                loss = self.loss.forward_array(logits, y)
            t1 = time.perf_counter()
            with tl.span("backward"):
                dy = self.loss.backward(self.grad_scale(len(y), m))
                hook = self._on_layer_done if (last and self.overlap and self.k > 1) else None
                self.model.backward(dy, hook)
            times.forward_s += t1 - t0
            times.backward_s += time.perf_counter() - t1
            loss_sum = loss if loss_sum is None else loss_sum + loss
        self.model.set_accumulate(False)
        self.finish_gradients()
        t0 = time.perf_counter()
        with tl.span("optimizer"):
            # decided on the reduced gradient, so every rank takes the same branch
            finite = self.grads_finite()
            self._grad_norm = None
            if finite:
                self._update(lr)
            elif self.on_nan == "stop":
                raise NonFiniteError(f"non-finite gradient at step {self.step_count} (after the all-reduce); "
                                     "lower --lr, or pass --on-nan skip to skip such steps")
            self.step_skipped = not finite
            self.skipped_steps += not finite
        times.optimizer_s += time.perf_counter() - t0
        if finite and self.sharded:
            self._gather(self.flat.params, f"parameter all-gather of step {self.step_count}")
        times.steps += 1
        self.step_count += 1
        return loss_sum / m

    def _update(self, lr: float) -> None:
        """The step on the averaged gradient: first its global norm, when clipping or asked (from a
        TensorNorms: sharded, every rank's pieces, so every rank clips alike), then the optimizer."""
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

    def grads_finite(self) -> bool:
        """Whether the reduced gradient is finite: the same answer on every rank (collective when sharded)."""
        return self.update.finite(self.watchdog, self.step_count)

    def check_in_step(self, stop: bool = False) -> bool:
        """Collective, once per step before any bucket: every rank must be at the same step with the same
        buffers, and at a check-in (not in another collective). A rank out of step is named on every rank
        instead of reducing the wrong data or hanging in a mismatched bucket (one 48-byte Allgather).
        Returns whether any rank passed ``stop`` (a SIGTERM to stop at this step)."""
        if self.k == 1:
            return stop
        mine = np.array([CHECK_IN, self.step_count, self.flat.size, self.flat.dtype.itemsize, len(self.buckets),
                         int(stop)], dtype=np.int64)
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
        return bool(every[:, 5].any())

    def _on_layer_done(self, layer: int) -> None:
        bucket = self._bucket_of_layer.get(layer)
        if bucket is not None:
            self._start(bucket)
        for b in self.buckets:  # MPI progresses only inside MPI calls: poke the open ones
            if b.handle is not None and b.t_start and b.handle.test():
                self._done(b)

    def _start(self, bucket: Bucket) -> None:
        self.timeline.begin(bucket.name, cat="comm")
        bucket.t_start = time.perf_counter()
        bucket.handle = self.update.start(bucket.index, self.flat.grads[bucket.start:bucket.stop])

    def _done(self, bucket: Bucket) -> None:
        self.times.comm_total_s += time.perf_counter() - bucket.t_start
        self.times.bytes_reduced += (bucket.stop - bucket.start) * self.flat.dtype.itemsize
        self.timeline.end(bucket.name, cat="comm")
        bucket.t_start = 0.0  # marks it complete

    def finish_gradients(self) -> None:
        """Start the buckets not yet started, wait for all; afterwards grads hold the mean (sharded: this
        rank's chunks of the mean are in the shard buffer, and grads keep whatever the reducer left)."""
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
        """Bytes of this rank's training state: parameters, gradients, the optimizer's buffers and,
        sharded, the chunk of the averaged gradient it receives."""
        return int(self.flat.params.nbytes + self.flat.grads.nbytes) + self.update.nbytes() + \
            self.optimizer.buffer_nbytes()

    def describe(self) -> str:
        """The banner's all-reduce line: what runs, the buckets, overlap."""
        mib = ", ".join(f"{(b.stop - b.start) * self.flat.dtype.itemsize / 2**20:.2f}" for b in self.buckets)
        when = "overlapped with backward" if self.overlap else "after backward"
        return f"{self.reducer.describe()} ({len(self.buckets)} bucket(s): {mib} MiB), {when}"

    def close(self) -> None:
        """Collective: every rank calls it together. A rank that fails alone must not call it (with a
        watchdog, rank 0 would wait for the others' close); abort the job instead."""
        self.watchdog.close()
        if self.shared_grads:  # the window goes with the reducer: the model keeps its gradients
            self.model.move_grads(np.empty_like(self.flat.grads))
            self.shared_grads = False
        self.reducer.close()
        self.comm.Free()

