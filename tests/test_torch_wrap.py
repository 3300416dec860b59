"""mpisgd.torch.wrap, the DDP-style wrapper: its views, half-precision gradients, zero_grad and no_sync at one
rank; under mpiexec (k = 2, 3) the same losses as DistributedDataParallel over gloo, rank 0's start and
buffers, unused parameters, bfloat16 gradients, accumulation, the noise scale and the planner's metrics."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'mpisgd[torch]')")

from mpi4py import MPI  # noqa: E402
from torch_factories import gloo  # noqa: E402

from mpisgd.torch import wrap  # noqa: E402
from mpisgd.torch.views import as_array  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def net(dtype=torch.float64, seed=0, bn=True):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(12, 32), *([torch.nn.BatchNorm1d(32)] if bn else []), torch.nn.ReLU(),
              torch.nn.Linear(32, 5)]
    return torch.nn.Sequential(*layers).to(dtype)


def data(n=480, dtype=torch.float64):
    """Inputs and labels a model can learn (a linear rule), so that the gradient is not all noise."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 12, generator=g, dtype=torch.float64)
    return x.to(dtype), (x @ torch.randn(12, 5, generator=g, dtype=torch.float64)).argmax(dim=1)


def train(model, comm, steps=8, b=12, accum=1, lr=0.1, zero_to_none=True, dtype=torch.float64):
    """A standard DDP loop (this rank's share of each global batch); returns this rank's losses."""
    x_all, y_all = data(dtype=dtype)
    k, r = comm.Get_size(), comm.Get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=zero_to_none)
        for i in range(accum):
            lo = ((step * accum + i) * k + r) * b
            x, y = x_all[lo:lo + b], y_all[lo:lo + b]
            sync = contextlib.nullcontext() if i == accum - 1 else model.no_sync()
            with sync:
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum
                loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses


def ddp_run(comm, make, **kw):
    gloo(comm)
    model = torch.nn.parallel.DistributedDataParallel(make())
    losses = train(model, comm, **kw)
    return losses, {k: v.clone() for k, v in model.module.state_dict().items()}


