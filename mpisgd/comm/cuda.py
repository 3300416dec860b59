"""GPU buffers and MPI: probe whether the library is CUDA-aware, then pass device buffers or stage them.

No library says reliably whether it accepts device pointers (mpi4py has no
query; one that claims support can still crash on a device buffer), so
:func:`probe_cuda_aware` asks the library first (Open MPI's
``MPIX_Query_cuda_support``, MPICH's ``MPIX_GPU_query_support``, via ctypes
when the symbol exists), then runs a tiny device-buffer all-reduce in a child
process, where a crash costs nothing. All ranks then agree (direct only if
every rank can). CuPy is imported only when a device buffer is in play.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import Array, Done, Handle, Reducer

STAGE_CHUNK_BYTES = 4 << 20  # pipelining grain of the staged path: D2H, MPI and H2D of different chunks overlap
MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's enum value for CUDA in MPIX_GPU_query_support

_PROBE = """
import sys
import cupy
from mpi4py import MPI
a = cupy.arange(1, 5, dtype=cupy.float32)
b = cupy.zeros_like(a)
cupy.cuda.get_current_stream().synchronize()
MPI.COMM_SELF.Allreduce(a, b, op=MPI.SUM)
c = cupy.zeros_like(a)
MPI.COMM_SELF.Sendrecv(a, 0, 7, c, 0, 7)
ok = bool((b == a).all()) and bool((c == a).all())
print("CUDA_AWARE_OK" if ok else "CUDA_AWARE_WRONG")
sys.exit(0 if ok else 1)
"""


def library_query() -> tuple[bool | None, str]:
    """(True/False from the library's own query, or None when it has none; a note)."""
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


def _child_env() -> dict[str, str]:
    """This environment minus the launcher's, so the child initialises MPI as a singleton."""
    drop = ("PMI_", "PMIX_", "OMPI_COMM_", "OMPI_MCA_ess", "OMPI_MCA_orte", "OMPI_MCA_pmix", "HYDRA_", "HYDI_",
            "MPI_LOCAL")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def probe_child(timeout_s: float = 60.0) -> tuple[bool, str]:
    """Run a device-buffer Allreduce and Sendrecv in a child process; (worked, note)."""
    try:
        res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=timeout_s, env=_child_env())
    except subprocess.TimeoutExpired:
        return False, f"device-buffer probe timed out after {timeout_s:.0f} s"
    if res.returncode == 0 and "CUDA_AWARE_OK" in res.stdout:
        return True, "device-buffer probe passed"
    tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.returncode}"]
    return False, f"device-buffer probe failed ({tail[0][:120]})"


def probe_cuda_aware(comm: Any, mode: str = "auto") -> tuple[bool, str]:
    """Decide direct (True) or staged (False) for all ranks of ``comm`` (collective); returns (direct, why)."""
    if mode not in ("auto", "direct", "staged"):
        raise ValueError(f"cuda_aware must be auto, direct or staged, got {mode!r}")
    if mode != "auto":
        return mode == "direct", f"forced {mode}"
    said, how = library_query()
    if said is False:
        ok, why = False, f"{how} says no"
    else:
        ok, why = probe_child()
        why = f"{how} says {'yes' if said else 'nothing'}; {why}"
    everyone = bool(comm.allreduce(int(ok), op=MPI.MIN))
    if ok and not everyone:
        why += "; but another rank cannot"
    return everyone, why


def _sync_current() -> None:
    import cupy  # noqa: PLC0415 - GPU path only

    cupy.cuda.get_current_stream().synchronize()


def _is_device(a: Array) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


class DirectReducer(Reducer):
    """Device buffers straight to a CUDA-aware MPI (after the device has finished writing them)."""

    name = "direct"

    def __init__(self, inner: Reducer, why: str = "") -> None:
        super().__init__(inner.comm)
        self.inner, self.why = inner, why

    def describe(self) -> str:
        return f"{self.inner.describe()}, CUDA-aware direct ({self.why})"

    def start(self, buf: Array) -> Handle:
        if _is_device(buf):
            _sync_current()
        return self.inner.start(buf)

    def allreduce_(self, buf: Array) -> None:
        self.start(buf).wait()

    def close(self) -> None:
        self.inner.close()


class StagedReducer(Reducer):
    """Device buffers through pinned host memory, pipelined in chunks.

    All device-to-host copies are queued at once on one stream (each chunk
    records an event); the host loop waits for chunk i's event, all-reduces it
    with ``inner`` and queues its host-to-device copy on a second stream, so
    the copies of other chunks run while MPI works. Blocking in ``start()``.
    """

    name = "staged"

    def __init__(self, inner: Reducer, why: str = "", chunk_bytes: int = STAGE_CHUNK_BYTES) -> None:
        super().__init__(inner.comm)
        self.inner, self.why, self.chunk_bytes = inner, why, chunk_bytes
        self._host: np.ndarray | None = None
        self._mem: Any = None
        self._streams: Any = None

    def describe(self) -> str:
        return f"{self.inner.describe()}, staged through pinned host memory ({self.why})"

    def _host_buffer(self, nbytes: int) -> np.ndarray:
        import cupy  # noqa: PLC0415 - GPU path only

        if self._host is None or self._host.nbytes < nbytes:  # grows only when too small
            self._mem = cupy.cuda.alloc_pinned_memory(nbytes)
            self._host = np.frombuffer(self._mem, dtype=np.uint8, count=nbytes)
        return self._host[:nbytes]

    def start(self, buf: Array) -> Handle:
        if not _is_device(buf):
            return self.inner.start(buf)
        import cupy  # noqa: PLC0415 - GPU path only

        if self._streams is None:
            self._streams = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True))
        d2h, h2d = self._streams
        flat = buf.reshape(-1)
        host = self._host_buffer(flat.nbytes).view(flat.dtype)
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        d2h.wait_event(ready)
        step = max(1, self.chunk_bytes // flat.itemsize)
        bounds = [(a, min(a + step, flat.size)) for a in range(0, flat.size, step)]
        size, base = flat.itemsize, host.ctypes.data
        copied = []
        for a, b in bounds:  # MemoryPointer's *_async copies: asynchronous in every CuPy version (get() may block)
            flat[a:b].data.copy_to_host_async(ctypes.c_void_p(base + a * size), (b - a) * size, d2h)
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(d2h)
            copied.append(ev)
        for (a, b), ev in zip(bounds, copied):
            ev.synchronize()
            self.inner.allreduce_(host[a:b])
            flat[a:b].data.copy_from_host_async(ctypes.c_void_p(base + a * size), (b - a) * size, h2d)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(h2d)
        cupy.cuda.get_current_stream().wait_event(done)  # later kernels see the result
        done.synchronize()
        return Done()

    def allreduce_(self, buf: Array) -> None:
        self.start(buf).wait()

    def close(self) -> None:
        self.inner.close()
        self._host = self._mem = None
