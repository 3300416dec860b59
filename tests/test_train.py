"""The CLI (mpisgd.train, mpisgd.app.trainer, mpisgd.app.report) end to end, under real mpiexec: equivalence
across k, metrics, banner and final lines, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, run_mpi

REAL = Path("/usr/share/datasets/fashion-mnist")
SYNTH = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "1536", "--dtype", "float64",
         "--hidden", "32,16", "--progress", "off", "--lr", "0.05", "--base-batch", "48", "--weight-decay", "1e-4"]


def mpi_library_name() -> str:
    """The MPI library's name as mpi4py reports it: "MPICH", "Open MPI", ..."""
    from mpi4py import MPI

    return MPI.get_vendor()[0]


def train_params(tmp_path: Path, k: int, b: int, *extra: str, steps: int = 10) -> np.ndarray:
    out = tmp_path / f"k{k}_b{b}_{abs(hash(extra))}.npz"
    r = run_mpi(k, *SYNTH, "--batch-size", str(b), "--max-steps", str(steps), "--save-model", str(out), *extra)
    assert r.returncode == 0, r.stderr + r.stdout
    warned = "warning: --allreduce ring has no reduce-scatter" in r.stdout
    assert warned == ("step sharded" in r.stdout and "ring" in extra), r.stdout  # sharded: the user is told
    return np.load(out, allow_pickle=False)["flat"]


@pytest.mark.parametrize("k", [2, 3])
def test_k_ranks_equal_one_rank_with_global_batch(tmp_path, k):
    b = 16
    ref = train_params(tmp_path, 1, k * b)
    ours = train_params(tmp_path, k, b)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-10)
    bug = train_params(tmp_path, k, b, "--lr", str(0.05 * k))  # what forgetting 1/k does: k times the rate
    assert not np.allclose(bug, ref, rtol=1e-5, atol=1e-10), "the check must see a k-times rate"


def test_same_result_for_every_allreduce_setting(tmp_path):
    ref = train_params(tmp_path, 2, 16, "--allreduce", "mpi", "--no-overlap")
    for extra in (("--bucket-mb", "0.001"), ("--bucket-mb", "0.001", "--no-overlap"), ("--check-replicas", "1")):
        np.testing.assert_array_equal(train_params(tmp_path, 2, 16, "--allreduce", "mpi", *extra), ref)


@pytest.mark.parametrize("k", [2, 3])
def test_sharded_optimizer_step_gives_the_replicated_result(tmp_path, k):
    """--shard-optimizer: reduce-scatter, 1/k of the update per rank, all-gather. With the default all-reduce
    (the node-shared buffer, rank-order sums either way) the same bits as the replicated step, at any k
    and bucket size; with others the same parameters up to the summation order at k >= 3."""
    ref = train_params(tmp_path, k, 16, "--allreduce", "mpi", "--no-shard-optimizer")
    out = tmp_path / "sharded.npz"
    r = run_mpi(k, *SYNTH, "--batch-size", "16", "--max-steps", "10", "--save-model", str(out),
                "--shard-optimizer", "--bucket-mb", "0.002")
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"step sharded (--shard-optimizer): each rank updates 1/{k}" in r.stdout, r.stdout
    assert "no reduce-scatter" not in r.stdout  # auto reduce-scatters in the node-shared buffer
    np.testing.assert_allclose(np.load(out)["flat"], ref, rtol=1e-9, atol=1e-12)
    for buckets in ("25", "0.002"):  # the default strategy: bitwise, whatever the chunks' bounds
        rep = train_params(tmp_path, k, 16, "--bucket-cap-mb", buckets, "--no-shard-optimizer")
        np.testing.assert_array_equal(train_params(tmp_path, k, 16, "--bucket-cap-mb", buckets), rep)
    for other in ("ring", "deterministic"):  # the ring's full all-reduce; the deterministic reduce-scatter
        ours = train_params(tmp_path, k, 16, "--allreduce", other, "--shard-optimizer")
        np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-12)
    if k == 2:  # one rank: nothing to split, and the banner says so; the default at k >= 2 shards 1 MiB or more
        one = run_mpi(1, *SYNTH, "--max-steps", "2", "--shard-optimizer")
        assert one.returncode == 0 and "nothing to split at k=1" in one.stdout, one.stderr
        small = run_mpi(2, *SYNTH, "--max-steps", "2")  # 0.1 MiB of float64 parameters
        assert "step replicated (default under 1 MiB of parameters" in small.stdout, small.stdout
        default = run_mpi(2, *SYNTH, "--max-steps", "2", "--hidden", "512")  # 3.1 MiB
        assert "step sharded (default at k >= 2 on host buffers, 1 MiB" in default.stdout, default.stdout
        off = run_mpi(2, *SYNTH, "--max-steps", "2", "--no-shard-optimizer")
        assert "step replicated (--no-shard-optimizer)" in off.stdout, off.stdout


