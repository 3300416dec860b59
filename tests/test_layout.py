"""Image layers take (N, C, H, W) at their boundary and run batch last inside (mpisgd.nn.layout): alone, in a
run of layers (one transpose at each end of the run), inside residual blocks, after the Permute layers of
models written before, and inside a module of the user's; plus the pooling layers."""

from __future__ import annotations

import numpy as np
import pytest
from test_layers import conv_reference, maxpool_reference

from mpisgd.nn import (
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool2d,
    Linear,
    MaxPool2d,
    Module,
    Permute,
    ReLU,
    Residual,
    Sequential,
    SpatialModule,
)
from mpisgd.nn.gradcheck import check_gradients
from mpisgd.nn.layout import FIRST, LAST, TO_FIRST, TO_LAST


def transposes(module: Module) -> list[tuple[int, ...]]:
    """The axes of every transpose the plan put into the model's Sequentials (not the user's Permutes)."""
    found = []
    for _, m in module.named_modules():
        if isinstance(m, Sequential):
            children = {id(c) for c in m.layers}
            found += [s.axes for s in m.steps if id(s) not in children]
    return found


def avgpool_reference(x: np.ndarray, k: int, stride: int) -> np.ndarray:
    n, c, h, w = x.shape
    ho, wo = (h - k) // stride + 1, (w - k) // stride + 1
    y = np.empty((n, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            y[:, :, i, j] = x[:, :, i * stride:i * stride + k, j * stride:j * stride + k].mean(axis=(2, 3))
    return y


@pytest.mark.parametrize("stride,padding,bias", [(1, 0, True), (1, 1, False), (2, 1, False), (2, 0, True)])
def test_a_convolution_alone_takes_and_gives_nchw(stride, padding, bias):
    conv = Conv2d(3, 4, 3, stride=stride, padding=padding, bias=bias)
    model = conv.materialize(np, "float64", seed=1)
    assert not conv.batch_last  # alone: it transposes in and out itself
    x = np.random.default_rng(2).standard_normal((5, 3, 9, 8))
    b = conv.params["b"] if bias else np.zeros(4)
    if bias:
        b[:] = [0.5, -1.0, 2.0, 0.25]
    np.testing.assert_allclose(model.forward(x), conv_reference(x, conv.params["W"], b, stride, padding), rtol=1e-12,
                               atol=1e-12)
    assert [n for n, _ in model.named_parameters()] == ["Conv2d.W"] + (["Conv2d.b"] if bias else [])


@pytest.mark.parametrize("layer", [Conv2d(2, 3, 3, stride=2, padding=1, bias=False), Conv2d(2, 3, 1, stride=2),
                                   Conv2d(2, 3, 3, padding=1), Conv2d(2, 2, 5, padding=2), AvgPool2d(2),
                                   AvgPool2d(3, stride=2), GlobalAvgPool2d(), MaxPool2d(2)],
                         ids=repr)
@pytest.mark.parametrize("where", ["alone", "in a run"])
def test_image_layers_pass_the_gradient_check_alone_and_in_a_run(layer, where):
    """Alone the layer transposes itself; in a run (after a convolution) it computes batch last. Its
    backward agrees with finite differences either way."""
    x = np.random.default_rng(3).standard_normal((3, 2, 7, 6))
    module = layer if where == "alone" else Sequential(Conv2d(2, 2, 3, padding=1), layer)
    errors = check_gradients(module, x)
    assert all(e.ok for e in errors), [e for e in errors if not e.ok]
    assert layer.batch_last == (where == "in a run")


def test_same_convolutions_take_the_transposed_route_for_dx_and_agree_with_the_offset_route():
    """dx of a stride-1 'same' convolution is a same convolution with the flipped kernels (its cheaper
    route); the kernel-offset route gives the same values."""
    conv = Conv2d(3, 4, 3, padding=1)
    Sequential(conv).materialize(np, "float64", seed=5)
    assert conv._same and Conv2d(3, 4, 5, padding=2)._same
    assert not Conv2d(3, 4, 3, stride=2, padding=1)._same and not Conv2d(6, 16, 5)._same  # LeNet's second
    x = np.random.default_rng(6).standard_normal((3, 8, 7, 4))  # (C, H, W, N): the layer is batch last here
    dy = np.random.default_rng(7).standard_normal((4, 8, 7, 4))
    conv.forward(x)
    np.testing.assert_allclose(conv._input_grad_same(dy), conv._input_grad_by_offset(dy), rtol=1e-12, atol=1e-12)


def chain() -> Sequential:
    return Sequential(Conv2d(1, 3, 3, padding=1), BatchNorm2d(3), ReLU(), MaxPool2d(2), Conv2d(3, 4, 3, stride=2),
                      AvgPool2d(2), Flatten(), Linear(4, 5))


def test_a_run_of_image_layers_transposes_once_at_each_end_and_computes_the_nchw_function():
    model = chain().materialize(np, "float64", seed=4)
    root = model.module
    assert transposes(root) == [TO_LAST, TO_FIRST]  # into the run before the first conv, back before Flatten
    assert [s.axes if isinstance(s, Permute) else type(s).__name__ for s in root.steps] == \
        [TO_LAST, "Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "Conv2d", "AvgPool2d", TO_FIRST, "Flatten", "Linear"]
    assert all(m.batch_last for m in model.modules() if isinstance(m, SpatialModule))
    model.eval()  # running statistics: the reference below is then a fixed affine map per channel
    bn = root.layers[1]
    bn.buffers["running_mean"][:] = [0.1, -0.2, 0.3]
    bn.buffers["running_var"][:] = [0.5, 2.0, 1.5]
    x = np.random.default_rng(5).standard_normal((6, 1, 16, 16))
    c1, c2, lin = root.layers[0], root.layers[4], root.layers[7]
    h = conv_reference(x, c1.params["W"], c1.params["b"], 1, 1)
    scale = bn.params["gamma"] / np.sqrt(bn.buffers["running_var"] + 1e-5)
    h = (h - bn.buffers["running_mean"][:, None, None]) * scale[:, None, None] + bn.params["beta"][:, None, None]
    h = maxpool_reference(np.maximum(h, 0), 2)
    h = avgpool_reference(conv_reference(h, c2.params["W"], c2.params["b"], 2, 0), 2, 2)
    want = h.reshape(6, -1) @ lin.params["W"] + lin.params["b"]
    np.testing.assert_allclose(model.forward(x), want, rtol=1e-10, atol=1e-12)
    errors = check_gradients(chain(), x[:3])  # train mode, through both transposes
    assert all(e.ok for e in errors), [e for e in errors if not e.ok]


def test_a_layer_that_needs_batch_first_ends_the_run_and_global_pooling_ends_it_by_itself():
    """Dropout keys its mask by sample (batch first): the run is left before it and entered again after it.
    GlobalAvgPool2d gives (N, C) from the run: no transpose back."""
    module = Sequential(Conv2d(1, 2, 3), Dropout(0.5), Conv2d(2, 2, 3), BatchNorm2d(2), GlobalAvgPool2d(),
                        Linear(2, 3))
    model = module.materialize(np, "float64", seed=0)
    assert transposes(model.module) == [TO_LAST, TO_FIRST, TO_LAST]
    errors = check_gradients(Sequential(Conv2d(1, 2, 3), Dropout(0.5), Conv2d(2, 2, 3), BatchNorm2d(2),
                                        GlobalAvgPool2d(), Linear(2, 3)),
                             np.random.default_rng(1).standard_normal((4, 1, 8, 8)))
    assert all(e.ok for e in errors), [e for e in errors if not e.ok]
    x = np.random.default_rng(2).standard_normal((4, 2, 5, 5))
    alone = GlobalAvgPool2d().materialize(np, "float64")
    np.testing.assert_allclose(alone.forward(x), x.mean(axis=(2, 3)), rtol=1e-12)


def test_residual_blocks_run_batch_last_inside_the_run():
    block = Residual(Sequential(Conv2d(2, 2, 3, padding=1, bias=False), BatchNorm2d(2), ReLU()),
                     shortcut=Sequential(Conv2d(2, 2, 1, bias=False), BatchNorm2d(2)))
    module = Sequential(Conv2d(1, 2, 3, padding=1), Sequential(block, ReLU()), GlobalAvgPool2d(), Linear(2, 3))
    model = module.materialize(np, "float64", seed=0)
    assert transposes(model.module) == [TO_LAST]
    assert all(m.batch_last for m in model.modules() if isinstance(m, SpatialModule))
    # a residual block as the whole model: its branches go into the run and back themselves
    alone = Residual(Sequential(Conv2d(2, 2, 3, padding=1), ReLU()))
    errors = check_gradients(alone, np.random.default_rng(3).standard_normal((3, 2, 5, 4)))
    assert all(e.ok for e in errors), [e for e in errors if not e.ok]
    assert transposes(alone) == [TO_LAST, TO_FIRST]


def test_models_with_the_permute_layers_of_before_keep_them_and_compute_the_same():
    """LeNet-5 style (Permute to batch last first, back before Flatten): the plan adds nothing, and the
    same parameters give the same output as the model without Permutes."""
    def layers(permute: bool) -> list[Module]:
        convs = [Conv2d(1, 3, 3, padding=1), ReLU(), MaxPool2d(2)]
        head = [Flatten(), Linear(3 * 4 * 4, 2)]
        return [Permute(TO_LAST), *convs, Permute(TO_FIRST), *head] if permute else [*convs, *head]

    old = Sequential(*layers(True)).materialize(np, "float64", seed=2)
    new = Sequential(*layers(False)).materialize(np, "float64", seed=2)
    assert transposes(old.module) == [] and transposes(new.module) == [TO_LAST, TO_FIRST]
    assert all(m.batch_last for m in old.modules() if isinstance(m, SpatialModule))
    np.testing.assert_array_equal(old.flat.params, new.flat.params)
    x = np.random.default_rng(4).standard_normal((3, 1, 8, 8))
    np.testing.assert_array_equal(old.forward(x), new.forward(x))


class Twice(Module):
    """A module of the user's (its own forward and backward) holding an mpisgd convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = self.add("conv", Conv2d(2, 2, 3, padding=1))

    def forward(self, x: np.ndarray) -> np.ndarray:
        return 2 * self.conv.forward(x)

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> np.ndarray | None:
        return self.backward_child(self.conv, 2 * dy, need_dx)


def test_a_module_of_the_users_gets_its_input_as_it_comes_and_hands_it_on():
    """The plan does not look inside a module that computes by itself: the run ends before it, and the
    convolution inside takes what the module passes on, (N, C, H, W)."""
    module = Sequential(Conv2d(1, 2, 3, padding=1), Twice(), GlobalAvgPool2d(), Linear(2, 2))
    model = module.materialize(np, "float64", seed=0)
    assert transposes(model.module) == [TO_LAST, TO_FIRST]
    assert not module.layers[1].conv.batch_last
    errors = check_gradients(Sequential(Conv2d(1, 2, 3, padding=1), Twice(), GlobalAvgPool2d(), Linear(2, 2)),
                             np.random.default_rng(0).standard_normal((3, 1, 6, 6)))
    assert all(e.ok for e in errors), [e for e in errors if not e.ok]


def test_layout_names_and_errors():
    assert (FIRST, LAST) == ("batch first", "batch last")
    with pytest.raises(ValueError, match=r"takes \(N, C, H, W\) batches, got shape \(4, 3\)"):
        Conv2d(3, 2, 3).materialize(np).forward(np.zeros((4, 3)))
    with pytest.raises(ValueError, match="takes 3 channels, got 2"):
        Conv2d(3, 2, 3).materialize(np).forward(np.zeros((4, 2, 5, 5)))
    with pytest.raises(ValueError, match="smaller than the kernel"):
        Conv2d(1, 1, 5).materialize(np).forward(np.zeros((1, 1, 3, 3)))
    # a Linear given another width: reshape(-1, in) made other rows (or a NumPy error about gufuncs)
    with pytest.raises(ValueError, match=r"Linear\(8, 2\) takes 8 features .* got shape \(8, 4\)"):
        Linear(8, 2).materialize(np).forward(np.zeros((8, 4)))
    with pytest.raises(ValueError, match=r"Linear\(400, 10\) takes 400 features .* got shape \(4, 576\)"):
        Sequential(Flatten(), Linear(400, 10)).materialize(np).forward(np.zeros((4, 1, 24, 24)))
    assert Linear(8, 2).materialize(np).forward(np.zeros((2, 3, 8))).shape == (2, 3, 2)  # leading axes are rows
    # raw uint8 pixels: a ufunc's casting error from inside the product
    with pytest.raises(TypeError, match=r"Linear\(8, 2\) takes floating-point inputs, got uint8: .*astype"):
        Linear(8, 2).materialize(np).forward(np.zeros((4, 8), np.uint8))
    with pytest.raises(TypeError, match=r"Conv2d\(1, 2, .*\) takes floating-point inputs, got uint8"):
        Sequential(Conv2d(1, 2, 3), Flatten()).materialize(np).forward(np.zeros((2, 1, 5, 5), np.uint8))
    with pytest.raises(ValueError, match="channels, kernel and stride must be >= 1"):
        Conv2d(1, 1, 3, stride=0)
