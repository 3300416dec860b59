"""Every layer's backward against central finite differences (float64), plus the loss and the model."""

from __future__ import annotations

import numpy as np
import pytest

from mpisgd.nn import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Sequential, SoftmaxCrossEntropy, cnn, mlp
from mpisgd.nn import layers as layers_module
from mpisgd.nn.layers import Permute

EPS = 1e-6


def numeric_grad(f, x: np.ndarray) -> np.ndarray:
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + EPS
        up = f()
        flat[i] = old - EPS
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * EPS)
    return g


def check_layer(layer, x: np.ndarray, seed: int = 0) -> None:
    """Compare analytic d(sum(y * r))/dx and /dparams with finite differences; the parameters and
    gradients are views of the model's flat buffers."""
    model = Sequential(layer).materialize(np, "float64", seed)
    y = layer.forward(x)
    r = np.random.default_rng(seed + 1).standard_normal(y.shape)

    def objective() -> float:
        return float((layer.forward(x) * r).sum())

    layer.forward(x)
    dx = layer.backward(r.copy(), need_dx=True)
    dx = None if dx is None else dx.copy()
    grads = {k: v.copy() for k, v in layer.grads.items()}
    np.testing.assert_allclose(dx, numeric_grad(objective, x), rtol=1e-5, atol=1e-7)
    for name, p in layer.params.items():
        np.testing.assert_allclose(grads[name], numeric_grad(objective, p), rtol=1e-5, atol=1e-7,
                                   err_msg=f"gradient of {name}")
    # what DataParallel reduces: backward wrote these gradients into the model's flat buffer, in order
    names = [name for name, _ in layer.param_shapes]
    in_order = [grads[name].reshape(-1) for name in names]
    np.testing.assert_array_equal(model.flat.grads, np.concatenate(in_order) if names else np.zeros(0))
    assert all(np.shares_memory(layer.params[name], model.flat.params) for name in names)


def test_linear_grad():
    check_layer(Linear(5, 4), np.random.default_rng(0).standard_normal((3, 5)))


def test_relu_grad():
    x = np.random.default_rng(1).standard_normal((4, 6))
    x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink
    check_layer(ReLU(), x)


def test_flatten_grad():
    check_layer(Flatten(), np.random.default_rng(2).standard_normal((2, 3, 2, 2)))


def test_permute_grad():
    check_layer(Permute((1, 2, 3, 0)), np.random.default_rng(2).standard_normal((2, 3, 4, 5)))


def conv_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, pad: int) -> np.ndarray:
    """The textbook NCHW cross-correlation, one output element at a time."""
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, _, h, wd = x.shape
    c_out, _, k, _ = w.shape
    ho, wo = (h - k) // stride + 1, (wd - k) // stride + 1
    y = np.empty((n, c_out, ho, wo))
    for i in range(ho):
        for j in range(wo):
            patch = x[:, :, i * stride:i * stride + k, j * stride:j * stride + k]
            y[:, :, i, j] = np.einsum("nckl,ockl->no", patch, w) + b
    return y


