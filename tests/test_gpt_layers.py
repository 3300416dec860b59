"""The GPT's layers: each one's float64 gradient check, the loss over positions with its ignore index, the
causal mask, Linear over leading dimensions, AdamW's decay mask and the warmup from zero."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpisgd.flatbuf import FlatBuffer
from mpisgd.nn import (
    GELU,
    CausalSelfAttention,
    Embedding,
    GPTShape,
    LayerNorm,
    Linear,
    PositionEmbedding,
    Sequential,
    TokenCrossEntropy,
    gpt,
)
from mpisgd.nn import embedding as embedding_module
from mpisgd.nn.gradcheck import check_gradients
from mpisgd.optim.adam import AdamW, matrices
from mpisgd.schedule import Schedule

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 5, 8))  # (N, T, D)
IDS = RNG.integers(0, 11, (3, 6))


def passes(module, x, **kw) -> list:
    errors = check_gradients(module, x, **kw)
    assert errors and all(e.ok for e in errors), [e for e in errors if not e.ok]
    return errors


@pytest.mark.parametrize("name,module,x", [
    ("Linear over (N, T, D)", lambda: Sequential(Linear(8, 6)), X),
    ("LayerNorm", lambda: Sequential(Linear(8, 8), LayerNorm(8)), X),
    ("GELU", lambda: Sequential(GELU()), X),
    ("PositionEmbedding", lambda: Sequential(PositionEmbedding(7, 8)), X),
    ("CausalSelfAttention", lambda: Sequential(CausalSelfAttention(8, 2, 5)), X),
    ("CausalSelfAttention with dropout", lambda: Sequential(CausalSelfAttention(8, 2, 5, dropout=0.3)), X),
])
def test_float_layers_pass_the_gradient_check(name, module, x):
    errors = passes(module(), x)
    assert errors[0].name == "input"  # the input's gradient is checked too


def test_embedding_passes_the_gradient_check_on_integer_ids():
    errors = passes(Sequential(Embedding(11, 8), Linear(8, 3)), IDS)
    assert [e.name for e in errors] == ["0.Embedding.W", "1.Linear.W", "1.Linear.b"]  # ids: no gradient


def test_a_small_gpt_passes_the_gradient_check_with_dropout():
    shape = GPTShape(vocab=11, context=6, layers=2, heads=2, width=8, dropout=0.2)
    errors = passes(gpt(shape), IDS, samples=6)
    assert len(errors) == 2 + 2 * 12 + 4  # embeddings, 12 tensors per block, the last LayerNorm and the head


def test_embedding_gradient_is_the_same_by_gemm_and_by_scatter(monkeypatch):
    """The one-hot GEMM (small vocabularies) and add.at (large ones) give the same gradient."""
    dy = RNG.standard_normal((3, 6, 8)).astype(np.float32)
    grads = []
    for limit in (1 << 30, 0):
        monkeypatch.setattr(embedding_module, "ONEHOT_MAX_BYTES", limit)
        model = Sequential(Embedding(11, 8)).materialize(np, "float32", 0)
        model.forward(IDS)
        model.backward(dy.copy())
        grads.append(model.flat.grads.copy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6, atol=1e-6)
    assert np.abs(grads[0]).sum() > 0


def test_attention_is_causal():
    """A later token never changes an earlier position's output (and does change its own)."""
    model = Sequential(CausalSelfAttention(8, 2, 5)).materialize(np, "float64", 0)
    x = X.copy()
    before = model.forward(x).copy()
    x[:, 3] += 1.0
    after = model.forward(x)
    np.testing.assert_array_equal(after[:, :3], before[:, :3])
    assert not np.allclose(after[:, 3:], before[:, 3:])


def test_linear_over_leading_dimensions_is_the_2d_linear_on_the_rows():
    model = Sequential(Linear(8, 6)).materialize(np, "float32", 0)
    x = X.astype(np.float32)
    y3 = model.forward(x).copy()
    y2 = model.forward(x.reshape(-1, 8)).copy()
    np.testing.assert_array_equal(y3.reshape(-1, 6), y2)


def test_layernorm_normalises_each_row():
    model = Sequential(LayerNorm(8)).materialize(np, "float64", 0)
    y = model.forward(3 + 5 * X)
    np.testing.assert_allclose(y.mean(axis=-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=-1), 1, rtol=1e-4)  # var / (var + eps)


def test_gelu_is_the_tanh_form():
    model = Sequential(GELU()).materialize(np, "float64", 0)
    x = np.array([[-3.0, -1.0, 0.0, 1.0, 3.0]])
    want = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(model.forward(x), want, rtol=1e-15)
    assert abs(model.forward(np.array([[1.0]]))[0, 0] - 0.841192) < 1e-6  # GPT-2's gelu(1)


