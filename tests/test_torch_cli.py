"""`python -m mpisgd.train` with a PyTorch model factory: it trains a ResNet (BatchNorm, Dropout) and a GPT,
saves, and python -m mpisgd.evaluate scores the file (with the factory named); at k = 2 its per-step losses
are DistributedDataParallel's (--no-overlap there, as the DDP loop reduces after backward; overlap gives the same
bits: tests/test_torch_parallel.py); a checkpointed run resumes bitwise (parameters and running statistics);
--reproducible says what its bits depend on and gives the same bits at k = 1, 2, 3."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT, run_mpi, serial_only

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'mpisgd[torch]')")

pytestmark = serial_only
ENV = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "MPISGD_PLAN_FILE": "off"}
BASE = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "512", "--limit-test", "200",
        "--progress", "off", "--batch-size", "16"]


def cli(k, *args, env=None, expect=0):
    r = run_mpi(k, *BASE, *args, timeout=400, env={**ENV, **(env or {})}, cwd=ROOT)
    assert r.returncode == expect, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def steps(path):
    return [json.loads(line)["loss"] for line in open(path) if '"kind":"step"' in line]


def test_resnet_trains_saves_and_evaluates_at_k1_and_reproducible_says_what_bits_depend_on(tmp_path, capsys,
                                                                                           torch_one_thread):
    """Evaluate in this process (one torch thread, as the trainer's ranks): it sets no torch state."""
    from mpisgd.app.evaluate import main as evaluate_here

    model = tmp_path / "r.npz"
    r = cli(1, "--model", "torch_factories:tiny_resnet", "--epochs", "1", "--save-model", str(model),
            "--reproducible")
    assert "model: torch_factories:tiny_resnet" in r.stdout and "Conv2d 4x1x3x3" in r.stdout
    said = " ".join(r.stdout.split())  # the banner's lines wrap where the machine's names make them
    assert "reproducible:" in said and "torch 2" in said and "deterministic algorithms" in said, r.stdout
    acc = r.stdout.split("final test accuracy ")[1].split()[0]
    saved = np.load(model)
    assert saved["state"].size == 2 * (4 + 8 + 8 + 8) + 4  # four BatchNorms' running statistics and counts
    capsys.readouterr()
    status = evaluate_here([str(model), "--dataset", "synthetic", "--limit-test", "200", "--model-factory",
                            "torch_factories:tiny_resnet"])
    out, err = capsys.readouterr()
    assert status == 0, err[-2000:]
    assert f"accuracy {acc}" in out  # eval mode and the saved running statistics: the trainer's score
    status = evaluate_here([str(model), "--dataset", "synthetic"])
    err = capsys.readouterr().err
    assert status == 2 and "--model-factory" in err and err.count("\n") == 1, err


def test_losses_at_k2_match_distributed_data_parallel(tmp_path):
    """The CLI's per-step losses (rank 0's batch) against a plain DDP loop over the same data, order, initial
    values and SGD (tests/torch_ddp_reference.py), float64."""
    metrics = tmp_path / "m.jsonl"
    cli(2, "--model", "torch_factories:tiny_mlp", "--epochs", "1", "--dtype", "float64", "--lr", "0.05",
        "--lr-scaling", "none", "--decay", "none", "--no-overlap", "--metrics-file", str(metrics))
    ours = steps(metrics)
    r = run_mpi(2, str(ROOT / "tests" / "torch_ddp_reference.py"), "--model", "torch_factories:tiny_mlp",
                "--samples", "512", "--batch-size", "16", "--lr", "0.05", "--seed", "0", "--steps", str(len(ours)),
                "--dtype", "float64", env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(ours, json.loads(r.stdout.strip().splitlines()[-1]), rtol=1e-10)
    assert len(ours) == 512 // 32


def test_gpt_at_k2_sharded_accumulated_with_the_noise_scale_planner_and_evaluate(tmp_path):
    """The sharded step (AdamW), two micro-batches per step, TensorBoard, the noise scale; the planner reads
    the metrics file; evaluate scores the saved model."""
    model, metrics = tmp_path / "g.npz", tmp_path / "g.jsonl"
    r = cli(2, "--model", "torch_factories:tiny_gpt", "--epochs", "2", "--optimizer", "adamw", "--lr", "0.01",
            "--batch-size", "8", "--accum-steps", "2", "--shard-optimizer", "--no-overlap", "--save-model",
            str(model), "--metrics-file", str(metrics), "--tensorboard", str(tmp_path / "tb"))
    assert "step sharded" in r.stdout and "m=2" in r.stdout
    epochs = [json.loads(line) for line in open(metrics) if '"kind":"epoch"' in line]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] and "noise_scale" in epochs[-1]
    assert any(p.name.startswith("events.") for p in (tmp_path / "tb").rglob("*"))
    plan = run_mpi(1, "-m", "mpisgd.plan", str(metrics), "--ranks", "1,2,4", "--link", "10gbe", "--noise-scale",
                   "100", env=ENV, cwd=ROOT, timeout=120)
    assert plan.returncode == 0 and "recommended" in plan.stdout, plan.stderr[-2000:]
    ev = run_mpi(2, "-m", "mpisgd.evaluate", str(model), "--dataset", "synthetic", "--limit-test", "200",
                 "--model-factory", "torch_factories:tiny_gpt", env=ENV, cwd=ROOT, timeout=200)
    assert ev.returncode == 0 and "accuracy" in ev.stdout, ev.stderr[-2000:]


def test_reproducible_refuses_a_forward_that_draws_from_torchs_generator():
    r = cli(1, "--model", "torch_factories:functional_dropout", "--epochs", "1", "--reproducible", expect=2)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--reproducible" in lines[0] and "torch's random generator" in lines[0], r.stderr


def test_checkpoint_and_resume_end_bitwise_where_an_uninterrupted_run_does(tmp_path):
    """k = 1, a ResNet with BatchNorm and Dropout: killed after its checkpoint at step 20, resumed; the
    parameters and the running statistics are those of the run that was never interrupted."""
    args = ["--model", "torch_factories:tiny_resnet", "--epochs", "2"]
    cli(1, *args, "--save-model", str(tmp_path / "full.npz"))
    ck = str(tmp_path / "ck")
    cli(1, *args, "--checkpoint-dir", ck, "--checkpoint-every", "20", expect=1, env={"MPISGD_FAIL_AT_STEP": "25:0"})
    r = cli(1, *args, "--checkpoint-dir", ck, "--checkpoint-every", "20", "--resume", "auto",
            "--save-model", str(tmp_path / "resumed.npz"))
    assert "resumed from" in r.stdout and "at step 20" in r.stdout
    full, resumed = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
    np.testing.assert_array_equal(resumed["flat"], full["flat"])
    np.testing.assert_array_equal(resumed["state"], full["state"])


def test_a_reproducible_resume_on_the_same_machine_warns_of_nothing(tmp_path):
    """The checkpoint records torch's build and threads; the resumed run, on the same machine, compares them
    with its own once its PyTorch model is set up (not before, when it had none: a warning '-> None')."""
    args = ["--model", "torch_factories:tiny_mlp", "--reproducible", "--max-steps", "4", "--checkpoint-dir",
            str(tmp_path / "ck"), "--checkpoint-every", "2"]
    cli(1, *args)
    r = cli(1, *args, "--resume", str(tmp_path / "ck" / "ckpt-000000002.npz"), "--overwrite-checkpoints")
    assert "resumed from" in r.stdout and "deterministic algorithms" in r.stdout, r.stdout  # torch's, set up
    assert "other arithmetic" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_reproducible_resnet_with_batch_norm_and_dropout_has_the_same_bits_at_k_1_2_3(tmp_path):
    """A torch ResNet with BatchNorm (statistics per fixed micro-batch, through the stat row) and Dropout
    (keyed by sample): parameters and running statistics bitwise equal at k = 1, 2, 3 under --reproducible;
    the control: without it, k = 1 and 2 differ."""
    def params(k, tag, *extra):
        out = tmp_path / f"{tag}{k}.npz"
        cli(k, "--model", "torch_factories:tiny_resnet", "--batch-size", "8", "--global-batch", "48",
            "--max-steps", "6", "--warmup-epochs", "0", "--save-model", str(out), *extra)
        with np.load(out) as z:
            return z["flat"], z["state"]

    runs = {k: params(k, "rep", "--reproducible") for k in (1, 2, 3)}
    for k in (2, 3):
        np.testing.assert_array_equal(runs[k][0], runs[1][0])
        np.testing.assert_array_equal(runs[k][1], runs[1][1])
    plain = [params(k, "plain")[0] for k in (1, 2)]
    assert not np.array_equal(*plain)


def test_recurrent_layers_train_and_have_the_same_bits_at_k_1_2_3_under_reproducible(tmp_path):
    """An LSTM of two layers and a bidirectional GRU (their weights views of mpisgd's buffers, as any
    module's; torch keeps its own list of an RNN's weights): the recurrent weights move from the values the
    factory gave them, and under --reproducible the parameters are bitwise equal at k = 1, 2, 3; the
    control: without it, k = 1 and 2 differ."""
    import torch
    from torch_factories import tiny_lstm

    def params(k, tag, *extra):
        out = tmp_path / f"{tag}{k}.npz"
        cli(k, "--model", "torch_factories:tiny_lstm", "--batch-size", "8", "--global-batch", "48",
            "--max-steps", "6", "--warmup-epochs", "0", "--optimizer", "adamw", "--lr", "0.01",
            "--save-model", str(out), *extra)
        with np.load(out) as z:
            return z["flat"]

    runs = {k: params(k, "rep", "--reproducible") for k in (1, 2, 3)}
    for k in (2, 3):
        np.testing.assert_array_equal(runs[k], runs[1])
    torch.manual_seed(0)  # as the CLI builds the model (--seed 0): its initial values, in torch's order
    module = tiny_lstm((1, 28, 28), 10)
    initial = np.concatenate([p.detach().numpy().ravel() for p in module.parameters()])
    recurrent = sum(p.numel() for m in (module.lstm, module.gru) for p in m.parameters())  # first in that order
    assert initial.shape == runs[1].shape and recurrent < initial.size
    assert (runs[1][:recurrent] != initial[:recurrent]).mean() > 0.9
    plain = [params(k, "plain") for k in (1, 2)]
    assert not np.array_equal(*plain)
