"""The reproducible mode: the same parameter bits for any k dividing B/b, any strategy, bucket layout,
overlap and sharding (in-process under mpiexec, size-agnostic: the reference is one rank running all
B/b micro-batches); through the CLI at k = 1, 2, 3, 4 for the MLP and the CNN, resume on another k,
and the negative control (without --reproducible, k = 1 and k = 3 differ)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from conftest import run_mpi, world

from mpisgd.comm import create_reducer
from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, synthetic
from mpisgd.nn import mlp
from mpisgd.optim import SGD
from mpisgd.optim.adam import LAMB, AdamW
from mpisgd.optim.lars import LARS
from mpisgd.parallel import DataParallel

B_OVER_B = 6  # micro-batches per step over all ranks: k = 1, 2, 3 and 6 divide it
B_LOCAL = 8


def train(comm, steps: int, *, allreduce: str = "auto", bucket_mb: float = 25.0, overlap: bool = True,
          shard: bool = False, optimizer: str = "sgd", reproducible: bool = True, dtype: str = "float32",
          clip: float | None = None) -> str:
    """Train a small MLP for ``steps`` steps of B = 6 * 8 samples over ``comm``; the parameters' digest."""
    k, rank = comm.Get_size(), comm.Get_rank()
    m = B_OVER_B // k
    data = synthetic(480, seed=0)
    model = mlp((24, 16)).materialize(np, dtype, seed=0)
    if optimizer in ("adamw", "lamb"):  # ufuncs only
        opt = (AdamW if optimizer == "adamw" else LAMB)(model.flat, weight_decay=1e-3)
    else:
        kind = LARS if optimizer == "lars" else SGD
        extra = {"trust_coef": 0.02} if optimizer == "lars" else {}
        opt = kind(model.flat, momentum=0.9, weight_decay=1e-3, level1=not reproducible, **extra)
    dp = DataParallel(model, opt, comm, reducer=create_reducer(allreduce, comm), bucket_cap_mb=bucket_mb,
                      overlap=overlap, shard_optimizer=shard, reproducible=reproducible, noise_every=2,
                      clip_grad_norm=clip)
    loader = BatchLoader(data, np, dtype)
    batches = GlobalBatches(len(data), B_OVER_B * B_LOCAL, rank, k, m)
    for step in range(steps):
        epoch, pos = divmod(step, batches.steps_per_epoch)
        perm = epoch_permutation(len(data), 0, epoch)
        micro = [loader.batch(batches.indices(perm, pos, i), slot=i) for i in range(m)]
        dp.train_step(micro, lr={"lars": 2.0, "adamw": 0.01, "lamb": 0.01}.get(optimizer, 0.05))
    digest = hashlib.sha256(dp.flat.params.tobytes()).hexdigest()
    dp.close()
    return digest


def one_rank(steps: int, **kw) -> str:
    from mpi4py import MPI

    return train(MPI.COMM_SELF, steps, **kw)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer", ["sgd", "lars"])
