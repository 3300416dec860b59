"""Synchronising arrays that mpisgd.nn did not make: your own model's, in NumPy, CuPy, PyTorch or JAX.

Horovod-style and small:

- :func:`broadcast_` gives every rank the root's values of a list of arrays
  (the same start everywhere);
- :class:`GradientAverager` averages a list of arrays over the ranks, in
  buckets of about ``bucket_cap_mb``, with any strategy of mpisgd.comm
  (``auto`` by default; ``create_reducer("deterministic", comm)`` for bitwise
  reproducible sums). ``start()`` may be called as gradients become ready
  during backward (overlap), ``wait()`` finishes them all.

Arrays go in as NumPy or CuPy arrays, or anything that exports DLPack (PyTorch
and JAX CPU tensors among them), viewed without a copy. Results are written in
place where the memory is writable and contiguous; a large array is reduced
where it lies, small ones through a packed buffer. Read-only inputs (JAX's are
immutable) get new arrays: use the returned list. Every rank must make the same
calls on arrays of the same shapes and dtypes, in the same order: each call
first compares them across ranks, so a mismatch raises ReplicaError on every
rank (and a rank that never arrives shows in the stall watchdog) instead of
averaging the wrong data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.agreement import bcast_, layout_digest, verify_same
from mpisgd.backend import is_device_array, to_numpy, xp_of
from mpisgd.comm import Reducer, create_reducer
from mpisgd.comm.base import Handle

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


def _signature(views: list[Any]) -> str:
    return layout_digest([(v.shape, v.dtype.str) for v in views])


def broadcast_(arrays: list[Any], comm: Any, root: int = 0) -> list[Any]:
    """Every rank takes ``root``'s values (collective); returns the arrays (new ones where read-only)."""
    views = [as_array(a) for a in arrays]
    verify_same(comm, _signature(views), "the arrays to broadcast (their number, shapes or dtypes)")
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


class GradientAverager:
    """The mean over ranks of lists of arrays (gradients), in buckets through a reducer."""

    def __init__(self, comm: Any, *, reducer: Reducer | None = None, bucket_cap_mb: float = 25.0) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.comm = comm.Dup()
        self.k = self.comm.Get_size()
        self._reducer = reducer
        self.bucket_bytes = int(bucket_cap_mb * 2**20)
        self.pending: list[tuple[Handle, Any, list[Any], list[int]]] = []  # handle, packed buffer, views, slots
        self.results: list[Any] = []
        self._staging: list[Any] = []  # packed buffers, reused in order from one wait() to the next

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
        verify_same(self.comm, _signature(views), "the arrays to average (their number, shapes or dtypes)")
        red = self.reducer(any(is_device_array(v) for v in views))
        base, group = len(self.results), []
        self.results += views
        for i, v in enumerate(views):
            if v.flags.c_contiguous and v.flags.writeable and v.nbytes >= IN_PLACE_BYTES:
                self.pending.append((red.start(v.reshape(-1)), None, [v], [base + i]))
                continue
            group.append(i)
            size = sum(views[j].nbytes for j in group)
            last = i + 1 == len(views) or views[i + 1].dtype != v.dtype or xp_of(views[i + 1]) is not xp_of(v)
            if size >= self.bucket_bytes or last:
                self._start_packed(red, [views[j] for j in group], [base + j for j in group])
                group = []

    def _start_packed(self, red: Reducer, views: list[Any], slots: list[int]) -> None:
        n = sum(v.size for v in views)
        xp, dtype, i = xp_of(views[0]), views[0].dtype, len(self.pending)
        while len(self._staging) <= i:
            self._staging.append(None)
        buf = self._staging[i]
        if buf is None or buf.dtype != dtype or buf.size < n or xp_of(buf) is not xp:
            buf = self._staging[i] = xp.empty(n, dtype=dtype)
        packed, lo = buf[:n], 0
        for v in views:
            packed[lo:lo + v.size] = v.reshape(-1)
            lo += v.size
        self.pending.append((red.start(packed), packed, views, slots))

    def wait(self) -> list[Any]:
        """Finish every average started since the last wait; returns the arrays in start order (each input
        itself where it was written in place, a new array where the input was read-only)."""
        for handle, packed, views, slots in self.pending:
            handle.wait()
            if packed is None:
                views[0] *= 1.0 / self.k
                continue
            packed *= 1.0 / self.k
            lo = 0
            for v, slot in zip(views, slots):
                mean = packed[lo:lo + v.size].reshape(v.shape)
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
        if self._reducer is not None:
            self._reducer.close()
        self.comm.Free()