def numeric_loss_grad(loss: TokenCrossEntropy, z: np.ndarray, y: np.ndarray, h: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(z)
    for i in np.ndindex(z.shape):
        old = z[i]
        z[i] = old + h
        up = loss.forward(z, y) * loss.count(y)  # the summed loss: what backward(scale=1) differentiates
        z[i] = old - h
        down = loss.forward(z, y) * loss.count(y)
        z[i] = old
        g[i] = (up - down) / (2 * h)
    return g


def test_token_cross_entropy_gradient_and_ignore_index():
    loss = TokenCrossEntropy(ignore_index=-1)
    z = RNG.standard_normal((2, 4, 5))
    y = RNG.integers(0, 5, (2, 4))
    y[0, 1] = y[1, 3] = -1
    assert loss.count(y) == 6
    numeric = numeric_loss_grad(loss, z, y)
    loss.forward(z, y)
    analytic = loss.backward(scale=1.0).copy()
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)
    assert analytic.shape == z.shape
    assert not analytic[0, 1].any() and not analytic[1, 3].any()  # ignored targets: no gradient
    # the mean is over the scored targets only, and matches the per-target formula
    keep = y != -1
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    want = -np.take_along_axis(logp, np.where(keep, y, 0)[..., None], axis=-1)[..., 0][keep].mean()
    assert abs(loss.forward(z, y) - want) < 1e-12
    # default scale: the gradient of the mean
    loss.forward(z, y)
    np.testing.assert_allclose(loss.backward(), analytic / 6, rtol=1e-12)


def test_token_cross_entropy_with_every_target_ignored_is_zero():
    loss = TokenCrossEntropy()
    z = RNG.standard_normal((1, 3, 4))
    y = np.full((1, 3), -1)
    assert loss.count(y) == 0 and loss.forward(z, y) == 0.0
    assert not loss.backward(scale=1.0).any()


def test_adamw_decays_only_the_masked_tensors():
    flat = FlatBuffer([(3, 4), (4,), (2, 2)], np.float64, np)
    flat.params[...] = 1.0
    opt = AdamW(flat, weight_decay=0.5, decay_mask=matrices(flat))
    flat.grads[...] = 0.0  # no gradient: only the decay moves the parameters
    opt.step(0.1)
    w, b, v = flat.param_views
    np.testing.assert_array_equal(w, 0.95)
    np.testing.assert_array_equal(b, 1.0)  # a vector: not decayed
    np.testing.assert_array_equal(v, 0.95)
    assert matrices(flat) == [True, False, True]


def test_adamw_decay_mask_of_all_tensors_is_the_unmasked_step_bitwise_and_shards_agree():
    rng = np.random.default_rng(3)
    shapes = [(5, 3), (3,), (3, 2), (2,)]
    runs = []
    for mask, shards in ((None, 1), ([True] * 4, 1), ([True, False, True, False], 1), ([True, False, True, False], 3)):
        flat = FlatBuffer(shapes, np.float32, np)
        flat.params[...] = np.random.default_rng(0).standard_normal(flat.size)
        opt = AdamW(flat, weight_decay=0.1, decay_mask=mask)
        for _ in range(3):
            flat.grads[...] = rng.standard_normal(flat.size)
            cuts = np.linspace(0, flat.size, shards + 1).astype(int)
            opt.step_shards(0.01, [(lo, hi, flat.grads[lo:hi]) for lo, hi in zip(cuts, cuts[1:])])
        runs.append(flat.params.copy())
        rng = np.random.default_rng(3)
    np.testing.assert_array_equal(runs[0], runs[1])  # a mask of every tensor is no mask
    assert not np.array_equal(runs[0], runs[2])  # the control: a mask changes the step
    np.testing.assert_array_equal(runs[2], runs[3])  # in shards that cut tensors, the same bits


def test_adamw_refuses_a_mask_of_the_wrong_length():
    with pytest.raises(ValueError, match="decay_mask has 1 entries for 2 parameter tensors"):
        AdamW(FlatBuffer([(2, 2), (2,)], np.float32, np), decay_mask=[True])


def test_warmup_from_zero():
    s = Schedule(base_lr=1e-3, peak_lr=1e-3, warmup_steps=10, total_steps=100, decay="cosine", warmup_start=0.0)
    assert s(0) == 0.0 and s(5) == pytest.approx(5e-4) and s(10) == pytest.approx(1e-3)
    assert s(99) < 1e-5
    goyal = Schedule(base_lr=1e-3, peak_lr=1e-3, warmup_steps=10, total_steps=100, decay="cosine")
    assert goyal(0) == 1e-3  # without it: from min(eta0, eta), flat when the two are equal


@pytest.mark.parametrize("make,x,says", [
    # a negative id silently embedded the last token's row (take wraps); one past the vocabulary was an IndexError
    (lambda: gpt(GPTShape(11, 8, 1, 2, 16, 0.0)), np.full((2, 8), -1), r"Embedding\(11, 16\) takes token ids 0..10, "
                                                                        r"got -1..-1"),
    (lambda: gpt(GPTShape(11, 8, 1, 2, 16, 0.0)), np.full((2, 8), 11), r"takes token ids 0..10, got 11..11"),
    # one window without its batch axis: "16 positions, more than the model's context of 8"
    (lambda: gpt(GPTShape(11, 8, 1, 2, 16, 0.0)), np.zeros(8, np.int64), r"takes \(N, T, 16\) inputs, got shape "
                                                                          r"\(8, 16\)"),
    (lambda: Sequential(LayerNorm(4)), np.zeros((2, 5)), r"LayerNorm\(4\) normalises 4 features on the last axis, "
                                                         r"got shape \(2, 5\)"),  # a NumPy broadcasting error
])
def test_the_language_layers_refuse_inputs_they_would_misread_in_one_line(make, x, says):
    with pytest.raises(ValueError, match=says):
        make().materialize(np, "float64").forward(x)
    with pytest.raises(ValueError, match=r"Embedding\(0, 4\): the vocabulary and the width must be >= 1"):
        Embedding(0, 4)
