"""Gradient accumulation and the effective-batch mean, through the real CLI under mpiexec.

B = k*b*m: (k=2, b=32, m=4) must train exactly like (k=1, b=256, m=1), and one step
must move the weights by eta times the mean gradient over all B samples, checked
against softmax regression written out in NumPy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import run_mpi

from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, synthetic
from mpisgd.nn import build_model

SEED, SAMPLES = 3, 2048
BASE = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", str(SAMPLES), "--dtype", "float64",
        "--progress", "off", "--seed", str(SEED), "--limit-test", "200"]


def train(tmp_path: Path, k: int, b: int, m: int, *extra: str, steps: int = 6) -> np.ndarray:
    out = tmp_path / f"k{k}_b{b}_m{m}_{abs(hash(extra))}.npz"
    r = run_mpi(k, *BASE, "--batch-size", str(b), "--accum-steps", str(m), "--max-steps", str(steps),
                "--save-model", str(out), *extra, timeout=180)
    assert r.returncode == 0, r.stderr + r.stdout
    return np.load(out, allow_pickle=False)["flat"]


MLP = ("--hidden", "32,16", "--lr", "0.05", "--warmup-steps", "2", "--weight-decay", "1e-4", "--momentum", "0.9")


@pytest.mark.parametrize("extra", [(), ("--momentum-correction", "--nesterov"),
                                   ("--optimizer", "adamw", "--lr", "0.005", "--clip-grad-norm", "0.05"),
                                   ("--optimizer", "lamb", "--lr", "0.005", "--clip-grad-norm", "0.05")])
def test_accumulation_and_ranks_equal_one_big_batch(tmp_path, extra):
    ref = train(tmp_path, 1, 256, 1, *MLP, *extra)
    accumulated = train(tmp_path, 2, 32, 4, *MLP, *extra, "--no-shard-optimizer")  # the replicated update
    np.testing.assert_allclose(accumulated, ref, rtol=1e-9, atol=1e-12)
    one_rank = train(tmp_path, 1, 64, 4, *MLP, *extra)  # accumulation alone
    np.testing.assert_allclose(one_rank, ref, rtol=1e-9, atol=1e-12)
    sharded = train(tmp_path, 2, 32, 4, *MLP, *extra, "--shard-optimizer")  # the update split over ranks
    np.testing.assert_allclose(sharded, ref, rtol=1e-9, atol=1e-12)


def softmax_regression_step(lr: float, batch: int) -> np.ndarray:
    """W, b after one plain SGD step on the mean cross-entropy over the first global batch."""
    model = build_model("mlp", (784,), 10, ()).materialize(np, "float64", SEED)  # the CLI's rank-0 initialisation
    w0 = model.flat.params.copy()
    W, b = w0[:784 * 10].reshape(784, 10), w0[784 * 10:]
    data = synthetic(SAMPLES, SEED)
    idx = GlobalBatches(SAMPLES, batch, 0, 1).indices(epoch_permutation(SAMPLES, SEED, 0), 0, 0)
    x, y = BatchLoader(data, np, "float64").batch(idx)
    x = x.reshape(batch, -1)
    z = x @ W + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(batch), y] -= 1.0  # d(cross-entropy)/dz per sample
    gW, gb = x.T @ p / batch, p.sum(axis=0) / batch  # the mean over all B samples
    return np.concatenate([(W - lr * gW).ravel(), b - lr * gb])


SOFTMAX = ("--hidden=", "--lr", "0.5", "--lr-scaling", "none", "--momentum", "0", "--weight-decay", "0")


def test_one_step_is_eta_times_the_effective_batch_mean_gradient(tmp_path):
    ref = softmax_regression_step(0.5, 256)
    w0 = build_model("mlp", (784,), 10, ()).materialize(np, "float64", SEED).flat.params
    for k, b, m in ((1, 256, 1), (2, 32, 4), (2, 128, 1)):
        ours = train(tmp_path, k, b, m, *SOFTMAX, steps=1)
        np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-12, err_msg=f"k={k} b={b} m={m}")
    # forgetting the division by k would make every step k times too long: k*eta, checked here at k = 2
    doubled = train(tmp_path, 2, 32, 4, *SOFTMAX[:2], "1.0", *SOFTMAX[3:], steps=1)
    assert not np.allclose(doubled, ref, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(doubled - w0, 2 * (ref - w0), rtol=1e-9, atol=1e-12)
