"""--val-split: a validation set held out of the training set by the seed, before sharding (so k ranks still
compute what one rank computes, and a resume continues the same split); each epoch scores it, the test set
is scored once, at the end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import root_makes, serial_only, train_here, world
from test_train import image_set

from mpisgd.data import BatchLoader, Dataset, hold_out, synthetic

SYNTH = ["--dataset", "synthetic", "--synthetic-samples", "1536", "--dtype", "float64",
         "--hidden", "32,16", "--progress", "off", "--lr", "0.05", "--base-batch", "48"]


def test_hold_out_is_a_pure_function_of_the_seed_and_disjoint():
    train = synthetic(1000, seed=1)
    rest, val = hold_out(train, 0.1, seed=5)
    assert (len(rest), len(val)) == (900, 100)
    again_rest, again_val = hold_out(train, 0.1, seed=5)
    np.testing.assert_array_equal(rest.rows, again_rest.rows)
    np.testing.assert_array_equal(val.images, again_val.images)
    assert not np.array_equal(hold_out(train, 0.1, seed=6)[0].rows, rest.rows)
    held_rows = np.setdiff1d(np.arange(1000), rest.rows)
    np.testing.assert_array_equal(val.images, train.images[held_rows])  # the validation samples are copies
    np.testing.assert_array_equal(val.labels, train.labels[held_rows])
    assert rest.images is train.images  # the rest keeps the arrays: a memory-mapped set stays mapped
    assert (val.scale, val.shift) == (train.scale, train.shift)


def test_a_loader_of_the_rest_reads_only_its_rows():
    images = np.arange(10, dtype=np.uint8)[:, None] * np.ones((1, 3), np.uint8)
    rest = Dataset(images, np.arange(10), rows=np.array([1, 4, 7]))
    x, y = BatchLoader(rest, np, "float64").batch(np.array([2, 0]))
    np.testing.assert_array_equal(y, [7, 1])
    np.testing.assert_array_equal(x[:, 0], [7.0, 1.0])
    assert len(rest) == 3 and len(rest.head(2)) == 2 and list(rest.head(2).labels) == [1, 4]


def test_a_split_that_leaves_nothing_is_refused():
    from mpisgd.data import DataError

    with pytest.raises(DataError, match="leaves none to train on"):
        hold_out(synthetic(3), 0.9, 0)


def params(tmp: Path, b: int, *extra: str, comm=None) -> np.ndarray:
    out = tmp / f"{'one' if comm is not None else 'k'}_{b}_{len(extra)}.npz"
    r = train_here([*SYNTH, "--batch-size", str(b), "--max-steps", "10", "--save-model", str(out), *extra], comm=comm)
    assert r.statuses == (0,) * len(r.statuses), r
    return np.load(out)["flat"]


@pytest.mark.mpi
def test_k_ranks_equal_one_rank_with_a_validation_split(shared_tmp):
    from mpi4py import MPI

    k = world().Get_size()
    ref = root_makes(lambda: params(shared_tmp, 48, "--val-split", "0.2", comm=MPI.COMM_SELF))
    np.testing.assert_allclose(params(shared_tmp, 48 // k, "--val-split", "0.2"), ref, rtol=1e-6, atol=1e-10)
    plain = root_makes(lambda: params(shared_tmp, 48, comm=MPI.COMM_SELF))
    assert not np.allclose(plain, ref, rtol=1e-6, atol=1e-10)  # the split changes the batches


@serial_only  # one rank's run, in this process
def test_epochs_report_validation_and_the_test_set_is_scored_once(tmp_path):
    metrics, data = tmp_path / "m.jsonl", image_set(tmp_path / "set.npz")  # 2400 train, 600 test, learnable
    learn = ["--data", str(data), "--hidden", "64", "--progress", "off", "--lr", "0.05", "--batch-size", "64",
             "--epochs", "2", "--val-split", "0.25"]
    r = train_here([*learn, "--metrics-file", str(metrics)])
    assert r.status == 0, r
    assert "1,800 train, 600 validation (--val-split 0.25), 600 test" in r.out, r.out
    lines = [x for x in r.out.splitlines() if x.startswith("epoch ")]
    assert len(lines) == 2 and all("val_loss" in x and "val_acc" in x and "test_acc" not in x for x in lines), lines
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    epochs = [e for e in records if e["kind"] == "epoch"]
    tests = [e for e in records if e["kind"] == "test"]
    assert all("val_acc" in e and "val_loss" in e and "test_acc" not in e for e in epochs)
    assert len(tests) == 1 and tests[0]["step"] == epochs[-1]["step"] and 0 < tests[0]["test_loss"]
    assert f"final test accuracy {tests[0]['test_acc']:.4f} after" in r.out
    assert f"validation accuracy {epochs[-1]['val_acc']:.4f}" in r.out
    assert epochs[-1]["val_acc"] > 0.9 and tests[0]["test_acc"] > 0.9  # samples of one learnable problem
    every = train_here([*learn, "--test-every-epoch"])
    assert every.status == 0, every
    assert all("val_acc" in x and "test_acc" in x for x in every.out.splitlines() if x.startswith("epoch "))


@serial_only  # one rank's run, in this process
def test_a_resume_keeps_the_split_or_is_refused(tmp_path):
    common = [*SYNTH, "--batch-size", "16", "--epochs", "2", "--checkpoint-dir", str(tmp_path / "ckpt")]
    r = train_here([*common, "--val-split", "0.2"])
    assert r.status == 0, r
    other = train_here([*common, "--val-split", "0.3", "--resume", "auto"])
    assert other.status == 2 and "this run differs from the checkpoint's: --data" in other.error, other
    assert "--resume-allow data" in other.error
    same = train_here([*common, "--val-split", "0.2", "--resume", "auto"])
    assert same.status == 0 and "the run is finished" in same.out, same


@pytest.mark.mpi
def test_every_rank_holds_out_the_same_samples():
    from conftest import world

    rest, val = hold_out(synthetic(999, seed=2), 0.15, seed=7)
    mine = (rest.rows.tobytes(), val.labels.tobytes(), val.images.tobytes())
    assert all(other == mine for other in world().allgather(mine))


@pytest.mark.mpi
def test_counts_summed_over_ranks_equal_one_process_counts():
    """mpisgd.evaluate's scoring: each rank its share, the sums equal one process scoring everything."""
    from conftest import world
    from mpi4py import MPI

    from mpisgd.app.evaluate import score
    from mpisgd.nn import build_model

    comm = world()
    model = build_model("mlp", (1, 28, 28), 10, (16,)).materialize(np, "float64", seed=1)
    test = synthetic(301, seed=3, split=1)
    counts = score(model, test, 10, 32, comm.Get_rank(), comm.Get_size())
    comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    ref = score(model, test, 10, 32, 0, 1)
    np.testing.assert_array_equal(counts[:, :2], ref[:, :2])
    np.testing.assert_allclose(counts[:, 2], ref[:, 2], rtol=1e-12)
    assert counts[:, 0].sum() == 301
