"""--val-split: a validation set held out of the training set by the seed, before sharding (so k ranks still
compute what one rank computes, and a resume continues the same split); each epoch scores it, the test set
is scored once, at the end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_mpi
from test_train import image_set

from mpisgd.data import BatchLoader, Dataset, hold_out, synthetic

SYNTH = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "1536", "--dtype", "float64",
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


def params(tmp_path: Path, k: int, b: int, *extra: str) -> np.ndarray:
    out = tmp_path / f"k{k}.npz"
    r = run_mpi(k, *SYNTH, "--batch-size", str(b), "--max-steps", "10", "--save-model", str(out), *extra)
    assert r.returncode == 0, r.stderr + r.stdout
    return np.load(out)["flat"]


def test_k_ranks_equal_one_rank_with_a_validation_split(tmp_path):
    ref = params(tmp_path, 1, 48, "--val-split", "0.2")
    np.testing.assert_allclose(params(tmp_path, 2, 24, "--val-split", "0.2"), ref, rtol=1e-6, atol=1e-10)
    np.testing.assert_allclose(params(tmp_path, 3, 16, "--val-split", "0.2"), ref, rtol=1e-6, atol=1e-10)
    assert not np.allclose(params(tmp_path, 1, 48), ref, rtol=1e-6, atol=1e-10)  # the split changes the batches


def test_epochs_report_validation_and_the_test_set_is_scored_once(tmp_path):
    metrics, data = tmp_path / "m.jsonl", image_set(tmp_path / "set.npz")  # 2400 train, 600 test, learnable
    learn = ["-m", "mpisgd.train", "--data", str(data), "--hidden", "64", "--progress", "off", "--lr", "0.05",
             "--batch-size", "32", "--epochs", "2", "--val-split", "0.25"]
    r = run_mpi(2, *learn, "--metrics-file", str(metrics))
    assert r.returncode == 0, r.stderr + r.stdout
    assert "1,800 train, 600 validation (--val-split 0.25), 600 test" in r.stdout, r.stdout
    lines = [x for x in r.stdout.splitlines() if x.startswith("epoch ")]
    assert len(lines) == 2 and all("val_loss" in x and "val_acc" in x and "test_acc" not in x for x in lines), lines
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    epochs = [e for e in records if e["kind"] == "epoch"]
    tests = [e for e in records if e["kind"] == "test"]
    assert all("val_acc" in e and "val_loss" in e and "test_acc" not in e for e in epochs)
    assert len(tests) == 1 and tests[0]["step"] == epochs[-1]["step"] and 0 < tests[0]["test_loss"]
    assert f"final test accuracy {tests[0]['test_acc']:.4f} after" in r.stdout
    assert f"validation accuracy {epochs[-1]['val_acc']:.4f}" in r.stdout
    assert epochs[-1]["val_acc"] > 0.9 and tests[0]["test_acc"] > 0.9  # samples of one learnable problem
    every = run_mpi(2, *learn, "--test-every-epoch")
    assert every.returncode == 0, every.stderr
    assert all("val_acc" in x and "test_acc" in x for x in every.stdout.splitlines() if x.startswith("epoch "))


def test_a_resume_keeps_the_split_or_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = [*SYNTH, "--batch-size", "16", "--epochs", "2", "--checkpoint-dir", str(ckpt)]
    r = run_mpi(2, *common, "--val-split", "0.2")
    assert r.returncode == 0, r.stderr
    other = run_mpi(2, *common, "--val-split", "0.3", "--resume", "auto", timeout=120)
    assert other.returncode == 2 and "this run differs from the checkpoint's: --data" in other.stderr, other.stderr
    assert "--resume-allow data" in other.stderr
    same = run_mpi(2, *common, "--val-split", "0.2", "--resume", "auto")
    assert same.returncode == 0 and "the run is finished" in same.stdout, same.stderr


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