def maxpool_reference(x: np.ndarray, k: int) -> np.ndarray:
    n, c, h, w = x.shape
    x = x[:, :, :h // k * k, :w // k * k]
    return x.reshape(n, c, h // k, k, w // k, k).max(axis=(3, 5))


TO_CHWN, TO_NCHW = (1, 2, 3, 0), (3, 0, 1, 2)
CONV_CASES = [(1, 0), (1, 2), (2, 1)]  # (stride, padding)


@pytest.fixture(params=["one chunk", "one row per chunk"])
def chunking(request, monkeypatch):
    """Conv2d's im2col in one chunk (the default at these sizes), or one output row at a time."""
    if request.param == "one row per chunk":
        monkeypatch.setattr(layers_module, "CHUNK_BYTES", 1)
    return request.param


@pytest.mark.parametrize("stride,padding", CONV_CASES)
def test_conv2d_grad(stride, padding, chunking):
    x = np.random.default_rng(3).standard_normal((2, 2, 6, 6)).transpose(TO_CHWN).copy()  # (C, H, W, N)
    check_layer(Conv2d(2, 3, 3, stride=stride, padding=padding), x)


@pytest.mark.parametrize("stride,padding", CONV_CASES)
def test_conv2d_is_the_nchw_cross_correlation(stride, padding, chunking):
    """Batch last inside, PyTorch's weight layout: the same function as the textbook NCHW convolution."""
    conv = Conv2d(2, 3, 3, stride=stride, padding=padding)
    Sequential(conv).materialize(np, "float64", seed=1)
    conv.params["b"][:] = [0.5, -1.0, 2.0]
    x = np.random.default_rng(4).standard_normal((4, 2, 7, 6))
    y = conv.forward(x.transpose(TO_CHWN).copy()).transpose(TO_NCHW)
    np.testing.assert_allclose(y, conv_reference(x, conv.params["W"], conv.params["b"], stride, padding),
                               rtol=1e-12, atol=1e-12)


def test_maxpool_grad():
    rng = np.random.default_rng(4)
    x = rng.permutation(2 * 2 * 6 * 6).reshape(2, 6, 6, 2).astype(np.float64) / 10  # distinct: no ties
    check_layer(MaxPool2d(2), x)


def maxpool_grad_reference(x: np.ndarray, k: int, dy: np.ndarray) -> np.ndarray:
    """Each output's gradient to the first maximum of its window in row-major order (PyTorch's rule)."""
    dx = np.zeros_like(x)
    n, c, ho, wo = dy.shape
    for idx in np.ndindex(n, c, ho, wo):
        a, b, i, j = idx
        window = x[a, b, i * k:(i + 1) * k, j * k:(j + 1) * k]
        r, s = np.unravel_index(np.argmax(window), window.shape)
        dx[a, b, i * k + r, j * k + s] += dy[idx]
    return dx


@pytest.mark.parametrize("k,shape", [(2, (3, 2, 6, 4)), (2, (3, 2, 5, 7)), (3, (2, 1, 7, 9))])
@pytest.mark.parametrize("values", ["distinct", "few levels"])
def test_maxpool_is_the_nchw_max_pool(k, shape, values):
    """Odd edges dropped, k = 3, many ties: the NCHW max pool and PyTorch's gradient routing."""
    layer = MaxPool2d(k)
    Sequential(layer).materialize(np, "float64")
    rng = np.random.default_rng(5)
    x = rng.permutation(np.prod(shape)).reshape(shape).astype(np.float64)
    if values == "few levels":
        x = np.floor(x / x.size * 3)  # three values: most windows hold ties
    y = layer.forward(x.transpose(TO_CHWN).copy()).transpose(TO_NCHW)
    np.testing.assert_array_equal(y, maxpool_reference(x, k))
    dy = rng.standard_normal(y.shape)
    dx = layer.backward(dy.transpose(TO_CHWN).copy()).transpose(TO_NCHW)
    np.testing.assert_array_equal(dx, maxpool_grad_reference(x, k, dy))


def test_maxpool_ties_route_gradient_once():
    layer = MaxPool2d(2)
    Sequential(layer).materialize(np, "float64")
    x = np.ones((1, 2, 2, 1))
    layer.forward(x)
    dx = layer.backward(np.array([[[[3.0]]]]))
    assert dx.sum() == 3.0 and dx[0, 0, 0, 0] == 3.0  # the first of the tied maxima, as in PyTorch


def test_maxpool_needs_a_window():
    with pytest.raises(ValueError, match="kernel >= 2"):
        MaxPool2d(1)


def lenet_reference(model: Sequential, x: np.ndarray) -> np.ndarray:
    """LeNet-5 written out in NCHW, conv-ReLU-pool, from the model's own parameters."""
    convs = [layer for layer in model.modules() if isinstance(layer, Conv2d)]
    linears = [layer for layer in model.modules() if isinstance(layer, Linear)]
    h = x
    for conv in convs:
        h = maxpool_reference(np.maximum(conv_reference(h, conv.params["W"], conv.params["b"], conv.stride,
                                                        conv.pad), 0), 2)
    h = h.reshape(len(x), -1)
    for i, lin in enumerate(linears):
        h = h @ lin.params["W"] + lin.params["b"]
        h = np.maximum(h, 0) if i < len(linears) - 1 else h
    return h


def test_cnn_is_lenet5_in_nchw():
    """The stock CNN (batch last inside, pooling before ReLU) computes NCHW LeNet-5 on NCHW batches."""
    model = cnn().materialize(np, "float64", seed=2)
    model.flat.params[:] += np.random.default_rng(9).uniform(-0.05, 0.05, model.flat.size)  # non-zero biases
    x = np.random.default_rng(10).standard_normal((3, 1, 28, 28))
    np.testing.assert_allclose(model.forward(x), lenet_reference(model, x), rtol=1e-10, atol=1e-12)


def test_cnn_matches_pytorch_lenet5():
    """Same parameters, same logits and gradients as PyTorch's NCHW LeNet-5: the flat parameter layout
    (conv weights (c_out, c_in, k, k), then biases; Linear weights transposed) is PyTorch's."""
    torch = pytest.importorskip("torch")
    model = cnn().materialize(np, "float64", seed=3)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 6, 5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(6, 16, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(400, 120), torch.nn.ReLU(), torch.nn.Linear(120, 84), torch.nn.ReLU(),
        torch.nn.Linear(84, 10)).double()
    ours = [layer for layer in model.modules() if layer.param_shapes]
    theirs = [m for m in net if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    for a, b in zip(ours, theirs, strict=True):
        with torch.no_grad():
            b.weight.copy_(torch.from_numpy(a.params["W"].T.copy() if isinstance(a, Linear) else a.params["W"]))
            b.bias.copy_(torch.from_numpy(np.random.default_rng(11).uniform(-0.1, 0.1, a.params["b"].shape)))
        a.params["b"][:] = b.bias.detach().numpy()
    rng = np.random.default_rng(12)
    x, labels = rng.standard_normal((5, 1, 28, 28)), rng.integers(0, 10, 5)
    loss = SoftmaxCrossEntropy()
    logits = model.forward(x)
    loss.forward(logits, labels)
    model.backward(loss.backward())
    t_logits = net(torch.from_numpy(x))
    torch.nn.functional.cross_entropy(t_logits, torch.from_numpy(labels)).backward()
    np.testing.assert_allclose(logits, t_logits.detach().numpy(), rtol=1e-9, atol=1e-12)
    for a, b in zip(ours, theirs, strict=True):
        w_grad = b.weight.grad.numpy()
        np.testing.assert_allclose(a.grads["W"], w_grad.T if isinstance(a, Linear) else w_grad, rtol=1e-8,
                                   atol=1e-12)
        np.testing.assert_allclose(a.grads["b"], b.bias.grad.numpy(), rtol=1e-8, atol=1e-12)


def test_softmax_cross_entropy_grad():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 4))
    labels = rng.integers(0, 4, 6)
    loss = SoftmaxCrossEntropy()

    def f() -> float:
        return loss.forward(logits, labels)

    expected = numeric_grad(f, logits)
    loss.forward(logits, labels)
    np.testing.assert_allclose(loss.backward(), expected, rtol=1e-5, atol=1e-8)
    # the value itself: -log softmax
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert loss.forward(logits, labels) == pytest.approx(-np.log(p[np.arange(6), labels]).mean())


def test_loss_scale_is_applied():
    rng = np.random.default_rng(6)
    logits, labels = rng.standard_normal((4, 3)), rng.integers(0, 3, 4)
    loss = SoftmaxCrossEntropy()
    loss.forward(logits, labels)
    g_mean = loss.backward().copy()
    loss.forward(logits, labels)
    np.testing.assert_allclose(loss.backward(scale=1 / 8), g_mean / 2)


@pytest.mark.parametrize("build,shape", [(lambda: mlp((7, 5), n_in=12, n_classes=3), (4, 1, 3, 4)),
                                         (lambda: cnn(n_classes=3), (2, 1, 28, 28))])
def test_whole_model_grad(build, shape):
    """End to end: model + loss, all parameters, through the flat gradient buffer."""
    model = build().materialize(np, "float64", seed=0)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape)
    y = rng.integers(0, 3, shape[0])
    loss = SoftmaxCrossEntropy()

    def f() -> float:
        return loss.forward(model.forward(x), y)

    f()
    model.backward(loss.backward())
    analytic = model.flat.grads.copy()
    idx = rng.choice(model.flat.size, size=min(60, model.flat.size), replace=False)
    numeric = np.empty(len(idx))
    for j, i in enumerate(idx):
        old = model.flat.params[i]
        model.flat.params[i] = old + EPS
        up = f()
        model.flat.params[i] = old - EPS
        down = f()
        model.flat.params[i] = old
        numeric[j] = (up - down) / (2 * EPS)
    np.testing.assert_allclose(analytic[idx], numeric, rtol=1e-4, atol=1e-7)


