"""The nccl strategy. On a CPU: a rank that cannot run NCCL makes every rank refuse, with that rank's
reason, before any NCCL set-up (which would wait for the others for ever); two ranks on one GPU are
refused too. On a machine with one GPU per rank: NCCL's sums, in and out of place. Under mpiexec."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import world

from mpisgd.comm import nccl

pytestmark = pytest.mark.mpi(min_size=1)


def test_one_rank_without_nccl_makes_every_rank_refuse(monkeypatch):
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    bad = k - 1
    monkeypatch.setattr(nccl, "local_gpu", lambda: ("no NCCL on this one", None) if r == bad else
                        (None, (f"host{r}", 0)))
    with pytest.raises(ValueError, match=f"rank {bad}: no NCCL on this one"):
        nccl.NcclReducer(comm)


@pytest.mark.mpi(min_size=2)
def test_ranks_sharing_a_gpu_are_refused(monkeypatch):
    monkeypatch.setattr(nccl, "local_gpu", lambda: (None, ("node", 0)))
    with pytest.raises(ValueError, match="share a GPU"):
        nccl.NcclReducer(world())


def test_nccl_sums_on_one_gpu_per_rank():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: NCCL untested here")
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    try:
        n_gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        n_gpus = 0
    if k > n_gpus:
        pytest.skip(f"NCCL needs one GPU per rank: {k} rank(s), {n_gpus} GPU(s)")
    cupy.cuda.Device(rank % n_gpus).use()
    red = nccl.NcclReducer(comm)
    failures = []
    for dtype in ("float16", "float32", "float64", "int32", "int64", "uint8"):
        for n in (1, 3, 1001, 1 << 20):
            values = ((np.arange(n) * 7 + 3 * rank + 1) % 11).astype(dtype)
            want = sum(((np.arange(n) * 7 + 3 * r + 1) % 11).astype("int64") for r in range(k)).astype(dtype)
            x = cupy.asarray(values)
            h = red.start(x)
            while not h.test():
                pass
            h.wait()
            dst = cupy.zeros(n, dtype=dtype)
            red.allreduce(cupy.asarray(values), dst)
            if not (np.array_equal(cupy.asnumpy(x), want) and np.array_equal(cupy.asnumpy(dst), want)):
                failures.append((dtype, n))
    red.close()
    assert [f for per in comm.allgather(failures) for f in per] == []
