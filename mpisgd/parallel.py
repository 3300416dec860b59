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
  4. waits for all buckets, then applies the identical optimizer step.

With ``shard_optimizer`` (k > 1), step 3 becomes a reduce-scatter: each rank
receives only its chunk of every bucket's averaged gradient, updates only
those parameters (1/k of the optimizer's work), and an all-gather of the
parameters then gives every rank the same new replica (ZeRO stage 1's split of
the update, with the momentum buffer kept whole so that checkpoints do not change). LARS needs
whole-layer norms first: one small all-gather of each rank's partial squared norms (_step_shards).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.backend import is_device_array, to_numpy
from mpisgd.blas import all_finite
from mpisgd.comm import Handle, Reducer, create_reducer
from mpisgd.comm.base import chunk_counts
from mpisgd.lars import LARS
from mpisgd.nn.loss import SoftmaxCrossEntropy
from mpisgd.nn.sequential import Sequential
from mpisgd.optim import SGD

FIRST_BUCKET_MB = 1.0  # as PyTorch DDP: a small first bucket starts communication early
CHECK_IN = 0x6D70_7367_645F_636B  # first word of a step check-in, so a peer in another collective shows


class ReplicaError(RuntimeError):
    """Replicas disagree (configuration at start, or parameters during training)."""


class NonFiniteError(RuntimeError):
    """The averaged gradient holds NaN or Inf (every rank raises it at the same step)."""


@dataclass
class Bucket:
    start: int  # element range [start, stop) of the flat gradient buffer
    stop: int
    first_layer: int  # the lowest layer index in the bucket: done last in backward
    name: str = ""  # for the timeline, made once (not per step)
    # sharded step: each rank's chunk of the bucket (elements, rank order); this rank's chunk [lo, hi) of
    # the flat buffer with its offset in the shard buffer, and the view of the shard buffer it fills
    counts: list[int] = field(default_factory=list)
    own: tuple[int, int, int] = (0, 0, 0)
    own_grads: Any = None
    handle: Handle | None = None
    t_start: float = 0.0  # when its all-reduce started; 0 once it is seen complete


@dataclass
class StepTimes:
    """Seconds spent, summed over steps since the last reset; and when this rank reached each step's
    synchronisation points (perf_counter), for the straggler report (mpisgd.straggler)."""

    forward: float = 0.0
    backward: float = 0.0
    comm_total: float = 0.0  # from a bucket's start to its observed completion
    comm_exposed: float = 0.0  # time the step waited for communication
    optimizer: float = 0.0
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
        bucket.name = f"allreduce b{i}"
    return buckets


def shapes_digest(model: Sequential) -> str:
    assert model.flat is not None
    text = repr(model) + str(model.flat.shapes) + str(model.flat.dtype)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differing_ranks(values: Sequence[Any]) -> list[int]:
    """Ranks whose value differs from the most common one (rank 0's on a tie)."""
    majority = Counter(values).most_common(1)[0][0]  # ties go to the first seen: rank 0's
    return [r for r, v in enumerate(values) if v != majority]


def verify_same(comm: Any, value: Any, what: str) -> None:
    """Raise ReplicaError on every rank when ``value`` differs between ranks (all ranks reach this)."""
    values = comm.allgather(value)
    bad = differing_ranks(values)
    if bad:
        raise ReplicaError(f"{what} differs on rank(s) {bad} from the other ranks "
                           f"({len(values)} ranks; values: {dict(enumerate(values))})")


class NullWatchdog:
    """The stall watchdog's interface, doing nothing (see mpisgd.watchdog)."""

    def enter(self, what: str) -> None: ...

    def exit(self) -> None: ...

    def close(self) -> None: ...


class NullTimeline:
    """The timeline's interface, recording nothing (see mpisgd.timeline)."""

    def begin(self, name: str, cat: str = "compute") -> None: ...

    def end(self, name: str, cat: str = "compute") -> None: ...

    def span(self, name: str, cat: str = "compute") -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def instant(self, name: str) -> None: ...


class DataParallel:
    """Wrap a model replica and its optimizer so that each step averages gradients over ``comm``.

    ``comm`` is duplicated (and freed by :meth:`close`), so our traffic never mixes with the caller's.
    ``reducer`` is the all-reduce strategy (``mpisgd.comm.create_reducer``; ``auto`` over ``comm``
    when None); DataParallel owns it and closes it. ``loss`` (default softmax cross-entropy) must
    offer ``forward_array(logits, labels)`` and ``backward(scale)``.
    """

    def __init__(self, model: Sequential, optimizer: SGD, comm: Any, *, reducer: Reducer | None = None,
                 loss: Any = None, bucket_cap_mb: float = 25.0, overlap: bool = True, on_nan: str = "stop",
                 shard_optimizer: bool = False, shared_grads: bool = True, watchdog: Any = None,
                 timeline: Any = None, fingerprint: bool = True) -> None:
        if on_nan not in ("stop", "skip"):
            raise ValueError(f"on_nan must be stop or skip, got {on_nan!r}")
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
        self.overlap = overlap
        self.on_nan = on_nan
        self.fingerprint = fingerprint  # per-step check that all ranks are at the same step
        self.skipped_steps = 0
        self.timeline = timeline or NullTimeline()
        self.watchdog = watchdog or NullWatchdog()
        self.reducer = reducer if reducer is not None else create_reducer("auto", self.comm, device=device)
        self.buckets = make_buckets(model, self.flat.dtype.itemsize, bucket_cap_mb)
        self._bucket_of_layer = {b.first_layer: b for b in self.buckets}
        self.sharded = shard_optimizer and self.k > 1
        self._shards: list[tuple[int, int, Any]] = []  # sharded step: (lo, hi, gradient chunk) per bucket
        self._shard_grads = self._plan_shards() if self.sharded else None
        self.loss = loss or SoftmaxCrossEntropy()
        self.times = StepTimes()
        self.step_count = 0
        verify_same(self.comm, shapes_digest(model), "the model (layers, shapes or dtype)")
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

    def _plan_shards(self) -> Any:
        """Give each bucket its chunk bounds (chunk_bounds, rank order) and this rank's part; returns
        the buffer that receives this rank's chunks of the averaged gradient, back to back."""
        covered = sorted((b.start, b.stop) for b in self.buckets)
        if covered[0][0] != 0 or covered[-1][1] != self.flat.size or \
                any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
            raise ValueError(f"buckets {covered} do not tile the {self.flat.size} parameters")
        offset = 0
        for b in self.buckets:
            b.counts = chunk_counts(b.stop - b.start, self.k)
            lo = b.start + sum(b.counts[:self.rank])
            hi = lo + b.counts[self.rank]
            b.own = (lo, hi, offset)
            offset += hi - lo
        shard = self.flat.xp.empty(offset, dtype=self.flat.dtype)
        for b in self.buckets:
            lo, hi, off = b.own
            b.own_grads = shard[off:off + hi - lo]
        self._shards = [(b.own[0], b.own[1], b.own_grads) for b in self.buckets]  # what step_shards takes
        return shard

    # -- start identical, check identical -------------------------------------------------
    def broadcast_parameters(self, root: int = 0) -> None:
        """Every rank takes ``root``'s parameters (and momentum, if any)."""
        self._bcast_(self.flat.params, root)
        if self.optimizer.velocity is not None:
            self._bcast_(self.optimizer.velocity, root)

    def _bcast_(self, arr: Any, root: int) -> None:
        """Broadcast in place; device arrays go through the host (start-up only, so no CUDA-aware MPI needed)."""
        if is_device_array(arr):
            host = to_numpy(arr)  # a copy after the kernels that wrote arr
            self.comm.Bcast(host, root=root)
            arr.set(host)
        else:
            self.comm.Bcast(arr, root=root)

    def replica_checksums(self) -> list[str]:
        """Every rank's parameter digest (collective)."""
        digest = hashlib.blake2b(to_numpy(self.flat.params).tobytes(), digest_size=8).hexdigest()
        return self.comm.allgather(digest)

    def check_replicas(self) -> None:
        """Raise ReplicaError on every rank, naming the diverged ranks, if parameters differ."""
        sums = self.replica_checksums()
        bad = differing_ranks(sums)
        if bad:
            raise ReplicaError(f"replicas diverged at step {self.step_count}: rank(s) {bad} hold parameters "
                               f"that differ from the other ranks (checksums {dict(enumerate(sums))})")

    # -- the step ------------------------------------------------------------------------
    def grad_scale(self, local_batch: int, accum_steps: int) -> float:
        """Loss-gradient factor making the all-reduce SUM the effective-batch mean: 1/(k*b*m)."""
        return 1.0 / (local_batch * accum_steps * self.k)

    def train_step(self, micro_batches: Sequence[tuple[Any, Any]], lr: float) -> Any:
        """One optimizer step over this rank's micro-batches; returns the local mean loss (0-d array)."""
        m = len(micro_batches)
        if m < 1:
            raise ValueError("train_step needs at least one micro-batch")
        if self.fingerprint and self.k > 1:
            self.check_in_step()
        tl = self.timeline
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
            self.times.forward += t1 - t0
            self.times.backward += time.perf_counter() - t1
            loss_sum = loss if loss_sum is None else loss_sum + loss
        self.model.set_accumulate(False)
        self.finish_gradients()
        t0 = time.perf_counter()
        with tl.span("optimizer"):
            # decided on the reduced gradient, so every rank takes the same branch
            finite = self.grads_finite()
            if finite and self.sharded:
                self._step_shards(lr)
            elif finite:
                self.optimizer.step(lr)
            elif self.on_nan == "skip":
                self.skipped_steps += 1
            else:
                raise NonFiniteError(f"non-finite gradient at step {self.step_count} (after the all-reduce); "
                                     "lower --lr, or pass --on-nan skip to skip such steps")
        self.times.optimizer += time.perf_counter() - t0
        if finite and self.sharded:
            self.gather_(self.flat.params, f"parameter all-gather of step {self.step_count}")
        self.times.steps += 1
        self.step_count += 1
        return loss_sum / m

    def _step_shards(self, lr: float) -> None:
        """The sharded update of this rank's chunks. LARS scales each layer by a ratio of whole-layer norms,
        and a chunk may hold only part of a layer: every rank's partial squared norms are all-gathered
        (one small collective, which every rank reaches) and summed in rank order, so that every rank
        applies the same ratios, bitwise, whatever the MPI library's reduction order."""
        if not isinstance(self.optimizer, LARS):
            self.optimizer.step_shards(lr, self._shards)
            return
        mine = self.optimizer.partial_sq_norms(self._shards)
        every = np.empty((self.k, *mine.shape), dtype=mine.dtype)
        self.watchdog.enter(f"layer-norm all-gather of step {self.step_count}")
        self.comm.Allgather(mine, every)
        self.watchdog.exit()
        self.optimizer.step_shards(lr, self._shards, every.sum(axis=0))

    def buffer_nbytes(self) -> int:
        """Bytes of this rank's training state: parameters, gradients, momentum and, sharded, the chunk
        of the averaged gradient it receives."""
        bufs = (self.flat.params, self.flat.grads, self._shard_grads)
        return sum(int(b.nbytes) for b in bufs if b is not None) + self.optimizer.buffer_nbytes()

    def check_in_step(self, stop: bool = False) -> bool:
        """Collective, once per step before any bucket: every rank must be at the same step with the same
        buffers, and at a check-in (not in another collective). A rank out of step is named on every rank
        instead of reducing the wrong data or hanging in a mismatched bucket (one 48-byte Allgather: a few
        microseconds). Returns whether any rank passed ``stop`` (a SIGTERM to stop at this step)."""
        if self.k == 1:
            return stop
        mine = np.array([CHECK_IN, self.step_count, self.flat.size, self.flat.dtype.itemsize, len(self.buckets),
                         int(stop)], dtype=np.int64)
        every = np.zeros((self.k, mine.size), dtype=np.int64)
        self.times.arrived_check_in.append(time.perf_counter())
        self.timeline.instant("arrive: step check-in")
        # watched like every blocking collective: a rank stopped between steps waits here
        self.watchdog.enter(f"step check-in of step {self.step_count}")
        try:
            self.comm.Allgather(mine, every)
        except MPI.Exception as exc:  # a peer in another collective whose message does not fit
            raise ReplicaError(f"the check-in of step {self.step_count} failed ({exc.Get_error_string()}): a rank "
                               "is in another collective; every rank must call DataParallel's methods in the "
                               "same order") from None
        self.watchdog.exit()
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
        grads = self.flat.grads[bucket.start:bucket.stop]
        if self.sharded:
            bucket.handle = self.reducer.start_reduce_scatter(grads, bucket.own_grads, bucket.counts)
        else:
            bucket.handle = self.reducer.start(grads)

    def _done(self, bucket: Bucket) -> None:
        elapsed = time.perf_counter() - bucket.t_start
        nbytes = (bucket.stop - bucket.start) * self.flat.dtype.itemsize
        self.times.comm_total += elapsed
        self.times.bytes_reduced += nbytes
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
        self.watchdog.enter(f"gradient {what} of step {self.step_count}")
        with self.timeline.span("wait comm", cat="comm"):
            for b in self.buckets:
                if b.handle is None:
                    self._start(b)
            for b in self.buckets:
                assert b.handle is not None
                b.handle.wait()
                if b.t_start:
                    self._done(b)
                b.handle = None
        self.watchdog.exit()
        self.times.comm_exposed += time.perf_counter() - t0

    def grads_finite(self) -> bool:
        """Whether the reduced gradient is finite; identical on every rank after the all-reduce (sharded:
        each rank checks its chunks, and one small all-reduce makes the answer every rank's)."""
        if not self.sharded:
            return all_finite(self.flat.grads, self.flat.xp)
        mine = all_finite(self._shard_grads, self.flat.xp)
        self.watchdog.enter(f"finite-gradient vote of step {self.step_count}")
        every = bool(self.comm.allreduce(mine, op=MPI.LAND))
        self.watchdog.exit()
        return every

    def gather_(self, buf: Any, what: str) -> None:
        """Sharded step: every rank's chunks of ``buf`` (parameters or momentum) to every rank, in place
        (collective; counted as exposed communication)."""
        t0 = time.perf_counter()
        self.watchdog.enter(what)
        with self.timeline.span("all-gather", cat="comm"):  # all buckets in flight at once, then wait
            handles = [self.reducer.start_allgather(buf[b.start:b.stop], b.counts) for b in self.buckets]
            for h in handles:
                h.wait()
        self.watchdog.exit()
        elapsed = time.perf_counter() - t0
        self.times.comm_exposed += elapsed
        self.times.comm_total += elapsed

    def gather_optimizer_state(self) -> None:
        """Collective: make the momentum buffer whole on every rank (sharded: each rank updated only its
        chunks). Needed before a checkpoint is written; a no-op when the step is not sharded."""
        if self.sharded and self.optimizer.velocity is not None:
            self.gather_(self.optimizer.velocity, f"momentum all-gather at step {self.step_count}")

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
