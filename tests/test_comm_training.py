"""The engine under DataParallel, under mpiexec: deterministic training is bitwise the same for every
strategy, bucket size and overlap setting; overlap never changes the result of any strategy."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, synthetic
from mpisgd.nn import mlp
from mpisgd.optim import SGD
from mpisgd.parallel import DataParallel

pytestmark = pytest.mark.mpi(min_size=2)
STRATEGIES = ("mpi", "ring", "auto", "hierarchical")


def train_digest(allreduce: str, bucket_mb: float, overlap: bool, deterministic: bool) -> str:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    k, rank = comm.Get_size(), comm.Get_rank()
    data = synthetic(256, seed=0)
    model = mlp((32, 16)).materialize(np, "float32", seed=0)
    opt = SGD(model.flat, momentum=0.9, nesterov=False, weight_decay=1e-3)
    dp = DataParallel(model, opt, comm, allreduce=allreduce, bucket_cap_mb=bucket_mb, overlap=overlap,
                      deterministic=deterministic)
    loader = BatchLoader(data, np, "float32")
    batches = GlobalBatches(len(data), k * 8, rank, k)
    for step in range(6):
        perm = epoch_permutation(len(data), 0, step // batches.steps_per_epoch)
        dp.train_step([loader.batch(batches.indices(perm, step % batches.steps_per_epoch, 0))], lr=0.05)
    digest = hashlib.sha256(dp.flat.params.tobytes()).hexdigest()
    dp.close()
    return digest


def test_deterministic_training_is_bitwise_the_same_for_every_strategy_bucket_and_overlap():
    from mpi4py import MPI

    digests = {(s, b, o): train_digest(s, b, o, deterministic=True)
               for s in STRATEGIES for b in (0.001, 0.004, 25.0) for o in (True, False)}
    everywhere = MPI.COMM_WORLD.allgather(digests)
    assert len({d for per in everywhere for d in per.values()}) == 1, everywhere[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overlap_on_and_off_give_the_same_bits(strategy):
    from mpi4py import MPI

    on = train_digest(strategy, 0.002, True, deterministic=False)
    off = train_digest(strategy, 0.002, False, deterministic=False)
    assert all(MPI.COMM_WORLD.allgather(on == off))