def test_params_are_views_of_one_flat_buffer():
    model = mlp((8,), n_in=6, n_classes=2).materialize(np, "float32", seed=0)
    lin = model.module.layers[1]
    assert np.shares_memory(lin.params["W"], model.flat.params)
    assert np.shares_memory(lin.grads["W"], model.flat.grads)
    model.flat.params[:] = 1.5
    assert (lin.params["W"] == 1.5).all()


def test_moved_gradients_keep_their_values_and_backward_writes_there():
    """move_grads (data parallelism's node-shared gradient buffer): values copied, every layer's
    gradient views now in the new buffer, so backward fills it and the old one goes stale."""
    model, x, y, loss = small_model_after_one_backward()
    old, first = model.flat.grads, model.flat.grads.copy()
    new = np.full(model.flat.size, np.nan)
    model.move_grads(new)
    assert model.flat.grads is new
    np.testing.assert_array_equal(new, first)
    old[...] = 0
    loss.forward(model.forward(2 * x), y)
    model.backward(loss.backward())
    assert not np.allclose(new, first) and np.all(old == 0)
    with pytest.raises(ValueError, match="gradient buffer"):
        model.move_grads(np.zeros(model.flat.size, np.float32))  # another dtype


def test_buffer_bytes_count_one_batch_of_activations():
    """Counted for the speed issue's memory bound: nothing before the first step; then at least each
    layer's output for the batch, and no second set when the same batch size comes again."""
    model = mlp((50,), n_in=20, n_classes=10).materialize(np, "float32", seed=0)
    assert model.buffer_nbytes() == 0
    loss = SoftmaxCrossEntropy()
    x, y = np.ones((16, 20), np.float32), np.zeros(16, np.int64)
    sizes = []
    for _ in range(2):
        loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        sizes.append(model.buffer_nbytes())
    assert 16 * (50 + 50 + 10) * 4 <= sizes[0] == sizes[1]


