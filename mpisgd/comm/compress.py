"""fp16 compression for the wire: cast to float16, all-reduce, cast back (Horovod's ``Compression.fp16``).

Halves the bytes moved. The cost is accuracy: each input is rounded to 11
significant bits, and each ring hop rounds the partial sum again (the ring sums
float16 itself, in float32 arithmetic rounded once per add; MPI has no
standard float16 SUM, MPICH's MPIX_C_FLOAT16 being an extension). Magnitudes
above 65504 overflow to inf and below about 6e-8 flush to zero: scale
gradients (e.g. by the loss scale) if they live there.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.comm.base import Array, Handle, Reducer, ScratchPool


class _CastBack:
    def __init__(self, inner: Handle, wire: Array, buf: Array, release: Any) -> None:
        self.inner, self.wire, self.buf, self.release = inner, wire, buf, release
        self.done = False

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self.buf[...] = self.wire.reshape(self.buf.shape)
            self.release(self.wire)

    def test(self) -> bool:
        if not self.done and self.inner.test():
            self._finish()
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.inner.wait()
            self._finish()


class CompressedReducer(Reducer):
    """Wraps another reducer; float32/64 buffers travel as float16, other dtypes pass through."""

    name = "fp16"

    def __init__(self, inner: Reducer) -> None:
        super().__init__(inner.comm)
        self.inner = inner
        self.scratch = ScratchPool()

    def describe(self) -> str:
        return f"{self.inner.describe()}, fp16 on the wire"

    def _wire(self, buf: Array) -> Array | None:
        if buf.dtype.kind != "f" or buf.dtype.itemsize <= 2:
            return None
        w = self.scratch.take(np.float16, buf.size, xp_of(buf))
        w[...] = buf.reshape(-1)
        return w

    def start(self, buf: Array) -> Handle:
        w = self._wire(buf)
        if w is None:
            return self.inner.start(buf)
        if type(w).__module__.split(".")[0] == "cupy":  # the cast must be done before MPI reads it
            import cupy  # noqa: PLC0415 - device buffers only

            cupy.cuda.get_current_stream().synchronize()
        return _CastBack(self.inner.start(w), w, buf, self.scratch.give)

    def allreduce_(self, buf: Array) -> None:
        self.start(buf).wait()

    def close(self) -> None:
        self.inner.close()

