"""A PyTorch model under mpisgd.DataParallel (the CLI's path), at k = 2, 3: the same losses as
DistributedDataParallel over gloo with the same model, data and seed; overlap on a chain of layers gives
the bits of the unoverlapped step, on a chain and on a ResNet, whose shortcut's gradients arrive out of the
flat buffer's order (a bucket starts when its last gradient arrives, mpisgd.parallel.buckets)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'mpisgd[torch]')")

from mpi4py import MPI  # noqa: E402
from torch_factories import TinyResNet, gloo  # noqa: E402

from mpisgd.optim import SGD  # noqa: E402
from mpisgd.parallel import DataParallel  # noqa: E402
from mpisgd.torch import from_torch  # noqa: E402

LR, STEPS, B = 0.05, 6, 8


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def chain():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def resnet():
    torch.manual_seed(0)
    return TinyResNet(p=0.0)  # BatchNorm, a residual branch; no dropout (DDP's would draw other masks)


def batches(comm, dtype):
    """This rank's share of each global batch: (x, y) per step, the same global batches at any k."""
    rng = np.random.default_rng(5)
    k, r = comm.Get_size(), comm.Get_rank()
    x = rng.standard_normal((STEPS * k * B, 1, 8, 8)).astype(dtype)
    y = (x.reshape(len(x), -1)[:, :10] * 3).argmax(axis=1)
    return [(x[(s * k + r) * B:(s * k + r + 1) * B], y[(s * k + r) * B:(s * k + r + 1) * B]) for s in range(STEPS)]


def ddp_losses(comm, make, dtype):
    gloo(comm)
    model = torch.nn.parallel.DistributedDataParallel(make().to(getattr(torch, dtype)))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in batches(comm, dtype):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]).double().numpy()


def mpisgd_losses(comm, make, dtype, overlap):
    model = from_torch(make(), np, dtype)
    dp = DataParallel(model, SGD(model.flat, momentum=0.9), comm, overlap=overlap, bucket_cap_mb=0.001)
    losses = [float(dp.train_step([(x, y)], LR)) for x, y in batches(comm, dtype)]
    params = model.flat.params.astype(np.float64)
    dp.close()
    return losses, params


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make", [chain, resnet], ids=["chain", "resnet"])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-11), ("float32", 1e-5)])
def test_losses_match_distributed_data_parallel(make, dtype, tol):
    comm = MPI.COMM_WORLD
    want, want_params = ddp_losses(comm, make, dtype)
    got, params = mpisgd_losses(comm, make, dtype, overlap=False)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(params, want_params, rtol=tol * 10, atol=tol * 10)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make", [chain, resnet], ids=["chain", "resnet"])
def test_overlap_gives_the_bits_of_the_unoverlapped_step(make):
    comm = MPI.COMM_WORLD
    a = mpisgd_losses(comm, make, "float32", overlap=True)
    b = mpisgd_losses(comm, make, "float32", overlap=False)
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])
