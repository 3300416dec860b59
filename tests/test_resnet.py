"""--model resnet (mpisgd.nn.resnet): ResNet-20 as PyTorch computes it (train and eval mode), and the model's
state (BatchNorm's running statistics) wherever a model goes: the trainer's, --val-split's and evaluate's scores
agree in eval mode, checkpoint -> resume continues the same bits, --save-model -> load_model / evaluate keep
it; --reproducible refuses SyncBatchNorm."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, clean_env, run_mpi, script, serial_only, train_here, world

import mpisgd
from mpisgd.data import BatchLoader, hold_out, synthetic
from mpisgd.nn import BatchNorm2d, Conv2d, Linear, SoftmaxCrossEntropy, resnet, scoring
from mpisgd.nn.models import build_model


def test_resnet_20_is_the_papers_network():
    model = resnet((3, 32, 32), 10).materialize(np, "float32")
    assert model.flat.size == 272_474  # He et al.'s ResNet-20 for CIFAR-10 has 0.27 M (option B shortcuts)
    convs = [m for m in model.modules() if isinstance(m, Conv2d)]
    assert len([c for c in convs if c.k == 3]) == 19 and len([c for c in convs if c.k == 1]) == 2
    assert sum(isinstance(m, Linear) for m in model.modules()) == 1
    assert model.stat_size == 2 * sum(m.C for m in model.modules() if isinstance(m, BatchNorm2d))
    with pytest.raises(ValueError, match="depth must be 6n"):
        resnet(depth=21)
    with pytest.raises(ValueError, match="takes C x H x W samples"):
        build_model("resnet", (784,), 10)


@pytest.mark.parametrize("model", ["resnet", "cnn"])
def test_channels_last_images_are_refused_naming_the_transpose(model):
    """N x H x W x C arrays (CIFAR as many loaders give it, Fashion-MNIST with a trailing 1) trained as 32 or 28
    channels of images 3 or 1 pixel wide; refused in one line. Channels-first images of any size still build."""
    for shape, says in (((32, 32, 3), "3 channel(s) of 32 x 32 images"), ((28, 28, 1), "1 channel(s) of 28 x 28")):
        with pytest.raises(ValueError, match=rf"look like H x W x C \(channels last: {re.escape(says)}.*"
                                             r"x.transpose\(0, 3, 1, 2\)"):
            build_model(model, shape, 10)
    for shape in ((3, 32, 32), (1, 28, 28), (4, 16, 16), (16, 12, 12)):
        build_model(model, shape, 10)


@pytest.mark.parametrize("in_shape", [(1, 12, 12), (3, 9, 11)])
def test_resnet_is_pytorchs_in_train_and_eval_mode(in_shape):
    """Same parameters: the same logits, parameter gradients and running statistics after a train-mode step,
    and the same eval-mode logits, in float64 (ResNet-8, narrow: the structure of every depth), as the twin
    that benchmarks/baselines.py times."""
    torch = pytest.importorskip("torch")
    widths = (4, 8, 16)
    model = resnet(in_shape, 5, depth=8, widths=widths).materialize(np, "float64", seed=1)
    net = script("benchmarks", "baselines").torch_resnet(torch, in_shape[0], 5, 1, widths).double()
    rng = np.random.default_rng(2)
    model.flat.params[:] += rng.uniform(-0.1, 0.1, model.flat.size)  # BN's gamma and beta off 1 and 0
    theirs = list(net.parameters())
    ours = list(model.named_parameters())
    assert len(ours) == len(theirs)
    with torch.no_grad():
        for (name, p), t in zip(ours, theirs, strict=True):
            t.copy_(torch.from_numpy(p.T.copy() if name.endswith("Linear.W") else p))
    x, labels = rng.standard_normal((6, *in_shape)), rng.integers(0, 5, 6)
    loss = SoftmaxCrossEntropy()
    logits = model.forward(x)
    loss.forward(logits, labels)
    model.backward(loss.backward())
    t_logits = net(torch.from_numpy(x))
    torch.nn.functional.cross_entropy(t_logits, torch.from_numpy(labels)).backward()
    np.testing.assert_allclose(logits, t_logits.detach().numpy(), rtol=1e-9, atol=1e-12)
    for (name, _), g, t in zip(ours, np.split(model.flat.grads, model.flat.offsets[1:-1]), theirs, strict=True):
        want = t.grad.numpy().T if name.endswith("Linear.W") else t.grad.numpy()
        np.testing.assert_allclose(g.reshape(want.shape), want, rtol=1e-7, atol=1e-10, err_msg=name)
    running = [b.numpy() for name, b in net.named_buffers() if "running" in name]
    np.testing.assert_allclose(model.state, np.concatenate(running), rtol=1e-12)
    model.eval()
    net.eval()
    x = rng.standard_normal((3, *in_shape))
    np.testing.assert_allclose(model.forward(x), net(torch.from_numpy(x)).detach().numpy(), rtol=1e-9, atol=1e-12)


# -- the CLI: state wherever a model goes -----------------------------------------------------------------
TINY_BN = '''
from mpisgd.nn import (BatchNorm1d, BatchNorm2d, Conv2d, Dropout, Flatten, GlobalAvgPool2d, Linear, ReLU,
                       Sequential, SyncBatchNorm)

def f(input_shape, n_classes):
    """BatchNorm2d, BatchNorm1d and Dropout: eval mode changes all three."""
    c, h, w = input_shape
    return Sequential(Conv2d(c, 6, 3, stride=2, bias=False), BatchNorm2d(6), ReLU(), Flatten(),
                      Linear(6 * ((h - 3) // 2 + 1) * ((w - 3) // 2 + 1), 16), BatchNorm1d(16), ReLU(), Dropout(0.3),
                      Linear(16, n_classes))

def synced(input_shape, n_classes):
    c, h, w = input_shape
    return Sequential(Conv2d(c, 4, 3, stride=2), SyncBatchNorm(4), GlobalAvgPool2d(), Linear(4, n_classes))
'''
SYNTH = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "1024", "--progress", "off",
         "--batch-size", "32", "--seed", "3", "--lr", "0.1", "--noise-scale-every", "0"]


def cli(tmp_path: Path, *args: str, k: int = 1) -> subprocess.CompletedProcess:
    (tmp_path / "tinybn.py").write_text(TINY_BN)
    return run_mpi(k, *SYNTH, *args, cwd=tmp_path, env={"PYTHONPATH": f"{ROOT}:{tmp_path}"}, timeout=240)


def evaluate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpisgd.evaluate", *args], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env={**clean_env(), "PYTHONPATH": f"{ROOT}:{tmp_path}"})


@serial_only
def test_trainer_validation_and_evaluate_score_the_same_parameters_alike(tmp_path, monkeypatch):
    """A BatchNorm + Dropout model: the trainer's test accuracy, --val-split's validation accuracy and python -m
    mpisgd.evaluate's, all in eval mode, are the same numbers for the same parameters and running statistics;
    scored in train mode (batch statistics, dropout on) they differ: the control that this can fail."""
    r = cli(tmp_path, "--model", "tinybn:f", "--epochs", "2", "--val-split", "0.25", "--test-every-epoch",
            "--metrics-file", "m.jsonl", "--save-model", "model.npz", "--synthetic-samples", "4096", "--lr", "0.4")
    assert r.returncode == 0, r.stderr + r.stdout
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    last = [rec for rec in records if rec["kind"] == "epoch"][-1]
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = mpisgd.load_model(str(tmp_path / "model.npz"), factory="tinybn:f")  # our own factory, named
    assert saved.state is not None and not np.array_equal(saved.state[:6], np.zeros(6))  # trained statistics
    e = evaluate(tmp_path, str(tmp_path / "model.npz"), "--model-factory", "tinybn:f", "--dataset", "synthetic",
                 "--batch-size", "32")
    assert e.returncode == 0, e.stderr
    shown = float(re.search(r"accuracy (\S+) \(", e.stdout).group(1))
    assert shown == pytest.approx(last["test_acc"], abs=5e-5)
    _, val = hold_out(synthetic(4096, 3), 0.25, 3)
    test = synthetic(2000, 3, split=1)

    def accuracy(data, train_mode: bool) -> float:
        loader = BatchLoader(data, np, "float32")
        idx = np.arange(len(data))
        batches = (loader.batch(idx[i:i + 32]) for i in range(0, len(idx), 32))  # one at a time: buffers reused
        if not train_mode:
            return scoring.score(saved, batches).accuracy
        saved.train()
        return sum(int((saved.forward(x).argmax(1) == y).sum()) for x, y in batches) / len(idx)

    assert last["test_acc"] > 0.5  # it learned: the scores below are not chance
    assert accuracy(val, False) == last["val_acc"]
    assert accuracy(test, False) == last["test_acc"]
    assert accuracy(test, True) != last["test_acc"]


@serial_only
def test_checkpoint_resume_continues_the_same_bits_running_statistics_included(tmp_path):
    """k = 1: 12 steps straight, and 6 + a resume for 6 more, give the same parameters and running statistics
    (the checkpoint holds them); a checkpoint of the model without its statistics is refused."""
    common = ["--model", "tinybn:f", "--max-steps", "12", "--checkpoint-every", "6"]
    r = cli(tmp_path, *common, "--checkpoint-dir", "a", "--save-model", "a.npz")
    assert r.returncode == 0, r.stderr + r.stdout
    with np.load(tmp_path / "a" / "ckpt-000000006.npz") as z:
        assert z["model_state"].size == 2 * 6 + 2 * 16
        kept = {k: z[k] for k in z.files}
    (tmp_path / "b").mkdir()
    np.savez(tmp_path / "b" / "ckpt-000000006.npz", **kept)
    r = cli(tmp_path, *common, "--checkpoint-dir", "b", "--resume", "auto", "--save-model", "b.npz")
    assert r.returncode == 0, r.stderr + r.stdout
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    np.testing.assert_array_equal(a["flat"], b["flat"])
    np.testing.assert_array_equal(a["state"], b["state"])
    del kept["model_state"]  # what a checkpoint written without the model's state would be
    (tmp_path / "c").mkdir()
    np.savez(tmp_path / "c" / "ckpt-000000006.npz", **kept)
    r = cli(tmp_path, *common, "--checkpoint-dir", "c", "--resume", "auto")
    assert r.returncode == 2 and r.stderr.count("mpisgd: error") == 1, r.stderr
    assert "holds no model state" in r.stderr and "running statistics" in r.stderr, r.stderr


@serial_only
def test_the_stock_resnet_trains_saves_and_loads_with_its_running_statistics(tmp_path):
    """--model resnet through the CLI (a few steps on a little data): the saved file and the checkpoint both
    hold the running statistics, load_model puts them back, and evaluate scores what the trainer scored."""
    r = run_mpi(1, "-m", "mpisgd.train", "--model", "resnet", "--dataset", "synthetic", "--synthetic-samples", "256",
                "--batch-size", "32", "--max-steps", "4", "--warmup-epochs", "0", "--progress", "off",
                "--limit-test", "128", "--save-model", str(tmp_path / "r.npz"),
                "--checkpoint-dir", str(tmp_path / "ck"), timeout=240)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "model: resnet | 272,186 parameters" in r.stdout
    trained = float(re.search(r"final test accuracy (\S+)", r.stdout).group(1))
    model = mpisgd.load_model(str(tmp_path / "r.npz"))
    with np.load(tmp_path / "r.npz") as z:
        np.testing.assert_array_equal(model.state, z["state"])
        assert z["state"].size == model.stat_size and not np.array_equal(z["state"], resnet().materialize(np).state)
    np.testing.assert_array_equal(mpisgd.load_model(str(tmp_path / "ck")).state, model.state)
    e = evaluate(tmp_path, str(tmp_path / "r.npz"), "--dataset", "synthetic", "--limit-test", "128")
    assert e.returncode == 0 and f"accuracy {trained:.4f}" in e.stdout, e.stdout + e.stderr


@serial_only
@pytest.mark.parametrize("k", [1, 2])
def test_reproducible_refuses_sync_batch_norm_in_one_line(tmp_path, k):
    r = cli(tmp_path, "--model", "tinybn:synced", "--reproducible", "--max-steps", "2", k=k)
    assert r.returncode == 2 and r.stderr.count("mpisgd: error") == 1, r.stderr
    assert "--reproducible: the model's SyncBatchNorm (1) normalises by statistics of all k ranks'" in r.stderr
    assert "Traceback" not in r.stderr



REPRODUCIBLE = ["--batch-size", "8", "--global-batch", "48", "--max-steps", "6", "--warmup-epochs", "0",
                "--limit-test", "64", "--synthetic-samples", "480"]


def residual_params(tmp_path: Path, k: int, tag: str, *extra: str) -> tuple[np.ndarray, np.ndarray]:
    out = tmp_path / f"{tag}-k{k}.npz"
    r = run_mpi(k, *SYNTH, *REPRODUCIBLE, "--save-model", str(out), *extra, cwd=tmp_path,
                env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}, timeout=240)
    assert r.returncode == 0, r.stderr + r.stdout
    with np.load(out) as z:
        return z["flat"], z["state"]


@serial_only
def test_reproducible_residual_network_with_batch_norm_and_dropout_has_the_same_bits_at_k_1_2_3(tmp_path):
    """Residual blocks, BatchNorm (statistics per fixed micro-batch, running statistics averaged over the
    global batch) and Dropout (masks keyed by sample): parameters and running statistics bitwise equal at
    k = 1, 2 and 3. Controls: without --reproducible k = 1 and 3 differ; without Dropout the bits differ
    (the masks took part)."""
    runs = {k: residual_params(tmp_path, k, "rep", "--model", "residual_factory:f", "--reproducible")
            for k in (1, 2, 3)}
    for k in (2, 3):
        np.testing.assert_array_equal(runs[k][0], runs[1][0])
        np.testing.assert_array_equal(runs[k][1], runs[1][1])
    assert not np.array_equal(runs[1][1], resnet((1, 28, 28), 10, depth=8, widths=(4, 4, 8)).materialize(np).state)
    plain = [residual_params(tmp_path, k, "plain", "--model", "residual_factory:f") for k in (1, 3)]
    assert not np.array_equal(plain[0][0], plain[1][0])
    undropped = residual_params(tmp_path, 1, "nodrop", "--model", "residual_factory:no_dropout", "--reproducible")
    assert not np.array_equal(undropped[0], runs[1][0])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("extra", [
    ("--shard-optimizer", "--accum-steps", "2"),
    ("--no-shard-optimizer", "--optimizer", "lars"),
    ("--shard-optimizer", "--optimizer", "lamb", "--lr", "0.01", "--clip-grad-norm", "1"),
    ("--optimizer", "adamw", "--lr", "0.003", "--tensorboard", "tb"),
], ids=["sharded-accumulated", "lars", "lamb-sharded-clipped", "adamw-tensorboard"])
def test_a_residual_network_trains_at_k_ranks_with_every_step_and_optimizer(shared_tmp, extra, monkeypatch):
    """BatchNorm and Dropout at k = 2 and 3, in this job: the sharded and replicated steps, accumulation,
    LARS, LAMB with clipping, AdamW, TensorBoard: the loss stays finite, the running statistics train, the
    noise scale is measured, and the planner reads the metrics (replicas staying identical is checked by
    the k-invariance tests, here and in tests/test_train.py)."""
    from mpisgd.app.plan import main as plan_main

    if "--tensorboard" in extra:
        pytest.importorskip("tensorboardX", reason="tensorboardX is not installed (Open MPI's environment has none)")
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.chdir(shared_tmp)
    metrics = shared_tmp / "m.jsonl"
    r = train_here([*SYNTH[2:], "--model", "residual_factory:f", "--synthetic-samples", "768", "--batch-size", "16",
                    "--epochs", "2", "--warmup-epochs", "0", "--limit-test", "64", "--noise-scale-every", "1",
                    "--metrics-file", str(metrics), "--save-model", str(shared_tmp / "r.npz"), *extra])
    assert r.status == 0, r
    with np.load(shared_tmp / "r.npz") as z:
        flat, state = z["flat"], z["state"]
    assert np.isfinite(flat).all()
    epochs = [json.loads(line) for line in metrics.read_text().splitlines() if '"kind":"epoch"' in line]
    assert len(epochs) == 2 and all(np.isfinite(e["train_loss"]) for e in epochs)
    assert epochs[-1]["noise_scale"] is not None and epochs[-1]["noise_scale"] > 0
    assert state.size and not np.array_equal(state, resnet((1, 28, 28), 10, depth=8, widths=(4, 4, 8))
                                             .materialize(np).state)
    if world().Get_rank() == 0:
        assert plan_main([str(metrics), "--ranks", "1,2,4", "--link", "10gbe"]) == 0
    if "--tensorboard" in extra:
        assert any((shared_tmp / "tb").iterdir())
