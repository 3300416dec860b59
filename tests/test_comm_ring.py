"""Our ring all-reduce against MPI_Allreduce, under mpiexec (scripts/test.sh runs -n 2 and -n 3;
test_comm.py runs these at k = 4): segment sizes and windows that cut the buffer every way, the
pipeline's progress, and its scratch cap."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, gathered, local_values, oracle, world

from mpisgd.comm import RingReducer

pytestmark = pytest.mark.mpi(min_size=2)
LENGTHS = [1, 2, 3, 5, 7, 64, 1001, 4099]  # odd, below k, one element per rank, several slices


@pytest.mark.parametrize("segment_bytes,window", [(1 << 20, 4), (8, 2), (24, 1), (40, 3)])
def test_ring_equals_mpi_allreduce_bitwise_every_dtype_and_length(segment_bytes, window):
    comm = world()
    red = RingReducer(comm, segment_bytes=segment_bytes, window=window)
    failures = []
    lengths = LENGTHS if segment_bytes > 1024 else LENGTHS[:-1]  # tiny segments: thousands of messages
    for dtype in DTYPES:
        for n in lengths:
            x = local_values(n, dtype, comm.Get_rank())
            want = oracle(comm, x)
            inplace = x.copy()
            red.allreduce_(inplace)
            out = np.full_like(x, 99)
            red.allreduce(x, out)
            if not np.array_equal(inplace, want):
                failures.append(("in-place", dtype, n))
            if not np.array_equal(out, want):
                failures.append(("out-of-place", dtype, n))
    red.close()
    assert gathered(comm, failures) == []


def test_ring_random_floats_within_rounding_of_the_exact_sum():
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = RingReducer(comm, segment_bytes=256)
    everyone = np.random.default_rng(1).standard_normal((k, 10_007))
    exact = everyone.sum(axis=0)
    errors = {}
    for dtype, tol in (("float32", 1e-5), ("float64", 1e-13)):
        x = everyone[rank].astype(dtype)
        red.allreduce_(x)
        errors[dtype] = float(np.max(np.abs(x - exact)) / np.max(np.abs(exact))) / tol
    red.close()
    worst = max(max(e.values()) for e in comm.allgather(errors))
    assert worst <= 1.0, f"relative error / tolerance = {worst}"


def test_test_alone_completes_an_operation():
    """Polling test() (as DataParallel does during backward) must finish the work without wait()."""
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = RingReducer(comm, segment_bytes=1024)
    x = np.full(50_000, rank + 1, dtype="float64")
    h = red.start(x)
    polls = 0
    while not h.test() and polls < 10_000_000:
        polls += 1
    finished = h.test()
    h.wait()
    red.close()
    assert all(comm.allgather(finished and bool((x == k * (k + 1) / 2).all())))


def test_scratch_cap_limits_slices_in_flight_without_changing_results(monkeypatch):
    from mpisgd.comm import ring

    monkeypatch.setattr(ring, "SCRATCH_CAP_BYTES", 1)  # one slice in flight at a time
    comm = world()
    failures = []
    red = RingReducer(comm, segment_bytes=256)
    for n in (5, 999, 4000):
        x = local_values(n, "int64", comm.Get_rank())
        want = oracle(comm, x)
        red.allreduce_(x)
        if not np.array_equal(x, want):
            failures.append(n)
    red.close()
    assert gathered(comm, failures) == []


def test_many_random_lengths_against_mpi():
    comm = world()
    red = RingReducer(comm, segment_bytes=40, window=3)
    lengths = np.random.default_rng(7).integers(0, 3000, size=25)  # same on every rank
    failures = []
    for n in lengths:
        x = local_values(int(n), "int32", comm.Get_rank())
        want = oracle(comm, x)
        red.allreduce_(x)
        if not np.array_equal(x, want):
            failures.append(int(n))
    red.close()
    assert gathered(comm, failures) == []


def test_ring_rejects_a_non_contiguous_buffer_and_bad_parameters():
    comm = world()
    red = RingReducer(comm)
    with pytest.raises(ValueError, match="contiguous"):
        red.allreduce_(np.zeros((4, 4))[:, 1])
    red.close()
    with pytest.raises(ValueError, match="segment_bytes"):
        RingReducer(comm, segment_bytes=0)
