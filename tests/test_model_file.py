"""The trained model, usable: --save-model's file and checkpoints say what model they hold,
mpisgd.load_model rebuilds it with its weights, python -m mpisgd.evaluate scores it (docs/api.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, clean_env, run_mpi, serial_only
from test_train import image_set

import mpisgd
from mpisgd.checkpoint import TrainState, save_checkpoint
from mpisgd.errors import UsageError
from mpisgd.model_file import ModelFileError, read_model
from mpisgd.nn import build_model

pytestmark = [serial_only, pytest.mark.xdist_group("model_file")]  # one worker makes the module fixture
SYNTH = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "1024", "--hidden", "32",
         "--progress", "off", "--batch-size", "32", "--epochs", "2", "--seed", "4"]


def evaluate(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpisgd.evaluate", *args], capture_output=True, text=True,
                          timeout=180, cwd=cwd, env={**clean_env(), "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short run on the synthetic set: its --save-model file, checkpoint directory and output."""
    d = tmp_path_factory.mktemp("trained")
    r = run_mpi(2, *SYNTH, "--save-model", str(d / "model.npz"), "--checkpoint-dir", str(d / "ckpt"))
    assert r.returncode == 0, r.stderr + r.stdout
    return d, r.stdout


def test_the_saved_file_says_what_model_it_holds(trained):
    d, _ = trained
    with np.load(d / "model.npz", allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        assert set(z.files) == {"flat", "meta", "1.Linear.W", "1.Linear.b", "3.Linear.W", "3.Linear.b"}
        flat = z["flat"]
    assert {k: meta[k] for k in ("format", "version", "model", "in_shape", "classes", "hidden", "dtype",
                                 "parameters", "seed", "step")} == \
        {"format": "mpisgd-model", "version": 1, "model": "mlp", "in_shape": [1, 28, 28], "classes": 10,
         "hidden": [32], "dtype": "float32", "parameters": flat.size, "seed": 4, "step": 32}
    assert meta["data"]["name"] == "synthetic" and meta["input_scale"] > 0


def test_load_model_from_the_file_and_from_a_checkpoint(trained):
    d, _ = trained
    model = mpisgd.load_model(str(d / "model.npz"))
    assert [type(layer).__name__ for layer in model.module.layers] == ["Flatten", "Linear", "ReLU", "Linear"]
    np.testing.assert_array_equal(model.flat.params, np.load(d / "model.npz")["flat"])
    for path in (d / "ckpt", d / "ckpt" / "ckpt-000000032.npz"):  # the directory: its newest checkpoint
        np.testing.assert_array_equal(mpisgd.load_model(str(path)).flat.params, model.flat.params)
    x = np.random.default_rng(0).normal(size=(5, 1, 28, 28)).astype("float32")
    assert model.forward(x).shape == (5, 10)


def test_evaluate_prints_the_accuracy_training_ended_with_and_a_table_per_class(trained):
    d, out = trained
    final = re.search(r"final test accuracy (\d\.\d{4})", out).group(1)
    r = evaluate(str(d / "model.npz"), "--dataset", "synthetic")  # the seed: the model's own (4)
    assert r.returncode == 0, r.stderr
    assert f"accuracy {final} (" in r.stdout, (out, r.stdout)
    rows = [line.split() for line in r.stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [int(row[0]) for row in rows] == list(range(10))
    assert sum(int(row[1]) for row in rows) == 2000
    assert sum(int(row[2].replace(",", "")) for row in rows) == round(float(final) * 2000)
    # under mpiexec: each rank scores its part, the counts are summed, rank 0 prints
    k2 = run_mpi(2, "-m", "mpisgd.evaluate", str(d / "ckpt"), "--dataset", "synthetic", "--limit-test", "999")
    one = evaluate(str(d / "ckpt"), "--dataset", "synthetic", "--limit-test", "999")
    assert k2.returncode == 0 and one.returncode == 0, k2.stderr + one.stderr
    assert k2.stdout.count("accuracy ") == 1 and "| 2 ranks" in k2.stdout
    assert k2.stdout.split("accuracy ", 1)[1] == one.stdout.split("accuracy ", 1)[1]


def test_a_model_of_your_own_on_your_data(tmp_path):
    data = image_set(tmp_path / "set.npz")
    out = tmp_path / "m.npz"
    r = run_mpi(2, "-m", "mpisgd.train", "--data", str(data), "--model", "examples.model_factory:small_convnet",
                "--epochs", "1", "--batch-size", "32", "--progress", "off", "--save-model", str(out), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    final = re.search(r"final test accuracy (\d\.\d{4})", r.stdout).group(1)
    refused = evaluate(str(out), "--data", str(data))  # the file names its factory: never imported from it
    assert refused.returncode == 2 and "--model-factory examples.model_factory:small_convnet" in refused.stderr
    e = evaluate(str(out), "--data", str(data), "--model-factory", "examples.model_factory:small_convnet")
    assert e.returncode == 0 and f"accuracy {final} (" in e.stdout, e.stderr + e.stdout
    assert "3x12x12 float32, 4 classes" in e.stdout
    wrong = evaluate(str(out), "--model-factory", "examples.model_factory:small_convnet")  # 1x28x28 images
    assert wrong.returncode == 2 and "takes samples of shape 3x12x12; this data's are 1x28x28" in wrong.stderr


def old_save_params(path: Path, model) -> None:
    """What --save-model wrote before it recorded the model."""
    np.savez(path, flat=model.flat.params, **{n: p for n, p in model.named_parameters()})


@pytest.mark.parametrize("name,in_shape", [("mlp", (1, 28, 28)), ("cnn", (1, 28, 28)), ("cnn", (3, 12, 12))])
def test_older_files_still_load(tmp_path, name, in_shape):
    model = build_model(name, in_shape, 7, (24, 12)).materialize(np, "float64", seed=3)
    old_save_params(tmp_path / "old.npz", model)
    loaded = read_model(str(tmp_path / "old.npz"), in_shape=in_shape)
    np.testing.assert_array_equal(loaded.model.flat.params, model.flat.params)
    assert loaded.meta["model"] == name and loaded.meta["classes"] == 7 and loaded.model.flat.dtype == np.float64
    x = np.random.default_rng(1).normal(size=(3, *in_shape))
    np.testing.assert_array_equal(loaded.model.forward(x), model.forward(x))
    if name == "mlp" or in_shape == (1, 28, 28):  # square images of the inferred size need no in_shape
        np.testing.assert_array_equal(mpisgd.load_model(str(tmp_path / "old.npz")).flat.params, model.flat.params)


def test_an_older_checkpoint_of_an_mlp_loads(tmp_path):
    model = build_model("mlp", (784,), 10, (16, 8)).materialize(np, "float32", seed=0)
    state = TrainState(params=model.flat.params.copy(), buffers={}, optimizer_state={"prev_lr": 0.1}, global_step=5,
                       epoch=0,
                       step_in_epoch=5, skipped_steps=0, world_size=2, effective_batch=64,
                       config={"model": "mlp", "hidden": [16, 8], "dtype": "float32"}, data={"classes": 10})
    path = save_checkpoint(tmp_path, state)
    np.testing.assert_array_equal(mpisgd.load_model(str(path)).flat.params, model.flat.params)


@pytest.mark.parametrize("case,says", [
    ("missing", "no such file"), ("text", "is not a model file"), ("other npz", "holds neither"),
    ("empty dir", "a directory with no usable checkpoint"),
    ("classes", "scores 3 classes; this data has labels up to 9"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, says):
    path = tmp_path / "x.npz"
    if case == "text":
        path.write_text("hello")
    elif case == "other npz":
        np.savez(path, weights=np.zeros(3))
    elif case == "empty dir":
        path.mkdir()
    elif case == "classes":
        old_save_params(path, build_model("mlp", (784,), 3, (8,)).materialize(np))
    for r in (evaluate(str(path), "--dataset", "synthetic"),
              run_mpi(2, "-m", "mpisgd.evaluate", str(path), "--dataset", "synthetic", timeout=120)):
        assert r.returncode == 2 and r.stderr.count("mpisgd-evaluate: error") == 1, r.stderr
        assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
    if case == "classes":
        assert mpisgd.load_model(str(path)).flat.size > 0  # the model loads; scoring 10 classes with it fails
    else:
        with pytest.raises(ModelFileError, match=says):
            mpisgd.load_model(str(path))


# -- a file runs no code, and every field is checked -------------------------------------------------------
def _hostile_file(path: Path, meta_changes: dict, params=None) -> Path:
    """A --save-model file of a small MLP with its description changed by ``meta_changes``."""
    from mpisgd.model_file import FORMAT, VERSION, save_params

    model = build_model("mlp", (1, 4, 4), 3, (5,)).materialize(np, "float32", seed=1)
    meta = {"format": FORMAT, "version": VERSION, "model": "mlp", "in_shape": [1, 4, 4], "classes": 3, "hidden": [5],
            "dtype": "float32", "parameters": int(model.flat.size), "input_scale": 1.0, "input_shift": 0.0,
            "data": {"name": "x"}, "seed": 0, "step": 3, **meta_changes}
    save_params(str(path), model, meta=meta)
    if params is not None:
        with np.load(path) as z:
            arrays = dict(z)
        arrays["flat"] = params(arrays["flat"])
        np.savez(path, **arrays)
    return path


def test_reading_a_file_runs_no_code_it_names(tmp_path, monkeypatch):
    """A model file is something people download and share: load_model imported and called the
    module:function its metadata named (subprocess:call with in_shape ["touch", X] ran touch X). Now the stock
    models come from mpisgd's own builders and a factory only from the caller: the file alone runs nothing."""
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                      "def build(in_shape, n_classes):\n    raise SystemExit('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    touched = tmp_path / "touched"
    for meta in ({"model": "evil:build"}, {"model": "subprocess:call", "in_shape": ["touch", str(touched)]}):
        path = _hostile_file(tmp_path / "m.npz", meta)
        with pytest.raises(ModelFileError) as err:
            mpisgd.load_model(str(path))
        assert not marker.exists() and not touched.exists() and "evil" not in sys.modules
        assert "runs no code it names" in str(err.value) or "in_shape must be" in str(err.value), err.value
    # a checkpoint's model record: the same rule
    model = build_model("mlp", (1, 4, 4), 3, (5,)).materialize(np, "float32", seed=1)
    st = TrainState(params=model.flat.params.copy(), buffers={}, optimizer_state={}, global_step=1, epoch=0,
                    step_in_epoch=1, skipped_steps=0, world_size=1, effective_batch=8,
                    config={"batch_size": 8}, model={"model": "evil:build", "in_shape": [1, 4, 4], "classes": 3})
    with pytest.raises(ModelFileError, match="runs no code it names"):
        read_model(str(save_checkpoint(tmp_path / "ck", st)))
    assert not marker.exists()


def test_a_factory_the_caller_names_builds_the_model(tmp_path):
    from mpisgd.nn import Flatten, Linear, Sequential

    model = Sequential(Flatten(), Linear(16, 3)).materialize(np, "float32", seed=2)
    from mpisgd.model_file import save_params

    path = tmp_path / "own.npz"
    save_params(str(path), model, meta={"format": "mpisgd-model", "version": 1, "model": "mine.net:build",
                                        "in_shape": [1, 4, 4], "classes": 3, "dtype": "float32"})
    got = mpisgd.load_model(str(path), factory=lambda in_shape, n: Sequential(Flatten(), Linear(16, n)))
    np.testing.assert_array_equal(got.flat.params, model.flat.params)
    with pytest.raises(ModelFileError, match="the factory must return an mpisgd.nn.Module"):
        mpisgd.load_model(str(path), factory=lambda in_shape, n: "not a model")


@pytest.mark.parametrize("change,says", [
    ({"model": 7}, "model must be mlp, cnn, resnet, gpt or package.module:function, got 7"),
    ({"model": "os.system"}, "model must be mlp, cnn, resnet, gpt or package.module:function"),
    ({"in_shape": "28x28"}, "in_shape must be a list of 1 to 8 positive integers"),
    ({"in_shape": [1, 0, 4]}, "in_shape must be"), ({"in_shape": [1, 4.0, 4]}, "in_shape must be"),
    ({"classes": "3"}, "classes must be a positive integer"), ({"classes": True}, "classes must be"),
    ({"classes": 10**30}, "classes must be"), ({"hidden": [5, -1]}, "hidden must be a list of positive integers"),
    ({"hidden": {"a": 1}}, "hidden must be"), ({"dtype": "int8"}, "dtype must be float32 or float64"),
    ({"seed": -1}, "seed must be an integer >= 0"), ({"step": "3"}, "step must be"),
    ({"parameters": 1.5}, "parameters must be"), ({"input_scale": float("nan")}, "input_scale must be a finite"),
    ({"input_shift": "0"}, "input_shift must be"), ({"data": "x"}, "data must be a JSON object"),
    ({"format": "onnx"}, "is not an mpisgd model file: its format is \"onnx\""),
    ({"version": 2}, "model file version 2, this mpisgd reads 1"), ({"version": "1"}, "model file version \"1\""),
])
def test_every_field_of_the_description_is_type_checked(tmp_path, change, says):
    """A hand-edited or foreign description: one ModelFileError naming the field (evaluate: one line, exit 2),
    never a TypeError or KeyError from deep inside."""
    with pytest.raises(ModelFileError, match=re.escape(says)):
        read_model(str(_hostile_file(tmp_path / "m.npz", change)))


@pytest.mark.parametrize("params,says", [
    (lambda f: np.where(np.arange(f.size) == 3, np.nan, f).astype(f.dtype), "hold 1 non-finite values"),
    (lambda f: f.astype(np.int32), "parameters must be a 1-D float32 or float64 array, got int32"),
    (lambda f: f.reshape(1, -1), "got float32 (1,"),
])
def test_nan_or_integer_parameters_are_refused(tmp_path, params, says):
    with pytest.raises(ModelFileError, match=re.escape(says)):
        read_model(str(_hostile_file(tmp_path / "m.npz", {}, params=params)))


@pytest.mark.parametrize("option", ["--data", "--data-dir", "PATH"])
def test_evaluate_with_an_empty_path_or_a_name_too_long_is_refused(tmp_path, option):
    """`evaluate --data ''` (an unset shell variable) scored Fashion-MNIST."""
    from mpisgd.app.evaluate import _prepare, build_parser

    model = str(_hostile_file(tmp_path / "m.npz", {}))
    argv = ["", "--data", str(tmp_path)] if option == "PATH" else [model, option, ""]
    with pytest.raises(UsageError, match=f"{re.escape(option)} is empty: give a path"):
        _prepare(build_parser(quiet=True).parse_args(argv))
    long = "/tmp/" + "y" * 300  # ENAMETOOLONG from the first look at it: a traceback before
    argv = [long, "--dataset", "synthetic"] if option == "PATH" else [model, option, long]
    with pytest.raises(UsageError, match="a name in it is 300 bytes long|File name too long"):
        _prepare(build_parser(quiet=True).parse_args(argv))


# -- --model-factory: only for a model of your own, and one that gives scores ------------------------------
def _synthetic_file(path: Path, name: str, module, meta: dict | None = None) -> Path:
    """A --save-model file of ``module`` (materialised with seed 1), recorded as model ``name`` for the
    synthetic set's 1x28x28 samples and 10 classes."""
    from mpisgd.model_file import save_params

    model = module.materialize(np, "float32", seed=1)
    save_params(str(path), model, meta={"format": "mpisgd-model", "version": 1, "model": name,
                                        "in_shape": [1, 28, 28], "classes": 10, "dtype": "float32", "seed": 0,
                                        **(meta or {})})
    return path


@pytest.mark.parametrize("kind,hidden", [("mlp", [8]), ("cnn", None)])
def test_evaluate_refuses_a_factory_for_a_file_of_mpisgds_own_model(tmp_path, kind, hidden):
    """`evaluate mlp.npz --model-factory pm:base` scored the stock model and ignored the factory without a word."""
    path = _synthetic_file(tmp_path / "m.npz", kind, build_model(kind, (1, 28, 28), 10, tuple(hidden or ())),
                           {"hidden": hidden})
    data = ["--dataset", "synthetic", "--limit-test", "50"]
    assert evaluate(str(path), *data).returncode == 0  # the file scores, without a factory
    factory = ["--model-factory", "examples.model_factory:small_convnet"]
    for r in (evaluate(str(path), *data, *factory),
              run_mpi(2, "-m", "mpisgd.evaluate", str(path), *data, *factory, timeout=120)):
        assert r.returncode == 2 and r.stderr.count("mpisgd-evaluate: error") == 1, r.stderr + r.stdout
        assert f"holds mpisgd's own {kind} model, which needs no factory: drop --model-factory " \
               "examples.model_factory:small_convnet" in r.stderr and "Traceback" not in r.stderr, r.stderr


FACTORIES = """import math
from torch import nn
def base(s, c): return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(s), 8), nn.ReLU(), nn.Linear(8, c))
class Two(nn.Module):
    def __init__(self, s, c, out): super().__init__(); self.m, self.out = base(s, c), out
    def forward(self, x): y = self.m(x); return (y, y) if self.out == "tuple" else {"logits": y}
def tup(s, c): return Two(s, c, "tuple")
def dct(s, c): return Two(s, c, "dict")
"""


def test_evaluate_refuses_a_factorys_module_that_returns_no_tensor_in_one_line(tmp_path, monkeypatch, capsys):
    """A PyTorch factory whose forward returns a tuple or a dict: the training command refuses it in one line,
    evaluate ended with a traceback from the first scored batch (exit 1). In this process for a file and a
    checkpoint, and launched at k = 2 (every rank exits 2)."""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'mpisgd[torch]')")
    from mpisgd.app.evaluate import main as evaluate_here

    (tmp_path / "pm.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = build_model("pm:base", (1, 28, 28), 10)
    path = _synthetic_file(tmp_path / "m.npz", "pm:base", module)
    model = mpisgd.load_model(str(path), factory="pm:base")
    st = TrainState(params=model.flat.params.copy(), buffers={}, optimizer_state={}, global_step=1, epoch=0,
                    step_in_epoch=1, skipped_steps=0, world_size=1, effective_batch=8, config={"batch_size": 8},
                    model={"model": "pm:base", "in_shape": [1, 28, 28], "classes": 10})
    ckpt = str(save_checkpoint(tmp_path / "ck", st))
    data = ["--dataset", "synthetic", "--limit-test", "50"]
    assert evaluate_here([str(path), *data, "--model-factory", "pm:base"]) == 0
    capsys.readouterr()
    runs = []
    for got, saved, factory in [("tuple", str(path), "pm:tup"), ("dict", str(path), "pm:dct"),
                                ("tuple", ckpt, "pm:tup")]:
        status = evaluate_here([saved, *data, "--model-factory", factory])
        runs.append((got, status, capsys.readouterr().err))
    r = run_mpi(2, "-m", "mpisgd.evaluate", str(tmp_path / "ck"), *data, "--model-factory", "pm:dct", cwd=tmp_path,
                timeout=120)  # python -m: pm.py is found in the working directory
    runs.append(("dict", r.returncode, r.stderr))
    for got, status, err in runs:
        assert status == 2 and err.count("mpisgd-evaluate: error") == 1, err
        assert "Traceback" not in err and "cannot score: the torch module must " \
               f"return one tensor (the scores), got {got}" in err, err


def test_a_language_model_of_your_own_trains_on_text_and_evaluate_and_sample_read_it_with_its_factory(
        tmp_path, monkeypatch, capsys):
    """A PyTorch model given a text file: read as characters (as for --model gpt), the model scores every
    position. evaluate reads the saved file with --model-factory (it answered 'pass it as the factory' even
    when the factory was passed), on the text or an .npz of its tokens, and names the model as the file does;
    sample draws from it. Without the factory both say to pass it. A binary file is refused as text, saying why
    it was read as text."""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'mpisgd[torch]')")
    text = "In the beginning God created the heaven and the earth. " * 40
    chars = "".join(sorted(set(text)))
    corpus = tmp_path / "genesis.txt"
    corpus.write_text(text)
    data = tmp_path / "tokens.npz"
    np.savez(data, tokens=np.array([chars.index(c) for c in text]), vocab=np.array(chars))
    saved, factory = tmp_path / "lm.npz", "examples.torch_models:gpt_tokens"
    r = run_mpi(1, "-m", "mpisgd.train", "--model", factory, "--data", str(corpus), "--context", "8", "--max-steps",
                "2", "--batch-size", "4", "--progress", "off", "--save-model", str(saved), cwd=ROOT, timeout=180,
                env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr + r.stdout
    assert "characters of UTF-8 text" in r.stdout, r.stdout
    from mpisgd.app.evaluate import main as evaluate_here  # in this process: evaluate sets no torch state
    from mpisgd.app.sample import main as sample_here

    monkeypatch.syspath_prepend(str(ROOT))  # examples.torch_models
    capsys.readouterr()
    scores = []
    for given in (corpus, data):
        status = evaluate_here([str(saved), "--data", str(given), "--model-factory", factory])
        out, err = capsys.readouterr()
        assert status == 0 and "bits/char" in out and f"| {factory}, " in out, err + out
        scores.append(out.splitlines()[-1])
    assert scores[0] == scores[1]  # the same tokens either way
    assert sample_here([str(saved), "--model-factory", factory, "--prompt", "In the", "--tokens", "12"]) == 0
    out = capsys.readouterr().out
    drawn = out.removeprefix("In the").removesuffix("\n")  # the prompt, 12 characters, the line's end
    assert out.startswith("In the") and len(drawn) == 12 and set(drawn) <= set(chars), repr(out)
    for main in (evaluate_here, sample_here):
        status = main([str(saved), *(["--data", str(data)] if main is evaluate_here else [])])
        err = capsys.readouterr().err
        assert status == 2 and "pass it as the factory" in err and "--model-factory" in err, err
    binary = tmp_path / "genesis.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    r = run_mpi(1, "-m", "mpisgd.train", "--model", factory, "--data", str(binary), "--max-steps", "1",
                "--progress", "off", cwd=ROOT, timeout=180, env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "is not UTF-8 text" in r.stderr and "is your own: a file that is not an .npz or " \
        ".npy is read as its text" in r.stderr, r.stderr
