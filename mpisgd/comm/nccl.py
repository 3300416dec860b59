"""NCCL through ``cupy.cuda.nccl``: one communicator per reducer, its unique id broadcast over MPI.

The all-reduce runs on a dedicated stream: it waits for an event recorded on
the compute stream (the gradients are written), and its completion event is
what ``test()`` polls and what the compute stream waits on in ``wait()``.
Import-safe without CuPy: the import happens in the constructor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.comm.base import Array, Handle, Reducer

_NCCL_TYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
               "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
               "int64": "NCCL_INT64", "uint64": "NCCL_UINT64"}


class _Event:
    def __init__(self, event: Any, cupy: Any) -> None:
        self.event, self.cupy = event, cupy

    def test(self) -> bool:
        return bool(self.event.done)

    def wait(self) -> None:
        self.cupy.cuda.get_current_stream().wait_event(self.event)
        self.event.synchronize()


class NcclReducer(Reducer):
    """NCCL all-reduce of CuPy buffers (device buffers only)."""

    name = "nccl"

    def __init__(self, comm: Any) -> None:
        try:
            import cupy  # noqa: PLC0415 - the CPU path never imports CuPy
            from cupy.cuda import nccl  # noqa: PLC0415
        except Exception as exc:
            raise ValueError(f"--allreduce nccl needs CuPy with NCCL ({type(exc).__name__}: {exc}); "
                             "use --allreduce ring or mpi") from None
        super().__init__(comm)
        self.cupy, self.nccl = cupy, nccl
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = comm.bcast(uid, root=0)
        self.nc = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def describe(self) -> str:
        return f"nccl {self.nccl.get_version()}"

    def _dtype(self, a: Array) -> int:
        name = _NCCL_TYPES.get(np.dtype(a.dtype).name)
        if name is None:
            raise TypeError(f"NCCL cannot reduce {a.dtype}")
        return getattr(self.nccl, name)

    def _launch(self, src: Array, dst: Array) -> _Event:
        if type(dst).__module__.split(".")[0] != "cupy":
            raise TypeError("the nccl strategy reduces device (CuPy) buffers only; use ring or mpi for host buffers")
        ready = self.cupy.cuda.Event(disable_timing=True)
        ready.record(self.cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)
        self.nc.allReduce(src.data.ptr, dst.data.ptr, dst.size, self._dtype(dst), self.nccl.NCCL_SUM,
                          self.stream.ptr)
        done = self.cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return _Event(done, self.cupy)

    def start(self, buf: Array) -> Handle:
        return self._launch(buf, buf)

    def allreduce_(self, buf: Array) -> None:
        self._launch(buf, buf).wait()

    def allreduce(self, src: Array, dst: Array) -> None:
        self._launch(src, dst).wait()

    def close(self) -> None:
        self.nc.destroy()