@pytest.mark.parametrize("k", [2, 3])
def test_lars_k_ranks_sharded_or_not_equal_one_rank(tmp_path, k):
    """--optimizer lars: k ranks (replicated, or sharded with chunks that split layers) reach one rank's
    parameters with k times the batch; the banner names it."""
    lars = ("--optimizer", "lars", "--trust-coef", "0.02", "--lr", "2")
    ref = train_params(tmp_path, 1, k * 16, *lars)
    np.testing.assert_allclose(train_params(tmp_path, k, 16, *lars, "--no-shard-optimizer"), ref, rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(train_params(tmp_path, k, 16, *lars, "--shard-optimizer"), ref, rtol=1e-9, atol=1e-12)
    assert not np.allclose(train_params(tmp_path, 1, k * 16), ref, rtol=1e-5)  # LARS is not SGD here
    r = run_mpi(1, *SYNTH, *lars, "--max-steps", "1", timeout=60)
    assert "optimizer: LARS, trust coefficient 0.02, momentum 0.9, weight decay 0.0001" in r.stdout, r.stdout


@pytest.mark.parametrize("k,optimizer", [(2, "adamw"), (3, "lamb")])
def test_adam_family_with_clipping_k_ranks_sharded_or_not_equal_one_rank(tmp_path, k, optimizer):
    """--optimizer adamw|lamb with --clip-grad-norm: k ranks, replicated or sharded, reach one rank's
    parameters with k times the batch; the clipping reaches the step (without it the run differs)."""
    opts = ("--optimizer", optimizer, "--lr", "0.005", "--clip-grad-norm", "0.05")
    ref = train_params(tmp_path, 1, k * 16, *opts)
    np.testing.assert_allclose(train_params(tmp_path, k, 16, *opts), ref, rtol=1e-9, atol=1e-12)
    sharded = train_params(tmp_path, k, 16, *opts, "--shard-optimizer", "--bucket-mb", "0.002")
    np.testing.assert_allclose(sharded, ref, rtol=1e-9, atol=1e-12)
    assert not np.allclose(train_params(tmp_path, k, 16, *opts[:-2]), ref, rtol=1e-5)  # unclipped
    r = run_mpi(1, *SYNTH, *opts, "--max-steps", "1", timeout=60)
    name = "AdamW" if optimizer == "adamw" else "LAMB"
    decay = " (decoupled)" if optimizer == "adamw" else ""
    assert f"optimizer: {name}, betas 0.9, 0.999, eps 1e-08, weight decay 0.0001{decay}, gradient clipped to norm " \
           "0.05 | " in r.stdout, r.stdout


@pytest.mark.skipif(not REAL.is_dir(), reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_real_data_short_run_writes_metrics(tmp_path, model):
    metrics = tmp_path / "m.jsonl"
    r = run_mpi(2, "-m", "mpisgd.train", "--model", model, "--epochs", "2", "--limit-train", "4096",
                "--limit-test", "1000", "--batch-size", "64", "--metrics-file", str(metrics), "--check-replicas", "20")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    lr = "lr: 0.1 for B0=256" if model == "mlp" else "lr: 0.02 for B0=256"  # the CNN's own default recipe
    for needle in (mpi_library_name(), "k=2 rank(s) on 1 node(s)", "device: cpu, NumPy", "B=128 |", lr,
                   ": ranks 0-1", "all-reduce: node-shared buffer on this node", "final test accuracy", "wall time"):
        assert needle in out, f"{needle!r} missing from:\n{out}"
    assert out.count("final test accuracy") == 1  # rank 0 only
    banner = out[:out.index("epoch ")]
    assert all(len(line) <= 120 for line in banner.splitlines()), banner
    assert "Error" not in banner and "\x00" not in out  # no exception text, no NUL from the MPI library
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
               for line in metrics.read_text().splitlines()]
    epochs = [e for e in records if e["kind"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    for key in ("epoch", "step", "lr", "train_loss", "test_acc", "samples_per_s", "comm_frac", "allreduce"):
        assert key in epochs[-1]
    assert 0.6 < epochs[-1]["test_acc"] <= 1.0 and epochs[-1]["train_loss"] < epochs[0]["train_loss"] * 1.2
    # peak memory of the largest rank: above the 47 MiB uint8 training set every rank holds, below 1 GiB,
    # and its parts: RSS at start-up (interpreter, NumPy, MPI; no data yet), what training holds, the rest
    last = epochs[-1]
    assert 47 < last["peak_rss_mib"] < 1024, last
    assert 20 < last["rss_start_mib"] < last["peak_rss_mib"]
    if model == "mlp":  # 1,863,690 float32 parameters, gradients, momentum, and (sharded, the default at
        # k = 2) this rank's half of the averaged gradient; 4096 + 1000 images, uint8
        held = (3 * 1_863_690 * 4 + 1_863_690 // 2 * 4 + (4096 + 1000) * (784 + 8)) / 2**20
        assert held < last["state_mib"] < held + 4, last  # + activations and batch buffers (b = 64)
    line = next(x for x in out.splitlines() if x.startswith("memory: peak"))
    peak, start, state, other = (int(w) for w in line.replace("=", " ").replace("+", " ").split() if w.isdigit())
    assert abs(peak - (start + state + other)) <= 2 and peak == round(last["peak_rss_mib"]), line
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"kind":"step"' in line]
    assert len(steps) == epochs[-1]["step"] == 2 * (4096 // 128)


@pytest.mark.parametrize("argv,needle", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--model", "vgg"], "--model must be mlp, cnn or package.module:function"),
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


def test_help_is_printed_once_and_lists_only_what_a_user_sets():
    r = run_mpi(2, "-m", "mpisgd.train", "--help", timeout=60)
    assert r.returncode == 0 and r.stdout.count("usage:") == 1 and "--check-replicas" in r.stdout
    for gone in ("--fail-at-step", "--fail-rank", "--grad-reduction", "--compress", "(default: None)"):
        assert gone not in r.stdout
    assert r.stdout.count("OMP_NUM_THREADS") == 1


def test_progress_on_shows_a_bar_under_mpiexec_and_threads_follow_omp_num_threads():
    r = run_mpi(2, *SYNTH, "--max-steps", "40", "--progress", "on", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert "epoch 1:" in r.stderr and "it/s" in r.stderr  # tqdm, forwarded by the launcher
    assert "BLAS threads per rank: 1 (OMP_NUM_THREADS)" in r.stdout
    quiet = run_mpi(2, *SYNTH, "--max-steps", "4", "--threads", "1")  # SYNTH has --progress off
    assert "it/s" not in quiet.stderr and "BLAS threads per rank: 1 (--threads)" in quiet.stdout


# -- your data and your model (docs/data.md) ----------------------------------------------------------
def image_set(path: Path, n: int = 2400, shape=(3, 12, 12), classes: int = 4, dtype: str = "float32",
              layout: str = "npz", seed: int = 0) -> Path:
    """A learnable C x H x W set: one random template per class plus noise (uint8: scaled to 0..255)."""
    rng = np.random.default_rng(seed)
    templates = rng.normal(size=(classes, *shape))
    arrays = {}
    for split, m in (("train", n), ("test", n // 4)):
        y = rng.integers(0, classes, m)
        x = templates[y] + 0.8 * rng.normal(size=(m, *shape))
        x = np.clip(x * 40 + 128, 0, 255).astype(np.uint8) if dtype == "uint8" else x.astype(dtype)
        arrays[f"x_{split}"], arrays[f"y_{split}"] = x, y
    if layout == "npz":
        np.savez(path, **arrays)
    else:
        path.mkdir()
        for name, a in arrays.items():
            np.save(path / f"{name}.npy", a)
    return path


DATA = ["-m", "mpisgd.train", "--dtype", "float64", "--progress", "off", "--lr", "0.05", "--base-batch", "48",
        "--max-steps", "8"]


@pytest.mark.parametrize("model", ["mlp", "cnn", "examples.model_factory:small_convnet"])
def test_your_data_and_model_train_k_invariantly(tmp_path, model):
    """k ranks with b = one rank with k*b, on an .npz of 3x12x12 images, for each built-in model and a
    model factory of one's own (loaded from examples/, run from the repository root)."""
    data = image_set(tmp_path / "set.npz")
    runs = {}
    for k in (1, 2, 3):
        out = tmp_path / f"k{k}.npz"
        r = run_mpi(k, *DATA, "--data", str(data), "--model", model, "--batch-size", str(48 // k), "--hidden", "32",
                    "--save-model", str(out), cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "samples 3x12x12 float32, 4 classes" in r.stdout, r.stdout
        runs[k] = np.load(out)["flat"]
    np.testing.assert_allclose(runs[2], runs[1], rtol=1e-6, atol=1e-10)
    np.testing.assert_allclose(runs[3], runs[1], rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize("layout,dtype", [("npz", "uint8"), ("dir", "float32")])
def test_your_data_learns_to_the_accuracy_it_allows(tmp_path, layout, dtype):
    data = image_set(tmp_path / ("set.npz" if layout == "npz" else "set"), layout=layout, dtype=dtype)
    r = run_mpi(2, "-m", "mpisgd.train", "--data", str(data), "--hidden", "64", "--epochs", "3", "--batch-size", "32",
                "--progress", "off", "--lr", "0.05")
    assert r.returncode == 0, r.stderr[-3000:]
    acc = float(r.stdout.split("final test accuracy ")[1].split()[0])
    assert acc > 0.9, r.stdout  # well-separated classes


def bad_set(tmp_path: Path, case: str) -> Path:
    rng = np.random.default_rng(0)
    a = {"x_train": rng.normal(size=(64, 5)).astype("float32"), "y_train": rng.integers(0, 3, 64),
         "x_test": rng.normal(size=(16, 5)).astype("float32"), "y_test": rng.integers(0, 3, 16)}
    if case == "missing":
        del a["y_test"]
    elif case == "shapes":
        a["x_test"] = rng.normal(size=(16, 6)).astype("float32")
    elif case == "float labels":
        a["y_train"] = a["y_train"].astype("float32")
    elif case == "negative":
        a["y_train"][3] = -1
    elif case == "nan":
        a["x_train"][10, 2] = np.nan
    elif case == "empty":
        a["x_test"], a["y_test"] = a["x_test"][:0], a["y_test"][:0]
    elif case == "int inputs":
        a["x_train"] = a["x_train"].astype("int32")
    path = tmp_path / f"{case.replace(' ', '_')}.npz"
    np.savez(path, **a)
    return path


@pytest.mark.parametrize("case,says", [
    ("missing", "missing y_test"), ("shapes", "they must have one shape"), ("float labels", "must be integers"),
    ("negative", "labels must be >= 0"), ("nan", "hold NaN (sample 10, the first)"), ("empty", "the test set is empty"),
    ("int inputs", "must be uint8 or floating point"), ("small", "fewer than one global batch"),
])
def test_bad_data_is_one_line_and_exit_2(tmp_path, case, says):
    data = bad_set(tmp_path, "ok" if case == "small" else case)
    r = run_mpi(2, "-m", "mpisgd.train", "--data", str(data), "--hidden", "8", "--progress", "off",
                "--batch-size", "64" if case == "small" else "8", timeout=120)
    assert r.returncode == 2 and r.stderr.count("mpisgd: error") == 1, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr and "epoch" not in r.stdout, r.stderr


BAD_MODELS = """
from mpisgd.nn import Flatten, Linear, Sequential
def raises(input_shape, n_classes):
    raise RuntimeError("this model is broken")
def three_outputs(input_shape, n_classes):
    return Sequential(Flatten(), Linear(5, 3 + 1))
def not_a_model(input_shape, n_classes):
    return 42
"""


@pytest.mark.parametrize("model,says", [
    ("nosuchmodule:f", "cannot import nosuchmodule"), ("badmodels:nope", "badmodels has no nope"),
    ("badmodels:raises", "raised RuntimeError: this model is broken"),
    ("badmodels:three_outputs", "gives (4,) outputs per sample; the data have 3 classes"),
    ("badmodels:not_a_model", "must return an mpisgd.nn.Module (e.g. a Sequential), got int"),
    ("cnn", "--model cnn takes C x H x W samples"), ("vgg", "--model must be mlp, cnn or package.module:function"),
])
def test_bad_models_are_one_line_and_exit_2(tmp_path, model, says):
    (tmp_path / "badmodels.py").write_text(BAD_MODELS)
    r = run_mpi(2, "-m", "mpisgd.train", "--data", str(bad_set(tmp_path, "ok")), "--model", model, "--progress",
                "off", "--batch-size", "8", cwd=tmp_path, timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr.count("mpisgd: error") == 1, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("k,slow", [(2, 1), (3, 2), (3, 0)])
def test_straggler_report_names_the_injected_slow_rank(tmp_path, k, slow):
    """A rank made 8 ms slower per step ($MPISGD_DELAY_RANK, the experiment's test-only switch) is named in
    the epoch line, and the metrics give every rank's share of the waiting."""
    metrics = tmp_path / "m.jsonl"
    r = run_mpi(k, *SYNTH, "--batch-size", "16", "--max-steps", "30", "--metrics-file", str(metrics),
                env={"MPISGD_DELAY_RANK": f"{slow}:8"})
    assert r.returncode == 0, r.stderr
    epoch = [json.loads(x) for x in metrics.read_text().splitlines() if '"kind":"epoch"' in x][-1]
    assert epoch["slowest_rank"] == slow and len(epoch["wait_caused_ms"]) == k == len(epoch["lag_ms"])
    others = epoch["wait_caused_ms"][:slow] + epoch["wait_caused_ms"][slow + 1:]
    assert epoch["wait_caused_ms"][slow] > 5 and max(others) < 3, epoch["wait_caused_ms"]
    assert f"slowest: rank {slow} (" in r.stdout and "ms/step for it" in r.stdout, r.stdout
