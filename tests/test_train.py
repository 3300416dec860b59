"""The CLI (mpisgd.train, mpisgd.app.trainer, mpisgd.app.report): equivalence across k, metrics, banner and
final lines, bad input. The CLI's code runs in the test's process (conftest.train_here) on the job's k ranks
(the MPI-marked tests, at k = 2 and 3 under MPICH and Open MPI), against one rank (this job's rank 0 alone,
on COMM_SELF); one short run on the real data is launched under mpiexec end to end, for the process's
memory."""

from __future__ import annotations

import json
import re
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, mpi_first, root_makes, run_mpi, serial_only, train_here, world

from mpisgd.app.inject import Injected
from mpisgd.app.records import EpochRecord
from mpisgd.app.report import format_epoch, memory_line, rank_map
from mpisgd.app.run import SHARD_MIN_BYTES, shard_policy

REAL = Path("/usr/share/datasets/fashion-mnist")
SYNTH = ["--dataset", "synthetic", "--synthetic-samples", "1536", "--dtype", "float64", "--hidden", "32,16",
         "--progress", "off", "--lr", "0.05", "--base-batch", "48", "--weight-decay", "1e-4"]


def mpi_library_name() -> str:
    """The MPI library's name as mpi4py reports it: "MPICH", "Open MPI", ..."""
    from mpi4py import MPI

    return MPI.get_vendor()[0]


def trained(tmp: Path, b: int, *extra: str, steps: int = 10, comm=None, base=SYNTH) -> np.ndarray:
    """The parameters after ``steps`` steps of batch ``b`` per rank, trained in process on ``comm`` (the job's
    ranks; MPI.COMM_SELF for one rank)."""
    from mpi4py import MPI

    alone = comm is MPI.COMM_SELF
    out = tmp / f"{'one' if alone else 'k'}_b{b}_{zlib.crc32(repr((base, extra, steps)).encode())}.npz"
    r = train_here([*base, "--batch-size", str(b), "--max-steps", str(steps), "--save-model", str(out), *extra],
                   comm=comm)
    assert r.statuses == (0,) * len(r.statuses), r
    warned = "warning: --allreduce ring has no reduce-scatter" in r.out
    assert warned == ("step sharded" in r.out and "ring" in extra), r.out  # sharded: the user is told
    LAST["out"] = r.out
    return np.load(out, allow_pickle=False)["flat"]


LAST: dict[str, str] = {}  # what the last ``trained`` run printed (rank 0's), for the banner's checks


def one_rank(tmp: Path, b: int, *extra: str, **kw) -> np.ndarray:
    """``trained`` by rank 0 alone (COMM_SELF), the parameters on every rank."""
    from mpi4py import MPI

    return root_makes(lambda: trained(tmp, b, *extra, comm=MPI.COMM_SELF, **kw))


def k() -> int:
    return world().Get_size()


@pytest.mark.mpi
def test_k_ranks_equal_one_rank_with_global_batch(shared_tmp):
    b = 16
    ref = one_rank(shared_tmp, k() * b)
    ours = trained(shared_tmp, b)
    assert "step replicated (default under 1 MiB of parameters" in LAST["out"], LAST  # 0.1 MiB
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-10)
    bug = trained(shared_tmp, b, "--lr", str(0.05 * k()))  # what forgetting 1/k does: k times the rate
    assert not np.allclose(bug, ref, rtol=1e-5, atol=1e-10), "the check must see a k-times rate"


@pytest.mark.mpi
def test_same_result_for_every_allreduce_setting(shared_tmp):
    ref = trained(shared_tmp, 16, "--allreduce", "mpi", "--no-overlap")
    for extra in (("--bucket-mb", "0.001"), ("--bucket-mb", "0.001", "--no-overlap"), ("--check-replicas", "1")):
        np.testing.assert_array_equal(trained(shared_tmp, 16, "--allreduce", "mpi", *extra), ref)


