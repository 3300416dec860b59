"""Data parallelism under real MPI (run by scripts/test.sh with mpiexec -n 2 and -n 3; test_comm.py
runs it at k = 4).

Size-agnostic: the reference is the same computation on one rank (COMM_SELF)
with the global batch, computed on every rank, so any k checks the seed's
equivalence. Every collective is reached by all ranks before any assert.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import world

from mpisgd.comm import create_reducer
from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, synthetic
from mpisgd.nn import SoftmaxCrossEntropy, mlp
from mpisgd.optim import SGD
from mpisgd.optim.adam import LAMB, AdamW
from mpisgd.optim.lars import LARS
from mpisgd.optim.norms import BlockNorms
from mpisgd.parallel.data_parallel import CHECK_IN_WORDS, DataParallel, ReplicaError, verify_same

pytestmark = pytest.mark.mpi(min_size=2)
STRATEGIES = ("mpi", "ring", "auto", "shared", "deterministic")


class SummedLoss(SoftmaxCrossEntropy):
    """The classic bug as a loss: its gradient is k times too large (summed over ranks, not averaged)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def backward(self, scale=None):
        return super().backward(scale * self.k)


def train(comm, local_batch: int, steps: int, average: bool = True, rank: int | None = None,
          allreduce: str = "mpi", bucket_mb: float = 25.0, overlap: bool = True, shard: bool = False,
          shared_grads: bool = True, deterministic: bool = False, dtype: str = "float64", hidden=(16, 8),
          lr: float = 0.05, clip: float | None = None, measure: bool = False, **opt) -> DataParallel:
    """Train a float64 MLP on synthetic data for ``steps`` steps over ``comm``."""
    k = comm.Get_size()
    rank = comm.Get_rank() if rank is None else rank
    data = synthetic(512, seed=0)
    model = mlp(hidden).materialize(np, dtype, seed=0)
    kind = opt.get("optimizer", "sgd")
    if kind in ("adamw", "lamb"):
        optimizer = {"adamw": AdamW, "lamb": LAMB}[kind](model.flat, betas=opt.get("betas", (0.9, 0.999)),
                                                          weight_decay=opt.get("weight_decay", 1e-3))
    else:
        extra = {"trust_coef": opt["trust_coef"]} if "trust_coef" in opt else {}
        optimizer = {"sgd": SGD, "lars": LARS}[kind](
            model.flat, momentum=opt.get("momentum", 0.9), nesterov=opt.get("nesterov", False),
            weight_decay=opt.get("weight_decay", 1e-3), momentum_correction=opt.get("momentum_correction", False),
            **extra)
    dp = DataParallel(model, optimizer, comm, reducer=create_reducer(allreduce, comm, deterministic=deterministic),
                      loss=None if average else SummedLoss(k), bucket_cap_mb=bucket_mb, overlap=overlap,
                      shard_optimizer=shard, shared_grads=shared_grads, clip_grad_norm=clip,
                      measure_grad_norm=measure)
    loader = BatchLoader(data, np, dtype)
    batches = GlobalBatches(len(data), k * local_batch, rank, k)
    for step in range(steps):
        perm = epoch_permutation(len(data), 0, step // batches.steps_per_epoch)
        dp.train_step([loader.batch(batches.indices(perm, step % batches.steps_per_epoch, 0))], lr=lr)
    return dp


def reference(k: int, b: int, steps: int, **opt) -> np.ndarray:
    """One rank, batch k*b: what k ranks with batch b must reproduce."""
    from mpi4py import MPI

    dp = train(MPI.COMM_SELF, k * b, steps, **opt)
    params = dp.flat.params.copy()
    dp.close()
    return params


LARS_OPT = {"optimizer": "lars", "trust_coef": 0.02, "lr": 2.0}  # a rate at which the layers move as with SGD
ADAMW_OPT = {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.01}
LAMB_OPT = {"optimizer": "lamb", "lr": 0.01, "weight_decay": 0.01}


@pytest.mark.parametrize("opt", [{}, {"nesterov": True}, {"momentum": 0.0, "weight_decay": 0.0}, LARS_OPT,
                                 {**LARS_OPT, "nesterov": True, "momentum_correction": True}, ADAMW_OPT, LAMB_OPT,
                                 {**LAMB_OPT, "betas": (0.8, 0.99), "clip": 0.05}, {"clip": 0.05}])
def test_k_ranks_match_one_rank_with_k_times_the_batch(opt):
    comm = world()
    k, b, steps = comm.Get_size(), 8, 12
    dp = train(comm, b, steps, **opt)
    ours = dp.flat.params.copy()
    dp.close()
    ref = reference(k, b, steps, **opt)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-9)
    assert np.max(np.abs(ours - ref)) < 1e-10  # float64: only summation-order rounding


