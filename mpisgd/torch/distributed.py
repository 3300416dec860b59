"""Your own PyTorch loop, data-parallel over MPI, in the style of DistributedDataParallel.

    model = mpisgd.torch.wrap(model, comm)      # instead of DistributedDataParallel(model)

:class:`DistributedModel` holds the module's trained parameters and their gradients in mpisgd's flat
buffers (one per dtype: ``param.data`` and ``param.grad`` are views of them, zero-copy), and its
persistent floating buffers (BatchNorm's running statistics) in flat state buffers. At construction
(collective) it compares the layout on every rank and broadcasts rank 0's parameters and buffers.

Each backward that is not inside :meth:`no_sync` averages the gradients over the ranks, overlapped with
backward: a hook on every parameter (``register_post_accumulate_grad_hook``) counts its bucket's
gradients final, and a bucket (contiguous in the flat gradient buffer, about ``bucket_cap_mb``, the
last layers first, as DDP's) starts its non-blocking all-reduce through an mpisgd reducer (``auto``:
node-shared memory or MPI, as measured) the moment its last gradient is final, pre-scaled by 1/k. The
end of backward (an autograd callback) starts what is left and waits: after ``loss.backward()`` every
``param.grad`` holds the mean over the ranks, ready for the optimizer, as with DDP.

- Unused parameters: autograd never reaches them; their gradient views hold zero (or what no_sync
  accumulated) and are averaged with the rest, so every rank steps alike. They are zero tensors
  afterwards, not None.
- ``optimizer.zero_grad()`` (setting gradients to None) is fine: autograd hands the new gradient over
  and its hook copies it into the flat buffer (one pass; zeroing and adding in place would take two);
  a gradient the caller replaced is copied in at the next forward.
- float16 and bfloat16 parameters: their gradients are averaged in float32 (NumPy has no bfloat16: its
  bits are held as uint16).
- Buffers: as DDP's ``broadcast_buffers=True``, rank 0's buffers are every rank's, broadcast (the flat
  state, one call) at the end of every synchronised backward rather than at the next forward's start:
  rank 0's trajectory is DDP's, and between steps the running statistics are the same on every rank.
- Every synchronising forward starts a check-in (one small non-blocking Allgather, completed at the end of
  backward): a rank at another step is named on every rank before anyone uses a wrongly averaged gradient.
- The gradient noise scale (mpisgd.noise) every ``noise_every`` steps: each rank's gradient before the
  average is a small batch (its samples), the average the big one; :meth:`noise_scale` (collective).
- ``metrics_file``: every ``metrics_every`` steps rank 0 appends one epoch record (docs/metrics.md) of the
  window since the last, which the planner reads (``python -m mpisgd.plan``), from :func:`window_record`;
  the rate is the loop's optimizer's, unknown here (null), and so is the loss unless given to ``log_loss``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpisgd.agreement import ReplicaError, bcast_, verify_same_layout
from mpisgd.backend import is_device_array, peak_rss_mib
from mpisgd.blas import finite_sq_norm
from mpisgd.comm import Handle, Reducer, create_reducer
from mpisgd.noise import NoiseScale, estimate
from mpisgd.parallel.stats import InFlight
from mpisgd.torch.views import array_module, as_array, as_tensor, storage_dtype
from mpisgd.watchdog import default_watchdog

FIRST_BUCKET_MB = 1.0  # as DDP (and mpisgd.parallel): a small first bucket starts communication early
CHECK_IN = 0x6D70_7367_645F_7477  # first word of the per-step check-in
HALF = (torch.float16, torch.bfloat16)  # averaged through float32


@dataclass
class _Group:
    """The trained parameters of one dtype and device, laid out in one flat buffer (and their gradients
    in another)."""

    dtype: Any  # torch dtype
    xp: Any  # numpy or cupy
    params: list[Any]  # the Parameters, in the module's order
    offsets: list[int]  # element offsets, len(params) + 1
    flat: Any = None  # the parameters' values (storage_dtype)
    grads: Any = None  # their gradients
    grad_tensors: list[Any] = field(default_factory=list)  # each parameter's gradient view, as a tensor


@dataclass
class _Bucket:
    group: _Group
    lo: int  # element range [lo, hi) of the group's flat gradient buffer
    hi: int
    n: int  # parameters in it
    left: int = 0  # parameters whose gradient is not final yet, this backward
    staging: Any = None  # float32 copy a half-precision bucket is reduced in
    handle: Handle | None = None
    t_start: float = 0.0


@dataclass
class WrapTimes:
    """Seconds and statistics since the last metrics record, on this rank."""

    steps: int = 0  # synchronised steps
    forwards: int = 0
    samples: int = 0  # leading dimension of the first tensor argument of each forward
    forward_s: float = 0.0
    backward_s: float = 0.0  # from each forward's end to the next forward or the end of backward
    comm_exposed_s: float = 0.0  # waiting for the all-reduce at the end of backward
    comm_total_s: float = 0.0  # with a bucket in flight: from a start to the observed completion (InFlight)
    other_s: float = 0.0  # from the end of backward to the next forward: the optimizer, data loading
    loss_sum: float = 0.0  # what log_loss was given
    losses: int = 0
    noise_steps: int = 0
    small_sq: float = 0.0  # this rank's gradient's squared norm, summed over the measured steps
    big_sq: float = 0.0  # the averaged gradient's
    b_small: int = 0  # samples behind one rank's gradient
    t_first: float = 0.0  # the first forward of the window


class DistributedModel(torch.nn.Module):
    """``module`` averaged over ``comm``'s ranks at each backward (module docstring). Collective at
    construction; :meth:`close` is collective too. ``reducer``: an mpisgd.comm Reducer (``auto`` over a
    duplicate of ``comm`` when None; owned and closed here)."""

    def __init__(self, module: Any, comm: Any, *, reducer: Reducer | None = None, bucket_cap_mb: float = 25.0,
                 broadcast_buffers: bool = True, noise_every: int | None = None, metrics_file: str | None = None,
                 metrics_every: int = 100, stall_timeout_s: float = 300.0, stall_abort_s: float = 1800.0) -> None:
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if metrics_every < 1:
            raise ValueError(f"metrics_every must be >= 1, got {metrics_every}")
        if any(_wrapped(p) for p in module.parameters()):  # every rank alike: before any collective
            raise ValueError("the module's parameters are wrapped already (mpisgd.torch.wrap of the same module, or "
                             "of a DistributedModel): two wrappers would average each gradient twice; wrap a "
                             "module once, or close() the other wrapper first")
        self.module = module
        self.comm = comm.Dup()
        self.k, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.broadcast_buffers = broadcast_buffers
        self.noise_every = (4 if metrics_file else 0) if noise_every is None else noise_every
        self.metrics_file = metrics_file if self.rank == 0 else None
        self.metrics_every = metrics_every
        self.watchdog = default_watchdog(self.comm, stall_timeout_s, stall_abort_s)
        self.step = 0  # synchronised backward passes so far
        self.times = WrapTimes()
        self._require_sync = True  # False inside no_sync()
        self._syncing = False  # this backward averages
        self._queued = False  # the end-of-backward callback is queued
        self._measure = False  # this step's noise statistics are gathered
        self._local_sq = 0.0
        self._t_mark = 0.0  # end of the last forward or backward: where the next interval starts
        self._after_backward = False  # the interval from _t_mark is "other" (optimizer), not backward
        self._records = 0
        self._rss_start_mib = peak_rss_mib()
        self._step_samples = 0  # samples of this rank's forwards since the last synchronised backward
        self._mine = np.zeros(4, dtype=np.int64)  # the per-step check-in: this rank's words, every rank's
        self._every = np.zeros((self.k, 4), dtype=np.int64)
        self._checkin: Any = None  # its request, from the forward to the end of backward
        self._closed = False
        verify_same_layout(self.comm, _layout(module), "the model (parameter and buffer names, shapes, dtypes)",
                           "tensor")
        self.groups = self._flatten_parameters()
        self.reducer = reducer if reducer is not None else create_reducer(
            "auto", self.comm, device=any(g.xp is not np for g in self.groups))
        self._shared = self._share_gradients()
        self.states = self._flatten_state()
        self.buckets = self._make_buckets(bucket_cap_mb)
        self._in_flight = InFlight()  # times.comm_total_s: time with a bucket in flight, not their sum
        self._broadcast_start()
        self._hooks = [g.params[j].register_post_accumulate_grad_hook(self._hook(g, j, b))
                       for g, j, b in self._bucket_of_param()]
        if self.k > 1:
            self.reducer.tune([b.staging if b.staging is not None else b.group.grads[b.lo:b.hi] for b in self.buckets])
        # closed at exit if the caller does not (every rank exits alike; before mpi4py finalises MPI)
        self._at_exit = _closer(weakref.ref(self))
        atexit.register(self._at_exit)
        for p in module.parameters():
            _WRAPPED[id(p)] = weakref.ref(p)

    # -- layout ------------------------------------------------------------------------------
    def _flatten_parameters(self) -> list[_Group]:
        """Trained parameters by (dtype, device), each group in one flat buffer; param.data and param.grad
        become views of them."""
        groups: dict[tuple[Any, Any], _Group] = {}
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            key = (p.dtype, p.device)
            if key not in groups:
                groups[key] = _Group(p.dtype, array_module(p.device), [], [0])
            g = groups[key]
            g.params.append(p)
            g.offsets.append(g.offsets[-1] + p.numel())
        for g in groups.values():
            sd = storage_dtype(g.dtype)
            g.flat = g.xp.empty(g.offsets[-1], dtype=sd)
            g.grads = g.xp.zeros(g.offsets[-1], dtype=sd)
            self._bind(g, copy_values=True)
        if not groups:
            raise ValueError("the model has no parameter that requires a gradient: nothing to average")
        return list(groups.values())

    def _bind(self, g: _Group, copy_values: bool) -> None:
        g.grad_tensors = []
        for j, p in enumerate(g.params):
            a, b = g.offsets[j], g.offsets[j + 1]
            pv = as_tensor(g.flat[a:b], g.dtype).view(p.shape)
            gv = as_tensor(g.grads[a:b], g.dtype).view(p.shape)
            if copy_values:
                pv.copy_(p.detach())
                if p.grad is not None:
                    gv.copy_(p.grad)
                p.data = pv
            p.grad = gv
            g.grad_tensors.append(gv)

    def _share_gradients(self) -> bool:
        """One float32/float64 group on the host at k > 1: its gradients go to the reducer's node-shared
        memory, where it has some (peers read them in place: mpisgd.comm.shared)."""
        if self.k == 1 or len(self.groups) != 1:
            return False
        g = self.groups[0]
        if g.xp is not np or g.dtype in HALF:
            return False
        shared = self.reducer.shared_buffer(g.offsets[-1], g.grads.dtype)
        if shared is None:
            return False
        shared[...] = g.grads
        g.grads = shared
        self._bind(g, copy_values=False)
        return True

    def _flatten_state(self) -> list[Any]:
        """Persistent floating buffers, one flat array per dtype (the module's buffers become views)."""
        found: dict[Any, list[tuple[Any, str, Any]]] = {}
        seen: set[int] = set()
        for m in self.module.modules():
            for name, buf in m.named_buffers(recurse=False):
                if id(buf) in seen or name in m._non_persistent_buffers_set or not buf.dtype.is_floating_point:
                    continue
                seen.add(id(buf))
                found.setdefault((buf.dtype, buf.device), []).append((m, name, buf))
        states = []
        for (dtype, device), items in found.items():
            flat = array_module(device).empty(sum(b.numel() for _, _, b in items), dtype=storage_dtype(dtype))
            lo = 0
            for m, name, buf in items:
                view = as_tensor(flat[lo:lo + buf.numel()], dtype).view(buf.shape)
                view.copy_(buf)
                m._buffers[name] = view
                lo += buf.numel()
            states.append(flat)
        return states

    def _make_buckets(self, cap_mb: float) -> list[_Bucket]:
        """Per group, parameters in reverse order grouped by bytes: the first bucket of all about
        FIRST_BUCKET_MB, the others about ``cap_mb`` (ending at parameter boundaries)."""
        buckets: list[_Bucket] = []
        cap = min(FIRST_BUCKET_MB, cap_mb) * 2**20
        for g in self.groups:
            item = g.grads.dtype.itemsize
            hi, n = g.offsets[-1], 0
            for j in range(len(g.params) - 1, -1, -1):
                n += 1
                lo = g.offsets[j]
                if (hi - lo) * item >= cap or j == 0:
                    buckets.append(_Bucket(g, lo, hi, n, n))
                    hi, n, cap = lo, 0, cap_mb * 2**20
        for b in buckets:
            if b.group.dtype in HALF:
                b.staging = b.group.xp.empty(b.hi - b.lo, dtype=np.float32)
        return buckets

    def _bucket_of_param(self) -> Iterator[tuple[_Group, int, _Bucket]]:
        for b in self.buckets:
            g = b.group
            for j, off in enumerate(g.offsets[:-1]):
                if b.lo <= off < b.hi:
                    yield g, j, b

    def _broadcast_start(self) -> None:
        """Every rank takes rank 0's parameters, buffers and anything else the module holds (frozen
        parameters, integer buffers)."""
        for g in self.groups:
            bcast_(self.comm, g.flat, 0)
        for s in self.states:
            bcast_(self.comm, s, 0)
        flat = {id(p) for g in self.groups for p in g.params}
        others = [t for t in (*self.module.parameters(), *self.module.buffers()) if id(t) not in flat]
        for s in self.states:  # buffers in the flat state are done
            others = [t for t in others if not _inside(t, s)]
        for t in others:
            host = np.ascontiguousarray(as_array(t.detach().cpu()))
            bcast_(self.comm, host, 0)
            with torch.no_grad():
                t.copy_(as_tensor(host, t.dtype if t.dtype == torch.bfloat16 else None).to(t.device).view(t.shape))

    # -- forward ------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's forward; when gradients are enabled, also what the coming backward needs: the
        gradient views in place, and outside no_sync the check-in."""
        if self._closed:
            raise RuntimeError("this DistributedModel is closed (close() frees its communicator): wrap the module "
                               "again to go on training it")
        t0 = time.perf_counter()
        if torch.is_grad_enabled():
            self._close_interval(t0)
            self._prepare_grads()
            if self._require_sync:
                self._arm()
            else:
                self._syncing = False
            t = self.times
            t.t_first = t.t_first or t0
            t.forwards += 1
            first = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
            n = int(first.shape[0]) if first is not None and first.dim() else 0
            t.samples += n
            self._step_samples += n
            t1 = time.perf_counter()
            out = self.module(*inputs, **kwargs)
            self._t_mark = time.perf_counter()
            self._after_backward = False
            t.forward_s += self._t_mark - t1
            return out
        return self.module(*inputs, **kwargs)

    def _close_interval(self, now: float) -> None:
        """Book the time since the last forward or backward ended: backward (and loss) after a forward,
        the caller's optimizer step and data after a backward."""
        if self._t_mark:
            if self._after_backward:
                self.times.other_s += now - self._t_mark
            else:
                self.times.backward_s += now - self._t_mark

    def _prepare_grads(self) -> None:
        """A gradient tensor the caller put in place of the view: its values into the view, which becomes
        param.grad again. A gradient set to None (as zero_grad() does) stays None: autograd will hand the
        new one over whole and the hook copies it in (one pass, where zeroing and adding would take two)."""
        for g in self.groups:
            for j, p in enumerate(g.params):
                view = g.grad_tensors[j]
                if p.grad is None or p.grad is view:
                    continue
                with torch.no_grad():
                    view.copy_(p.grad)
                p.grad = view

    def _arm(self) -> None:
        """Before a forward whose backward will average: check in with the other ranks, count every
        bucket's gradients afresh."""
        if self.k > 1:
            self._check_in()
        for b in self.buckets:
            b.left = b.n
        self._syncing, self._queued = True, False
        self._measure = self.noise_every > 0 and self.k > 1 and self.step % self.noise_every == 0
        self._local_sq = 0.0

    def _check_in(self) -> None:
        """Start this step's check-in (non-blocking: no extra wait before the forward); _check_in_done
        completes it before any rank uses the averaged gradient."""
        self._mine[:] = (CHECK_IN, self.step, sum(g.offsets[-1] for g in self.groups), len(self.buckets))
        self._checkin = self.comm.Iallgather(self._mine, self._every)

    def _check_in_done(self) -> None:
        """Every rank checked in at the same step with the same buffers, or ReplicaError on every rank."""
        if self._checkin is None:
            return
        with self.watchdog.watching(f"step check-in of step {self.step}"):
            self._checkin.Wait()
        self._checkin = None
        rows = [tuple(int(v) for v in r) for r in self._every]
        odd = [r for r, row in enumerate(rows) if row != rows[0]]
        if odd:
            raise ReplicaError(f"rank(s) {odd} are not at the check-in of step {self.step} as rank 0 is: (marker, "
                               f"step, parameters, buckets) per rank {dict(enumerate(rows))}; every rank must run as "
                               "many synchronising forward/backward passes (and no_sync ones) in the same order")

    # -- backward -----------------------------------------------------------------------------
    def _hook(self, g: _Group, j: int, b: _Bucket) -> Callable[[Any], None]:
        def done(p: Any) -> None:
            view = g.grad_tensors[j]
            if p.grad is not view:  # a new tensor (after zero_grad, or double backward's): into the view
                with torch.no_grad():
                    view.copy_(p.grad)
                p.grad = view
            if not self._syncing:
                return
            if not self._queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._queued = True
            b.left -= 1
            if b.left == 0:
                self._start(b)
            for other in self.buckets:  # MPI progresses only inside MPI calls: poke the open ones
                if other.handle is not None and other.t_start and other.handle.test():
                    self._done(other)
        return done

    def _start(self, b: _Bucket) -> None:
        grads = b.group.grads[b.lo:b.hi]
        if b.staging is not None:
            buf = b.staging
            as_tensor(buf).copy_(as_tensor(grads, b.group.dtype))
        else:
            buf = grads
        if self._measure:
            self._local_sq += finite_sq_norm(buf, b.group.xp)[1]
        buf *= 1.0 / self.k  # the sum over the ranks is then the mean
        b.t_start = time.perf_counter()
        self._in_flight.started(b.t_start)
        b.handle = self.reducer.start(buf)

    def _done(self, b: _Bucket) -> None:
        self.times.comm_total_s += self._in_flight.done(time.perf_counter())
        b.t_start = 0.0

    def _finish(self) -> None:
        """The end of a synchronising backward (an autograd callback): start what is left (buckets whose
        parameters autograd did not reach), wait for every bucket, half precision back from float32; then
        rank 0's buffers to every rank."""
        t0 = time.perf_counter()
        self.times.backward_s += t0 - self._t_mark
        for g in self.groups:  # parameters autograd did not reach (since zero_grad): zero gradients
            for j, p in enumerate(g.params):
                if p.grad is None:
                    g.grads[g.offsets[j]:g.offsets[j + 1]] = 0
                    p.grad = g.grad_tensors[j]
        with self.watchdog.watching(f"gradient all-reduce of step {self.step}"):
            for b in self.buckets:
                if b.handle is None:
                    self._start(b)
            for b in self.buckets:
                assert b.handle is not None
                b.handle.wait()
                if b.t_start:
                    self._done(b)
                b.handle = None
        self._check_in_done()  # after the buckets, so that no request is left behind when it raises
        for b in self.buckets:
            if b.staging is not None:
                as_tensor(b.group.grads[b.lo:b.hi], b.group.dtype).copy_(as_tensor(b.staging))
        if self.broadcast_buffers and self.k > 1:  # rank 0's buffers (running statistics) everywhere
            with self.watchdog.watching(f"buffer broadcast of step {self.step}"):
                for s in self.states:
                    bcast_(self.comm, s, 0)
        t = self.times
        if self._measure:
            big = sum(finite_sq_norm(b.staging if b.staging is not None else b.group.grads[b.lo:b.hi],
                                     b.group.xp)[1] for b in self.buckets)
            t.noise_steps += 1
            t.small_sq += self._local_sq
            t.big_sq += big
            t.b_small = self._step_samples
        self._step_samples = 0
        self._syncing = self._queued = False
        self.step += 1
        t.steps += 1
        self._t_mark = time.perf_counter()
        self._after_backward = True
        t.comm_exposed_s += self._t_mark - t0
        if self.metrics_every and self.step % self.metrics_every == 0:
            self.write_metrics()

    # -- accumulation, statistics, metrics --------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward inside accumulate gradients locally (added in the flat buffer); the next
        backward outside averages the sum."""
        old, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = old

    def log_loss(self, loss: Any) -> None:
        """Note a step's loss for the metrics records' ``train_loss`` (a host sync: ``float(loss)``)."""
        self.times.loss_sum += float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self.times.losses += 1

    def noise_scale(self) -> NoiseScale | None:
        """Collective: the gradient noise scale over the steps measured since the last metrics record
        (mpisgd.noise; None when nothing was measured: k = 1, or noise_every = 0)."""
        t = self.times
        sums = np.array([t.small_sq, t.big_sq, t.noise_steps, t.b_small], dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        steps = sums[2] / self.k
        if steps < 1:
            return None
        b_small = int(round(sums[3] / self.k))
        return estimate(b_small, sums[0] / self.k / steps, self.k * b_small, sums[1] / self.k / steps)

    def write_metrics(self) -> None:
        """Collective: rank 0 appends one record of the window since the last one to ``metrics_file``
        (every rank's times averaged, the noise scale), and a new window starts."""
        t = self.times
        noise = self.noise_scale()
        local = np.array([t.forward_s, t.backward_s, t.comm_exposed_s, t.comm_total_s, t.other_s], dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, local, op=MPI.SUM)
        self._records += 1
        if self.metrics_file and t.steps:
            record = window_record(self, t, local / self.k, noise, time.perf_counter() - t.t_first)
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(record, allow_nan=False, default=float) + "\n")
        self.times = WrapTimes()

    def describe(self) -> str:
        """The all-reduce in words, with the buckets' MiB (the form mpisgd.train's records use)."""
        mib = ", ".join(f"{(b.hi - b.lo) * (4 if b.staging is not None else b.group.grads.dtype.itemsize) / 2**20:.2f}"
                        for b in self.buckets)
        return f"{self.reducer.describe()} ({len(self.buckets)} bucket(s): {mib} MiB), overlapped with backward"

    @property
    def grad_nbytes(self) -> int:
        return sum(int(g.grads.nbytes) for g in self.groups)

    # -- the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Collective (every rank together): write the last metrics record, free the communicator and the
        reducer. The gradients leave node-shared memory first (it goes with the reducer). Called at exit
        for a model not closed before (DDP needs no call either); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        if self.times.steps and self.metrics_every:
            self.write_metrics()
        for h in self._hooks:
            h.remove()
        for p in self.module.parameters():
            _WRAPPED.pop(id(p), None)
        self.watchdog.close()
        if self._shared:
            g = self.groups[0]
            g.grads = g.grads.copy()
            self._bind(g, copy_values=False)
            self._shared = False
        self.reducer.close()
        self.comm.Free()


# the parameters of every open DistributedModel, by id (a tensor's == is elementwise: no dictionary key), each
# with a weak reference that tells a live parameter from a new tensor given the id of one gone
_WRAPPED: dict[int, weakref.ref[torch.Tensor]] = {}


def _wrapped(p: torch.Tensor) -> bool:
    """Whether parameter ``p`` belongs to an open DistributedModel."""
    ref = _WRAPPED.get(id(p))
    return ref is not None and ref() is p


def _closer(ref: Any) -> Callable[[], None]:
    def close() -> None:
        model = ref()
        if model is not None:
            model.close()
    return close


def window_record(dm: DistributedModel, t: WrapTimes, mean_s: np.ndarray, noise: NoiseScale | None,
                  wall_s: float) -> dict[str, Any]:
    """One metrics record of ``dm``'s last window, with the fields of mpisgd.train's epoch records that
    the planner reads (world_size, local_batch, accum_steps, effective_batch, grad_nbytes, the times per
    step, samples_per_s, train_loss, step, noise_scale). The one place that knows the record's layout."""
    steps = max(1, t.steps)
    m = max(1, round(t.forwards / steps))
    b = t.samples // max(1, t.forwards)
    per_step = 1e3 / steps
    forward_ms, backward_ms, exposed_ms, total_ms, other_ms = (float(v) * per_step for v in mean_s)
    algbw = dm.grad_nbytes / (total_ms * 1e6) if total_ms > 0 else 0.0  # GB/s: bytes per ns
    peak = peak_rss_mib()
    record: dict[str, Any] = {
        "kind": "epoch", "epoch": dm._records, "step": dm.step, "source": "mpisgd.torch.wrap",
        "lr": None,  # the loop's own optimizer's: not known here
        "train_loss": t.loss_sum / t.losses if t.losses else None,  # null: log_loss was not called
        "world_size": dm.k, "local_batch": b, "accum_steps": m, "effective_batch": dm.k * b * m,
        "grad_nbytes": dm.grad_nbytes, "allreduce": dm.describe(), "steps": t.steps,
        "step_ms": 1e3 * wall_s / steps, "forward_ms": forward_ms, "backward_ms": backward_ms,
        "comm_exposed_ms": exposed_ms, "comm_total_ms": total_ms, "optimizer_ms": other_ms,
        "samples_per_s": dm.k * t.samples / wall_s if wall_s > 0 else 0.0,
        "comm_frac": exposed_ms / (1e3 * wall_s / steps) if wall_s > 0 else 0.0,
        "epoch_time_s": wall_s, "skipped_steps": 0,
        "bucket_algbw_gbps": algbw, "bucket_busbw_gbps": algbw * 2 * (dm.k - 1) / dm.k,
        "peak_rss_mib": peak, "rss_start_mib": dm._rss_start_mib,
        "state_mib": 2 * dm.grad_nbytes / 2**20,  # the flat parameters and gradients mpisgd holds
    }
    if noise is not None and math.isfinite(noise.noise_scale):
        record.update(noise_scale=noise.noise_scale, grad_sqr=noise.grad_sqr, grad_var=noise.grad_var,
                      noise_steps=t.noise_steps)
    return record


def _layout(module: Any) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """What every rank's module must share: its parameters and buffers, by name, shape and dtype."""
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()] + \
        [(n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]


def _inside(t: Any, flat: Any) -> bool:
    """Whether tensor ``t`` lies in array ``flat``'s memory."""
    ptr = flat.data.ptr if is_device_array(flat) else flat.ctypes.data
    return ptr <= t.data_ptr() < ptr + flat.nbytes


def wrap(module: Any, comm: Any, **options: Any) -> DistributedModel:
    """``DistributedModel(module, comm, **options)`` (collective): the DDP-style wrapper over the mpi4py
    communicator ``comm`` (e.g. MPI.COMM_WORLD)."""
    return DistributedModel(module, comm, **options)


__all__ = ["DistributedModel", "WrapTimes", "window_record", "wrap"]
