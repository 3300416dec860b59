"""Synchronising arrays mpisgd.nn did not make (mpisgd.parallel.sync), under mpiexec (-n 2 and -n 3; test_comm.py
runs it at k = 4): a hand-written model's averaged step is one process's step on the k-times batch,
in place or not, NumPy or PyTorch; a mismatch between ranks raises everywhere."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rank_order_sum, world

from mpisgd import GradientAverager, broadcast_
from mpisgd.comm import create_reducer
from mpisgd.parallel import ReplicaError

pytestmark = pytest.mark.mpi(min_size=2)


def linear_grads(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradients of the mean squared error of a linear model, written by hand."""
    err = x @ w + b - y
    return [x.T @ err / len(y), err.mean(axis=0)]


def test_averaged_step_of_a_hand_written_model_is_one_process_step_on_the_whole_batch():
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16 * k, 700)), rng.normal(size=(16 * k, 200))  # the global batch, on every rank
    w, b = np.random.default_rng(r).normal(size=(700, 200)), np.zeros(200)  # 1.1 MB: reduced in place
    broadcast_([w, b], comm)
    ref = [g.copy() for g in linear_grads(w, b, x, y)]  # one process, the whole batch
    grads = linear_grads(w, b, x[r::k], y[r::k])  # this rank's share
    avg = GradientAverager(comm, bucket_cap_mb=0.001)
    out = avg.average_(grads)
    avg.close()
    assert all(o is g for o, g in zip(out, grads))  # in place
    everyone = comm.allgather(np.concatenate([g.ravel() for g in grads]).tobytes())
    for g, want in zip(grads, ref):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-13)
    assert len(set(everyone)) == 1  # every rank holds the same average


def test_start_as_gradients_arrive_then_wait_mixed_dtypes_and_read_only_inputs():
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    avg = GradientAverager(comm, bucket_cap_mb=0.01)
    a = np.full(5000, r + 1.0, dtype="float32")
    b = np.full((3, 3), float(r), dtype="float64")
    c = np.full(7, r + 2.0)
    c.flags.writeable = False  # as a JAX array's view is: the mean comes back as a new array
    avg.start([a])
    avg.start([b, c])
    a_out, b_out, c_out = avg.wait()
    avg.close()
    assert a_out is a and b_out is b and c_out is not c and np.all(c == r + 2.0)
    assert np.all(a == (k + 1) / 2) and np.all(b == (k - 1) / 2) and np.all(c_out == (k + 3) / 2)


def test_deterministic_reducer_gives_the_rank_order_sum_over_k():
    comm = world()
    x = np.random.default_rng(comm.Get_rank()).standard_normal(3001).astype("float32")
    want = rank_order_sum(comm, x) * np.float32(1.0 / comm.Get_size())
    avg = GradientAverager(comm, reducer=create_reducer("deterministic", comm))
    avg.average_([x])
    avg.close()
    np.testing.assert_array_equal(x, want)


def test_broadcast_gives_every_rank_root_values_and_new_arrays_for_read_only_inputs():
    comm = world()
    r = comm.Get_rank()
    a = np.full((4, 5), float(r))
    ro = np.full(3, float(r))
    ro.flags.writeable = False
    out = broadcast_([a, ro], comm, root=comm.Get_size() - 1)
    assert out[0] is a and np.all(a == comm.Get_size() - 1)
    assert out[1] is not ro and np.all(out[1] == comm.Get_size() - 1) and np.all(ro == r)


def test_ranks_with_other_arrays_are_refused_on_every_rank():
    comm = world()
    avg = GradientAverager(comm)
    odd = comm.Get_size() - 1
    shape = (5,) if comm.Get_rank() == odd else (4,)
    with pytest.raises(ReplicaError, match=rf"differs on rank\(s\) \[{odd}\] from the other ranks: array 0: rank {odd} "
                                           r"has \(\(5,\), 'float64'\) where rank 0 has \(\(4,\), 'float64'\)"):
        avg.average_([np.zeros(shape)])  # the difference named, not two digests
    with pytest.raises(ReplicaError, match=rf"rank {odd} has 1 arrays where rank 0 has 2"):
        avg.average_([np.zeros(4)] * (1 if comm.Get_rank() == odd else 2))
    with pytest.raises(TypeError, match="floating-point"):
        avg.average_([np.zeros(3, dtype=np.int64)])
    avg.close()


def test_pytorch_gradients_are_averaged_in_place_through_dlpack():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    params = [p.data for p in model.parameters()]
    broadcast_(params, comm)
    same = torch.Generator().manual_seed(1)  # the global batch: the same on every rank
    x, y = torch.randn(8 * k, 6, generator=same).double(), torch.randint(0, 2, (8 * k,), generator=same)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x[r::k]), y[r::k]).backward()
    grads = [p.grad for p in model.parameters()]
    GradientAverager(comm).average_(grads)  # writes into the tensors' own memory
    for g, want in zip(grads, ref):
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["mpi", "ring", "auto", "deterministic"])
def test_exact_mean_is_the_same_bits_for_every_strategy_and_close_to_the_true_mean(name):
    """exact=True: integer sums, so every strategy (and bucket size) gives the same bits; the mean is the
    exactly rounded one to within the fixed point's last unit."""
    import math

    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(10 + r)
    arrays = [(rng.standard_normal(20_000) * 2.0 ** rng.uniform(-20, 0, 20_000)).astype("float32"),
              rng.standard_normal((7, 5)).astype("float64")]
    every = comm.allgather([a.copy() for a in arrays])
    avg = GradientAverager(comm, reducer=create_reducer(name, comm), bucket_cap_mb=0.01, exact=True)
    out = avg.average_([a.copy() for a in arrays])
    avg.close()
    digest = b"".join(o.tobytes() for o in out)
    digests = comm.allgather(digest)
    truth = [np.array([math.fsum(float(e[t].ravel()[i]) for e in every) / k for i in range(every[0][t].size)])
             for t in range(2)]
    assert len(set(digests)) == 1
    np.testing.assert_allclose(out[0].ravel(), truth[0], rtol=2e-7, atol=1e-12)
    np.testing.assert_allclose(out[1].ravel(), truth[1], rtol=1e-13, atol=1e-15)
    # and the same bits as another strategy's (the one the oracle uses)
    avg = GradientAverager(comm, reducer=create_reducer("mpi", comm), exact=True)
    again = avg.average_([a.copy() for a in arrays])
    avg.close()
    assert b"".join(o.tobytes() for o in again) == digest


def test_exact_mean_of_an_array_with_nan_on_one_rank_is_nan_everywhere():
    comm = world()
    x = np.ones(100, "float32")
    if comm.Get_rank() == comm.Get_size() - 1:
        x[3] = np.nan
    avg = GradientAverager(comm, exact=True)
    out, other = avg.average_([x, np.ones(4, "float32")])
    avg.close()
    assert np.isnan(out).all() and (other == 1).all()


def test_the_library_has_a_stall_watchdog_by_default():
    from mpisgd.watchdog import NullWatchdog, Watchdog

    comm = world()
    avg = GradientAverager(comm)
    off = GradientAverager(comm, stall_timeout_s=0, stall_abort_s=0)
    kinds = type(avg.watchdog), type(off.watchdog)
    avg.close()
    off.close()
    assert kinds == (Watchdog, NullWatchdog)
