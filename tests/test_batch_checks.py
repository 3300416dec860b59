"""DataParallel.train_step in your own loop refuses micro-batches the model cannot train on, in one clear
error: on every rank at once (the check-in, k >= 2), or a ValueError at k = 1. Before, labels above the
classes and float labels were an IndexError from inside the loss on the ranks that had them (the others
waited in the all-reduce), an empty micro-batch a ZeroDivisionError, a NaN rate trained silently, a
negative label at k = 1 silently scored the last class, and TokenCrossEntropy's documented ignore_index (-1)
was refused at k >= 2 as a label outside the classes. The building blocks of such a loop (GlobalBatches,
BatchLoader, materialize, Linear, the optimizers) refuse arguments that would train wrongly or fail later."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import world
from mpi4py import MPI

from mpisgd.agreement import ReplicaError
from mpisgd.data import BatchLoader, GlobalBatches, synthetic
from mpisgd.nn import GPTShape, TokenCrossEntropy, gpt, mlp
from mpisgd.optim import SGD
from mpisgd.optim.adam import AdamW
from mpisgd.parallel.data_parallel import DataParallel

CLASSES = 3


def classifier(comm) -> DataParallel:
    model = mlp((16,), n_in=8, n_classes=CLASSES).materialize(np, "float64", seed=0)
    return DataParallel(model, SGD(model.flat, momentum=0.9), comm)


def good(rank: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(rank).normal(size=(4, 8))
    return x, np.array([0, 1, 2, 1])


def spoiled(case: str, rank: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x, y = good(rank)
    return {"negative label": (x, np.array([0, -1, 2, 1])),
            "float labels": (x, y.astype(np.float64)),
            "empty": (x[:0], y[:0]),
            "fewer labels": (x, y[:3]),
            "label above the classes": (x, np.array([0, 1, 7, 1]))}[case]


SAYS = {"negative label": "labels outside 0..", "float labels": "labels that are not integers",
        "empty": "an empty micro-batch", "fewer labels": "labels are not one per sample (len(y) != len(x))",
        "label above the classes": "labels outside 0..2"}


@pytest.mark.parametrize("case", list(SAYS))
def test_at_k_1_a_bad_micro_batch_is_one_value_error(case):
    dp = classifier(MPI.COMM_SELF)
    before = dp.flat.params.copy()
    with pytest.raises(ValueError) as err:
        dp.train_step([spoiled(case)], lr=0.1)
    assert SAYS[case] in str(err.value), err.value
    np.testing.assert_array_equal(dp.flat.params, before)  # nothing was applied
    if case != "label above the classes":  # the check-in's own bound (the classes known from a forward)
        dp.train_step([good()], lr=0.1)
        with pytest.raises(ValueError, match=SAYS[case].replace("(", r"\(").replace(")", r"\)")):
            dp.train_step([spoiled(case)], lr=0.1)
    dp.close()


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -0.1])
def test_a_rate_that_is_not_a_finite_non_negative_number_is_refused(lr):
    dp = classifier(MPI.COMM_SELF)
    before = dp.flat.params.copy()
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        dp.train_step([good()], lr=lr)
    np.testing.assert_array_equal(dp.flat.params, before)
    dp.train_step([good()], lr=0.0)  # zero is a rate (a frozen step)
    dp.close()


def language_model(comm) -> DataParallel:
    model = gpt(GPTShape(11, 8, 1, 2, 16, 0.0)).materialize(np, "float64", seed=0)
    return DataParallel(model, AdamW(model.flat), comm, loss=TokenCrossEntropy())


def padded_tokens(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)
    x, y = rng.integers(0, 11, (4, 8)), rng.integers(0, 11, (4, 8))
    y[:, -3:] = -1  # padding: not scored
    return x, y


def test_at_k_1_targets_the_loss_ignores_train_and_others_outside_the_vocabulary_are_refused():
    dp = language_model(MPI.COMM_SELF)
    x, y = padded_tokens(0)
    assert np.isfinite(float(dp.train_step([(x, y)], lr=1e-3)))
    y[0, 0] = -2
    with pytest.raises(ValueError, match=r"labels outside 0..10 \(or -1, which the loss ignores\)"):
        dp.train_step([(x, y)], lr=1e-3)
    dp.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["negative label", "float labels", "empty", "fewer labels"])
def test_one_ranks_bad_micro_batch_is_refused_on_every_rank_naming_it(case):
    comm = world()
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    dp = classifier(comm)
    dp.train_step([good(rank)], lr=0.1)
    before = dp.flat.params.copy()
    with pytest.raises(ReplicaError) as err:
        dp.train_step([spoiled(case, rank) if rank == last else good(rank)], lr=0.1)
    says = str(err.value)
    assert f"rank(s) [{last}] passed micro-batches the model cannot train on" in says and SAYS[case] in says, says
    np.testing.assert_array_equal(dp.flat.params, before)
    dp.train_step([good(rank)], lr=0.1)  # the job goes on: every rank refused the same step
    dp.check_replicas()
    dp.close()


@pytest.mark.mpi(min_size=2)
def test_targets_the_loss_ignores_train_at_k_2_and_more():
    comm = world()
    dp = language_model(comm)
    for _ in range(2):
        assert np.isfinite(float(dp.train_step([padded_tokens(comm.Get_rank())], lr=1e-3)))
    dp.check_replicas()
    dp.close()


def _batches(**change):
    args = {"n_samples": 100, "global_batch": 12, "rank": 0, "world_size": 2, "accum_steps": 1, **change}
    return GlobalBatches(**args)


@pytest.mark.parametrize("make,says", [
    (lambda: _batches(global_batch=10, world_size=3), "global batch 10 is not a positive multiple of world_size x "
                                                       "accum_steps = 3"),  # rank 0 drew 3 samples, rank 2 four
    (lambda: _batches(rank=2), "the rank must be in 0..world_size-1"),  # samples of a rank that does not exist
    (lambda: _batches(global_batch=0), "not a positive multiple"),  # ZeroDivisionError
    (lambda: _batches().indices(np.arange(100), 8, 0), "an epoch has steps 0..7"),  # an empty batch
    (lambda: _batches(accum_steps=2).indices(np.arange(100), 0, 2), "of micro-batches 0..1"),
    (lambda: SGD(classifier(MPI.COMM_SELF).flat, weight_decay=float("nan")), "weight decay must be finite"),
    (lambda: mlp((8,), n_in=4).materialize(np, "int32"), "the parameters' dtype is float32 or float64, got int32"),
    (lambda: mlp((0,), n_in=4), r"Linear\(4, 0\): its input and output widths must be >= 1"),
    (lambda: BatchLoader(synthetic(10), np, "int32"), "inputs in float32 or float64"),  # a NumPy casting error
])
def test_the_librarys_building_blocks_refuse_arguments_that_would_train_wrongly(make, says):
    with pytest.raises((ValueError, IndexError), match=says):
        make()
