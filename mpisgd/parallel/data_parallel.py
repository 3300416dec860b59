"""Synchronous data parallelism: same start, averaged gradients, the same step everywhere.

``DataParallel(model, optimizer, comm)`` coordinates a model replica, an update rule and a reducer:

  1. checks that every rank built the same model (layers, shapes, dtype, state) and optimizer, then
     broadcasts rank 0's parameters, so all replicas start identical;
  2. per step, checks in (every rank at the same step), runs forward and backward on the local
     micro-batches and produces the averaged gradient — the gradient strategy: float sums
     (:class:`~mpisgd.parallel.gradients.FloatGradients`) or int64 fixed point for ``reproducible``
     (:class:`~mpisgd.parallel.fixed_point.ExactGradients`), reduced bucket by bucket while backward
     still runs (:mod:`mpisgd.parallel.buckets`);
  3. decides on the reduced gradient whether it is finite, (optionally) clips it by its global norm and
     applies the optimizer's step — the update strategy: every rank all of it
     (:class:`~mpisgd.parallel.replicated.ReplicatedStep`) or 1/k each with 1/k of the optimizer state,
     then an all-gather (:class:`~mpisgd.parallel.sharded.ShardedStep`, ``shard_optimizer``);
  4. averages the models' statistics rows (BatchNorm) over the global batch.

Both strategies are chosen once, at construction. The seams are typed protocols (mpisgd.parallel.protocols).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np
from mpi4py import MPI

from mpisgd.agreement import (
    ReplicaError,
    bcast_,
    differing_ranks,
    same_arithmetic,
    verify_same,
    verify_same_layout,
)
from mpisgd.backend import arithmetic, is_device_array, to_numpy
from mpisgd.comm import Reducer, create_reducer
from mpisgd.nn.loss import SoftmaxCrossEntropy
from mpisgd.optim import Optimizer, clip_grad_norm_
from mpisgd.parallel.buckets import BucketSchedule, make_buckets
from mpisgd.parallel.check_in import CHECK_IN_WORDS, BatchProblem, batch_problem
from mpisgd.parallel.check_in import check_in as step_check_in
from mpisgd.parallel.fixed_point import ExactGradients
from mpisgd.parallel.gradients import FloatGradients
from mpisgd.parallel.protocols import Array, BasicModel, Gradients, LeafDone, Loss, ReplicaModel, Timeline, Update
from mpisgd.parallel.protocols import Watchdog as WatchdogLike
from mpisgd.parallel.replica import MicroBatch, as_replica, micro_batches_of, model_layout, optimizer_layout
from mpisgd.parallel.replicated import ReplicatedStep
from mpisgd.parallel.sharded import ShardedStep
from mpisgd.parallel.stats import Meter, StepStats
from mpisgd.timeline import NullTimeline
from mpisgd.watchdog import default_watchdog

# on_nan="skip" gives up after this many skipped steps in a row: a skipped step changes nothing, so these were
# as many batches on the same parameters, none of them finite; the run has diverged
SKIPS_IN_A_ROW = 20

__all__ = ["CHECK_IN_WORDS", "DataParallel", "NonFiniteError", "ReplicaError", "StepStats", "verify_same"]


class NonFiniteError(RuntimeError):
    """The averaged gradient holds NaN or Inf (every rank raises it at the same step)."""


class DataParallel:
    """Wrap a model replica and its optimizer so that each step averages gradients over ``comm``.

    ``model``: a :class:`~mpisgd.parallel.protocols.ReplicaModel` (mpisgd.nn's models), materialised.
    ``comm`` is duplicated (and freed by :meth:`close`), so our traffic never mixes with the caller's.
    ``reducer`` is the all-reduce strategy (``mpisgd.comm.create_reducer``; ``auto`` over ``comm``
    when None); DataParallel owns it and closes it. ``loss`` (default softmax cross-entropy): a
    :class:`~mpisgd.parallel.protocols.Loss`. ``check_in``: the per-step check-in that every rank is at
    the same step with as many micro-batches and targets (:meth:`check_in_step`) runs inside each
    :meth:`train_step`; a caller that checks in itself (the CLI's loop) turns it off.
    ``reproducible``: gradients summed exactly in fixed point (mpisgd.exact), so that the parameters
    are the same bits for any number of ranks, strategy and bucket layout given the same micro-batches.
    ``shard_optimizer`` (k > 1, host buffers): each rank updates 1/k of the parameters and keeps 1/k of
    the optimizer state. ``noise_every``: measure the gradient-noise statistics every that many steps
    (0: never). ``clip_grad_norm``: clip the averaged gradient to this global L2 norm before the
    optimizer's step (None or 0: off); ``measure_grad_norm``: compute that norm (:attr:`last_grad_norm`)
    even without. ``watchdog``: the stall watchdog its collectives report to (DataParallel closes it);
    without one, its own: a wait of ``stall_timeout_s`` names the ranks that have not arrived, one of
    ``stall_abort_s`` ends the job (0: never; both 0: no watchdog).
    """

    def __init__(self, model: ReplicaModel | BasicModel, optimizer: Optimizer, comm: MPI.Intracomm, *,
                 reducer: Reducer | None = None, loss: Loss | None = None, bucket_cap_mb: float = 25.0,
                 overlap: bool = True, on_nan: str = "stop", shard_optimizer: bool = False, shared_grads: bool = True,
                 watchdog: WatchdogLike | None = None, timeline: Timeline | None = None, check_in: bool = True,
                 reproducible: bool = False, noise_every: int = 0, stall_timeout_s: float = 300.0,
                 stall_abort_s: float = 1800.0, clip_grad_norm: float | None = None,
                 measure_grad_norm: bool = False) -> None:
        if on_nan not in ("stop", "skip"):
            raise ValueError(f"on_nan must be stop or skip, got {on_nan!r}")
        if clip_grad_norm is not None and not (math.isfinite(clip_grad_norm) and clip_grad_norm >= 0):
            raise ValueError(f"clip_grad_norm must be a finite number >= 0 (0 or None: no clipping), got "
                             f"{clip_grad_norm}")
        flat = model.flat
        if flat is None:
            raise ValueError("materialize() the model before wrapping it")
        if noise_every < 0:
            raise ValueError(f"noise_every must be >= 0, got {noise_every}")
        device = is_device_array(flat.params)
        if shard_optimizer and device:
            raise ValueError("the sharded optimizer step runs on host buffers only; drop --shard-optimizer "
                             "or use --device cpu")
        if reducer is not None and device and not reducer.device:
            raise ValueError("GPU parameters need a reducer made for device buffers: "
                             "create_reducer(name, comm, device=True)")
        kind = ExactGradients if reproducible else FloatGradients  # how the gradient is produced
        kind.check(optimizer)
        self.model, self.replica, self.optimizer, self.flat = model, as_replica(model), optimizer, flat
        self.comm = comm.Dup()
        self.k, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self._model_ctx = getattr(model, "ctx", None)  # mpisgd.nn's: modules that reduce across ranks use its comm
        if self._model_ctx is not None and hasattr(self._model_ctx, "comm"):
            self._model_ctx.comm = self.comm  # (SyncBatchNorm): every rank reaches those collectives alike
        self.overlap, self.on_nan, self.check_in, self.noise_every = overlap, on_nan, check_in, noise_every
        self.clip_grad_norm = clip_grad_norm or None  # the averaged gradient's largest global L2 norm
        self.measure_grad_norm = measure_grad_norm  # compute last_grad_norm even without clipping
        self._grad_norm: float | None = None
        self.skipped_steps = 0
        self.step_skipped = False  # whether the last train_step skipped its update (--on-nan skip)
        self.skips_in_a_row = 0  # SKIPS_IN_A_ROW of them end the run
        self.step_count = 0
        self.meter = Meter()
        self.timeline: Timeline = timeline or NullTimeline()
        self.watchdog: WatchdogLike = watchdog or default_watchdog(comm, stall_timeout_s, stall_abort_s)
        self.reducer = reducer if reducer is not None else create_reducer("auto", self.comm, device=device)
        self.buckets = make_buckets(self.replica.layer_param_ranges(), flat.dtype.itemsize, bucket_cap_mb)
        self.sharded = shard_optimizer and self.k > 1
        self.loss: Loss = loss or SoftmaxCrossEntropy()
        self._n_classes: int | None = None  # the model's outputs, known after the first forward
        self._classes_at = -1  # the step of that forward
        ignore = getattr(self.loss, "ignore_index", None)  # targets the loss does not score (TokenCrossEntropy's)
        self._ignore: int | None = int(ignore) if ignore is not None else None
        self._rows = np.zeros((0, self.replica.stat_size))  # per micro-batch, the model's statistics
        self._closed = False
        reduced = kind.reduced_dtype(flat.dtype)
        ranges = [(b.start, b.stop) for b in self.buckets]
        self.update: Update = ShardedStep(flat, ranges, self.comm, self.reducer, reduced, kind.block_sums) \
            if self.sharded else ReplicatedStep(flat, self.comm, self.reducer, kind.block_sums)
        self.update.own_state(optimizer)  # sharded: each rank keeps its chunks of the state only (local, before
        # the optimizer's buffers are first made: the whole ones never are)
        verify_same_layout(self.comm, model_layout(self.replica, flat) | optimizer_layout(optimizer),
                           "the model (layers, shapes, dtype or state) or the optimizer (its kind and state buffers)")
        kernels = getattr(getattr(model, "ctx", None), "kernels", None)  # mpisgd.kernels: portable ones need no check
        if getattr(kernels, "name", "fast") != "portable":  # ranks that round otherwise would drift apart
            same_arithmetic(self.comm, arithmetic(flat.params, getattr(optimizer, "blas", None) is not None))
        # what the buckets reduce, in memory the reducer reads in place where it has any (one node: comm.shared)
        shared = self.reducer.shared_buffer(flat.size, reduced) if shared_grads and self.k > 1 and not device else None
        self.shared_grads = shared is not None
        self.schedule = BucketSchedule(self.buckets, self.k, self.meter, self.timeline, self.watchdog)
        self.gradients: Gradients = kind(self.replica, flat, self.comm, self.update, self.schedule, self.watchdog,
                                         overlap=overlap, shared=shared)
        self.broadcast_parameters()
        if self.k > 1:  # auto picks its strategy for these sizes now, not mid-step
            self.reducer.tune([self.gradients.reduced[b.start:b.stop] for b in self.buckets],
                              reduce_scatter=self.sharded)

    # -- start identical, check identical, continue -----------------------------------------
    def broadcast_parameters(self, root: int = 0) -> None:
        """Every rank takes ``root``'s parameters, the model's state and (where every rank holds it whole:
        not sharded) the optimizer's state buffers (momentum, moments)."""
        bcast_(self.comm, self.flat.params, root)
        if self.replica.state is not None:
            bcast_(self.comm, self.replica.state, root)
        self.update.broadcast_state(self.optimizer, root)

    def replica_checksums(self) -> list[str]:
        """Every rank's digest of its parameters and the model's state (collective)."""
        h = hashlib.blake2b(to_numpy(self.flat.params).tobytes(), digest_size=8)
        if self.replica.state is not None:
            h.update(to_numpy(self.replica.state).tobytes())
        with self.watchdog.watching(f"replica check at step {self.step_count}"):
            return self.comm.allgather(h.hexdigest())

    def check_replicas(self) -> None:
        """Raise ReplicaError on every rank, naming the diverged ranks, if parameters or state differ."""
        sums = self.replica_checksums()
        bad = differing_ranks(sums)
        if bad:
            raise ReplicaError(f"replicas diverged at step {self.step_count}: rank(s) {bad} hold parameters "
                               f"that differ from the other ranks (checksums {dict(enumerate(sums))})")

    def restore(self, step_count: int, skipped_steps: int, exponents: Sequence[int] | np.ndarray | None = None) -> None:
        """Continue a run from a checkpoint: its step number, the steps it skipped so far and, reproducible,
        the fixed-point exponents its next step uses."""
        self.step_count, self.skipped_steps = step_count, skipped_steps
        self.gradients.restore(exponents)

    @property
    def exponents(self) -> np.ndarray | None:
        """Reproducible: the fixed-point exponents the next step uses (None before the first step)."""
        return self.gradients.exponents

    @property
    def times(self) -> StepStats:
        """Timings and statistics since the last :meth:`reset_times`."""
        return self.meter.times

    def reset_times(self) -> StepStats:
        """Start new timings and statistics (an epoch's); returns the ones gathered since the last reset."""
        return self.meter.reset()

    # -- the step ------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[tuple[Array, ...]], lr: float) -> Array:
        """One optimizer step over this rank's micro-batches, each ``(x, y)`` or ``(x, y, sample_ids)``
        (without ids: mpisgd.parallel.replica.micro_batches_of says which); returns the local mean loss
        (0-d array). The model is put in train mode."""
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"train_step's lr must be a finite number >= 0, got {lr}")
        batches = micro_batches_of(micro_batches, self.rank, self.loss)
        if self.check_in and self.k > 1:  # the caller has not vouched for its batches: every rank checks them
            self._check_in(0, batches)
        elif self.check_in and (problem := self._batch_problem(batches)):
            raise ValueError(f"train_step: {problem.says(self._n_classes, self._ignore)}")
        self.replica.train()
        targets = sum(b.count for b in batches)
        # every target weighs 1/(k*targets): with the same count on every rank (the check-in compares it)
        # the reduction's SUM is the mean over the effective batch, with no pass after it
        scale = 1.0 / (self.k * targets)
        measure = self.noise_every > 0 and self.step_count % self.noise_every == 0
        rows = self._stat_rows(len(batches))

        def run(i: int, hook: LeafDone | None) -> Array:
            return self._forward_backward(batches[i], rows[i], scale, hook)

        produced = self.gradients.produce(run, [b.count for b in batches], self.step_count, measure)
        t0 = time.perf_counter()
        with self.timeline.span("optimizer"):
            verdict = self.gradients.verdict(self.step_count, measure)  # every rank alike
            self._grad_norm = None
            if verdict.finite:
                self._update(lr)
            elif self.on_nan == "stop":
                raise NonFiniteError(f"non-finite gradient at step {self.step_count} (after the all-reduce); "
                                     "lower --lr, or pass --on-nan skip to skip such steps")
            self.step_skipped = not verdict.finite
            self.skipped_steps += not verdict.finite
            self.skips_in_a_row = 0 if verdict.finite else self.skips_in_a_row + 1
            if self.skips_in_a_row >= SKIPS_IN_A_ROW:  # every rank alike: the verdict is
                first = self.step_count - SKIPS_IN_A_ROW + 1
                raise NonFiniteError(f"non-finite gradients at {SKIPS_IN_A_ROW} steps in a row (steps {first} to "
                                     f"{self.step_count}), all on the same parameters (a skipped step changes "
                                     "nothing): the run has diverged; lower --lr")
        self.times.optimizer_s += time.perf_counter() - t0
        if verdict.finite:
            if measure and produced.small_sq is not None:
                self.times.note_noise(produced.small_sq, produced.b_small, targets, self.k, verdict.sq_norm)
            if rows.shape[1]:  # the model keeps statistics: every rank takes the global batch's mean
                self.replica.apply_stats(self.gradients.mean_stats(rows))
            elapsed = self.update.after_step(self.watchdog, self.timeline, self.step_count)
            self.times.comm_exposed_s += elapsed  # nothing overlaps it
            self.times.comm_total_s += elapsed
        self.times.steps += 1
        self.step_count += 1
        return produced.loss_sum / len(batches)

    def _stat_rows(self, m: int) -> np.ndarray:
        """The (m, stat_size) float64 rows the model fills, one per micro-batch (kept from step to step)."""
        if self._rows.shape[0] != m:
            self._rows = np.zeros((m, self._rows.shape[1]))
        return self._rows

    def _forward_backward(self, batch: MicroBatch, row: np.ndarray, scale: float, hook: LeafDone | None) -> Array:
        t0 = time.perf_counter()
        with self.timeline.span("forward"):
            row[...] = 0.0
            self.replica.begin_batch(step=self.step_count, sample_ids=batch.ids, stat_row=row)
            logits = self.replica.forward(batch.x)
            self._bound_labels(logits, batch)
            loss = self.loss.forward_array(logits, batch.y)
        t1 = time.perf_counter()
        with self.timeline.span("backward"):
            self.replica.backward(self.loss.backward(scale), hook)
        self.times.forward_s += t1 - t0
        self.times.backward_s += time.perf_counter() - t1
        return loss

    def _bound_labels(self, logits: Array, batch: MicroBatch) -> None:
        """Learn the labels' upper bound (the model's outputs) at the first forward, and check that step's
        labels against it: its check-in could not (the ranks' next check-ins compare them)."""
        if self._n_classes is None and logits.ndim >= 2:
            self._n_classes, self._classes_at = logits.shape[-1], self.step_count
        if self.check_in and self._classes_at == self.step_count and \
                self._batch_problem([batch]) == BatchProblem.RANGE:
            raise ValueError(f"train_step: rank {self.rank} passed "
                             f"{BatchProblem.RANGE.says(self._n_classes, self._ignore)}")

    def _update(self, lr: float) -> None:
        """The step on the averaged gradient: first its global norm, when clipping or asked (from the
        update's norms: every rank's blocks, so every rank clips alike and k does not matter), then the
        optimizer."""
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

    def check_in_step(self, stop: int = 0, micro: Sequence[tuple[Array, ...]] = ()) -> int:
        """Collective, once per step before any bucket: every rank must be at the same step with the same
        buffers (and, given its ``micro`` batches, as many micro-batches and targets, with labels the
        model can score), and at a check-in (not in another collective). A rank out of step is named on
        every rank instead of reducing the wrong data or hanging in a mismatched bucket (one small
        Allgather). Returns the largest ``stop`` any rank passed (0: none; a SIGTERM to stop at this step)."""
        if self.k == 1:
            return stop
        return self._check_in(stop, micro_batches_of(micro, self.rank, self.loss) if micro else [])

    def _batch_problem(self, batches: Sequence[MicroBatch]) -> BatchProblem:
        return batch_problem([(b.x, b.y) for b in batches], self._n_classes, self._ignore)

    def _check_in(self, stop: int, batches: Sequence[MicroBatch]) -> int:
        return step_check_in(self.comm, self.watchdog, self.timeline, self.meter, step=self.step_count,
                             size=self.flat.size, itemsize=self.flat.dtype.itemsize, buckets=len(self.buckets),
                             micro_batches=len(batches), targets=sum(b.count for b in batches), stop=stop,
                             problem=self._batch_problem(batches), n_classes=self._n_classes, ignore=self._ignore)

    def grads_finite(self) -> bool:
        """Whether the reduced gradient is finite: the same answer on every rank (collective when sharded)."""
        return self.update.finite(self.watchdog, self.step_count)[0]

    # -- the optimizer's state: whole in checkpoints ------------------------------------------
    def gather_optimizer_state(self, root: int = 0) -> dict[str, np.ndarray]:
        """Collective: the optimizer's state buffers, whole, by name, on ``root`` (what a checkpoint
        holds; sharded, each rank keeps only its chunks and they are gathered; {} on the other ranks
        then). Replicated, every rank's own live buffers."""
        return self.update.gather_state(self.optimizer, self.watchdog, root)

    def load_optimizer_state(self, scalars: Mapping[str, float], buffers: Mapping[str, Array] | None,
                             root: int = 0) -> None:
        """Collective: continue from a checkpoint's optimizer state — its scalars (every rank passes them)
        and its whole buffers (``root``'s; None elsewhere), which every rank takes (sharded: its chunks).
        A buffer the checkpoint lacks stays as it is; a whole buffer of the wrong size raises on every rank."""
        self.optimizer.load_state(scalars, None)
        self.update.scatter_state(self.optimizer, buffers if self.rank == root else None, self.watchdog, root)

    # -- what it holds, what it runs ---------------------------------------------------------
    def buffer_nbytes(self) -> int:
        """Bytes of this rank's training state: parameters, gradients, the model's state, the optimizer's
        buffers (sharded: its chunks of them) and the strategies' own (sharded, the chunk of the averaged
        gradient it receives; reproducible, the integers)."""
        state = self.replica.state
        held = int(self.flat.params.nbytes) + int(self.flat.grads.nbytes) + (0 if state is None else int(state.nbytes))
        return held + self.gradients.nbytes() + self.update.nbytes() + self.optimizer.buffer_nbytes()

    def describe(self) -> str:
        """The banner's all-reduce line: what runs, the buckets, overlap."""
        itemsize = self.gradients.reduced.dtype.itemsize
        mib = ", ".join(f"{(b.stop - b.start) * itemsize / 2**20:.2f}" for b in self.buckets)
        when = "overlapped with backward" if self.overlap else "after backward"
        what = self.gradients.describe()
        return f"{self.reducer.describe()} ({what}{len(self.buckets)} bucket(s): {mib} MiB), {when}"

    def close(self) -> None:
        """Collective: every rank calls it together (a second call does nothing). A rank that fails alone
        must not call it (with a watchdog, rank 0 would wait for the others' close); abort the job instead."""
        if self._closed:
            return
        self._closed = True
        if self._model_ctx is not None and hasattr(self._model_ctx, "comm"):
            self._model_ctx.comm = None  # freed below
        self.watchdog.close()
        self.gradients.close()  # the node-shared window goes with the reducer: the model's gradients come home
        self.shared_grads = False
        self.reducer.close()
        self.comm.Free()
