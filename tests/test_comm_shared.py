"""The shared strategy: buffers in node-shared memory summed from the peers' copies, under mpiexec
(-n 2 and -n 3; test_comm.py runs them at k = 4). Every rank of these runs is on one node.
Every collective is reached by all ranks before any assert.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import rank_order_sum, world

from mpisgd.comm import SharedReducer
from mpisgd.comm.base import chunk_bounds

pytestmark = pytest.mark.mpi(min_size=2)


def arena_of(comm, n: int, dtype: str = "float32"):
    red = SharedReducer(comm)
    buf = red.shared_buffer(n, dtype)
    assert buf is not None and red.win is not None, "every rank is on one node here"
    return red, buf


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_buckets_in_flight_together_sum_in_rank_order_bit_for_bit(dtype):
    """Three buckets of one buffer in flight at once (two all-reduces, one reduce-scatter), advanced in
    a different order on each rank, some with n < k (empty chunks): each is the rank-order sum, bit for
    bit, whichever rank owns a chunk (at k >= 3 another order gives other bits for random floats; rank
    r >= 2 must not sum over its own part before adding it)."""
    from mpisgd.comm.shared import SharedOp

    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    sizes = (4099, 1, 2 * k + 1)
    red, buf = arena_of(comm, sum(sizes), dtype)
    buf[...] = np.random.default_rng(r).standard_normal(buf.size).astype(dtype)
    before, want = buf.copy(), rank_order_sum(comm, buf)
    b = chunk_bounds(sizes[2], k)
    counts = [b[c + 1] - b[c] for c in range(k)]
    out = np.full(counts[r], 7, dtype=dtype)
    views = [buf[:4099], buf[4099:4100], buf[4100:]]
    handles = [red.start(views[0]), red.start(views[1]), red.start_reduce_scatter(views[2], out, counts)]
    comm.Barrier()
    order = [(i + r) % 3 for i in range(3)]
    while not all([handles[i].test() for i in order]):
        pass
    result, desc = buf.copy(), red.describe()
    red.close()
    assert all(isinstance(h, SharedOp) for h in handles)
    assert desc.startswith("node-shared buffer")
    np.testing.assert_array_equal(result[:4100], want[:4100])
    np.testing.assert_array_equal(out, want[4100:][b[r]:b[r + 1]])
    np.testing.assert_array_equal(result[4100:], before[4100:])  # a reduce-scatter leaves its input


@pytest.mark.parametrize("op", ["allreduce", "reduce-scatter"])
def test_completion_means_no_peer_reads_this_buffer_again(op, monkeypatch):
    """Once an operation completes, a rank may overwrite its buffer (the next backward does): rank 0 is
    made slow in its last read of the peers' memory, the others overwrite their buffers with NaN as
    soon as theirs completes, and rank 0's result must still be the sum. Without the closing signal
    ("copied", or "summed" for a reduce-scatter) rank 0 reads NaN."""
    from mpisgd.comm.shared import SharedOp

    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    n = 1000
    red, buf = arena_of(comm, n, "float64")
    if r == 0:
        slow = "_copy" if op == "allreduce" else "_sum"
        original = getattr(SharedOp, slow)

        def late(self):
            time.sleep(0.3)
            original(self)

        monkeypatch.setattr(SharedOp, slow, late)
    buf[...] = r + 1
    b = chunk_bounds(n, k)
    out = np.empty(b[r + 1] - b[r])
    if op == "allreduce":
        h = red.start(buf)
    else:
        h = red.start_reduce_scatter(buf, out, [b[c + 1] - b[c] for c in range(k)])
    h.wait()
    result = (buf if op == "allreduce" else out).copy()
    buf[...] = np.nan  # what a fast rank's next step may do
    comm.Barrier()
    red.close()
    ok = comm.allgather(bool(np.all(result == k * (k + 1) / 2)))
    assert all(ok), ok


def test_ranks_reducing_different_pieces_all_raise():
    """The offset and size travel with the first signal: ranks that start different buckets raise on
    every rank, naming the ranks, instead of adding the wrong memory."""
    comm = world()
    r = comm.Get_rank()
    red, buf = arena_of(comm, 40)
    piece = buf[:10] if r == 0 else buf[10:20]  # same size, another offset on rank 0
    with pytest.raises(RuntimeError, match="different piece"):
        red.start(piece).wait()
    comm.Barrier()
    red.close()


def test_only_contiguous_pieces_of_this_ranks_buffer_use_the_window():
    """Anything else goes to mpi, whatever it is."""
    from mpisgd.comm.shared import SharedOp

    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red, buf = arena_of(comm, 1 << 10)
    assert red.offset_of(buf[8:16]) == 8
    assert red.offset_of(buf[::2]) is None  # strided
    assert red.offset_of(buf.view(np.int32)) is None  # another dtype
    assert red.offset_of(np.zeros(8, np.float32)) is None  # private memory
    assert red.offset_of(buf[:0]) is None
    assert red.shared_buffer(8, "float32") is None  # one window per reducer
    private = np.full(1 << 10, r + 1, np.float32)
    h = red.start(private)
    h.wait()
    red.close()
    assert not isinstance(h, SharedOp)
    assert np.all(private == k * (k + 1) / 2)


def test_no_window_when_the_shared_file_system_lacks_room_on_any_rank(monkeypatch):
    """A full /dev/shm (a container's 64 MiB) would end the job with SIGBUS at the first touch of a
    page: if any rank lacks room for twice the window, every rank declines and says why."""
    comm = world()
    if comm.Get_rank() == comm.Get_size() - 1:
        monkeypatch.setattr("mpisgd.comm.shared.shm_free_bytes", lambda: 1000)
    red = SharedReducer(comm)
    buf = red.shared_buffer(1000, "float32")
    desc = red.describe()
    red.close()
    assert buf is None and red.win is None
    assert "no node-shared buffer" in desc and "/dev/shm" in desc


def test_refused_unless_every_rank_is_on_one_node(monkeypatch):
    monkeypatch.setattr("mpisgd.comm.shared.on_one_node", lambda comm: False)
    with pytest.raises(ValueError, match="every rank on one node"):
        SharedReducer(world())
