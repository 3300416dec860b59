"""GPU buffers and MPI: device pointers to a CUDA-aware MPI, or copies through pinned host memory.

No library says reliably whether it takes device pointers in every call (some
only in blocking collectives), so :func:`probe_cuda_aware` asks the library,
then runs a device-buffer Allreduce in a child process (where a crash costs
nothing), then every call training makes, on the real communicator at the real
k, checking each result; device pointers only if every rank passes. Either way
an operation starts once the kernels that wrote its buffer are done (an event,
not a device-wide wait), in the order operations were asked for on every rank.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.backend import is_device_array
from mpisgd.comm.base import Array, Handle, InOrder, Reducer, flat_view

MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's enum value for CUDA in MPIX_GPU_query_support

_CHILD = """
import cupy, sys
from mpi4py import MPI
a = cupy.arange(1, 5, dtype=cupy.float32); b = cupy.zeros_like(a)
cupy.cuda.get_current_stream().synchronize()
MPI.COMM_SELF.Allreduce(a, b, op=MPI.SUM)
sys.exit(0 if bool((b == a).all()) else 1)
"""


def library_query() -> tuple[bool | None, str]:
    """(True/False from the library's own query, or None when it has none; which query)."""
    try:
        lib = ctypes.CDLL(MPI.__file__)  # dlsym on the extension also searches the libmpi it links
    except OSError as exc:
        return None, f"cannot dlopen mpi4py ({exc})"
    if hasattr(lib, "MPIX_Query_cuda_support"):
        return bool(lib.MPIX_Query_cuda_support()), "MPIX_Query_cuda_support"
    if hasattr(lib, "MPIX_GPU_query_support"):
        flag = ctypes.c_int(0)
        if lib.MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
            return bool(flag.value), "MPIX_GPU_query_support(CUDA)"
    return None, "no query function in the MPI library"


def child_env() -> dict[str, str]:
    """This environment minus the launcher's, so that a child initialises MPI as a singleton."""
    drop = ("PMI_", "PMIX_", "OMPI_COMM_", "OMPI_MCA_ess", "OMPI_MCA_orte", "OMPI_MCA_pmix", "HYDRA_", "HYDI_",
            "MPI_LOCAL")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def probe_child(timeout_s: float = 60.0) -> tuple[bool, str]:
    """A device-buffer Allreduce in a child process: (worked, note)."""
    try:
        res = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s,
                             env=child_env())
    except subprocess.TimeoutExpired:
        return False, f"device-buffer probe timed out after {timeout_s:.0f} s"
    if res.returncode == 0:
        return True, "device-buffer probe passed"
    tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.returncode}"]
    return False, f"device-buffer probe failed ({tail[0][:120]})"


def probe_calls(comm: Any, xp: Any) -> list[str]:
    """The calls training makes, on small device buffers over ``comm`` (collective): the names of those
    whose result was wrong. A crash here ends the job, hence the child probe first."""
    comm = comm.Dup()  # our own messages: the tag below meets nobody else's
    k, r = comm.Get_size(), comm.Get_rank()
    counts, displs = [2] * (k - 1) + [3], [2 * p for p in range(k)]
    n, mine = sum(counts), slice(displs[r], displs[r] + counts[r])
    x = xp.arange(n, dtype=xp.float32) + r
    out = {c: xp.zeros(n, dtype=xp.float32) for c in ("Allreduce", "Iallreduce", "Isend/Irecv", "Iallgatherv")}
    a2a = xp.zeros(k * counts[r], dtype=xp.float32)
    out["Iallgatherv"][mine] = x[mine]
    xp.cuda.get_current_stream().synchronize()
    comm.Allreduce(x, out["Allreduce"], op=MPI.SUM)
    MPI.Request.Waitall([
        comm.Iallreduce(x, out["Iallreduce"], op=MPI.SUM),
        comm.Irecv(out["Isend/Irecv"], (r - 1) % k, 77), comm.Isend(x, (r + 1) % k, 77),
        comm.Iallgatherv(MPI.IN_PLACE, [out["Iallgatherv"], counts, displs, MPI.FLOAT]),
        comm.Ialltoallv([x, counts, displs, MPI.FLOAT], [a2a, [counts[r]] * k, [counts[r] * p for p in range(k)],
                                                          MPI.FLOAT])])
    comm.Free()
    total = np.arange(n) * k + k * (k - 1) / 2
    want = {"Allreduce": total, "Iallreduce": total, "Isend/Irecv": np.arange(n) + (r - 1) % k,
            "Iallgatherv": np.arange(n) + np.repeat(np.arange(k), counts)}
    wrong = [c for c, a in out.items() if not np.array_equal(xp.asnumpy(a), want[c])]
    a2a_want = np.concatenate([np.arange(n)[mine] + p for p in range(k)])
    return wrong + ([] if np.array_equal(xp.asnumpy(a2a), a2a_want) else ["Ialltoallv"])


def probe_cuda_aware(comm: Any, mode: str = "auto", xp: Any = None) -> tuple[bool, str]:
    """Decide device pointers (True) or staging (False) for every rank of ``comm`` (collective): (direct, why)."""
    if mode not in ("auto", "direct", "staged"):
        raise ValueError(f"cuda_aware must be auto, direct or staged, got {mode!r}")
    if mode != "auto":
        return mode == "direct", f"--cuda-aware {mode}"
    said, how = library_query()
    ok, why = (False, f"{how} says no") if said is False else probe_child()
    if said is not False:
        why = f"{how} says {'yes' if said else 'nothing'}; {why}"
    if not comm.allreduce(ok, op=MPI.LAND):
        return False, why if not ok else why + "; another rank's did not"
    if xp is None:
        import cupy  # noqa: PLC0415 - GPU path only

        xp = cupy
    wrong = probe_calls(comm, xp)
    everyone = comm.allgather(wrong)
    bad = sorted({name for w in everyone for name in w})
    if bad:
        return False, f"{why}; but {', '.join(bad)} on device buffers gave wrong results at k={comm.Get_size()}"
    return True, f"{why}; every call training makes checked on device buffers at k={comm.Get_size()}"


