"""The model contract of DataParallel (mpisgd.parallel.protocols.ReplicaModel), with a small fake model:
leaves reported out of order (buckets start only when all their leaves have), non-trained state
(broadcast, compared, part of the layout), per-micro-batch statistics averaged over the global batch
(float: one all-reduce; reproducible: the same bits at any k), the step and sample ids before each
forward, train mode, and the loss's target count. Under mpiexec at k = 2, 3 (each test computes k = 1
in-process as its reference); the serial tests run at k = 1."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import world

from mpisgd.comm import create_reducer
from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, synthetic
from mpisgd.nn import SoftmaxCrossEntropy, mlp
from mpisgd.optim import SGD
from mpisgd.parallel import DataParallel, ReplicaError
from mpisgd.parallel.buckets import BucketSchedule
from mpisgd.parallel.protocols import ReplicaModel

B_OVER_B, B_LOCAL = 6, 8  # micro-batches per step over all ranks (k = 1, 2, 3 divide it), samples in each


class Fake:
    """An MLP offering the whole contract. ``scramble``: backward reports its leaves with parameters in
    another order than reverse (the middle one first, the last one last), and each leaf's gradient holds
    NaN until it is reported, as if computed late. ``stat_size`` 2: each micro-batch's row is the mean
    of its inputs and of their squares; ``apply_stats`` moves ``state`` towards the mean row (BatchNorm's
    running statistics, in miniature)."""

    def __init__(self, dtype: str = "float64", seed: int = 0, scramble: bool = False, stats: bool = False,
                 state_size: int | None = None) -> None:
        self.inner = mlp((16, 8)).materialize(np, dtype, seed=seed)
        self.flat = self.inner.flat
        self.scramble = scramble
        self.stat_size = 2 if stats else 0
        size = (2 if stats else 0) if state_size is None else state_size
        self.state = np.zeros(size, dtype) if size else None
        self.training = True
        self.begun: list[tuple[int, np.ndarray]] = []  # (step, sample ids) of each begin_batch
        self.applied: list[np.ndarray] = []
        self.reported: list[int] = []  # this backward's reports so far
        self._row: np.ndarray | None = None

    def forward(self, x):
        if self.stat_size:
            xs = x.reshape(len(x), -1).astype(np.float64)
            self._row[:] = [xs.mean(), (xs * xs).mean()]
        return self.inner.forward(x)

    def backward(self, dy, on_layer_done=None) -> None:
        self.reported = []
        if not (self.scramble and on_layer_done is not None):
            self.inner.backward(dy, on_layer_done)
            return
        self.inner.backward(dy)  # every gradient computed; reported below, one by one
        ranges = self.inner.layer_param_ranges()
        leaves = [i for i, (a, _) in enumerate(ranges) if a >= 0]  # flat order: the three Linear layers
        order = [leaves[1], leaves[0], *leaves[2:]]  # the middle, the first, the last (first in reverse) last
        grads = self.flat.grads
        kept = {i: grads[ranges[i][0]:ranges[i][1]].copy() for i in order}
        for i in order:
            grads[ranges[i][0]:ranges[i][1]] = np.nan  # not final yet
        for i in order:
            grads[ranges[i][0]:ranges[i][1]] = kept[i]
            self.reported.append(i)
            on_layer_done(i)

    def set_accumulate(self, on: bool) -> None:
        self.inner.set_accumulate(on)

    def move_grads(self, buf) -> None:
        self.inner.move_grads(buf)
        self.flat = self.inner.flat

    def layer_param_ranges(self) -> list[tuple[int, int]]:
        return self.inner.layer_param_ranges()

    def train(self, mode: bool = True) -> Fake:
        self.training = mode
        return self

    def eval(self) -> Fake:
        return self.train(False)

    def begin_batch(self, step: int, sample_ids, stat_row: np.ndarray) -> None:
        self.begun.append((step, np.asarray(sample_ids).copy()))
        self._row = stat_row

    def apply_stats(self, mean_row: np.ndarray) -> None:
        self.applied.append(mean_row.copy())
        if self.state is not None:
            self.state *= 0.9
            self.state += 0.1 * mean_row.astype(self.state.dtype)

    def __repr__(self) -> str:
        return f"Fake({self.inner!r})"


def train(comm, model, steps: int, *, reproducible: bool = False, bucket_mb: float = 25.0, shard: bool = False,
          ids: bool = True, loss=None, lr: float = 0.05, on_nan: str = "stop",
          weight_decay: float = 1e-3) -> DataParallel:
    """``steps`` steps of B = 6 * 8 samples over ``comm`` (m = 6 / k micro-batches per rank), each
    micro-batch with its samples' indices in the data set (``ids``) or without."""
    k, rank = comm.Get_size(), comm.Get_rank()
    m = B_OVER_B // k
    data = synthetic(480, seed=0)
    opt = SGD(model.flat, momentum=0.9, weight_decay=weight_decay, level1=not reproducible)
    dp = DataParallel(model, opt, comm, reducer=create_reducer("mpi", comm), bucket_cap_mb=bucket_mb,
                      shard_optimizer=shard, reproducible=reproducible, loss=loss, on_nan=on_nan)
    loader = BatchLoader(data, np, model.flat.dtype)
    batches = GlobalBatches(len(data), B_OVER_B * B_LOCAL, rank, k, m)
    for step in range(steps):
        perm = epoch_permutation(len(data), 0, step // batches.steps_per_epoch)
        micro = []
        for i in range(m):
            idx = batches.indices(perm, step % batches.steps_per_epoch, i)
            x, y = loader.batch(idx, slot=i)
            micro.append((x, y, idx) if ids else (x, y))
        dp.train_step(micro, lr=lr)
    return dp


def finish(dp: DataParallel) -> np.ndarray:
    params = dp.flat.params.copy()
    dp.close()
    return params


def skip_unless_k_divides() -> None:
    if B_OVER_B % world().Get_size():
        pytest.skip(f"k={world().Get_size()} does not divide B/b={B_OVER_B}")


class Basic:
    """A model offering only the basic contract (forward, backward, accumulate, move_grads, ranges), as
    models written before modes and state did."""

    def __init__(self) -> None:
        self.inner = mlp((8,)).materialize(np, "float64")
        self.flat = self.inner.flat

    def forward(self, x):
        return self.inner.forward(x)

    def backward(self, dy, on_layer_done=None) -> None:
        self.inner.backward(dy, on_layer_done)

    def set_accumulate(self, on: bool) -> None:
        self.inner.set_accumulate(on)

    def move_grads(self, buf) -> None:
        self.inner.move_grads(buf)

    def layer_param_ranges(self):
        return self.inner.layer_param_ranges()


def test_the_fake_and_the_stock_models_offer_the_contract_and_a_basic_model_gets_its_defaults():
    from mpisgd.parallel.replica import WithoutState, as_replica

    fake, stock, basic = Fake(), mlp((8,)).materialize(np, "float64"), Basic()
    assert isinstance(fake, ReplicaModel) and as_replica(fake) is fake
    assert isinstance(stock, ReplicaModel) and as_replica(stock) is stock
    wrapped = as_replica(basic)
    assert not isinstance(basic, ReplicaModel)
    assert isinstance(wrapped, WithoutState) and wrapped.state is None and wrapped.stat_size == 0
    assert wrapped.flat is basic.flat and wrapped.eval() is wrapped


# -- leaves reported out of order --------------------------------------------------------------------
def record_early_starts(monkeypatch, model: Fake) -> list:
    """Patch the schedule to note every bucket that starts before all its leaves have reported."""
    early = []
    start = BucketSchedule.start

    def recording(self, bucket):
        if not set(bucket.leaves) <= set(model.reported):
            early.append((bucket.leaves, list(model.reported)))
        start(self, bucket)

    monkeypatch.setattr(BucketSchedule, "start", recording)
    return early


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("reproducible", [False, True])
@pytest.mark.parametrize("bucket_mb", [25.0, 0.0015])  # one bucket of the three leaves; two: the last two, the first
def test_buckets_wait_for_every_leaf_whatever_the_order(monkeypatch, bucket_mb, reproducible):
    """Each bucket starts only once all its leaves have reported (checked at its start), and the run ends
    with the bits of the same model reporting in reverse order (reproducible: of one rank)."""
    skip_unless_k_divides()
    comm = world()
    scrambled = Fake(scramble=True)
    early = record_early_starts(monkeypatch, scrambled)
    dp = train(comm, scrambled, 4, bucket_mb=bucket_mb, reproducible=reproducible)
    buckets = [b.leaves for b in dp.buckets]
    ours = finish(dp)
    monkeypatch.undo()
    in_order = finish(train(comm, Fake(), 4, bucket_mb=bucket_mb, reproducible=reproducible))
    first, middle, last = [i for i, (a, _) in enumerate(scrambled.layer_param_ranges()) if a >= 0]
    assert buckets == ([(first, middle, last)] if bucket_mb > 1 else [(middle, last), (first,)])
    assert early == [] and np.array_equal(ours, in_order)
    if reproducible:
        from mpi4py import MPI

        assert np.array_equal(ours, finish(train(MPI.COMM_SELF, Fake(), 4, reproducible=True)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bucket_mb", [25.0, 0.0015])
def test_starting_a_bucket_at_its_first_report_is_caught(monkeypatch, bucket_mb):
    """Negative control: a schedule that starts a bucket when any one of its leaves has reported (what
    starting at the bucket's lowest leaf amounts to when reports come out of order) is seen by the check
    above (whether MPI then reads the NaN of a leaf not yet final depends on its timing: on_nan skip)."""
    skip_unless_k_divides()
    comm = world()
    armed = BucketSchedule.armed

    def any_report(self):
        armed(self)

        def hook(leaf: int) -> None:  # the rule for leaves in reverse order: start at the first report
            bucket = self._of_leaf.get(leaf)
            if bucket is not None and bucket.handle is None:
                self.start(bucket)
        return hook

    scrambled = Fake(scramble=True)
    early = record_early_starts(monkeypatch, scrambled)
    monkeypatch.setattr(BucketSchedule, "armed", any_report)
    finish(train(comm, scrambled, 1, bucket_mb=bucket_mb, on_nan="skip"))
    middle = [i for i, (a, _) in enumerate(scrambled.layer_param_ranges()) if a >= 0][1]
    assert early and early[0][1] == [middle]  # the first bucket started after the middle leaf alone


# -- the model's state and statistics -----------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_model_state_is_broadcast_compared_and_part_of_the_layout():
    comm = world()
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    model = Fake(stats=True)
    model.state[:] = rank + 1.0
    dp = DataParallel(model, SGD(model.flat), comm)
    after_start = model.state.copy()
    if rank == last:
        model.state[0] += 1.0  # one replica's running statistics drift
    with pytest.raises(ReplicaError, match=rf"rank\(s\) \[{last}\]"):
        dp.check_replicas()
    dp.close()
    odd = Fake(stats=True, state_size=3 if rank == last else 2)
    with pytest.raises(ReplicaError, match=rf"state.* differs on rank\(s\) \[{last}\] .*: state size: rank {last} "
                                           r"has 3 where rank 0 has 2"):
        DataParallel(odd, SGD(odd.flat), comm)
    assert np.array_equal(after_start, [1.0, 1.0])  # rank 0's


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("reproducible", [False, True])
def test_statistics_are_the_global_batch_mean_on_every_rank(reproducible):
    """Every step, every rank applies the mean of the rows of all k*m micro-batches: the same bits on
    every rank; reproducible, one rank's bits (the rows added in global micro-batch order); float, one
    rank's to rounding. The step and each micro-batch's sample ids reach begin_batch before its forward."""
    skip_unless_k_divides()
    from mpi4py import MPI

    comm = world()
    k, rank, m = comm.Get_size(), comm.Get_rank(), B_OVER_B // comm.Get_size()
    ours = Fake(stats=True)
    params = finish(train(comm, ours, 3, reproducible=reproducible))
    ref = Fake(stats=True)
    ref_params = finish(train(MPI.COMM_SELF, ref, 3, reproducible=reproducible))
    every = comm.allgather([row.tobytes() for row in ours.applied])
    assert len(ours.applied) == 3 and all(rows == every[0] for rows in every)
    assert comm.allgather(ours.state.tobytes()) == [ours.state.tobytes()] * k
    if reproducible:
        assert all(np.array_equal(a, b) for a, b in zip(ours.applied, ref.applied))
        assert np.array_equal(params, ref_params)
    else:
        np.testing.assert_allclose(ours.applied, ref.applied, rtol=1e-12)
    begun_steps = [s for s, _ in ours.begun if s == 1]  # a step is computed once (reproducible: step 0 twice)
    assert len(begun_steps) == m
    perm = epoch_permutation(480, 0, 0)
    batches = GlobalBatches(480, B_OVER_B * B_LOCAL, rank, k, m)
    got = [ids for s, ids in ours.begun if s == 1]
    assert all(np.array_equal(ids, batches.indices(perm, 1, i)) for i, ids in enumerate(got))


@pytest.mark.mpi(min_size=2)
def test_without_ids_a_sample_is_its_position_in_the_global_batch():
    skip_unless_k_divides()
    comm = world()
    rank, m = comm.Get_rank(), B_OVER_B // comm.Get_size()
    model = Fake()
    finish(train(comm, model, 1, ids=False))
    got = [ids for _, ids in model.begun]
    want = [rank * m * B_LOCAL + i * B_LOCAL + np.arange(B_LOCAL) for i in range(m)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want)) and len(got) == m


def test_train_step_trains_and_the_model_without_statistics_is_not_asked():
    from mpi4py import MPI

    model = Fake()
    model.eval()
    dp = train(MPI.COMM_SELF, model, 1)
    dp.close()
    assert model.training and model.applied == []  # stat_size 0: no apply_stats


# -- the loss's target count ---------------------------------------------------------------------------
class Twice(SoftmaxCrossEntropy):
    """Counts every label twice: the loss scale halves."""

    def count(self, labels) -> int:
        return 2 * int(labels.size)


def test_the_loss_scale_is_one_over_k_times_the_targets():
    """Twice the targets halves every gradient (a power of two: exactly), so twice the rate gives the
    same step, bitwise (momentum is linear in the gradient; no weight decay); the default rate does not."""
    from mpi4py import MPI

    plain = finish(train(MPI.COMM_SELF, Fake(), 2, lr=0.05, weight_decay=0.0))
    doubled = finish(train(MPI.COMM_SELF, Fake(), 2, lr=0.1, loss=Twice(), weight_decay=0.0))
    halved = finish(train(MPI.COMM_SELF, Fake(), 2, lr=0.05, loss=Twice(), weight_decay=0.0))
    assert np.array_equal(plain, doubled) and not np.allclose(plain, halved)


@pytest.mark.mpi(min_size=2)
def test_the_check_in_compares_the_targets():
    skip_unless_k_divides()
    comm = world()
    last = comm.Get_size() - 1
    loss = Twice() if comm.Get_rank() == last else SoftmaxCrossEntropy()
    model = Fake()
    with pytest.raises(ReplicaError, match=rf"rank\(s\) \[{last}\] passed other batches: \(micro-batches, targets\)"):
        train(comm, model, 1, loss=loss)
