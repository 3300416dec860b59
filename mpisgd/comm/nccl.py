"""``nccl``: NCCL through ``cupy.cuda.nccl``, one communicator per reducer, its unique id broadcast over MPI.

The all-reduce runs on a stream of its own: it waits for an event recorded on
the compute stream (the gradients are written), and its completion event is
what ``test()`` polls and what the compute stream waits on in ``wait()``, so
backward goes on while a bucket is reduced. Import-safe without CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.backend import is_device_array
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


def local_gpu() -> tuple[str | None, tuple[str, int] | None]:
    """(why NCCL cannot run here, or None; this rank's (host, GPU))."""
    try:
        import cupy  # noqa: PLC0415 - the CPU path never imports CuPy
        from cupy.cuda import nccl  # noqa: F401, PLC0415

        return None, (MPI.Get_processor_name(), cupy.cuda.runtime.getDevice())
    except Exception as exc:
        return f"CuPy with NCCL is not usable here ({type(exc).__name__}: {exc})", None


def why_not(comm: Any) -> str | None:
    """Why NCCL cannot run on every rank, as the lowest failing rank saw it (collective): CuPy or NCCL
    missing, or two ranks on one GPU (NCCL needs one each; its set-up would hang or fail on some only)."""
    everyone = comm.allgather(local_gpu())
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e]
    if failed:
        return f"rank {failed[0][0]}: {failed[0][1]}; use --allreduce auto, ring or mpi"
    places = [w for _, w in everyone]
    shared = [r for r, w in enumerate(places) if places.count(w) > 1]
    if shared:
        return (f"ranks {shared} share a GPU ({places[shared[0]][0]} gpu {places[shared[0]][1]}): NCCL needs one "
                "GPU per rank; start no more ranks per node than GPUs, or use --allreduce auto")
    return None


class NcclReducer(Reducer):
    """NCCL all-reduce of CuPy buffers (device buffers only)."""

    name = "nccl"
    device = True

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        why = why_not(self.comm)
        if why:
            self.comm.Free()
            raise ValueError(f"--allreduce nccl: {why}")
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        self.cupy, self.nccl = cupy, nccl
        uid = self.comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self.nc = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def describe(self) -> str:
        return f"nccl {self.nccl.get_version()} (on a stream of its own, overlapped with backward)"

    def _launch(self, src: Array, dst: Array) -> _Event:
        if not is_device_array(dst):
            raise TypeError("the nccl strategy reduces device (CuPy) buffers only; use ring or mpi for host buffers")
        name = _NCCL_TYPES.get(np.dtype(dst.dtype).name)
        if name is None:
            raise TypeError(f"NCCL cannot reduce {dst.dtype}")
        ready = self.cupy.cuda.Event(disable_timing=True)
        ready.record(self.cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)
        self.nc.allReduce(src.data.ptr, dst.data.ptr, dst.size, getattr(self.nccl, name), self.nccl.NCCL_SUM,
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
        super().close()
