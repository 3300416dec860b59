"""GPU paths of the communication engine (CuPy buffers): CUDA-aware direct, staged, NCCL, fp16.

Skipped, with the reason, where CuPy or a GPU is missing. Run by
scripts/gpu_check.sh under mpiexec (-n 1 and -n number-of-GPUs); size-agnostic.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed: GPU paths untested here")
try:
    N_GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception:  # CUDA driver missing
    N_GPUS = 0
pytestmark = [pytest.mark.mpi(min_size=1),
              pytest.mark.skipif(N_GPUS == 0, reason="no CUDA device: GPU paths untested here")]


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture(scope="module")
def backend():
    from mpisgd.backend import select_backend

    comm = world()
    be, _ = select_backend("gpu", local_rank=comm.Get_rank())
    return be


@pytest.fixture(scope="module")
def cuda_aware():
    from mpisgd.comm.cuda import probe_cuda_aware

    return probe_cuda_aware(world(), "auto")


def device_values(n: int, dtype: str, rank: int):
    return cupy.asarray(((np.arange(n) * 7 + 3 * rank + 1) % 11).astype(dtype))


def expected(n: int, dtype: str, k: int) -> np.ndarray:
    return sum(((np.arange(n) * 7 + 3 * r + 1) % 11).astype("int64") for r in range(k)).astype(dtype)


def check(comm, failures: list) -> None:
    assert [f for per in comm.allgather(failures) for f in per] == []


def test_probe_decides_and_says_why(cuda_aware):
    direct, why = cuda_aware
    assert isinstance(direct, bool) and why


@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("name", ["mpi", "ring", "auto", "hierarchical"])
def test_device_buffers_through_mpi(backend, cuda_aware, mode, name):
    from mpisgd.comm import create_reducer

    comm = world()
    if mode == "direct" and not cuda_aware[0]:
        pytest.skip(f"MPI is not CUDA-aware here ({cuda_aware[1]}): direct would crash")
    k, rank = comm.Get_size(), comm.Get_rank()
    red = create_reducer(name, comm, backend=backend, cuda_aware=mode)
    failures = []
    for dtype in ("float32", "float64", "int32"):
        for n in (1, 3, 1001, (5 << 20) // 4 + 3):  # the last spans several staging chunks
            x = device_values(n, dtype, rank)
            red.allreduce_(x)
            if not np.array_equal(cupy.asnumpy(x), expected(n, dtype, k)):
                failures.append((name, mode, dtype, n))
            h = red.start(y := device_values(n, dtype, rank))
            h.wait()
            if not np.array_equal(cupy.asnumpy(y), expected(n, dtype, k)):
                failures.append((name, mode, dtype, n, "start"))
    red.close()
    check(comm, failures)


def test_nccl(backend):
    from mpisgd.comm import create_reducer

    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    if k > N_GPUS:
        pytest.skip(f"NCCL needs one GPU per rank: {k} ranks, {N_GPUS} GPU(s)")
    red = create_reducer("nccl", comm, backend=backend)
    failures = []
    for dtype in ("float16", "float32", "float64", "int32", "int64", "uint8"):
        for n in (1, 3, 1001, 1 << 20):
            x = device_values(n, dtype, rank)
            h = red.start(x)
            while not h.test():
                pass
            h.wait()
            if not np.array_equal(cupy.asnumpy(x), expected(n, dtype, k)):
                failures.append((dtype, n))
            src, dst = device_values(n, dtype, rank), cupy.zeros(n, dtype=dtype)
            red.allreduce(src, dst)
            if not np.array_equal(cupy.asnumpy(dst), expected(n, dtype, k)):
                failures.append((dtype, n, "out-of-place"))
    red.close()
    check(comm, failures)


def test_fp16_and_deterministic_on_device(backend):
    from mpisgd.comm import create_reducer

    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    everyone = np.random.default_rng(3).standard_normal((k, 100_003)).astype("float32")
    exact = everyone.astype("float64").sum(axis=0)
    comp = create_reducer("ring", comm, backend=backend, compress="fp16", cuda_aware="staged")
    x = cupy.asarray(everyone[rank])
    comp.allreduce_(x)
    comp.close()
    err = np.abs(cupy.asnumpy(x).astype("float64") - exact)
    bound = 2.0 ** -11 * (2 * k) * np.abs(everyone).astype("float64").sum(axis=0) + 1e-7
    det = create_reducer("ring", comm, backend=backend, deterministic=True, cuda_aware="staged")
    a, b = cupy.asarray(everyone[rank]), cupy.asarray(everyone[rank])
    det.allreduce_(a)
    for lo in range(0, b.size, 7777):
        det.allreduce_(b[lo:lo + 7777])
    det.close()
    same = bool(cupy.array_equal(a, b))
    everywhere = comm.allgather((float(np.max(err / bound)), same))
    assert all(w <= 1.0 for w, _ in everywhere)
    assert all(s for _, s in everywhere)
