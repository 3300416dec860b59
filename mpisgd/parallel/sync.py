"""Synchronising arrays that mpisgd.nn did not make: your own model's, in NumPy, CuPy, PyTorch or JAX.

Horovod-style and small:

- :func:`broadcast_` gives every rank the root's values of a list of arrays
  (the same start everywhere);
- :class:`GradientAverager` averages a list of arrays over the ranks, in
  buckets of about ``bucket_cap_mb``, with any strategy of mpisgd.comm
  (``auto`` by default). ``start()`` may be called as gradients become ready
  during backward (overlap), ``wait()`` finishes them all. ``exact=True`` sums
  them as fixed-point integers (mpisgd.exact): the mean is then the same bits
  whatever the strategy, the order and the node layout.

Arrays go in as NumPy or CuPy arrays, or anything that exports DLPack (PyTorch
and JAX CPU tensors among them), viewed without a copy. Results are written in
place where the memory is writable and contiguous; a large array is reduced
where it lies, small ones through a packed buffer. Read-only inputs (JAX's are
immutable) get new arrays: use the returned list. Every rank must make the same
calls on arrays of the same shapes and dtypes, in the same order: each call
first compares them across ranks, so a mismatch raises ReplicaError on every
rank (and a rank that never arrives is named by the stall watchdog, which
ends the job after ``stall_abort_s``) instead of averaging the wrong data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.agreement import bcast_, verify_same_layout
from mpisgd.backend import is_device_array, to_numpy, xp_of
from mpisgd.comm import Reducer, create_reducer
from mpisgd.comm.base import Handle
from mpisgd.exact import FixedPoint
from mpisgd.watchdog import default_watchdog

IN_PLACE_BYTES = 1 << 20  # a contiguous writable array this large is reduced where it lies, not packed


def as_array(a: Any) -> Any:
    """A NumPy or CuPy view of ``a`` (no copy for NumPy, CuPy and DLPack exporters)."""
    if isinstance(a, np.ndarray) or is_device_array(a):
        return a
    if hasattr(a, "__dlpack__"):
        if a.__dlpack_device__()[0] == 2:  # kDLCUDA
            import cupy  # noqa: PLC0415 - device arrays only

            return cupy.from_dlpack(a)
        return np.from_dlpack(a)
    raise TypeError(f"cannot synchronise a {type(a).__name__}: pass NumPy or CuPy arrays, or objects that export "
                    "DLPack (PyTorch, JAX)")


def _layout(views: list[Any]) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(v.shape), str(v.dtype)) for v in views]


def broadcast_(arrays: list[Any], comm: Any, root: int = 0) -> list[Any]:
    """Every rank takes ``root``'s values (collective); returns the arrays (new ones where read-only)."""
    views = [as_array(a) for a in arrays]
    verify_same_layout(comm, _layout(views), "the arrays to broadcast (their number, shapes or dtypes)", "array")
    out = []
    for v in views:
        if is_device_array(v) or (v.flags.writeable and v.flags.c_contiguous):
            bcast_(comm, v, root)  # in place (a device array through a host copy)
            out.append(v)
            continue
        host = np.array(to_numpy(v), order="C")  # one MPI may not write into: a host copy
        bcast_(comm, host, root)
        if v.flags.writeable:
            v[...] = host
            out.append(v)
        else:
            out.append(host)
    return out


@dataclass
class _Pending:
    handle: Handle
    packed: Any  # the buffer reduced (None: the array itself, in place)
    views: list[Any]
    slots: list[int]  # their places in the results
    codec: FixedPoint | None = None  # exact: how the integers become floats again
    bad: Any = None  # exact: the arrays that held NaN or Inf on some rank