@pytest.mark.mpi
def test_sharded_optimizer_step_gives_the_replicated_result(shared_tmp):
    """--shard-optimizer: reduce-scatter, 1/k of the update per rank, all-gather. With the default all-reduce
    (the node-shared buffer, rank-order sums either way) the same bits as the replicated step, at any k
    and bucket size; with others the same parameters up to the summation order at k >= 3."""
    ref = trained(shared_tmp, 16, "--allreduce", "mpi", "--no-shard-optimizer")
    out = shared_tmp / "sharded.npz"
    r = train_here([*SYNTH, "--batch-size", "16", "--max-steps", "10", "--save-model", str(out),
                    "--shard-optimizer", "--bucket-mb", "0.002"])
    assert r.status == 0, r
    assert f"step sharded (--shard-optimizer): each rank updates 1/{k()}" in r.out, r.out
    assert "no reduce-scatter" not in r.out  # auto reduce-scatters in the node-shared buffer
    np.testing.assert_allclose(np.load(out)["flat"], ref, rtol=1e-9, atol=1e-12)
    for buckets in ("25", "0.002"):  # the default strategy: bitwise, whatever the chunks' bounds
        rep = trained(shared_tmp, 16, "--bucket-cap-mb", buckets, "--no-shard-optimizer")
        assert "step replicated (--no-shard-optimizer)" in LAST["out"], LAST
        np.testing.assert_array_equal(trained(shared_tmp, 16, "--bucket-cap-mb", buckets), rep)
    for other in ("ring", "deterministic"):  # the ring's full all-reduce; the deterministic reduce-scatter
        ours = trained(shared_tmp, 16, "--allreduce", other, "--shard-optimizer")
        np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.mpi
def test_the_banner_says_the_step_is_sharded_by_default_from_1_mib():
    """At k >= 2 the default shards 1 MiB of parameters or more (shard_policy's other answers: below, and
    in the other tests' banners)."""
    default = train_here([*SYNTH, "--max-steps", "2", "--hidden", "512"])  # 3.1 MiB of float64 parameters
    assert "step sharded (default at k >= 2 on host buffers, 1 MiB" in default.out, default.out


def test_shard_policy_follows_the_request_then_k_the_device_and_the_size():
    big = SHARD_MIN_BYTES
    assert shard_policy(True, 2, False, 10) == (True, "--shard-optimizer")
    assert shard_policy(True, 1, False, big) == (False, "--shard-optimizer: nothing to split at k=1")
    assert shard_policy(False, 4, False, big) == (False, "--no-shard-optimizer")
    assert shard_policy(None, 4, True, big) == (False, "default on a GPU")
    assert shard_policy(None, 1, False, big) == (False, "nothing to split at k=1")
    assert shard_policy(None, 2, False, big - 1)[0] is False and "too small an update" in \
        shard_policy(None, 2, False, big - 1)[1]
    assert shard_policy(None, 2, False, big) == (True, "default at k >= 2 on host buffers, 1 MiB of parameters or "
                                                       "more")


