"""The array module ``xp`` (NumPy or CuPy), chosen once at start.

The CPU path never imports CuPy: ``--device cpu`` does not try, and
:func:`is_device_array` recognises CuPy arrays by their type's module name.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from mpisgd.errors import UsageError


@dataclass(frozen=True)
class Backend:
    xp: ModuleType  # numpy or cupy
    device: str  # "cpu" or "gpu"
    gpu_id: int | None = None  # the GPU this rank is bound to
    gpu_name: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.device == "gpu"

    def describe(self) -> str:
        if self.is_gpu:
            return f"gpu {self.gpu_id} ({self.gpu_name}), CuPy"
        return "cpu, NumPy"


def _gpu_count() -> tuple[ModuleType | None, int, str]:
    """(cupy, number of GPUs, why not) without failing when CuPy or a GPU is absent."""
    try:
        import cupy  # noqa: PLC0415 - lazy on purpose: the CPU path must not import it
    except ModuleNotFoundError:
        return None, 0, "CuPy not installed"
    except Exception as exc:  # a broken CUDA install
        return None, 0, f"CuPy unusable: {exc}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return cupy, 0, f"no CUDA device: {exc}"
    return cupy, n, "" if n else "no CUDA device"


def select_backend(device: str, local_rank: int = 0) -> tuple[Backend, str]:
    """Pick the array module for ``device`` (auto|cpu|gpu) and bind this rank's GPU.

    Returns the backend and a note for the banner (why CPU was chosen, if it was).
    """
    if device == "cpu":
        return Backend(np, "cpu"), ""
    if device not in ("auto", "gpu"):
        raise UsageError(f"unknown device {device!r}: use auto, cpu or gpu")
    cupy, n, why = _gpu_count()
    if n == 0:
        if device == "gpu":
            raise UsageError(f"--device gpu but {why}; use --device cpu or auto")
        return Backend(np, "cpu"), f"no GPU: {why}"
    assert cupy is not None  # n > 0: CuPy found the devices
    gpu_id = local_rank % n
    cupy.cuda.Device(gpu_id).use()
    props = cupy.cuda.runtime.getDeviceProperties(gpu_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return Backend(cupy, "gpu", gpu_id, name), ""


def is_device_array(a: Any) -> bool:
    """True for a CuPy array, decided without importing CuPy."""
    return type(a).__module__.split(".")[0] == "cupy"


def xp_of(a: Any) -> Any:
    """The array module of ``a``, without importing CuPy for NumPy arrays."""
    if is_device_array(a):
        import cupy  # noqa: PLC0415

        return cupy
    return np


def to_numpy(a: Any) -> np.ndarray:
    """A host copy (or the array itself when it is already NumPy)."""
    if is_device_array(a):
        return a.get()
    return np.asarray(a)


def sync(a: Any) -> None:
    """Wait for the GPU work queued on ``a``'s device (nothing for a host array): MPI must not read a
    device buffer that a kernel is still writing."""
    if is_device_array(a):
        import cupy  # noqa: PLC0415

        cupy.cuda.get_current_stream().synchronize()


def set_threads(n: int) -> None:
    """Limit BLAS/OpenMP threads of this process (ranks sharing cores must not fight)."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    from threadpoolctl import threadpool_limits  # noqa: PLC0415 - only the CLI needs it

    threadpool_limits(n)


def environment(backend: Backend, threads: int) -> dict[str, str | int]:
    """What a run's exact bits depend on besides its inputs: the BLAS and its threads, NumPy and the SIMD
    targets its loops run (or the GPU), the CPU model. Two runs that differ here may round differently
    (docs/reproducible.md)."""
    if backend.is_gpu:
        return {"device": backend.gpu_name, "array": f"cupy {backend.xp.__version__}"}
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"blas": blas_kernel(), "threads": threads, "array": f"numpy {np.__version__}", "simd": numpy_simd(),
            "cpu": cpu or "unknown"}


def arithmetic(params: Any, level1: bool) -> dict[str, str]:
    """What decides this process's floating-point results besides its inputs, for a model whose parameters
    are ``params`` and an optimizer whose level-1 BLAS path is on or off: on the host, the BLAS (library,
    version, the CPU kernel it picked) and its threads, NumPy and the SIMD targets its loops dispatch to,
    the level-1 switch; on a GPU, the device and CuPy. Ranks that differ here round differently: their
    replicas drift apart, and a reproducible run's bits depend on which rank computed what."""
    if is_device_array(params):
        import cupy  # noqa: PLC0415

        props = cupy.cuda.runtime.getDeviceProperties(params.device.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return {"device": name, "array": f"cupy {cupy.__version__}", "dtype": str(params.dtype)}
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    threads = [str(i.get("num_threads")) for i in threadpool_info() if i.get("user_api") == "blas"]
    return {"blas": blas_kernel(), "blas threads": ", ".join(threads) or "-", "array": f"numpy {np.__version__}",
            "simd": numpy_simd(), "level-1 BLAS update": "on" if level1 else "off", "dtype": str(params.dtype)}


def blas_kernel() -> str:
    """The BLAS libraries this process loaded, each with its version and the CPU kernel it picked
    (OpenBLAS's 'Haswell', 'SkylakeX': OPENBLAS_CORETYPE can force one)."""
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    blas = [f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture', '?')})"
            for i in threadpool_info() if i.get("user_api") == "blas"]
    return ", ".join(blas) or "none found"


def numpy_simd() -> str:
    """The SIMD targets NumPy's loops run here: its baseline and the dispatched targets this CPU has
    (NPY_DISABLE_CPU_FEATURES can turn some off); "unknown" where NumPy does not say."""
    try:
        umath = importlib.import_module("numpy._core._multiarray_umath")
    except ImportError:  # pragma: no cover - NumPy 1.x
        umath = importlib.import_module("numpy.core._multiarray_umath")
    baseline = getattr(umath, "__cpu_baseline__", None)
    dispatch, features = getattr(umath, "__cpu_dispatch__", None), getattr(umath, "__cpu_features__", None)
    if baseline is None or dispatch is None or features is None:
        return "unknown"
    found = [t for t in dispatch if features.get(t)]
    return " ".join(baseline) + (" + " + " ".join(found) if found else "")