class _DeviceOp:
    """One operation on a device buffer, begun (in start order) once the kernels that wrote it are done."""

    def __init__(self, red: Any, buf: Array, written: Any = None) -> None:
        self.red, self.buf, self.cupy = red, buf, red.cupy
        self.inner: Handle | None = None
        if written is None:  # the kernels queued so far on the compute stream wrote the buffer
            written = self.cupy.cuda.Event(disable_timing=True)
            written.record(self.cupy.cuda.get_current_stream())
        self.written = written
        red.order.queue.append(self)
        red.order.pump()

    def ready(self, block: bool) -> bool:
        """Whether the buffer is written (waiting for it when ``block``)."""
        if block:
            self.written.synchronize()
        return block or bool(self.written.done)

    def begin(self) -> None:
        self.inner = self.red.inner.start(self.buf)

    def finish(self) -> None:
        """The result is in ``buf`` (nothing to do when MPI wrote it there)."""

    def test(self) -> bool:
        self.red.order.pump()
        if self.inner is None or not self.inner.test():
            return False
        self.finish()
        return True

    def wait(self) -> None:
        self.red.order.pump(until=self)
        assert self.inner is not None  # pumped until this operation began
        self.inner.wait()
        self.finish()


class _StagedOp(_DeviceOp):
    """Device -> pinned host copy on the copy stream, the inner (host) operation, host -> device copy."""

    def __init__(self, red: StagedReducer, buf: Array) -> None:
        cupy, stream = red.cupy, red.copies
        self.flat, self.slot = flat_view(buf), red.take(buf.nbytes)
        self.back: Any = None  # the event of the copy back to the device
        self.host = self.slot[1][:buf.nbytes].view(buf.dtype)
        written = cupy.cuda.Event(disable_timing=True)
        written.record(cupy.cuda.get_current_stream())
        stream.wait_event(written)
        self.flat.data.copy_to_host_async(ctypes.c_void_p(self.host.ctypes.data), buf.nbytes, stream)
        copied = cupy.cuda.Event(disable_timing=True)
        copied.record(stream)
        super().__init__(red, buf, written=copied)  # for the host copy, ready means copied

    def begin(self) -> None:
        self.inner = self.red.inner.start(self.host)

    def finish(self) -> None:
        if self.back is not None:
            return
        cupy, stream = self.cupy, self.red.copies
        self.flat.data.copy_from_host_async(ctypes.c_void_p(self.host.ctypes.data), self.flat.nbytes, stream)
        self.back = cupy.cuda.Event(disable_timing=True)
        self.back.record(stream)
        cupy.cuda.get_current_stream().wait_event(self.back)  # later kernels see the result
        self.back.synchronize()  # then the pinned buffer may be reused
        self.red.free.append(self.slot)


class CudaAwareReducer(Reducer):
    """Device buffers straight to a CUDA-aware MPI through ``inner``."""

    name = "cuda-aware"
    device = True
    op: Any = _DeviceOp

    def __init__(self, inner: Reducer, why: str = "") -> None:
        import cupy  # noqa: PLC0415 - GPU path only

        super().__init__(inner.comm)
        self.inner, self.why, self.cupy, self.order = inner, why, cupy, InOrder()

    def describe(self) -> str:
        return f"{self.inner.describe()}; device buffers to MPI directly"

    def start(self, buf: Array) -> Handle:
        return self.op(self, buf) if is_device_array(buf) else self.inner.start(buf)

    def allreduce_(self, buf: Array) -> None:
        self.start(buf).wait()

    def tune(self, bufs: list[Array], *, reduce_scatter: bool = False) -> None:
        self.inner.tune(bufs, reduce_scatter=reduce_scatter)

    def close(self) -> None:
        self.inner.close()
        super().close()


class StagedReducer(CudaAwareReducer):
    """Device buffers through pinned host memory, so that MPI only ever sees host buffers; the copies
    run on a stream of their own, so backward goes on while a bucket is copied out and reduced."""

    name = "staged"
    op = _StagedOp

    def __init__(self, inner: Reducer, why: str = "") -> None:
        super().__init__(inner, why)
        self.copies = self.cupy.cuda.Stream(non_blocking=True)
        self.free: list[tuple[Any, np.ndarray]] = []  # pinned buffers not in use: (memory, its bytes)

    def describe(self) -> str:
        return f"{self.inner.describe()}; device buffers staged through host memory"

    def take(self, nbytes: int) -> tuple[Any, np.ndarray]:
        for i, (_, view) in enumerate(self.free):
            if view.nbytes >= nbytes:
                return self.free.pop(i)
        mem = self.cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return mem, np.frombuffer(mem, dtype=np.uint8, count=max(nbytes, 1))

    def tune(self, bufs: list[Array], *, reduce_scatter: bool = False) -> None:
        # the inner sees host buffers of these sizes
        self.inner.tune([np.empty(b.size, b.dtype) for b in bufs], reduce_scatter=reduce_scatter)
