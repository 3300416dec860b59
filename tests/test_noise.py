"""The gradient noise scale: the estimator (McCandlish et al. 2018, Appendix A), the norms data
parallelism feeds it, and what a run records."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_mpi, world

from mpisgd.data import BatchLoader, synthetic
from mpisgd.nn import SoftmaxCrossEntropy, mlp
from mpisgd.noise import estimate, why_none
from mpisgd.optim import SGD


def test_the_estimator_inverts_the_expected_norms():
    g2, trace = 3.0, 600.0
    small, big = 16, 256
    est = estimate(small, g2 + trace / small, big, g2 + trace / big)
    assert est.grad_sqr == pytest.approx(g2) and est.grad_var == pytest.approx(trace)
    assert est.noise_scale == pytest.approx(trace / g2)
    assert estimate(16, 1.0, 16, 1.0) is None and estimate(16, float("nan"), 32, 1.0) is None


def test_the_estimator_recovers_a_known_noise_scale_from_sampled_gradients():
    """Per-sample gradients G + noise (tr Σ = d σ²): averaged over steps, the estimates approach the truth."""
    rng = np.random.default_rng(0)
    d, sigma, b, k, steps = 50, 2.0, 8, 4, 3000
    G = rng.standard_normal(d) * 0.5
    small, big = [], []
    for _ in range(steps):
        per_rank = G + sigma * rng.standard_normal((k, b, d)).mean(axis=1)  # each rank's mean of b samples
        small.append(float((per_rank ** 2).sum(axis=1).mean()))
        big.append(float((per_rank.mean(axis=0) ** 2).sum()))
    est = estimate(b, float(np.mean(small)), k * b, float(np.mean(big)))
    truth = d * sigma**2 / float(G @ G)
    assert est.noise_scale == pytest.approx(truth, rel=0.1)


def test_why_there_is_none():
    assert "k=1 with m=1" in why_none(1, 1, 4) and why_none(2, 1, 4) == "" and why_none(1, 2, 4) == ""
    assert "off" in why_none(2, 1, 0)


def _grad_sq(model, x, y) -> float:
    """|mean-loss gradient|^2 of one batch, computed on its own."""
    loss = SoftmaxCrossEntropy()
    model.set_accumulate(False)
    loss.forward_array(model.forward(x), y)
    model.backward(loss.backward(1.0 / len(y)))
    return float(model.flat.grads.astype(np.float64) @ model.flat.grads.astype(np.float64))


@pytest.mark.parametrize("reproducible", [False, True])
def test_one_rank_measures_its_first_micro_batch_against_the_whole_step(reproducible):
    """k = 1, m = 2: the small batch is a micro-batch (the first one; every one when reproducible), the big
    one the step's; the sums are in true units (not the buffer's 1/m scaling)."""
    from mpi4py import MPI

    from mpisgd.parallel import DataParallel

    data = synthetic(64, seed=1)
    x, y = BatchLoader(data, np, "float64").batch(np.arange(32))
    halves = [(x[:16].copy(), y[:16].copy()), (x[16:].copy(), y[16:].copy())]
    model = mlp((12,)).materialize(np, "float64", seed=0)
    dp = DataParallel(model, SGD(model.flat, level1=not reproducible), MPI.COMM_SELF, noise_every=1,
                      reproducible=reproducible)
    params = model.flat.params.copy()
    dp.train_step(halves, lr=0.0)
    t = dp.times
    dp.close()
    check = mlp((12,)).materialize(np, "float64", seed=0)
    check.flat.params[...] = params
    small = [_grad_sq(check, *h) for h in halves]
    expected_small = np.mean(small) if reproducible else small[0]
    assert t.noise_steps == 1 and t.b_small == 16
    assert t.small_sq == pytest.approx(expected_small, rel=1e-9)
    assert t.big_sq == pytest.approx(_grad_sq(check, x, y), rel=1e-9)


@pytest.mark.mpi(min_size=2)
def test_each_rank_measures_its_own_gradient_before_the_all_reduce():
    from mpisgd.comm import create_reducer
    from mpisgd.parallel import DataParallel

    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    data = synthetic(16 * k, seed=2)
    x, y = BatchLoader(data, np, "float64").batch(np.arange(16 * k))
    mine = (x[16 * r:16 * (r + 1)].copy(), y[16 * r:16 * (r + 1)].copy())
    model = mlp((12,)).materialize(np, "float64", seed=0)
    dp = DataParallel(model, SGD(model.flat), comm, reducer=create_reducer("auto", comm), noise_every=1,
                      bucket_cap_mb=0.0005)
    params = model.flat.params.copy()
    dp.train_step([mine], lr=0.0)
    t = dp.times
    dp.close()
    check = mlp((12,)).materialize(np, "float64", seed=0)
    check.flat.params[...] = params
    own, whole = _grad_sq(check, *mine), _grad_sq(check, x, y)
    ok = t.small_sq == pytest.approx(own, rel=1e-9) and t.big_sq == pytest.approx(whole, rel=1e-9)  # true units
    assert all(comm.allgather(ok)), (t.small_sq, own, t.big_sq, whole)


def test_a_run_records_the_noise_scale_the_same_for_every_k_when_reproducible(tmp_path):
    """Reproducible, the small batch is every micro-batch whatever k: the statistics do not depend on k
    (up to the float sums of the squared norms)."""
    got = {}
    for k in (1, 3):
        metrics = tmp_path / f"m{k}.jsonl"
        r = run_mpi(k, "-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "1536", "--hidden", "32",
                    "--batch-size", "8", "--global-batch", "48", "--epochs", "2", "--progress", "off",
                    "--reproducible", "--noise-scale-every", "1", "--metrics-file", str(metrics), timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        epochs = [json.loads(line) for line in metrics.read_text().splitlines() if '"epoch"' in line]
        epochs = [e for e in epochs if e["kind"] == "epoch"]
        assert all(e["noise_scale"] > 0 and e["grad_sqr"] > 0 and e["grad_var"] > 0 for e in epochs), epochs
        assert "noise scale" in r.stdout
        got[k] = [e["noise_scale"] for e in epochs]
    np.testing.assert_allclose(got[1], got[3], rtol=1e-6)


def test_one_rank_without_micro_batches_says_why_there_is_none(tmp_path):
    r = run_mpi(1, "-m", "mpisgd.train", "--dataset", "synthetic", "--hidden", "16", "--max-steps", "3",
                "--progress", "off", timeout=120)
    assert r.returncode == 0 and "noise scale: none" in r.stdout, r.stdout
