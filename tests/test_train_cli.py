"""The CLI end to end, under real mpiexec: equivalence across k, metrics, banner, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_mpi

REAL = Path("/usr/share/datasets/fashion-mnist")
SYNTH = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "1536", "--dtype", "float64",
         "--hidden", "32,16", "--progress", "off", "--lr", "0.05", "--base-batch", "48", "--weight-decay", "1e-4"]


def train_params(tmp_path: Path, k: int, b: int, *extra: str, steps: int = 10) -> np.ndarray:
    out = tmp_path / f"k{k}_b{b}_{abs(hash(extra))}.npz"
    r = run_mpi(k, *SYNTH, "--batch-size", str(b), "--max-steps", str(steps), "--save-model", str(out), *extra)
    assert r.returncode == 0, r.stderr + r.stdout
    if "--shard-optimizer" in extra:  # hierarchical has no reduce-scatter of its own: the user is told
        warned = "warning: with --allreduce hierarchical there is no reduce-scatter" in r.stdout
        assert warned == ("hierarchical" in extra), r.stdout
    return np.load(out, allow_pickle=False)["flat"]


@pytest.mark.parametrize("k", [2, 3])
def test_k_ranks_equal_one_rank_with_global_batch(tmp_path, k):
    b = 16
    ref = train_params(tmp_path, 1, k * b)
    ours = train_params(tmp_path, k, b)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-10)
    bug = train_params(tmp_path, k, b, "--grad-reduction", "sum")
    assert not np.allclose(bug, ref, rtol=1e-5, atol=1e-10), "forgetting 1/k must change the result"


def test_same_result_for_every_allreduce_setting(tmp_path):
    ref = train_params(tmp_path, 2, 16, "--allreduce", "mpi", "--no-overlap")
    for extra in (("--bucket-mb", "0.001"), ("--bucket-mb", "0.001", "--no-overlap"), ("--check-replicas", "1")):
        np.testing.assert_array_equal(train_params(tmp_path, 2, 16, "--allreduce", "mpi", *extra), ref)


@pytest.mark.parametrize("k", [2, 3])
def test_sharded_optimizer_step_gives_the_replicated_result(tmp_path, k):
    """--shard-optimizer: reduce-scatter, 1/k of the update per rank, all-gather; the same parameters
    up to rounding (summation order at k >= 3, and BLAS's scalar tail at the chunk ends)."""
    ref = train_params(tmp_path, k, 16, "--allreduce", "mpi")
    out = tmp_path / "sharded.npz"
    r = run_mpi(k, *SYNTH, "--batch-size", "16", "--max-steps", "10", "--save-model", str(out),
                "--shard-optimizer", "--bucket-mb", "0.002")
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"optimizer step: sharded (reduce-scatter of each bucket; each rank updates 1/{k}" in r.stdout
    assert "no reduce-scatter" not in r.stdout  # auto reduce-scatters through MPI_Ireduce_scatter
    np.testing.assert_allclose(np.load(out)["flat"], ref, rtol=1e-9, atol=1e-12)
    for other in ("ring", "hierarchical"):  # the ring's own reduce-scatter; hierarchical's full all-reduce
        ours = train_params(tmp_path, k, 16, "--allreduce", other, "--shard-optimizer")
        np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-12)
    if k == 2:  # one rank: nothing to split, and the banner says so
        one = run_mpi(1, *SYNTH, "--max-steps", "2", "--shard-optimizer")
        assert one.returncode == 0 and "nothing to split at k=1" in one.stdout, one.stderr


@pytest.mark.skipif(not REAL.is_dir(), reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_real_data_short_run_writes_metrics(tmp_path, model):
    metrics = tmp_path / "m.jsonl"
    r = run_mpi(2, "-m", "mpisgd.train", "--model", model, "--epochs", "2", "--limit-train", "4096",
                "--limit-test", "1000", "--batch-size", "64", "--metrics-file", str(metrics), "--check-replicas", "20")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for needle in ("MPICH", "k=2 rank(s)", "device: cpu, NumPy", "effective B=128", "lr: eta0=0.1",
                   "rank map: 0:", "final test accuracy", "wall time"):
        assert needle in out, f"{needle!r} missing from:\n{out}"
    assert out.count("final test accuracy") == 1  # rank 0 only
    epochs = [json.loads(line) for line in metrics.read_text().splitlines() if '"kind":"epoch"' in line]
    assert [e["epoch"] for e in epochs] == [1, 2]
    for key in ("epoch", "step", "lr", "train_loss", "test_acc", "samples_per_s", "comm_frac"):
        assert key in epochs[-1]
    assert 0.6 < epochs[-1]["test_acc"] <= 1.0 and epochs[-1]["train_loss"] < epochs[0]["train_loss"] * 1.2
    # peak memory of the largest rank: above the 47 MiB uint8 training set every rank holds, below 1 GiB
    assert 47 < epochs[-1]["peak_rss_mib"] < 1024, epochs[-1]
    assert f"peak memory {epochs[-1]['peak_rss_mib']:.0f} MiB per rank" in out
    # its parts: RSS at start-up (interpreter, NumPy, MPI; no data yet) and what training holds
    last = epochs[-1]
    assert 20 < last["rss_start_mib"] < last["peak_rss_mib"]
    if model == "mlp":  # 1,863,690 float32 parameters, gradients, momentum; 4096 + 1000 images, uint8
        held = (3 * 1_863_690 * 4 + (4096 + 1000) * (784 + 8)) / 2**20
        assert held < last["state_mib"] < held + 4, last  # + activations and batch buffers (b = 64)
    assert f"{last['rss_start_mib']:.0f} at start-up, before any data, then {last['state_mib']:.0f} of" in out
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"kind":"step"' in line]
    assert len(steps) == epochs[-1]["step"] == 2 * (4096 // 128)


@pytest.mark.parametrize("argv,needle", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--model", "vgg"], "invalid choice: 'vgg'"),
    (["--device", "gpu"], "--device gpu but"),
    (["--data-dir", "/nonexistent/fmnist"], "Fashion-MNIST not found; searched /nonexistent/fmnist"),
    (["--dataset", "synthetic", "--synthetic-samples", "8", "--batch-size", "8"], "fewer than one global batch"),
    (["--epochs", "1", "--warmup-epochs", "3", "--dataset", "synthetic"], "longer than the run"),
])
def test_bad_input_one_line_exit_2_everywhere(argv, needle):
    r = run_mpi(2, "-m", "mpisgd.train", *argv, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("mpisgd: error") == 1, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_help_is_printed_once():
    r = run_mpi(2, "-m", "mpisgd.train", "--help", timeout=60)
    assert r.returncode == 0 and r.stdout.count("usage:") == 1 and "--check-replicas" in r.stdout


def test_fp16_compression_on_cpu_warns_and_still_trains(tmp_path):
    """On the CPU, float16 is software arithmetic: the run says so once, and still learns alike."""
    out = tmp_path / "fp16.npz"
    r = run_mpi(2, *SYNTH, "--batch-size", "16", "--max-steps", "10", "--compress", "fp16", "--save-model", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    assert (r.stdout + r.stderr).count("warning: --compress fp16 on the CPU") == 1, r.stdout
    ref = train_params(tmp_path, 2, 16)
    got = np.load(out, allow_pickle=False)["flat"]
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-3)  # rounded on the wire, not wrong
    assert "warning: --compress" not in run_mpi(2, *SYNTH, "--max-steps", "2").stdout
