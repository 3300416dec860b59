"""Every layer's backward against central finite differences (float64), plus the loss and the model."""

from __future__ import annotations

import numpy as np
import pytest

from mpisgd.nn import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Sequential, SoftmaxCrossEntropy, cnn, mlp

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
    """Compare analytic d(sum(y * r))/dx and /dparams with finite differences."""
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
    assert model.flat is not None


def test_linear_grad():
    check_layer(Linear(5, 4), np.random.default_rng(0).standard_normal((3, 5)))


def test_relu_grad():
    x = np.random.default_rng(1).standard_normal((4, 6))
    x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink
    check_layer(ReLU(), x)


def test_flatten_grad():
    check_layer(Flatten(), np.random.default_rng(2).standard_normal((2, 3, 2, 2)))


@pytest.mark.parametrize("stride,padding", [(1, 0), (1, 2), (2, 1)])
def test_conv2d_grad(stride, padding):
    check_layer(Conv2d(2, 3, 3, stride=stride, padding=padding), np.random.default_rng(3).standard_normal((2, 2, 6, 6)))


def test_maxpool_grad():
    rng = np.random.default_rng(4)
    x = rng.permutation(2 * 2 * 6 * 6).reshape(2, 2, 6, 6).astype(np.float64) / 10  # distinct: no ties
    check_layer(MaxPool2d(2), x)


def test_maxpool_ties_route_gradient_once():
    layer = MaxPool2d(2)
    Sequential(layer).materialize(np, "float64")
    x = np.ones((1, 1, 2, 2))
    layer.forward(x)
    dx = layer.backward(np.array([[[[3.0]]]]))
    assert dx.sum() == 3.0 and (dx != 0).sum() == 1


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
    lin = model.layers[1]
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
