"""BatchNorm1d, BatchNorm2d and SyncBatchNorm (mpisgd.nn.normalization): gradient checks in train and eval
mode, PyTorch's function, momentum and unbiased running variance, the statistics row that data parallelism
averages, and SyncBatchNorm over k ranks (the MPI tests: run under mpiexec -n 2 and -n 3)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import RANKS, world

from mpisgd.nn import BatchNorm1d, BatchNorm2d, Conv2d, Linear, Sequential, SyncBatchNorm
from mpisgd.nn.gradcheck import check_gradients


class Seasoned2d(BatchNorm2d):
    """BatchNorm2d with running statistics far from their start (0 and 1): eval mode then computes something."""

    def init_buffers(self, dtype: np.dtype) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(8)
        return {"running_mean": rng.uniform(-1, 1, self.C).astype(dtype),
                "running_var": rng.uniform(0.5, 2, self.C).astype(dtype)}


class Seasoned1d(BatchNorm1d):
    init_buffers = Seasoned2d.init_buffers


CASES = {
    "BatchNorm1d": (lambda: Sequential(Linear(3, 4), Seasoned1d(4)), (6, 3)),
    "BatchNorm2d alone": (lambda: Seasoned2d(3), (4, 3, 5, 4)),
    "BatchNorm2d in a run": (lambda: Sequential(Conv2d(2, 3, 3, padding=1), Seasoned2d(3)), (4, 2, 5, 4)),
    "SyncBatchNorm, one process": (lambda: Sequential(Conv2d(2, 3, 3), SyncBatchNorm(3)), (3, 2, 5, 5)),
}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", CASES)
def test_batch_norm_passes_the_gradient_check(case, training):
    build, shape = CASES[case]
    x = np.random.default_rng(1).standard_normal(shape) * 3 + 1
    errors = check_gradients(build(), x, training=training)
    assert len(errors) >= 3 and all(e.ok for e in errors), [e for e in errors if not e.ok]


def test_the_gradient_check_catches_a_wrong_batch_norm_backward():
    class Wrong(BatchNorm2d):
        def backward_bl(self, dy, need_dx=True):
            dx = super().backward_bl(dy, need_dx)
            self.grads["gamma"] *= 1.01
            return dx

    errors = check_gradients(Wrong(2), np.random.default_rng(0).standard_normal((3, 2, 4, 4)))
    assert [e.name for e in errors if not e.ok] == ["Wrong.gamma"]


@pytest.mark.parametrize("dims", [1, 2])
def test_batch_norm_is_pytorchs_in_train_and_eval_mode(dims):
    """The same function, gradients and running statistics (momentum 0.1 on the unbiased variance) as
    torch.nn.BatchNorm1d/2d, over three train-mode steps, then the same eval-mode output."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    ours = (BatchNorm1d if dims == 1 else BatchNorm2d)(3, momentum=0.2)
    model = ours.materialize(np, "float64", seed=0)
    theirs = (torch.nn.BatchNorm1d if dims == 1 else torch.nn.BatchNorm2d)(3, momentum=0.2).double()
    gamma, beta = rng.uniform(0.5, 1.5, 3), rng.uniform(-1, 1, 3)
    ours.params["gamma"][:], ours.params["beta"][:] = gamma, beta
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(gamma))
        theirs.bias.copy_(torch.from_numpy(beta))
    shape = (7, 3) if dims == 1 else (4, 3, 5, 6)
    for _ in range(3):
        x = rng.standard_normal(shape) * 2 + rng.uniform(-3, 3, (1, 3) + (1,) * (len(shape) - 2))
        dy = rng.standard_normal(shape)
        xt = torch.from_numpy(x).requires_grad_()
        yt = theirs(xt)
        yt.backward(torch.from_numpy(dy))
        np.testing.assert_allclose(model.forward(x), yt.detach().numpy(), rtol=1e-10, atol=1e-12)
        dx = ours.backward(dy.copy())
        np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(ours.grads["gamma"], theirs.weight.grad.numpy(), rtol=1e-10)
        np.testing.assert_allclose(ours.grads["beta"], theirs.bias.grad.numpy(), rtol=1e-10)
        theirs.weight.grad = theirs.bias.grad = None
        np.testing.assert_allclose(ours.buffers["running_mean"], theirs.running_mean.numpy(), rtol=1e-12)
        np.testing.assert_allclose(ours.buffers["running_var"], theirs.running_var.numpy(), rtol=1e-12)
    model.eval()
    theirs.eval()
    x = rng.standard_normal(shape)
    np.testing.assert_allclose(model.forward(x), theirs(torch.from_numpy(x)).detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(model.state, [*theirs.running_mean.numpy(), *theirs.running_var.numpy()], rtol=1e-12)


def test_with_a_statistics_row_forward_writes_it_and_apply_stats_updates_once():
    """DataParallel's path: each micro-batch writes its mean and unbiased variance to the row, the running
    statistics move only in apply_stats (once per step). With one micro-batch that is the same update, bit for
    bit, as the standalone path's."""
    x = np.random.default_rng(3).standard_normal((5, 2, 3, 3)).astype(np.float32) * 2 + 1
    standalone = Sequential(Conv2d(2, 2, 1), BatchNorm2d(2)).materialize(np, "float32", seed=1)
    standalone.forward(x)
    model = Sequential(Conv2d(2, 2, 1), BatchNorm2d(2)).materialize(np, "float32", seed=1)
    before = model.state.copy()
    row = np.zeros(model.stat_size)
    model.begin_batch(step=0, sample_ids=np.arange(5), stat_row=row)
    y = model.forward(x)
    np.testing.assert_array_equal(model.state, before)  # not yet
    conv = model.module.layers[0]  # 1 x 1: a matrix product per pixel
    h = (np.einsum("oc,nchw->onhw", conv.params["W"][:, :, 0, 0], x) + conv.params["b"][:, None, None, None])
    h = h.reshape(2, -1).astype(np.float64)
    np.testing.assert_allclose(row, np.concatenate([h.mean(axis=1), h.var(axis=1, ddof=1)]), rtol=1e-5)
    model.apply_stats(row)
    np.testing.assert_array_equal(model.state, standalone.state)
    np.testing.assert_array_equal(y, standalone.forward(x))  # train mode: batch statistics, the same output
    assert not np.array_equal(model.state, before)


def test_running_statistics_average_the_micro_batches_rows():
    """Two micro-batches' rows averaged, as DataParallel will: the running mean moves to the mean of their
    means; the running variance to the mean of their unbiased variances (not the variance of both)."""
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((6, 1)) + 2, rng.standard_normal((6, 1)) - 2
    model = BatchNorm1d(1, momentum=1.0).materialize(np, "float64")
    rows = []
    for x in (a, b):
        rows.append(np.zeros(2))
        model.begin_batch(stat_row=rows[-1])
        model.forward(x)
    model.apply_stats((rows[0] + rows[1]) / 2)
    assert model.state[0] == pytest.approx((a.mean() + b.mean()) / 2)
    assert model.state[1] == pytest.approx((a.var(ddof=1) + b.var(ddof=1)) / 2)


def test_batch_norm_refuses_what_it_cannot_normalise():
    with pytest.raises(ValueError, match="more than one value per channel"):
        BatchNorm1d(3).materialize(np).forward(np.ones((1, 3), np.float32))
    assert BatchNorm1d(3).materialize(np).eval().forward(np.ones((1, 3), np.float32)).shape == (1, 3)
    with pytest.raises(ValueError, match="takes 3 channels, got 4"):
        BatchNorm2d(3).materialize(np).forward(np.ones((2, 4, 2, 2), np.float32))
    with pytest.raises(ValueError, match=r"takes \(N, C\) arrays"):
        BatchNorm1d(3).materialize(np).forward(np.ones((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match="momentum in"):
        BatchNorm2d(3, momentum=0)
    assert repr(BatchNorm2d(4, momentum=0.01)) == "BatchNorm2d(4, momentum=0.01)"


# -- SyncBatchNorm across ranks ------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.skipif(RANKS < 2, reason="needs mpiexec -n 2 or more")
def test_sync_batch_norm_is_batch_norm_over_every_ranks_micro_batch():
    """Each rank holds its micro-batch of one global batch: SyncBatchNorm's output and input gradient on each
    are BatchNorm2d's on the whole batch (the same bits on every rank), its gamma and beta gradients add up
    over the ranks to the whole batch's, and its running statistics are the whole batch's."""
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(5)
    b = 3
    x = rng.standard_normal((k * b, 2, 4, 5)) * 2 + 1  # every rank draws the whole batch, keeps its share
    dy = rng.standard_normal(x.shape)
    whole = BatchNorm2d(2).materialize(np, "float64")
    y_whole = whole.forward(x).copy()
    dx_whole = whole.module.backward(dy.copy()).copy()
    mine = slice(r * b, (r + 1) * b)
    sync = SyncBatchNorm(2).materialize(np, "float64")
    sync.ctx.comm = comm
    y = sync.forward(x[mine])
    np.testing.assert_allclose(y, y_whole[mine], rtol=1e-12, atol=1e-12)
    dx = sync.module.backward(dy[mine].copy())
    np.testing.assert_allclose(dx, dx_whole[mine], rtol=1e-10, atol=1e-12)
    grads = np.array(sync.flat.grads)
    summed = np.zeros_like(grads)
    from mpi4py import MPI

    comm.Allreduce(grads, summed, op=MPI.SUM)
    np.testing.assert_allclose(summed, whole.flat.grads, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sync.state, whole.state, rtol=1e-12)
    every = comm.allgather(np.concatenate([sync.state, dx.reshape(-1)[:4]]))
    assert all(np.array_equal(every[0][:4], e[:4]) for e in every)  # the statistics: the same bits everywhere
    # a negative control: plain BatchNorm2d on this rank's share alone normalises by other statistics
    alone = BatchNorm2d(2).materialize(np, "float64")
    assert not np.allclose(alone.forward(x[mine]), y_whole[mine], rtol=1e-3)
