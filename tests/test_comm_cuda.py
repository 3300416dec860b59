"""GPU buffers and MPI (mpisgd.comm.cuda). On a CPU: the probe's decision (every rank agrees; one rank's
wrong result stages everyone) and the rule that device operations start in the order they were asked
for, with stand-in events. On a GPU (CuPy and a CUDA device; skipped with the reason elsewhere): device
buffers through every strategy, staged and, where the probe allows, passed to MPI. Under mpiexec at
k = 1, 2, 3 (scripts/gpu_check.sh runs k = 2 and 3 on one GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import world

from mpisgd.comm import cuda

pytestmark = pytest.mark.mpi(min_size=1)


# -- on any machine ------------------------------------------------------------------------------------
def test_forced_modes_and_bad_mode():
    assert cuda.probe_cuda_aware(world(), "direct") == (True, "--cuda-aware direct")
    assert cuda.probe_cuda_aware(world(), "staged") == (False, "--cuda-aware staged")
    with pytest.raises(ValueError, match="auto, direct or staged"):
        cuda.probe_cuda_aware(world(), "sometimes")


@pytest.mark.parametrize("library,child,wrong_on_last,want", [
    ((False, "MPIX_Query_cuda_support"), None, None, (False, "says no")),
    ((None, "no query function"), (False, "device-buffer probe failed (boom)"), None, (False, "probe failed")),
    ((True, "MPIX_Query_cuda_support"), (True, "passed"), [], (True, "every call training makes checked")),
    ((None, "no query function"), (True, "passed"), ["Ialltoallv"], (False, "Ialltoallv on device buffers")),
])
def test_probe_decides_alike_on_every_rank(monkeypatch, library, child, wrong_on_last, want):
    """The library's word, then the crash-safe child, then every training call on the real communicator:
    one rank's wrong result (here the last rank's all-to-all) makes every rank stage."""
    comm = world()
    last = comm.Get_rank() == comm.Get_size() - 1
    monkeypatch.setattr(cuda, "library_query", lambda: library)
    monkeypatch.setattr(cuda, "probe_child", lambda: child)
    monkeypatch.setattr(cuda, "probe_calls", lambda c, xp: (wrong_on_last or []) if last else [])
    direct, why = cuda.probe_cuda_aware(comm, "auto", xp=object())
    everyone = comm.allgather(direct)
    assert all(d == want[0] for d in everyone), everyone
    assert want[1] in why


# -- on a GPU ------------------------------------------------------------------------------------------
def gpu():
    """CuPy with a device bound (local rank % GPUs), or a skip on every rank when any rank lacks one:
    a rank skipping alone would leave the others waiting in the test's collectives."""
    why, cupy = "", None
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        why = "" if n else "no CUDA device: GPU paths untested here"
    except Exception as exc:  # CuPy missing, or the CUDA driver
        why = f"no CuPy or no CUDA ({type(exc).__name__}): GPU paths untested here"
    whys = [w for w in world().allgather(why) if w]
    if whys:
        pytest.skip(whys[0])
    from mpisgd.comm.base import node_layout

    cupy.cuda.Device(node_layout(world())[0] % n).use()
    return cupy


def device_values(cupy, n: int, dtype: str, rank: int):
    return cupy.asarray(((np.arange(n) * 7 + 3 * rank + 1) % 11).astype(dtype))


def expected(n: int, dtype: str, k: int) -> np.ndarray:
    return sum(((np.arange(n) * 7 + 3 * r + 1) % 11).astype("int64") for r in range(k)).astype(dtype)


def test_probe_on_the_real_communicator():
    cupy = gpu()
    direct, why = cuda.probe_cuda_aware(world(), "auto")
    assert isinstance(direct, bool) and why
    wrong = cuda.probe_calls(world(), cupy) if direct else []
    assert wrong == []


@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("name", ["mpi", "ring", "auto", "deterministic"])
def test_device_buffers_through_every_strategy(mode, name):
    cupy = gpu()
    from mpisgd.comm import create_reducer

    comm = world()
    if mode == "direct" and not cuda.probe_cuda_aware(comm, "auto")[0]:
        pytest.skip("MPI is not CUDA-aware here: direct would crash")
    k, rank = comm.Get_size(), comm.Get_rank()
    red = create_reducer(name, comm, device=True, cuda_aware=mode)
    failures = []
    for dtype in ("float32", "float64", "int32"):
        for n in (1, 3, 1001, (5 << 20) // 4 + 3):
            x = device_values(cupy, n, dtype, rank)
            red.allreduce_(x)
            if not np.array_equal(cupy.asnumpy(x), expected(n, dtype, k)):
                failures.append((name, mode, dtype, n))
        # buckets as training makes them: several in flight, written by kernels just queued, tested in a
        # rank-dependent order (the starts must still happen in the same order everywhere)
        xs = [device_values(cupy, n, dtype, rank) * 1 for n in (70_000, 5, 300_001)]
        handles = [red.start(x) for x in xs]
        turn = [(i + rank) % 3 for i in range(3)]
        while not all([handles[i].test() for i in turn]):
            pass
        for h in handles:
            h.wait()
        for x in xs:
            if not np.array_equal(cupy.asnumpy(x), expected(x.size, dtype, k)):
                failures.append((name, mode, dtype, x.size, "start"))
    red.close()
    assert [f for per in comm.allgather(failures) for f in per] == []


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_reproducible_training_on_device_buffers_gives_one_rank_s_bits(mode):
    """--reproducible on CuPy: int64 fixed point on the device, summed through MPI (staged or device
    pointers): the parameters after a few steps are one rank's bits, whatever k divides B/b."""
    cupy = gpu()
    import hashlib

    from mpi4py import MPI

    from mpisgd.comm import create_reducer
    from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, synthetic
    from mpisgd.nn import mlp
    from mpisgd.optim import SGD
    from mpisgd.parallel import DataParallel

    comm = world()
    if mode == "direct" and not cuda.probe_cuda_aware(comm, "auto")[0]:
        pytest.skip("MPI is not CUDA-aware here: direct would crash")
    if 6 % comm.Get_size():
        pytest.skip(f"k={comm.Get_size()} does not divide B/b=6")

    def digest(c) -> str:
        k, r = c.Get_size(), c.Get_rank()
        data = synthetic(480, seed=0)
        model = mlp((24, 16)).materialize(cupy, "float32", seed=0)
        dp = DataParallel(model, SGD(model.flat, momentum=0.9, weight_decay=1e-3, level1=False), c,
                          reducer=create_reducer("auto", c, device=True, cuda_aware=mode), reproducible=True)
        loader, batches = BatchLoader(data, cupy, "float32"), GlobalBatches(len(data), 48, r, k, 6 // k)
        for step in range(6):
            perm = epoch_permutation(len(data), 0, 0)
            dp.train_step([loader.batch(batches.indices(perm, step, i), slot=i) for i in range(6 // k)], lr=0.05)
        out = hashlib.sha256(cupy.asnumpy(dp.flat.params).tobytes()).hexdigest()
        dp.close()
        return out

    ours, ref = digest(comm), digest(MPI.COMM_SELF)
    assert all(comm.allgather(ours == ref))
