"""The deterministic strategy: every element summed in rank order whatever the buffer, under mpiexec
(-n 2 and -n 3; test_comm.py runs it at k = 4, where orders really differ)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import rank_order_sum, world

from mpisgd.comm import DeterministicReducer, SharedReducer, create_reducer

pytestmark = pytest.mark.mpi(min_size=2)


def random_floats(rank: int, n: int, dtype: str) -> np.ndarray:
    """Values of many magnitudes: at k >= 3 another summation order gives other bits."""
    rng = np.random.default_rng(100 + rank)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, size=n)).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_bitwise_the_rank_order_sum_whatever_the_buckets(dtype):
    comm = world()
    x = random_floats(comm.Get_rank(), 6007, dtype)
    want = rank_order_sum(comm, x)
    red = DeterministicReducer(comm)
    results = []
    for bucket in (None, 997, 4096, 13, 5):
        y = x.copy()
        cuts = [0, y.size] if bucket is None else [*range(0, y.size, bucket), y.size]
        handles = [red.start(y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]  # all in flight at once
        for h in reversed(handles):
            h.wait()
        results.append(y.tobytes())
    blocking = x.copy()
    red.allreduce_(blocking)
    red.close()
    everyone = comm.allgather((len(set(results)), results[0] == want.tobytes(), blocking.tobytes() == results[0],
                               hashlib.sha256(results[0]).hexdigest()))
    assert all(n == 1 for n, _, _, _ in everyone), "results differ between bucketings"
    assert all(ok and same for _, ok, same, _ in everyone), "not the rank-order sum"
    assert len({h for _, _, _, h in everyone}) == 1, "ranks disagree"


def test_same_bits_as_the_shared_strategy_and_as_the_option():
    """shared sums in the same rank order: the two agree bit for bit; --deterministic picks this strategy
    for mpi and ring where order matters (k >= 3); auto keeps its node-shared buffer (test_comm_auto.py)."""
    comm = world()
    x = random_floats(comm.Get_rank(), 3001, "float32")
    det = DeterministicReducer(comm)
    a = x.copy()
    det.allreduce_(a)
    det.close()
    shared = SharedReducer(comm)
    buf = shared.shared_buffer(x.size, x.dtype)
    buf[...] = x
    shared.start(buf).wait()
    b = buf.copy()
    shared.close()
    names = []
    for name in ("mpi", "ring", "auto"):
        red = create_reducer(name, comm, deterministic=True)
        names.append(red.name)
        red.close()
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert names == (["deterministic"] * 2 if comm.Get_size() > 2 else ["mpi", "ring"]) + ["auto"]


def test_test_alone_completes_both_phases():
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = DeterministicReducer(comm)
    x = np.full(50_001, rank + 1, dtype="float64")
    h = red.start(x)
    while not h.test():
        pass
    red.close()
    assert all(comm.allgather(bool((x == k * (k + 1) / 2).all())))


class _LoggedComm:
    """A communicator that notes the collectives started on it, in order, and passes everything on."""

    def __init__(self, comm) -> None:
        self.comm, self.started = comm, []

    def Ialltoallv(self, *args):  # noqa: N802 - mpi4py's name
        self.started.append("exchange")
        return self.comm.Ialltoallv(*args)

    def Iallgatherv(self, *args):  # noqa: N802
        self.started.append("gather")
        return self.comm.Iallgatherv(*args)

    def __getattr__(self, name):
        return getattr(self.comm, name)


def test_every_rank_starts_the_collectives_in_one_order_however_fast_it_is():
    """MPI wants one order of collective starts per communicator on every rank (Open MPI raised
    MPI_ERR_TRUNCATE when they interleaved differently). Rank 0 here lets its first operation's exchange
    complete before starting the second; the others start both at once."""
    comm = world()
    red = DeterministicReducer(comm)
    real, red.comm = red.comm, _LoggedComm(red.comm)
    a, b = random_floats(comm.Get_rank(), 5003, "float64"), random_floats(comm.Get_rank() + 7, 3001, "float64")
    want_a, want_b = rank_order_sum(comm, a), rank_order_sum(comm, b)
    first = red.start(a)
    if comm.Get_rank() == 0:
        for _ in range(20_000):
            first.test()
            if first.summed:  # its exchange is in, and its gather has started
                break
    second = red.start(b)
    second.wait()
    first.wait()
    started, red.comm = red.comm.started, real
    red.close()
    everyone = comm.allgather((started, np.array_equal(a, want_a), np.array_equal(b, want_b)))
    assert all(s == ["exchange", "gather", "exchange", "gather"] for s, _, _ in everyone), everyone
    assert all(ok_a and ok_b for _, ok_a, ok_b in everyone)