def test_initialisation_is_deterministic_from_seed():
    a = mlp((16,)).materialize(np, "float32", seed=3).flat.params
    b = mlp((16,)).materialize(np, "float32", seed=3).flat.params
    c = mlp((16,)).materialize(np, "float32", seed=4).flat.params
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def small_model_after_one_backward():
    """A float64 MLP 4-5-3 with the gradients of one batch of 6 in its flat buffer, and that batch."""
    model = mlp((5,), n_in=4, n_classes=3).materialize(np, "float64", seed=0)
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((6, 4)), rng.integers(0, 3, 6)
    loss = SoftmaxCrossEntropy()
    loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    return model, x, y, loss


def test_accumulate_adds_gradients():
    model, x, y, loss = small_model_after_one_backward()
    once = model.flat.grads.copy()
    model.set_accumulate(True)
    loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    model.set_accumulate(False)
    np.testing.assert_allclose(model.flat.grads, 2 * once)


def test_loss_decreases_on_a_small_problem():
    from mpisgd.data import synthetic
    from mpisgd.optim import SGD

    data = synthetic(512, seed=0)
    x = (data.images.astype(np.float64) / 255 - 0.5)
    model = mlp((32,)).materialize(np, "float64", seed=0)
    opt = SGD(model.flat, momentum=0.9)
    loss = SoftmaxCrossEntropy()
    losses = []
    for step in range(30):
        idx = slice((step * 64) % 512, (step * 64) % 512 + 64)
        losses.append(loss.forward(model.forward(x[idx]), data.labels[idx]))
        model.backward(loss.backward())
        opt.step(0.05)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