@pytest.mark.mpi
def test_lars_k_ranks_sharded_or_not_equal_one_rank(shared_tmp):
    """--optimizer lars: k ranks (replicated, or sharded with chunks that split layers) reach one rank's
    parameters with k times the batch; the banner names it."""
    lars = ("--optimizer", "lars", "--trust-coef", "0.02", "--lr", "2")
    ref = one_rank(shared_tmp, k() * 16, *lars)
    np.testing.assert_allclose(trained(shared_tmp, 16, *lars, "--no-shard-optimizer"), ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(trained(shared_tmp, 16, *lars, "--shard-optimizer"), ref, rtol=1e-9, atol=1e-12)
    assert "optimizer: LARS, trust coefficient 0.02, momentum 0.9, weight decay 0.0001" in LAST["out"], LAST
    assert not np.allclose(one_rank(shared_tmp, k() * 16), ref, rtol=1e-5)  # LARS is not SGD here


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_adam_family_with_clipping_k_ranks_sharded_or_not_equal_one_rank(shared_tmp, optimizer):
    """--optimizer adamw|lamb with --clip-grad-norm: k ranks, replicated or sharded, reach one rank's
    parameters with k times the batch; the clipping reaches the step (without it the run differs)."""
    opts = ("--optimizer", optimizer, "--lr", "0.005", "--clip-grad-norm", "0.05")
    ref = one_rank(shared_tmp, k() * 16, *opts)
    np.testing.assert_allclose(trained(shared_tmp, 16, *opts), ref, rtol=1e-9, atol=1e-12)
    sharded = trained(shared_tmp, 16, *opts, "--shard-optimizer", "--bucket-mb", "0.002")
    np.testing.assert_allclose(sharded, ref, rtol=1e-9, atol=1e-12)
    name, decay = ("AdamW", " (decoupled)") if optimizer == "adamw" else ("LAMB", "")
    assert f"optimizer: {name}, betas 0.9, 0.999, eps 1e-08, weight decay 0.0001{decay}, gradient clipped to norm " \
           "0.05 | " in LAST["out"], LAST
    assert not np.allclose(trained(shared_tmp, 16, *opts[:-2]), ref, rtol=1e-5)  # unclipped


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
    for key in ("epoch", "step", "lr", "train_loss", "test_acc", "samples_per_s", "comm_frac"):
        assert key in epochs[-1]
    assert records[0]["kind"] == "run" and records[0]["allreduce_plan"].startswith("node-shared buffer")
    assert 0.6 < epochs[-1]["test_acc"] <= 1.0 and epochs[-1]["train_loss"] < epochs[0]["train_loss"] * 1.2
    # peak memory of the largest rank: above the 47 MiB uint8 training set every rank holds, below 1 GiB,
    # and its parts: RSS at start-up (interpreter, NumPy, MPI; no data yet), what training holds, the rest
    last = epochs[-1]
    assert 47 < last["peak_rss_mib"] < 1024, last
    assert 20 < last["rss_start_mib"] < last["peak_rss_mib"]
    if model == "mlp":  # 1,863,690 float32 parameters and gradients; sharded (the default at k = 2), this
        # rank's half of the momentum (ZeRO-1) and of the averaged gradient; 4096 + 1000 images, uint8
        held = (2 * 1_863_690 * 4 + 2 * (1_863_690 // 2) * 4 + (4096 + 1000) * (784 + 8)) / 2**20
        assert held < last["state_mib"] < held + 4, last  # + activations and batch buffers (b = 64)
    line = next(x for x in out.splitlines() if x.startswith("memory: peak"))
    peak, start, state, other = (int(w) for w in line.replace("=", " ").replace("+", " ").split() if w.isdigit())
    assert abs(peak - (start + state + other)) <= 2 and peak == round(last["peak_rss_mib"]), line
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"kind":"step"' in line]
    assert len(steps) == epochs[-1]["step"] == 2 * (4096 // 128)


@pytest.mark.parametrize("argv,needle", mpi_first([
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--model", "vgg"], "--model must be mlp, cnn, resnet, gpt or package.module:function"),
    (["--device", "gpu"], "--device gpu but"),
    (["--data-dir", "/nonexistent/fmnist"], "Fashion-MNIST not found; searched /nonexistent/fmnist"),
    (["--dataset", "synthetic", "--synthetic-samples", "8", "--batch-size", "16"], "fewer than one global batch"),
    (["--epochs", "1", "--warmup-epochs", "3", "--dataset", "synthetic"], "longer than the run"),
]))
def test_bad_input_one_line_exit_2_everywhere(argv, needle):
    r = train_here(argv)
    assert r.statuses == (2,) * k() and needle in r.error, r


@pytest.mark.mpi
def test_help_is_printed_once_and_lists_only_what_a_user_sets():
    r = train_here(["--help"])
    assert r.statuses == (0,) * k() and r.out.count("usage:") == 1 and "--check-replicas" in r.out
    assert not any(r.outs[1:]), r.outs  # rank 0 only
    for gone in ("--fail-at-step", "--fail-rank", "--grad-reduction", "--compress", "(default: None)"):
        assert gone not in r.out
    assert r.out.count("OMP_NUM_THREADS") == 1


@pytest.mark.mpi
def test_progress_on_shows_a_bar_and_threads_follow_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    r = train_here([*SYNTH, "--max-steps", "40", "--progress", "on"])
    assert r.status == 0, r
    assert "epoch 1:" in r.err and "it/s" in r.err  # tqdm, on rank 0's stderr
    assert "BLAS threads per rank: 1 (OMP_NUM_THREADS)" in r.out
    quiet = train_here([*SYNTH, "--max-steps", "4", "--threads", "1"])  # SYNTH has --progress off
    assert "it/s" not in quiet.err and "BLAS threads per rank: 1 (--threads)" in quiet.out


def test_report_lines_from_their_records():
    assert rank_map([("a", 0, None), ("a", 1, None), ("b", 0, 3)]) == "a: ranks 0-1 | b: rank 2 on gpu 3"
    assert rank_map([("a", 0, None), ("b", 0, None), ("a", 1, None)]) == "a: ranks 0,2 | b: rank 1"
    assert memory_line(130.4, 100.2, 20.1) == "memory: peak 130 MiB per rank (largest rank) = 100 at start-up + " \
                                               "20 training state + 10 other"
    zero = dict.fromkeys(("comm_exposed_ms", "comm_total_ms", "forward_ms", "backward_ms", "optimizer_ms",
                          "step_ms", "bucket_algbw_gbps", "bucket_busbw_gbps", "peak_rss_mib", "rss_start_mib",
                          "state_mib"), 0.0)
    epoch = EpochRecord(epoch=3, step=36, train_loss=0.25, test_acc=0.875, samples_per_s=12345.6, comm_frac=0.052,
                        lr=0.1, epoch_time_s=4.04, noise_scale=2.5e6, skipped_steps=0, world_size=2,
                        effective_batch=64, local_batch=32, accum_steps=1, grad_nbytes=4, **zero)
    assert format_epoch(epoch, 12) == "epoch   3/12  loss 0.2500  test_acc 0.8750  samples/s    12346  waiting " \
                                      "for comm  5.2%  lr 0.1  4.0s  noise scale 2.5e+06"


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


DATA = ["--dtype", "float64", "--progress", "off", "--lr", "0.05", "--base-batch", "48"]


@pytest.mark.mpi
@pytest.mark.parametrize("model", ["mlp", "cnn", "examples.model_factory:small_convnet"])
def test_your_data_and_model_train_k_invariantly(shared_tmp, model, monkeypatch):
    """k ranks with b = one rank with k micro-batches of b, on an .npz of 3x12x12 images, for each built-in
    model and a model factory of one's own (examples/, importable from the repository root; its BatchNorm
    normalises each micro-batch, so the one rank accumulates k micro-batches rather than taking one of k*b)."""
    monkeypatch.syspath_prepend(str(ROOT))
    data = root_makes(lambda: image_set(shared_tmp / "set.npz"))
    run = [*DATA, "--data", str(data), "--model", model, *(("--hidden", "32") if model == "mlp" else ())]
    ours = trained(shared_tmp, 48 // k(), steps=8, base=run)
    assert "samples 3x12x12 float32, 4 classes" in LAST["out"], LAST
    ref = one_rank(shared_tmp, 48 // k(), "--global-batch", "48", steps=8, base=run)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-10)


@serial_only  # one rank's run, in this process
@pytest.mark.parametrize("layout,dtype", [("npz", "uint8"), ("dir", "float32")])
def test_your_data_learns_to_the_accuracy_it_allows(tmp_path, layout, dtype):
    data = image_set(tmp_path / ("set.npz" if layout == "npz" else "set"), layout=layout, dtype=dtype)
    r = train_here(["--data", str(data), "--hidden", "64", "--epochs", "3", "--batch-size", "32", "--progress", "off",
                    "--lr", "0.05"])
    assert r.status == 0, r
    acc = float(r.out.split("final test accuracy ")[1].split()[0])
    assert acc > 0.9, r.out  # well-separated classes


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
    elif case == "fractional labels":
        a["y_train"] = a["y_train"] + 0.5
    elif case == "one-hot":
        a["y_train"] = np.eye(3)[a["y_train"]]
    elif case == "raw scale":
        a["x_train"], a["x_test"] = a["x_train"] * 1e30, a["x_test"] * 1e30
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


@pytest.mark.parametrize("case,says", mpi_first([
    ("missing", "missing y_test"), ("shapes", "they must have one shape"),
    ("float labels", "must be integers, got float32 (whole numbers: y.astype(np.int64))"),
    ("fractional labels", "must be integers, got float64"),
    ("one-hot", "labels of shape (64, 3): one row of scores per sample (one-hot)? mpisgd takes one class index per "
                "sample: y.argmax(axis=1)"),
    ("negative", "labels must be >= 0"), ("nan", "hold NaN (sample 10, the first)"), ("empty", "the test set is empty"),
    ("int inputs", "must be uint8 or floating point"), ("small", "fewer than one global batch"),
]))
def test_bad_data_is_one_line_and_exit_2(shared_tmp, case, says):
    data = root_makes(lambda: bad_set(shared_tmp, "ok" if case == "small" else case))
    r = train_here(["--data", str(data), "--hidden", "8", "--progress", "off", "--batch-size",
                    "128" if case == "small" else "8"])  # 64 samples: not one batch at any k
    assert r.statuses == (2,) * k() and says in r.error and "epoch" not in r.out, r


def test_inputs_far_from_order_one_are_warned_of_and_their_overflow_is_one_line(shared_tmp):
    """Float inputs of about 1e30 (raw units): a warning before training says so; the overflow that follows is the
    trainer's one line (--on-nan), not NumPy's RuntimeWarnings from every rank. Standardised inputs: no word."""
    data = root_makes(lambda: bad_set(shared_tmp, "raw scale"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = train_here(["--data", str(data), "--hidden", "8", "--progress", "off", "--batch-size", "8"])
    assert r.statuses == (1,) * k() and "non-finite gradient" in r.error, r
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    said = " ".join(r.out.split())  # rank 0's warnings wrap to the terminal's width
    assert re.search(r"warning: the training inputs reach [0-9.]+e\+30 in magnitude: models train best on inputs "
                     r"of order 1", said), said
    assert "RuntimeWarning" not in r.err + "".join(r.outs), r.err
    ok = root_makes(lambda: bad_set(shared_tmp, "ok"))
    r = train_here(["--data", str(ok), "--hidden", "8", "--progress", "off", "--batch-size", "8"])
    assert r.status == 0 and "in magnitude" not in r.out, r


BAD_MODELS = """
from mpisgd.nn import Flatten, Linear, Module, Sequential
def raises(input_shape, n_classes):
    raise RuntimeError("this model is broken")
def three_outputs(input_shape, n_classes):
    return Sequential(Flatten(), Linear(5, 3 + 1))
def not_a_model(input_shape, n_classes):
    return 42
def one_argument(input_shape):
    return Sequential(Flatten(), Linear(5, 3))
def negative_width(input_shape, n_classes):
    return Sequential(Flatten(), Linear(5, -3), Linear(-3, n_classes))
class Gain(Module):
    def __init__(self, n):
        super().__init__()
        self.param_shapes = [("g", (n,))]
def empty_parameter(input_shape, n_classes):  # a module of your own checks no size: the model check does
    return Sequential(Flatten(), Linear(5, n_classes), Gain(0))
"""


@pytest.mark.parametrize("model,says", mpi_first([
    ("nosuchmodule:f", "cannot import nosuchmodule"), ("badmodels:nope", "badmodels has no nope"),
    ("badmodels:raises", "raised RuntimeError: this model is broken"),
    ("badmodels:three_outputs", "gives (4,) outputs per sample; the data have 3 classes"),
    ("badmodels:one_argument", "takes 1 positional argument but 2 were given (mpisgd calls a factory as "
                               "f(input_shape, n_classes))"),
    ("badmodels:negative_width", "raised ValueError: Linear(5, -3): its input and output widths must be >= 1"),
    ("badmodels:empty_parameter", "parameter 2.Gain.g has shape (0,): a parameter's dimensions must be "),
    ("badmodels:not_a_model", "must return an mpisgd.nn.Module (e.g. a Sequential) or a torch.nn.Module, got int"),
    ("cnn", "--model cnn takes C x H x W samples"),
    ("vgg", "--model must be mlp, cnn, resnet, gpt or package.module:function"),
]))
def test_bad_models_are_one_line_and_exit_2(shared_tmp, own_module, model, says):
    own_module("badmodels", BAD_MODELS)
    data = root_makes(lambda: bad_set(shared_tmp, "ok"))
    r = train_here(["--data", str(data), "--model", model, "--progress", "off", "--batch-size", "8"])
    assert r.statuses == (2,) * k() and says in r.error, r


@pytest.mark.mpi
@pytest.mark.parametrize("which", ["last", "first"])
def test_straggler_report_names_the_injected_slow_rank(shared_tmp, which):
    """A rank made 20 ms slower per step (the hook $MPISGD_DELAY_RANK sets, mpisgd.app.inject) is named in
    the epoch line, and the metrics book the waiting to it: most of its delay, and several times what any
    other rank caused (a machine shared with other work delays every rank now and then)."""
    slow = k() - 1 if which == "last" else 0
    metrics = shared_tmp / "m.jsonl"
    r = train_here([*SYNTH, "--batch-size", "16", "--max-steps", "30", "--metrics-file", str(metrics)],
                   hooks=Injected(delay=(slow, 0.020)))
    assert r.status == 0, r
    epoch = [json.loads(x) for x in metrics.read_text().splitlines() if '"kind":"epoch"' in x][-1]
    assert epoch["slowest_rank"] == slow and len(epoch["wait_caused_ms"]) == k() == len(epoch["lag_ms"])
    caused = epoch["wait_caused_ms"]
    others = caused[:slow] + caused[slow + 1:]
    assert caused[slow] > 12 and max(others) < caused[slow] / 4, caused
    assert f"slowest: rank {slow} (" in r.out and "ms/step for it" in r.out, r.out