class GradientAverager:
    """The mean over ranks of lists of arrays (gradients), in buckets through a reducer.

    ``exact``: each call's arrays become int64 fixed point at scales every rank agrees on (one small
    MAX all-reduce per call), the integers are summed, the sum turned back: the same bits for any
    strategy, summation order and node layout (for the same bits at any *number* of ranks the arrays
    themselves must not depend on it: docs/api.md). ``stall_timeout_s``, ``stall_abort_s``: the stall
    watchdog's (mpisgd.watchdog) bounds on a wait, as DataParallel's."""

    def __init__(self, comm: Any, *, reducer: Reducer | None = None, bucket_cap_mb: float = 25.0,
                 exact: bool = False, stall_timeout_s: float = 300.0, stall_abort_s: float = 1800.0) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.comm = comm.Dup()
        self.k = self.comm.Get_size()
        self._reducer = reducer
        self.exact = exact
        self.bucket_bytes = int(bucket_cap_mb * 2**20)
        self.pending: list[_Pending] = []
        self.results: list[Any] = []
        self._staging: list[Any] = []  # packed buffers, reused in order from one wait() to the next
        self.watchdog = default_watchdog(comm, stall_timeout_s, stall_abort_s)
        self._calls = 0

    def reducer(self, device: bool) -> Reducer:
        if self._reducer is None:
            self._reducer = create_reducer("auto", self.comm, device=device)
        return self._reducer

    def start(self, arrays: list[Any]) -> None:
        """Begin averaging ``arrays`` (collective, non-blocking): call :meth:`wait` before reading them."""
        views = [as_array(a) for a in arrays]
        for v in views:
            if v.dtype.kind != "f":
                raise TypeError(f"only floating-point arrays can be averaged, got {v.dtype}")
        self._calls += 1
        with self.watchdog.watching(f"GradientAverager.start call {self._calls}: comparing the arrays"):
            verify_same_layout(self.comm, _layout(views), "the arrays to average (their number, shapes or dtypes)",
                               "array")
        red = self.reducer(any(is_device_array(v) for v in views))
        base, group = len(self.results), []
        self.results += views
        if self.exact:
            self._start_exact(red, views, list(range(base, base + len(views))))
            return
        for i, v in enumerate(views):
            if v.flags.c_contiguous and v.flags.writeable and v.nbytes >= IN_PLACE_BYTES:
                self.pending.append(_Pending(red.start(v.reshape(-1)), None, [v], [base + i]))
                continue
            group.append(i)
            size = sum(views[j].nbytes for j in group)
            last = i + 1 == len(views) or views[i + 1].dtype != v.dtype or xp_of(views[i + 1]) is not xp_of(v)
            if size >= self.bucket_bytes or last:
                self._start_packed(red, [views[j] for j in group], [base + j for j in group])
                group = []

    def _buffer(self, n: int, dtype: Any, xp: Any) -> Any:
        """Staging buffer number len(self.pending), of at least n elements."""
        i = len(self.pending)
        while len(self._staging) <= i:
            self._staging.append(None)
        buf = self._staging[i]
        if buf is None or buf.dtype != dtype or buf.size < n or xp_of(buf) is not xp:
            buf = self._staging[i] = xp.empty(n, dtype=dtype)
        return buf[:n]

    def _start_packed(self, red: Reducer, views: list[Any], slots: list[int]) -> None:
        packed, lo = self._buffer(sum(v.size for v in views), views[0].dtype, xp_of(views[0])), 0
        for v in views:
            packed[lo:lo + v.size] = v.reshape(-1)
            lo += v.size
        self.pending.append(_Pending(red.start(packed), packed, views, slots))

    def _start_exact(self, red: Reducer, views: list[Any], slots: list[int]) -> None:
        """Every array of this call to fixed point in one int64 buffer, its scale from the largest norm of
        it on any rank (k terms: no headroom needed), then one integer all-reduce."""
        xps = {id(xp_of(v)) for v in views}
        if len(xps) > 1:
            raise TypeError("exact averaging takes the arrays of one call on one device: NumPy or CuPy, not both")
        offsets = [0]
        for v in views:
            offsets.append(offsets[-1] + v.size)
        codec = FixedPoint(offsets, self.k, headroom_bits=0)
        codec.start_step()
        flats = [v.reshape(-1) if v.flags.c_contiguous else v.ravel() for v in views]
        for t, f in enumerate(flats):
            codec.measure(f, offsets[t], offsets[t + 1])
        agreed = np.concatenate([codec.bad.astype(np.int64), codec.needed])
        with self.watchdog.watching(f"GradientAverager.start call {self._calls}: agreeing the scales"):
            self.comm.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MAX)
        codec.set_exponents(agreed[len(views):])
        packed = self._buffer(offsets[-1], np.dtype(np.int64), xp_of(views[0]))
        with np.errstate(invalid="ignore"):  # arrays with NaN or Inf give garbage integers: they become NaN
            for t, f in enumerate(flats):
                codec.encode_(f, packed[offsets[t]:offsets[t + 1]], offsets[t], offsets[t + 1], False)
        self.pending.append(_Pending(red.start(packed), packed, views, slots, codec, agreed[:len(views)] > 0))

    def wait(self) -> list[Any]:
        """Finish every average started since the last wait; returns the arrays in start order (each input
        itself where it was written in place, a new array where the input was read-only)."""
        with self.watchdog.watching(f"GradientAverager.wait after call {self._calls}"):
            for p in self.pending:
                p.handle.wait()
        for p in self.pending:
            if p.packed is None:
                p.views[0] *= 1.0 / self.k
                continue
            if p.codec is None:
                p.packed *= 1.0 / self.k
                means = p.packed
            else:  # the exact sum, then the one rounding of the mean
                means = xp_of(p.packed).empty(p.packed.size, dtype=np.float64)
                p.codec.decode(p.packed, means, 0, p.packed.size)
                means *= 1.0 / self.k
            lo = 0
            for t, (v, slot) in enumerate(zip(p.views, p.slots)):
                mean = means[lo:lo + v.size].reshape(v.shape)
                if p.codec is not None:
                    mean = (mean if not p.bad[t] else mean * np.nan).astype(v.dtype)
                if v.flags.writeable:
                    v[...] = mean
                else:
                    self.results[slot] = mean.copy()
                lo += v.size
        out, self.results, self.pending = self.results, [], []
        return out

    def average_(self, arrays: list[Any]) -> list[Any]:
        """start() and wait() together."""
        self.start(arrays)
        return self.wait()

    def close(self) -> None:
        """Collective."""
        self.watchdog.close()
        if self._reducer is not None:
            self._reducer.close()
        self.comm.Free()