# -- a model of one's own: whatever the user's module or factory does, one line --------------------------
USER_MODULES = {
    "typo": "from mpisgd.nn import Sequential\ndef f(input_shape, n_classes)\n    return Sequential()\n",
    "raises_at_import": "import os\nraise RuntimeError('no GPU here')\n",
    "exits_at_import": "import sys\nsys.exit(3)\n",
    "exits_in_factory": "import sys\ndef f(input_shape, n_classes):\n    sys.exit()\n",
    "backward_raises": (
        "from mpisgd.nn import Flatten, Linear, Sequential\n"
        "class Broken(Linear):\n"
        "    def backward(self, dy, need_dx=True):\n"
        "        raise ArithmeticError('my backward is wrong')\n"
        "def f(input_shape, n_classes):\n"
        "    return Sequential(Flatten(), Linear(12, 4), Broken(4, n_classes))\n"),
    "permute_not_back": (  # written for the batch-last layers of before, with the Permute back forgotten
        "from mpisgd.nn import Conv2d, Flatten, Linear, MaxPool2d, Permute, ReLU, Sequential\n"
        "def f(input_shape, n_classes):\n"
        "    c, h, w = input_shape\n"
        "    return Sequential(Permute((1, 2, 3, 0)), Conv2d(c, 4, 3, padding=1), ReLU(), MaxPool2d(2), Flatten(),\n"
        "                      Linear(4 * (h // 2) * (w // 2), n_classes))\n"),
}


@pytest.mark.parametrize("module,says", [
    ("typo", r"--model typo:f: .*typo.py, line 2: SyntaxError: expected ':'"),
    ("raises_at_import", r"--model raises_at_import:f: importing raises_at_import raised RuntimeError: no GPU here "
                         r"\(at .*raises_at_import.py:2\)"),
    ("exits_at_import", r"--model exits_at_import:f: importing exits_at_import called sys.exit\(3\)"),
    ("exits_in_factory", r"--model exits_in_factory:f called sys.exit\(\)"),
])
def test_a_user_module_that_fails_to_import_or_exits_is_one_line(tmp_path, monkeypatch, module, says):
    from mpisgd.nn import build_model

    (tmp_path / f"{module}.py").write_text(USER_MODULES[module])
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=says):
        build_model(f"{module}:f", (3, 2, 2), 3)


@pytest.mark.parametrize("module,says", [
    ("backward_raises", r"the model's backward fails \(ArithmeticError: my backward is wrong\)$"),
    ("permute_not_back", r"the model cannot take samples of shape \(3, 8, 8\) .*; image layers .* take \(N, C, H, "
                         r"W\) batches as they come: no Permute is needed; .* Permute\(\(3, 0, 1, 2\)\) back before "
                         r"Flatten"),
])
def test_the_start_up_check_runs_backward_and_hints_at_the_layout(tmp_path, monkeypatch, module, says):
    from mpisgd.nn import build_model
    from mpisgd.nn.models import check_output

    (tmp_path / f"{module}.py").write_text(USER_MODULES[module])
    monkeypatch.syspath_prepend(str(tmp_path))
    shape = (3, 2, 2) if module == "backward_raises" else (3, 8, 8)
    model = build_model(f"{module}:f", shape, 3).materialize(np, "float32")
    with pytest.raises(ValueError, match=says):
        check_output(model, np, shape, 3, "float32")
