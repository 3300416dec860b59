"""The array module ``xp`` (NumPy or CuPy), chosen once at start.

The CPU path never imports CuPy: ``--device cpu`` does not try, and
:func:`is_device_array` recognises CuPy arrays by their type's module name.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
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


def environment(backend: Backend, threads: int, level: str = "") -> dict[str, str | int]:
    """What a run's exact bits may depend on besides its inputs: the BLAS, its kernel and threads, NumPy and
    the SIMD loops it dispatches to (or the GPU), the CPU model, and how the run is pinned (``pinned``: the
    variables mpisgd.pinning set, JSON; "" where none) at ``level`` ("pinned", "portable" or "" for
    neither). Which of these a level's bits depend on: :func:`bits_depend_on`. Checkpoints keep them;
    set-up compares them across ranks (docs/reproducible.md)."""
    from mpisgd import pinning  # noqa: PLC0415

    pinned = pinning.is_pinned()
    facts: dict[str, str | int] = {"level": level, "pinned": json.dumps(pinned, sort_keys=True) if pinned else ""}
    if backend.is_gpu:
        return {"device": backend.gpu_name, "array": f"cupy {backend.xp.__version__}", **facts}
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    flags = pinning.cpu_flags()
    return {"blas": ", ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture', '?')})"
                              for i in blas) or "none found",
            "threads": threads, "blas_threads": ",".join(str(i.get("num_threads")) for i in blas) or "-",
            "array": f"numpy {np.__version__}", "numpy_simd": " ".join(numpy_simd()) or "baseline",
            "cpu": cpu or "unknown", "cpu_simd": " ".join(f for f in ("avx2", "fma", "avx512f") if f in flags),
            **facts}


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
            "simd": " ".join(numpy_simd()) or "baseline", "level-1 BLAS update": "on" if level1 else "off",
            "dtype": str(params.dtype)}


def blas_kernel() -> str:
    """The BLAS libraries this process loaded, each with its version and the CPU kernel it picked
    (OpenBLAS's 'Haswell', 'SkylakeX': OPENBLAS_CORETYPE can force one)."""
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    blas = [f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture', '?')})"
            for i in threadpool_info() if i.get("user_api") == "blas"]
    return ", ".join(blas) or "none found"


def numpy_simd(enabled: bool = True) -> list[str]:
    """The SIMD targets NumPy's loops dispatch to in this process beyond its baseline (after
    NPY_DISABLE_CPU_FEATURES): which exp, log and tanh loops run; with ``enabled`` false, every target
    this NumPy was built for."""
    try:
        umath = importlib.import_module("numpy._core._multiarray_umath")  # NumPy >= 2
    except ImportError:  # pragma: no cover - NumPy 1.x
        umath = importlib.import_module("numpy.core._multiarray_umath")
    features = umath.__cpu_features__
    return [t for t in umath.__cpu_dispatch__ if features.get(t) or not enabled]


# The facts each level's bits depend on (keys of environment()): compared across ranks at start-up and
# with a checkpoint's on resume. The portable level's depend on none of them.
BITS_DEPEND_ON = {
    "pinned": ("level", "blas", "blas_threads", "array", "numpy_simd", "pinned"),
    "portable": ("level",),
    "": ("blas", "threads", "array", "numpy_simd", "cpu", "device"),
}


def bits_depend_on(level: str) -> tuple[str, ...]:
    """The keys of :func:`environment` a run's bits depend on at ``level`` ("pinned", "portable", "")."""
    return BITS_DEPEND_ON[level]


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (0.0 where the OS does not say)."""
    try:
        import resource  # noqa: PLC0415 - Unix only
    except ImportError:
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux
