"""The start-up check of modules mpisgd did not write (mpisgd.nn.usercheck): a wrong backward is refused
in one line naming the module, on every rank, before any training; a right one passes; mpisgd's own
models are not checked at all."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_mpi, serial_only

from mpisgd.nn import Conv2d, GlobalAvgPool2d, Linear, Module, ReLU, Sequential, SpatialModule, build_model
from mpisgd.nn.usercheck import check_user_modules, user_modules, written_elsewhere

USER = '''
import numpy as np
from mpisgd.backend import xp_of
from mpisgd.nn import Conv2d, Flatten, GlobalAvgPool2d, Linear, Module, ReLU, Residual, Sequential, SpatialModule


class Scale(Module):
    """y = x * a per feature; ``wrong`` scales the parameter's gradient by 1.5 on purpose."""

    def __init__(self, n, wrong=False):
        super().__init__()
        self.n, self.wrong = n, wrong
        self.param_shapes = [("a", (n,))]

    def init_params(self, rng, dtype):
        return {"a": rng.uniform(0.5, 1.5, self.n).astype(dtype)}

    def forward(self, x):
        self._x = x
        return x * self.params["a"]

    def backward(self, dy, need_dx=True):
        g = self._grad_out("a", (self.n,), dy)
        g[...] = (dy * self._x).sum(axis=0) * (1.5 if self.wrong else 1.0)
        self._grad_done("a", g)
        return dy * self.params["a"] if need_dx else None


class Block(Module):
    """A module of the user's holding another: y = inner(x) + x."""

    def __init__(self, n, wrong=False):
        super().__init__()
        self.inner = self.add("inner", Scale(n, wrong))

    def forward(self, x):
        return self.inner.forward(x) + x

    def backward(self, dy, need_dx=True):
        return self.backward_child(self.inner, dy.copy(), need_dx) + dy


class Shift2d(SpatialModule):
    """An image layer of the user's (batch last inside a run): y = x + b per channel; ``wrong`` forgets dx."""

    def __init__(self, c, wrong=False):
        super().__init__()
        self.c, self.wrong = c, wrong
        self.param_shapes = [("b", (c,))]

    def init_params(self, rng, dtype):
        return {"b": rng.uniform(-1, 1, self.c).astype(dtype)}

    def forward_bl(self, x):
        return x + self.params["b"][:, None, None, None]

    def backward_bl(self, dy, need_dx=True):
        g = self._grad_out("b", (self.c,), dy)
        g[...] = dy.reshape(self.c, -1).sum(axis=1)
        self._grad_done("b", g)
        return (2 * dy if self.wrong else dy) if need_dx else None


def right(input_shape, n_classes):
    return Sequential(Flatten(), Linear(784, 8), Block(8), ReLU(), Scale(8), Linear(8, n_classes))


def wrong(input_shape, n_classes):
    return Sequential(Flatten(), Linear(784, 8), ReLU(), Scale(8, wrong=True), Linear(8, n_classes))


def wrong_inside(input_shape, n_classes):
    return Sequential(Flatten(), Linear(784, 8), Block(8, wrong=True), Linear(8, n_classes))


def wrong_image_layer(input_shape, n_classes):
    return Sequential(Conv2d(1, 3, 3, stride=2), Shift2d(3, wrong=True), ReLU(), GlobalAvgPool2d(),
                      Linear(3, n_classes))


def right_image_layer(input_shape, n_classes):
    return Sequential(Conv2d(1, 3, 3, stride=2), Shift2d(3), ReLU(), GlobalAvgPool2d(), Linear(3, n_classes))
'''


@pytest.fixture
def usermodels(tmp_path, monkeypatch):
    (tmp_path / "usermodels.py").write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import usermodels
    return importlib.reload(usermodels)


@pytest.mark.parametrize("factory,path,cls", [
    ("wrong", "3", "usermodels.Scale"),
    ("wrong_inside", "2.inner", "usermodels.Scale"),  # the deepest failing module, not its enclosing Block
    ("wrong_image_layer", "1", "usermodels.Shift2d"),  # checked where it runs: batch last, inside the run
])
def test_a_wrong_backward_is_named(usermodels, factory, path, cls):
    build = getattr(usermodels, factory)
    error, warnings = check_user_modules(lambda: build((1, 28, 28), 10), (1, 28, 28))
    assert error is not None and (error.path, error.cls) == (path, cls), error
    line = error.describe()
    assert line.startswith(f"the backward of module {path} ({cls}) disagrees with float64 finite differences: ")
    assert "\n" not in line and warnings == []


@pytest.mark.parametrize("factory", ["right", "right_image_layer"])
def test_a_right_backward_passes(usermodels, factory):
    build = getattr(usermodels, factory)
    assert check_user_modules(lambda: build((1, 28, 28), 10), (1, 28, 28)) == (None, [])
    assert user_modules(build((1, 28, 28), 10))  # there was something to check


def test_mpisgds_own_models_are_not_checked_or_built_again():
    """Zero cost for the stock models and for factories made only of mpisgd's layers."""
    def never() -> Module:
        raise AssertionError("built again")

    for name, shape in (("mlp", (1, 28, 28)), ("cnn", (1, 28, 28)), ("resnet", (1, 28, 28))):
        model = build_model(name, shape, 10)
        assert user_modules(model) == [] and not any(written_elsewhere(m) for _, m in model.named_modules())
        assert check_user_modules(never, shape, skip=model) == (None, [])
    own = Sequential(Conv2d(1, 2, 3), ReLU(), GlobalAvgPool2d(), Linear(2, 10))
    assert check_user_modules(never, (1, 8, 8), skip=own) == (None, [])
    assert not written_elsewhere(SpatialModule()) and written_elsewhere(type("Mine", (Module,), {
        "forward": lambda self, x: x, "__module__": "mine"})())


def test_a_module_the_forward_does_not_use_is_a_warning(usermodels):
    def build() -> Module:
        model = usermodels.right((1, 28, 28), 10)
        model.layers[2].add("spare", usermodels.Scale(3))  # registered in the Block, which never calls it
        return model

    error, warnings = check_user_modules(build, (1, 28, 28))
    assert error is None and warnings == ["module 2.spare (usermodels.Scale) was not used by forward: its backward "
                                          "was not checked"]


@serial_only
@pytest.mark.parametrize("k", [1, 2])
def test_the_cli_refuses_a_wrong_backward_before_training_on_every_rank(tmp_path, k):
    (tmp_path / "usermodels.py").write_text(USER)
    r = run_mpi(k, "-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "256", "--model",
                "usermodels:wrong", "--batch-size", "16", "--max-steps", "2", "--progress", "off", cwd=tmp_path,
                env={"PYTHONPATH": f"{ROOT}:{tmp_path}"}, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        "mpisgd: error: --model usermodels:wrong: the backward of module 3 (usermodels.Scale) disagrees"), r.stderr
    assert "epoch" not in r.stdout  # before any training


@serial_only
def test_the_cli_trains_a_right_one(tmp_path):
    (tmp_path / "usermodels.py").write_text(USER)
    r = run_mpi(1, "-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "256", "--model",
                "usermodels:right_image_layer", "--batch-size", "16", "--max-steps", "2", "--progress", "off",
                cwd=tmp_path, env={"PYTHONPATH": f"{ROOT}:{tmp_path}"}, timeout=120)
    assert r.returncode == 0 and "final test accuracy" in r.stdout, r.stdout + r.stderr