# -- one rank --------------------------------------------------------------------------------------
class _Ticks:
    """A clock that moves one second per reading (the wrapper's time.perf_counter)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class _Overlapping:
    """A reducer whose all-reduces overlap: none completes before the end of backward waits for it (5 s each)."""

    def __init__(self, clock: _Ticks) -> None:
        self.clock, self.starts, self.ends = clock, [], []

    def start(self, buf):
        self.starts.append(self.clock.now)  # the reading the wrapper just took as the bucket's start
        reducer = self

        class Handle:
            def test(self) -> bool:
                return False

            def wait(self) -> None:
                reducer.clock.now += 5.0
                reducer.ends.append(reducer.clock.now)

        return Handle()

    def describe(self) -> str:
        return "overlapping"

    def close(self) -> None:
        pass


def test_the_wrappers_time_in_flight_is_the_union_of_its_buckets(monkeypatch):
    """Buckets in flight together count once in comm_total_s (the busbw of its metrics): from the first start
    to the last completion the wrapper observes, where their own times summed count the overlap again."""
    from mpisgd.torch import distributed

    clock = _Ticks()
    monkeypatch.setattr(distributed.time, "perf_counter", clock)
    reducer = _Overlapping(clock)
    model = wrap(net(bn=False), MPI.COMM_SELF, reducer=reducer, bucket_cap_mb=0.001)  # 2 buckets of 4.6 KB
    x, y = data(12)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    starts, observed = reducer.starts, [e + 1.0 for e in reducer.ends]  # completion: the reading after a wait
    assert len(starts) == len(model.buckets) >= 2
    union, summed = observed[-1] - starts[0], sum(e - s for s, e in zip(starts, observed, strict=True))
    assert model.times.comm_total_s == union < summed
def test_parameters_gradients_and_buffers_are_views_of_flat_buffers():
    model = wrap(net(), MPI.COMM_SELF)
    (g,) = model.groups
    for p in model.module.parameters():
        assert np.shares_memory(p.detach().numpy(), g.flat) and np.shares_memory(p.grad.numpy(), g.grads)
    for _, b in model.module.named_buffers():
        if b.dtype.is_floating_point:
            assert np.shares_memory(b.numpy(), model.states[0])
    train(model, MPI.COMM_SELF, steps=2)
    assert all(np.shares_memory(p.grad.numpy(), g.grads) for p in model.module.parameters())  # still
    model.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_are_averaged(dtype):
    """bfloat16 has no NumPy dtype (DLPack refuses it): its bits live in uint16 and its average goes through
    float32. At one rank the average is the gradient itself."""
    model = wrap(net(dtype, bn=False), MPI.COMM_SELF)
    ref = net(dtype, bn=False)
    x, y = data(24, dtype)
    torch.nn.functional.cross_entropy(model(x).float(), y).backward()
    torch.nn.functional.cross_entropy(ref(x).float(), y).backward()
    for p, q in zip(model.module.parameters(), ref.parameters(), strict=True):
        assert p.grad.dtype == dtype and torch.equal(p.grad, q.grad)
    assert model.groups[0].grads.dtype == (np.uint16 if dtype == torch.bfloat16 else np.float16)
    model.close()


def test_zero_grad_no_sync_and_unused_parameters_at_one_rank():
    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "spare": torch.nn.Linear(3, 2)})

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m["used"](x)

    model = wrap(Net().double(), MPI.COMM_SELF)
    x = torch.ones(4, 3, dtype=torch.float64)
    model(x).sum().backward()
    once = model.module.m["used"].weight.grad.clone()
    assert torch.equal(model.module.m["spare"].weight.grad, torch.zeros(2, 3, dtype=torch.float64))  # zero, not None
    with model.no_sync():
        model(x).sum().backward()
    model(x).sum().backward()
    assert torch.equal(model.module.m["used"].weight.grad, 3 * once)  # no_sync and the synchronised pass add up
    for p in model.parameters():
        p.grad = None  # zero_grad(set_to_none=True)
    model(x).sum().backward()
    assert torch.equal(model.module.m["used"].weight.grad, once)
    model.module.m["used"].weight.grad = torch.full((2, 3), 0.5, dtype=torch.float64)  # the caller's own tensor
    model(x).sum().backward()
    assert torch.equal(model.module.m["used"].weight.grad, once + 0.5)
    assert np.shares_memory(model.module.m["used"].weight.grad.numpy(), model.groups[0].grads)
    model.close()


def test_metrics_records_are_what_the_planner_reads(tmp_path):
    from mpisgd.app.planner.workload import from_metrics

    path = tmp_path / "m.jsonl"
    model = wrap(net(), MPI.COMM_SELF, metrics_file=str(path), metrics_every=3)
    x_all, y_all = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(7):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x_all[step * 8:step * 8 + 8]), y_all[step * 8:step * 8 + 8])
        loss.backward()
        model.log_loss(loss)
        opt.step()
    model.close()  # the last, partial window too
    prof, _ = from_metrics(str(path), noise_scale=100.0)  # k = 1: no noise scale of its own
    assert (prof.k, prof.b, prof.m, prof.B, prof.grad_nbytes) == (1, 8, 1, 8, model.grad_nbytes)
    assert prof.step_ms > 0 and prof.forward_ms > 0 and prof.samples == 7 * 8


# -- k ranks ---------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_losses_match_distributed_data_parallel(dtype, tol):
    """The same loop, model, data and seed through DDP (gloo) and through the wrapper: the same per-step
    losses and parameters, and BatchNorm's running statistics those of DDP's rank 0 (which DDP broadcasts at
    the next forward; the wrapper at the end of each step), to float tolerance."""
    comm = MPI.COMM_WORLD
    want, want_state = ddp_run(comm, lambda: net(dtype), dtype=dtype)
    rank0 = comm.bcast(want_state, root=0)
    model = wrap(net(dtype), comm, bucket_cap_mb=0.001)  # several buckets
    got = train(model, comm, dtype=dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    for name, value in model.module.state_dict().items():
        ref = rank0[name] if "running" in name or "batches" in name else want_state[name]
        torch.testing.assert_close(value.double(), ref.double(), rtol=tol * 10, atol=tol * 10)
    model.close()


@pytest.mark.mpi(min_size=2)
def test_accumulation_with_no_sync_matches_ddp():
    comm = MPI.COMM_WORLD
    want, _ = ddp_run(comm, net, accum=3, steps=4)
    model = wrap(net(), comm)
    np.testing.assert_allclose(train(model, comm, accum=3, steps=4), want, rtol=1e-13)
    model.close()


@pytest.mark.mpi(min_size=2)
def test_start_from_rank_0_and_buffers_stay_identical():
    comm = MPI.COMM_WORLD
    model = wrap(net(seed=comm.Get_rank()), comm)  # every rank built other values
    every = comm.allgather({k: v.clone() for k, v in model.module.state_dict().items()})
    for other in every[1:]:
        for name, value in other.items():
            assert torch.equal(value, every[0][name]), name
    train(model, comm, steps=3)
    every = comm.allgather({k: v.clone() for k, v in model.module.state_dict().items()})
    for other in every[1:]:  # parameters, running statistics, num_batches_tracked
        for name, value in other.items():
            assert torch.equal(value, every[0][name]), name
    model.close()


@pytest.mark.mpi(min_size=2)
def test_parameters_unused_on_some_ranks_average_with_zeros():
    comm = MPI.COMM_WORLD
    k, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.arms = torch.nn.ModuleList(torch.nn.Linear(3, 2) for _ in range(3))

        def forward(self, x, arm):
            return self.arms[arm](x)

    model = wrap(Branches().double(), comm)
    x = torch.ones(2, 3, dtype=torch.float64)
    model(x, r % 2).sum().backward()  # arm 2 unused everywhere, arm 1 on even ranks
    full = torch.full((2, 3), 2.0, dtype=torch.float64)  # one rank's gradient of the sum: 2 samples of ones
    users = [sum(1 for q in range(k) if q % 2 == arm) for arm in range(3)]
    for arm in range(3):
        torch.testing.assert_close(model.module.arms[arm].weight.grad, full * users[arm] / k)
    model.close()


@pytest.mark.mpi(min_size=2)
def test_bfloat16_gradients_are_averaged_over_ranks():
    comm = MPI.COMM_WORLD
    k, r = comm.Get_size(), comm.Get_rank()
    model = wrap(net(torch.bfloat16, bn=False), comm)
    x, y = data(8 * k, torch.bfloat16)
    torch.nn.functional.cross_entropy(model(x[r * 8:r * 8 + 8]).float(), y[r * 8:r * 8 + 8]).backward()
    ref = net(torch.bfloat16, bn=False)
    mean = None
    for q in range(k):  # every rank's gradient, averaged in float32, rounded to bfloat16 once
        ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(x[q * 8:q * 8 + 8]).float(), y[q * 8:q * 8 + 8]).backward()
        g = [p.grad.float() / k for p in ref.parameters()]
        mean = g if mean is None else [a + b for a, b in zip(mean, g, strict=True)]
    for p, want in zip(model.module.parameters(), mean, strict=True):
        assert p.grad.dtype == torch.bfloat16
        torch.testing.assert_close(p.grad.float(), want.bfloat16().float(), rtol=1e-2, atol=1e-3)
    model.close()


@pytest.mark.mpi(min_size=2)
def test_noise_scale_and_metrics_at_k_ranks(tmp_path_factory):
    comm = MPI.COMM_WORLD
    from mpisgd.app.planner.workload import from_metrics

    path = comm.bcast(str(tmp_path_factory.mktemp("wrap") / "m.jsonl") if comm.Get_rank() == 0 else None)
    model = wrap(net(bn=False), comm, metrics_file=path, metrics_every=8, noise_every=1)
    x_all, y_all = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    k, r = comm.Get_size(), comm.Get_rank()
    for step in range(8):
        opt.zero_grad()
        lo = (step * k + r) * 8
        loss = torch.nn.functional.cross_entropy(model(x_all[lo:lo + 8]), y_all[lo:lo + 8])
        loss.backward()
        model.log_loss(loss)
        opt.step()
        if step == 3:
            est = model.noise_scale()  # collective
            assert est is not None and est.b_small == 8 and est.b_big == 8 * k and np.isfinite(est.grad_var)
    model.close()
    prof = from_metrics(path)[0] if comm.Get_rank() == 0 else None  # its own noise scale this time
    prof = comm.bcast(prof, root=0)
    assert prof.k == k and prof.B == 8 * k and prof.noise_scale > 0 and prof.overlap


def test_as_array_keeps_bfloat16_bits():
    t = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16)
    a = as_array(t)
    assert a.dtype == np.uint16 and np.shares_memory(a, t.view(torch.int16).numpy())


@pytest.mark.mpi(min_size=2)
def test_a_rank_at_another_step_is_named_on_every_rank():
    from mpisgd.agreement import ReplicaError

    comm = MPI.COMM_WORLD
    model = wrap(net(bn=False), comm)
    x, y = data(8)
    if comm.Get_rank() == 1:
        model.step = 5  # as if it had run five more synchronised steps
    with pytest.raises(ReplicaError, match=r"rank\(s\) \[1\] are not at the check-in of step"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    model.step = 0
    model.close()


@pytest.mark.mpi(min_size=2)
def test_a_rank_with_another_model_is_refused_naming_the_tensor_that_differs():
    """The message names the first tensor that differs and both ranks' versions (it showed two digests)."""
    from mpisgd.agreement import ReplicaError

    comm = MPI.COMM_WORLD
    odd = comm.Get_size() - 1
    module = net(dtype=torch.float32 if comm.Get_rank() == odd else torch.float64, bn=False)
    first = next(iter(module.state_dict()))
    with pytest.raises(ReplicaError, match=rf"differs on rank\(s\) \[{odd}\] from the other ranks: tensor 0: "
                                           rf"rank {odd} has \('{first}', .*'torch.float32'.* where rank 0 has "
                                           r".*'torch.float64'"):
        wrap(module, comm)


@pytest.mark.mpi
def test_a_module_is_wrapped_once_and_a_closed_wrapper_says_so():
    """Two wrappers over the same parameters (the module twice, or a DistributedModel wrapped) would average
    each gradient twice: refused on every rank before any collective. A closed wrapper's forward names the
    close (it was MPI's 'Invalid communicator' error stack); after close the module can be wrapped again."""
    comm = MPI.COMM_WORLD
    module = net(bn=False)
    model = wrap(module, comm)
    for again in (module, model):
        with pytest.raises(ValueError, match="the module's parameters are wrapped already"):
            wrap(again, comm)
    x, y = data(8)
    model.close()
    with pytest.raises(RuntimeError, match=r"this DistributedModel is closed \(close\(\) frees its communicator\)"):
        model(x)
    model = wrap(module, comm)  # closed: its parameters are free again
    torch.nn.functional.cross_entropy(model(x), y).backward()
    model.close()