def test_every_strategy_bucket_overlap_and_sharding_gives_one_rank_s_bits(optimizer):
    comm = world()
    if B_OVER_B % comm.Get_size():
        pytest.skip(f"k={comm.Get_size()} does not divide B/b={B_OVER_B}")
    ref = one_rank(8, optimizer=optimizer)
    ours = {(s, b, o, sh): train(comm, 8, allreduce=s, bucket_mb=b, overlap=o, shard=sh, optimizer=optimizer)
            for s in ("auto", "mpi", "ring", "shared") for b in (25.0, 0.002) for o in (True, False)
            for sh in (False, True)}
    every = comm.allgather(ours)
    assert all(d == ref for per in every for d in per.values()), {key: d == ref for key, d in ours.items()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer,clip", [("sgd", 0.05), ("adamw", 0.05), ("lamb", None), ("lamb", 0.05)])
def test_adamw_lamb_and_clipping_keep_one_rank_s_bits(optimizer, clip):
    """AdamW's update is element by element; LAMB's ratios and the clipping norm come from the step's
    block norms: neither depends on k, sharded or not (clip 0.05 bites at every step here)."""
    comm = world()
    if B_OVER_B % comm.Get_size():
        pytest.skip(f"k={comm.Get_size()} does not divide B/b={B_OVER_B}")
    ref = one_rank(6, optimizer=optimizer, clip=clip)
    ours = {(s, b, sh): train(comm, 6, allreduce=s, bucket_mb=b, shard=sh, optimizer=optimizer, clip=clip)
            for s in ("auto", "ring") for b in (25.0, 0.002) for sh in (False, True)}
    unclipped = train(comm, 6, optimizer=optimizer) if clip else ref
    every = comm.allgather(ours)
    assert all(d == ref for per in every for d in per.values()), {key: d == ref for key, d in ours.items()}
    assert (unclipped != ref) == bool(clip)  # the clipping changed the run


@pytest.mark.mpi(min_size=2)
def test_float64_too():
    comm = world()
    if B_OVER_B % comm.Get_size():
        pytest.skip(f"k={comm.Get_size()} does not divide B/b={B_OVER_B}")
    assert all(comm.allgather(train(comm, 6, dtype="float64", shard=True) == one_rank(6, dtype="float64")))


def test_it_computes_the_float_step_to_rounding():
    """Same bits everywhere is worthless if the step is wrong: on one rank, float64, twenty steps over which
    the gradients' norms cross powers of two (the exponents change), the reproducible parameters are the
    plain float step's to within the fixed point's ~50 bits (a gradient decoded at another step's scale
    would be off by a power of two)."""
    from mpi4py import MPI

    def params(reproducible: bool) -> np.ndarray:
        data = synthetic(960, seed=5)
        model = mlp((24, 16)).materialize(np, "float64", seed=0)
        opt = SGD(model.flat, momentum=0.9, weight_decay=1e-3, level1=False)
        dp = DataParallel(model, opt, MPI.COMM_SELF, reproducible=reproducible)
        loader, batches = BatchLoader(data, np, "float64"), GlobalBatches(len(data), 48, 0, 1, 6)
        seen = set()
        for step in range(20):
            perm = epoch_permutation(len(data), 0, step // batches.steps_per_epoch)
            dp.train_step([loader.batch(batches.indices(perm, step % batches.steps_per_epoch, i), slot=i)
                           for i in range(6)], lr=0.5)
            if reproducible:
                seen.add(tuple(dp.exponents))
        out = dp.flat.params.copy()
        dp.close()
        assert not reproducible or len(seen) > 1, "the exponents never changed: the test would not test"
        return out

    np.testing.assert_allclose(params(True), params(False), rtol=1e-9, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_without_it_the_bits_depend_on_k():
    """The negative control: the plain float sums of k ranks are not one rank's bits (so the tests
    above can fail)."""
    comm = world()
    if B_OVER_B % comm.Get_size():
        pytest.skip(f"k={comm.Get_size()} does not divide B/b={B_OVER_B}")
    ours = train(comm, 8, allreduce="ring", bucket_mb=0.002, reproducible=False)
    assert not any(comm.allgather(ours == one_rank(8, reproducible=False)))


@pytest.mark.mpi(min_size=2)
def test_the_first_step_and_a_sudden_growth_are_computed_again():
    """Step 0 has no exponents (measured, then computed again); a gradient 2**10 times larger than the
    last step's overflows the headroom and the step is computed again: the same bits as one rank."""
    comm = world()
    if B_OVER_B % comm.Get_size():
        pytest.skip(f"k={comm.Get_size()} does not divide B/b={B_OVER_B}")

    def run(c) -> str:
        k, rank = c.Get_size(), c.Get_rank()
        m = B_OVER_B // k
        data = synthetic(96, seed=4)
        model = mlp((16,)).materialize(np, "float32", seed=0)
        dp = DataParallel(model, SGD(model.flat, level1=False), c, reducer=create_reducer("mpi", c), reproducible=True)
        loader = BatchLoader(data, np, "float32")
        batches = GlobalBatches(len(data), B_OVER_B * B_LOCAL, rank, k, m)
        perm = epoch_permutation(len(data), 0, 0)
        seen = []
        for step, scale in enumerate((1.0, 1.0, 1024.0)):  # the third step's inputs, hence gradients, grow
            micro = [loader.batch(batches.indices(perm, step % 2, i), slot=i) for i in range(m)]
            micro = [(x * scale, y) for x, y in micro]
            dp.train_step(micro, lr=1e-4)
            seen.append(dp.exponents.copy())
        digest = hashlib.sha256(dp.flat.params.tobytes()).hexdigest()
        dp.close()
        return digest, seen

    from mpi4py import MPI

    (ours, exps), (ref, ref_exps) = run(comm), run(MPI.COMM_SELF)
    assert all(comm.allgather(ours == ref))
    assert (exps[2] > exps[1] + 6).any()  # the growth was past the headroom: the step was redone
    assert all(np.array_equal(a, b) for a, b in zip(exps, ref_exps))


# -- through the CLI -------------------------------------------------------------------------------
CLI = ("-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "2304", "--limit-test", "256",
       "--batch-size", "8", "--global-batch", "96", "--max-steps", "24", "--progress", "off", "--reproducible")


def cli_params(tmp_path: Path, k: int, tag: str, *extra: str) -> np.ndarray:
    out = tmp_path / f"{tag}-k{k}.npz"
    r = run_mpi(k, *CLI, "--save-model", str(out), *extra, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return np.load(out)["flat"]


@pytest.mark.parametrize("model", [("--hidden", "64"), ("--model", "cnn")])
def test_the_cli_gives_the_same_bits_at_k_1_2_3_4(tmp_path, model):
    params = {k: cli_params(tmp_path, k, model[-1], *model) for k in (1, 2, 3, 4)}
    assert all(np.array_equal(params[1], p) for p in params.values())


def test_the_cli_without_reproducible_differs_between_k_1_and_3(tmp_path):
    plain = [a for a in CLI if a != "--reproducible"]
    got = []
    for k in (1, 3):
        out = tmp_path / f"plain-{k}.npz"
        r = run_mpi(k, *plain, "--hidden", "64", "--save-model", str(out), timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        got.append(np.load(out)["flat"])
    assert not np.array_equal(*got)


def test_resuming_on_another_k_is_bitwise_and_the_banner_says_what_the_bits_need(tmp_path):
    whole = cli_params(tmp_path, 1, "whole", "--hidden", "64")
    ck = str(tmp_path / "ck")
    r = run_mpi(2, *CLI, "--hidden", "64", "--checkpoint-dir", ck, "--checkpoint-every", "10",
                env={"MPISGD_FAIL_AT_STEP": "15"}, timeout=300)
    assert r.returncode == 1
    resumed = cli_params(tmp_path, 3, "resumed", "--hidden", "64", "--checkpoint-dir", ck, "--resume", "auto")
    assert np.array_equal(whole, resumed)
    r = run_mpi(2, *CLI, "--hidden", "64", "--max-steps", "2", timeout=300)
    assert "reproducible: the same bits for any k dividing B/b = 12" in r.stdout and "thread(s)" in r.stdout, r.stdout


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_adam_family_with_clipping_resumes_on_another_k_bitwise(tmp_path, optimizer):
    """Their moments and step count in the checkpoint, gathered from k = 2's parts, continue on k = 3 to
    one rank's bits."""
    opts = ("--hidden", "64", "--optimizer", optimizer, "--lr", "0.002", "--weight-decay", "0.01",
            "--clip-grad-norm", "0.1")
    whole = cli_params(tmp_path, 1, "whole", *opts)
    ck = str(tmp_path / "ck")
    r = run_mpi(2, *CLI, *opts, "--checkpoint-dir", ck, "--checkpoint-every", "10",
                env={"MPISGD_FAIL_AT_STEP": "15"}, timeout=300)
    assert r.returncode == 1
    resumed = cli_params(tmp_path, 3, "resumed", *opts, "--checkpoint-dir", ck, "--resume", "auto")
    assert np.array_equal(whole, resumed)