def test_summing_without_dividing_by_k_breaks_the_equivalence():
    """The classic bug (k times the learning rate) must be visible to the check above."""
    comm = world()
    k, b, steps = comm.Get_size(), 8, 12
    dp = train(comm, b, steps, average=False)
    ours = dp.flat.params.copy()
    dp.close()
    ref = reference(k, b, steps)
    assert not np.allclose(ours, ref, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("bucket_mb,overlap", [(25.0, True), (0.0005, True), (0.0005, False)])
def test_replicas_identical_after_every_step(bucket_mb, overlap):
    comm = world()
    k = comm.Get_size()
    dp = train(comm, 8, 0, bucket_mb=bucket_mb, overlap=overlap)
    data = synthetic(256, seed=1)
    loader = BatchLoader(data, np, "float64")
    batches = GlobalBatches(len(data), k * 8, comm.Get_rank(), k)
    perm = epoch_permutation(len(data), 1, 0)
    all_same = []
    for step in range(5):
        dp.train_step([loader.batch(batches.indices(perm, step, 0))], lr=0.1)
        sums = dp.replica_checksums()
        all_same.append(len(set(sums)) == 1)
    n_buckets = len(dp.buckets)
    dp.close()
    assert all(all_same), all_same
    if bucket_mb < 0.01:
        assert n_buckets > 1  # the small cap really split the gradient


def test_start_identical_even_from_different_seeds():
    """Rank 0's parameters are broadcast: other ranks' own initialisation is discarded."""
    comm = world()
    model = mlp((8,)).materialize(np, "float64", seed=comm.Get_rank())
    dp = DataParallel(model, SGD(model.flat), comm)
    sums = dp.replica_checksums()
    dp.close()
    assert len(set(sums)) == 1


def test_check_replicas_names_the_diverged_rank():
    comm = world()
    dp = train(comm, 8, 2)
    if comm.Get_rank() == 1:
        dp.flat.params[3] += 1.0  # silently corrupt one replica
    with pytest.raises(ReplicaError, match=r"rank\(s\) \[1\]"):
        dp.check_replicas()
    dp.close()


def test_different_models_are_refused_on_every_rank():
    comm = world()
    width = 8 if comm.Get_rank() != 1 else 9
    model = mlp((width,)).materialize(np, "float64")
    with pytest.raises(ReplicaError, match=r"rank\(s\) \[1\]"):
        DataParallel(model, SGD(model.flat), comm)


def test_verify_same_passes_on_equal_values_and_names_the_odd_rank():
    comm = world()
    odd = comm.Get_size() - 1
    verify_same(comm, "same", "a value")  # equal everywhere: returns on every rank
    with pytest.raises(ReplicaError, match=rf"a value differs on rank\(s\) \[{odd}\]"):
        verify_same(comm, "odd" if comm.Get_rank() == odd else "same", "a value")  # raised on every rank


def test_nonfinite_gradient_stops_every_rank_together():
    from mpisgd.parallel import NonFiniteError

    comm = world()
    dp = train(comm, 8, 1)
    data = synthetic(64, seed=2)
    x, y = BatchLoader(data, np, "float64").batch(np.arange(8))
    if comm.Get_rank() == comm.Get_size() - 1:
        x = x.copy()
        x[0, 0, 0, 0] = np.inf  # only one rank sees bad data; after the all-reduce all know
    with pytest.raises(NonFiniteError):
        dp.train_step([(x, y)], lr=0.1)
    dp.on_nan = "skip"
    before = dp.flat.params.copy()
    dp.train_step([(x, y)], lr=0.1)
    assert dp.skipped_steps == 1 and np.array_equal(before, dp.flat.params)
    dp.close()


def test_skipping_gives_up_after_twenty_skipped_steps_in_a_row():
    """on_nan="skip" skips isolated steps; SKIPS_IN_A_ROW of them in a row (the same parameters every time)
    end the run with NonFiniteError on every rank, and a finite step between them starts the count again."""
    from mpisgd.parallel import NonFiniteError
    from mpisgd.parallel.data_parallel import SKIPS_IN_A_ROW

    comm = world()
    dp = train(comm, 8, 1)
    dp.on_nan = "skip"
    x, y = BatchLoader(synthetic(64, seed=2), np, "float64").batch(np.arange(8))
    bad = x.copy()
    if comm.Get_rank() == comm.Get_size() - 1:
        bad[0, 0, 0, 0] = np.inf  # one rank's data: after the all-reduce every rank's gradient
    for _ in range(SKIPS_IN_A_ROW - 1):
        dp.train_step([(bad, y)], lr=0.1)
    dp.train_step([(x, y)], lr=0.1)  # finite: the count starts again
    for _ in range(SKIPS_IN_A_ROW - 1):
        dp.train_step([(bad, y)], lr=0.1)
    assert dp.skipped_steps == 2 * (SKIPS_IN_A_ROW - 1)
    last = dp.step_count
    says = rf"at {SKIPS_IN_A_ROW} steps in a row \(steps {last - SKIPS_IN_A_ROW + 1} to {last}\)"
    with pytest.raises(NonFiniteError, match=says):
        dp.train_step([(bad, y)], lr=0.1)
    dp.close()


def test_a_rank_out_of_step_fails_fast_on_every_rank():
    """A rank one step ahead is named before any gradient of the step is reduced."""
    comm = world()
    dp = train(comm, 8, 2)
    if comm.Get_rank() == comm.Get_size() - 1:
        dp.restore(dp.step_count + 1, dp.skipped_steps)  # as a rank resumed from another checkpoint would
    data = synthetic(64, seed=3)
    x, y = BatchLoader(data, np, "float64").batch(np.arange(8))
    before = dp.flat.params.copy()
    with pytest.raises(ReplicaError, match=rf"rank\(s\) \[{comm.Get_size() - 1}\] out of step"):
        dp.train_step([(x, y)], lr=0.1)
    assert np.array_equal(before, dp.flat.params)  # nothing was reduced or applied
    dp.close()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_finite_check_is_exact(dtype):
    """The cheap check (sum of |g|) overflows on huge finite values: those must still pass; NaN/Inf not."""
    comm = world()
    model = mlp((8,)).materialize(np, dtype, seed=0)
    dp = DataParallel(model, SGD(model.flat, momentum=0.9), comm)
    g = dp.flat.grads
    g[...] = np.finfo(g.dtype).max / 4  # finite, but their sum is not
    assert dp.grads_finite()
    for bad in (np.nan, np.inf, -np.inf):
        g[...] = 1.0
        g[g.size // 2] = bad
        assert not dp.grads_finite()
    dp.close()


# -- the sharded optimizer step ---------------------------------------------------------------------
@pytest.mark.parametrize("allreduce,bucket_mb,overlap,opt", [
    ("mpi", 25.0, True, {}),
    ("auto", 0.0005, True, {"nesterov": True}),
    ("auto", 0.0005, False, {"momentum_correction": True}),
    ("ring", 0.0005, True, {"momentum": 0.0}),
    ("deterministic", 25.0, True, {}),
    ("shared", 0.0005, True, {}),
    ("auto", 25.0, True, LARS_OPT),  # one bucket: the k chunks split layers
    ("auto", 0.0005, True, LARS_OPT),
    ("deterministic", 0.0005, False, {**LARS_OPT, "nesterov": True}),
    ("ring", 0.0005, True, {**LARS_OPT, "momentum": 0.0}),
    ("auto", 25.0, True, ADAMW_OPT),
    ("auto", 0.0005, True, {**ADAMW_OPT, "clip": 0.05}),
    ("auto", 25.0, True, LAMB_OPT),  # one bucket: the k chunks split layers
    ("deterministic", 0.0005, False, {**LAMB_OPT, "clip": 0.05}),
    ("ring", 0.0005, True, {**LAMB_OPT, "clip": 0.05}),
])
def test_sharded_step_matches_one_rank_and_keeps_replicas_identical(allreduce, bucket_mb, overlap, opt):
    comm = world()
    k, b, steps = comm.Get_size(), 8, 12
    dp = train(comm, b, steps, allreduce=allreduce, bucket_mb=bucket_mb, overlap=overlap, shard=True, **opt)
    sums = dp.replica_checksums()
    ours = dp.flat.params.copy()
    owned = sum(hi - lo for lo, hi in dp.update.own)
    sharded, n = dp.sharded, dp.flat.size
    dp.close()
    total = comm.allreduce(owned)
    ref = reference(k, b, steps, **opt)
    assert sharded and len(set(sums)) == 1
    assert total == n  # the ranks' chunks tile the parameters: each updated by exactly one rank
    assert np.max(np.abs(ours - ref)) < 1e-10  # float64: only summation-order rounding


@pytest.mark.parametrize("shard,bucket_mb,overlap", [(False, 25.0, True), (False, 0.0005, True),
                                                      (False, 0.0005, False), (True, 0.0005, True)])
def test_gradients_in_node_shared_memory_train_like_one_rank(shard, bucket_mb, overlap):
    """auto on one node keeps the gradients in its shared window (mpisgd.comm.shared) and reduces the
    buckets there; the result is one rank's with k times the batch, replicas stay identical, and on
    close the model gets its gradients back in private memory, values kept."""
    comm = world()
    k, b, steps = comm.Get_size(), 8, 12
    dp = train(comm, b, steps, allreduce="auto", bucket_mb=bucket_mb, overlap=overlap, shard=shard)
    arena = dp.reducer.shared
    in_arena = arena is not None and arena.offset_of(dp.flat.grads) == 0
    layer_grads_in_arena = all(arena.offset_of(g.reshape(-1)) is not None
                               for layer in dp.model.modules() for g in layer.grads.values())
    sums, n_buckets = dp.replica_checksums(), len(dp.buckets)
    ours, grads = dp.flat.params.copy(), dp.flat.grads.copy()
    owned = sum(hi - lo for lo, hi in dp.update.own) if shard else 0
    state = dp.buffer_nbytes()  # parameters, gradients, momentum and, sharded, this rank's gradient chunks
    dp.close()
    after_close = dp.flat.grads
    ref = reference(k, b, steps)
    off = train(comm, b, 1, allreduce="auto", shared_grads=False)
    off_shared = off.shared_grads
    off.close()
    assert arena.win is None and not dp.shared_grads
    assert in_arena and layer_grads_in_arena  # the layers write their gradients there, not a stale copy
    assert len(set(sums)) == 1 and np.max(np.abs(ours - ref)) < 1e-10
    assert (n_buckets > 1) == (bucket_mb < 1)  # this model fits in one 25 MiB bucket, not in 0.5 KiB ones
    np.testing.assert_array_equal(after_close, grads)  # private again, same values
    momentum = owned * dp.flat.dtype.itemsize if shard else dp.flat.nbytes  # sharded: this rank's chunks only
    ufunc_tmp = 0 if dp.optimizer.blas else momentum  # without BLAS axpby (reference BLAS) a temporary
    assert state == 2 * dp.flat.nbytes + momentum + ufunc_tmp + owned * dp.flat.dtype.itemsize
    assert not off_shared  # shared_grads=False keeps them private


@pytest.mark.parametrize("opt", [LARS_OPT, LAMB_OPT, {"clip": 0.05}])
def test_sharded_norms_without_every_ranks_pieces_differ(monkeypatch, opt):
    """The check above can fail: LARS's and LAMB's ratios, or the clipping norm, from each rank's own
    chunks of a layer, not the whole layer's (for clipping, ranks would then even clip unalike)."""
    comm = world()
    k, b, steps = comm.Get_size(), 8, 12
    every_rank = BlockNorms.squared

    def own_blocks_only(self, *quantities):
        return every_rank(BlockNorms(self.offsets, self.ranges, None, self.block_sums), *quantities)

    monkeypatch.setattr(BlockNorms, "squared", own_blocks_only)
    dp = train(comm, b, steps, shard=True, bucket_mb=0.02, hidden=(32, 16), **opt)  # chunks that split layers
    ours = dp.flat.params.copy()
    dp.close()
    monkeypatch.undo()
    assert not np.allclose(ours, reference(k, b, steps, hidden=(32, 16), **opt), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("opt", [LARS_OPT, LAMB_OPT, {"clip": 0.05}, {**LARS_OPT, "momentum_correction": True}])
def test_sharded_lars_lamb_and_clipping_give_the_replicated_steps_bits(opt):
    """The norms are block norms that no chunk cuts (mpisgd.optim.norms): with the default strategy (sums in
    rank order either way) the sharded step gives the replicated step's bits, however the chunks cut the
    layers (here at k >= 2 they do)."""
    comm = world()
    got = {shard: digest(train(comm, 8, 8, allreduce="auto", shard=shard, dtype="float32", hidden=(256, 64), **opt))
           for shard in (False, True)}
    assert got[True] == got[False]


def test_sharded_step_without_dividing_by_k_still_differs():
    """The equivalence check above can fail: the sharded step with the gradient summed, not averaged."""
    comm = world()
    k, b, steps = comm.Get_size(), 8, 12
    dp = train(comm, b, steps, average=False, shard=True)
    ours = dp.flat.params.copy()
    dp.close()
    assert not np.allclose(ours, reference(k, b, steps), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("opt", [{}, ADAMW_OPT, LAMB_OPT])
def test_sharded_optimizer_state_is_made_whole_for_checkpoints(opt):
    """Each rank keeps only its chunks of every state buffer (momentum; Adam's two moments);
    gather_optimizer_state makes rank 0's the replicated run's whole buffers."""
    comm = world()
    dp = train(comm, 8, 6, shard=True, **opt)
    own = dp.update.own
    local = {name: buf.copy() for name, buf in dp.optimizer.state_buffers().items()}
    whole = dp.gather_optimizer_state()
    dp.close()
    plain = train(comm, 8, 6, **opt)
    ref = {name: buf.copy() for name, buf in plain.optimizer.state_buffers().items()}
    plain.close()
    assert sorted(ref) == (["velocity"] if not opt else ["exp_avg", "exp_avg_sq"])
    assert sorted(whole) == (sorted(ref) if comm.Get_rank() == 0 else [])
    for name, buf in whole.items():
        np.testing.assert_allclose(buf, ref[name], rtol=1e-9, atol=1e-12)
    for name, buf in local.items():  # this rank's chunks, back to back: nothing else
        assert buf.size == sum(hi - lo for lo, hi in own) < ref[name].size
        np.testing.assert_allclose(buf, np.concatenate([ref[name][lo:hi] for lo, hi in own]), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("opt", [{}, ADAMW_OPT, LARS_OPT, LAMB_OPT])
def test_the_sharded_step_keeps_one_kth_of_the_optimizer_state(opt):
    """ZeRO-1: the ranks' optimizer buffers tile the replicated step's (momentum or moments and the
    update's scratch), each rank's near 1/k of them."""
    comm = world()
    k = comm.Get_size()
    dp = train(comm, 8, 1, shard=True, hidden=(256,), **opt)
    mine, owned = dp.optimizer.buffer_nbytes(), sum(hi - lo for lo, hi in dp.update.own)
    dp.close()
    plain = train(comm, 8, 1, hidden=(256,), **opt)
    whole, n = plain.optimizer.buffer_nbytes(), plain.flat.size
    plain.close()
    every = comm.allgather(mine)
    assert whole > 0 and mine == whole * owned // n  # exactly this rank's share of every buffer
    assert sum(every) == whole  # the chunks tile the parameters
    assert max(every) <= whole / k + whole * 2 * 4096 / n  # even shares, up to a block per bucket boundary


def test_broadcast_parameters_gives_every_rank_root_s_state_buffers():
    comm = world()
    dp = train(comm, 8, 0, **ADAMW_OPT)
    for buf in dp.optimizer.state_buffers().values():
        buf[...] = comm.Get_rank() + 1.0
    dp.broadcast_parameters()
    got = [float(buf.min()) for buf in dp.optimizer.state_buffers().values()] + \
        [float(buf.max()) for buf in dp.optimizer.state_buffers().values()]
    dp.close()
    assert got == [1.0] * 4


def test_ranks_with_another_optimizer_are_refused_on_every_rank():
    comm = world()
    model = mlp((8,)).materialize(np, "float64")
    optimizer = AdamW(model.flat) if comm.Get_rank() == 1 else SGD(model.flat, momentum=0.9)
    with pytest.raises(ReplicaError, match=r"the optimizer .* differs on rank\(s\) \[1\] from the other ranks: "
                                           r"optimizer: rank 1 has 'AdamW' where rank 0 has 'SGD'"):
        DataParallel(model, optimizer, comm)


# -- clipping by the global norm of the averaged gradient ----------------------------------------------
@pytest.mark.parametrize("shard", [False, True])
def test_every_rank_clips_alike_and_reports_the_averaged_gradients_norm(shard):
    """last_grad_norm is the averaged gradient's norm before clipping: the same on every rank, one
    rank's with k times the batch, and the gradient left behind (SGD without decay does not touch it)
    has the clipped norm; the bound bites at every step here."""
    from mpi4py import MPI

    comm = world()
    k, b, clip = comm.Get_size(), 8, 0.05
    dp = train(comm, b, 4, shard=shard, clip=clip, weight_decay=0.0)
    norm = dp.last_grad_norm
    held = dp.update.grads if shard else dp.flat.grads
    left = float(np.sqrt(comm.allreduce(float(held @ held)))) if shard else float(np.linalg.norm(held))
    norms = comm.allgather(norm)
    dp.close()
    one = train(MPI.COMM_SELF, k * b, 4, clip=clip, weight_decay=0.0)
    ref = one.last_grad_norm
    one.close()
    assert len(set(norms)) == 1 and norm > 2 * clip  # every rank the same norm; clipping bit
    assert norm == pytest.approx(ref, rel=1e-10)
    assert left == pytest.approx(clip, rel=1e-4)


def test_clipping_changes_the_trajectory_and_measuring_does_not():
    """Negative control for the equivalence checks with clipping: without it the run ends elsewhere.
    Measuring the norm alone (measure_grad_norm) computes it and leaves the step bitwise as it was;
    with neither, last_grad_norm is None."""
    comm = world()
    k, b = comm.Get_size(), 8
    plain = train(comm, b, 6)
    unmeasured, none = plain.flat.params.copy(), plain.last_grad_norm
    plain.close()
    measured = train(comm, b, 6, measure=True)
    same, norm = np.array_equal(measured.flat.params, unmeasured), measured.last_grad_norm
    measured.close()
    assert none is None and same and norm > 0.05
    assert not np.allclose(unmeasured, reference(k, b, 6, clip=0.05), rtol=1e-5, atol=1e-9)


def test_clip_must_be_a_number_at_least_zero():
    model = mlp((8,)).materialize(np, "float64")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clip_grad_norm"):
            DataParallel(model, SGD(model.flat), world(), clip_grad_norm=bad)


def test_sharded_finite_vote_reaches_every_rank():
    """A NaN in one rank's chunk only: every rank must see a non-finite gradient (and stop or skip together)."""
    from mpisgd.parallel import NonFiniteError

    comm = world()
    dp = train(comm, 8, 1, shard=True)
    last = comm.Get_rank() == comm.Get_size() - 1
    before_nan = dp.grads_finite()  # collective: asserted at the end, once every rank has been through all
    if last:
        dp.update.grads[-1] = np.nan
    votes = dp.grads_finite()
    data = synthetic(64, seed=2)
    x, y = BatchLoader(data, np, "float64").batch(np.arange(8))
    if last:
        x = x.copy()
        x[0, 0, 0, 0] = np.inf
    with pytest.raises(NonFiniteError):
        dp.train_step([(x, y)], lr=0.1)
    dp.on_nan = "skip"
    before = dp.flat.params.copy()
    dp.train_step([(x, y)], lr=0.1)
    skipped, same = dp.skipped_steps, np.array_equal(before, dp.flat.params)
    dp.close()
    assert before_nan is True and votes is False
    assert skipped == 1 and same


def test_sharded_step_refuses_gpu_buffers_before_any_communication(monkeypatch):
    monkeypatch.setattr("mpisgd.parallel.data_parallel.is_device_array", lambda a: True)  # parameters "on a GPU"
    model = mlp((8,)).materialize(np, "float64")
    with pytest.raises(ValueError, match="host buffers only"):
        DataParallel(model, SGD(model.flat), world(), shard_optimizer=True)
    with pytest.raises(ValueError, match="device=True"):
        DataParallel(model, SGD(model.flat), world(), reducer=create_reducer("mpi", world()))


# -- every strategy under data parallelism --------------------------------------------------------------
def digest(dp: DataParallel) -> str:
    value = hashlib.sha256(dp.flat.params.tobytes()).hexdigest()
    dp.close()
    return value


def test_deterministic_training_is_bitwise_the_same_for_every_strategy_bucket_and_overlap():
    """--deterministic: every strategy sums in rank order (auto and shared through the node-shared
    buffer, the others through the deterministic strategy at k >= 3; at k = 2 any order is exact)."""
    digests = {(s, b, o): digest(train(world(), 8, 6, allreduce=s, bucket_mb=b, overlap=o, deterministic=True,
                                       dtype="float32", hidden=(32, 16), weight_decay=1e-3))
               for s in STRATEGIES for b in (0.001, 0.004, 25.0) for o in (True, False)}
    everywhere = world().allgather(digests)
    assert len({d for per in everywhere for d in per.values()}) == 1, everywhere[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overlap_on_and_off_give_the_same_bits(strategy):
    on = digest(train(world(), 8, 6, allreduce=strategy, bucket_mb=0.002, overlap=True, dtype="float32"))
    off = digest(train(world(), 8, 6, allreduce=strategy, bucket_mb=0.002, overlap=False, dtype="float32"))
    assert all(world().allgather(on == off))


def test_a_rank_in_another_collective_is_named_at_the_check_in():
    """Rank 0 trains a step while the last rank is in another collective of the same size: the check-in
    sees it is not a check-in and names that rank, instead of reading its data as a step number."""
    comm = world()
    dp = train(comm, 8, 1)
    data = synthetic(64, seed=3)
    x, y = BatchLoader(data, np, "float64").batch(np.arange(8))
    last = comm.Get_size() - 1
    if comm.Get_rank() == last:
        words = CHECK_IN_WORDS  # a collective of the check-in's own size, so only its content tells
        dp.comm.Allgather(np.zeros(words, dtype=np.int64), np.zeros((comm.Get_size(), words), dtype=np.int64))
        err = None
    else:
        with pytest.raises(ReplicaError) as info:
            dp.train_step([(x, y)], lr=0.1)
        err = str(info.value)
    dp.close()
    if err is not None:
        assert f"rank(s) [{last}] are not at the check-in of step 1" in err, err


def test_close_twice_is_a_no_op():
    """The second close() of a DataParallel does nothing (the first freed the communicator and the watchdog)."""
    dp = train(world(), 8, 1)
    dp.close()
    dp.close()
    assert dp.shared_grads is False


def test_an_unmaterialised_model_says_so():
    model = mlp((8,))
    with pytest.raises(AttributeError, match="materialize"):
        SGD(model.flat)
    with pytest.raises((AttributeError, ValueError), match="materialize"):
        DataParallel(model, None, world())  # type: ignore[arg-type]
