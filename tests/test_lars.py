"""LARS against a hand-written NumPy step; zero norms; biases excluded; shards and their summed norms."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import step_peak_bytes

from mpisgd.blas import level1_for
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim import SGD, TensorNorms
from mpisgd.optim.lars import LARS

SHAPES = [(6, 5), (5,), (5, 4, 2), (4,), (8, 3), (3,)]  # weights and biases, one 3-D tensor
RATES = [0.1 * (1 + t) for t in range(4)] + [0.5 * 0.8 ** t for t in range(8)]  # warmup, then decay


def make(seed: int = 0, dtype: type = np.float64) -> FlatBuffer:
    flat = FlatBuffer(SHAPES, dtype, np)
    flat.params[...] = np.random.default_rng(seed).standard_normal(flat.size)
    return flat


def whole_norms(flat: FlatBuffer) -> TensorNorms:
    return TensorNorms(flat.offsets, [(0, flat.size)])


def grad_of(w: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """A gradient that depends on the path (and a different size per tensor, so the ratios differ)."""
    return scale * (np.sin(3.0 * w) + 0.1 * np.arange(w.size) / w.size)


def run(lars: LARS, rates: list[float], scale: float = 1.0) -> np.ndarray:
    flat = lars.flat
    for lr in rates:
        flat.grads[...] = grad_of(flat.params, scale)
        lars.step(lr)
    return flat.params.copy()


def reference(w0: np.ndarray, rates: list[float], mu: float = 0.0, wd: float = 0.0, c: float = 0.1,
              nesterov: bool = False, scale: float = 1.0) -> np.ndarray:
    """LARS by hand, tensor by tensor: ratio = c*|w|/(|g| + wd*|w|) for tensors of 2 or more dimensions
    (1 for biases, or when a norm is 0); d = ratio*(g + wd*w); v = mu*v + d; w -= lr*v (or Nesterov)."""
    w, v = w0.copy(), np.zeros_like(w0)
    offsets = np.cumsum([0] + [int(np.prod(s)) for s in SHAPES])
    for lr in rates:
        g = grad_of(w, scale)
        for (a, b), shape in zip(zip(offsets, offsets[1:]), SHAPES):
            wn, gn = np.linalg.norm(w[a:b]), np.linalg.norm(g[a:b])
            ratio = c * wn / (gn + wd * wn) if len(shape) > 1 and wn > 0 and gn > 0 else 1.0
            d = ratio * (g[a:b] + wd * w[a:b])
            v[a:b] = mu * v[a:b] + d
            w[a:b] -= lr * (mu * v[a:b] + d if nesterov else v[a:b])
    return w


FORMS = [dict(), dict(weight_decay=0.01), dict(momentum=0.9), dict(momentum=0.9, weight_decay=0.01),
         dict(momentum=0.9, nesterov=True, weight_decay=0.01), dict(momentum=0.9, trust_coef=0.001),
         dict(momentum=0.9, nesterov=True, weight_decay=0.01, trust_coef=0.02)]


@pytest.mark.parametrize("level1", [True, False])
@pytest.mark.parametrize("kw", FORMS)
def test_lars_matches_hand_written_reference(kw, level1):
    flat = make()
    w0 = flat.params.copy()
    ours = run(LARS(flat, level1=level1, **kw), RATES)
    ref = reference(w0, RATES, kw.get("momentum", 0.0), kw.get("weight_decay", 0.0), kw.get("trust_coef", 0.1),
                    kw.get("nesterov", False))
    np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-12)
    assert np.abs(ours - w0).max() > 1e-3  # it moved


def test_reference_is_not_plain_sgd():
    """The reference check can fail: the trust ratio changes the iterates."""
    flat = make()
    w0 = flat.params.copy()
    sgd = SGD(flat, momentum=0.9, weight_decay=0.01)
    for lr in RATES:
        flat.grads[...] = grad_of(flat.params)
        sgd.step(lr * 0.1)
    assert not np.allclose(flat.params, reference(w0, RATES, 0.9, 0.01), rtol=1e-3, atol=1e-6)


def test_momentum_correction_gives_the_default_iterates():
    """LARS scales d and hands it to SGD's update: the momentum-corrected form still agrees."""
    a, b = make(), make()
    default = run(LARS(a, momentum=0.9, weight_decay=0.01), RATES)
    corrected = run(LARS(b, momentum=0.9, weight_decay=0.01, momentum_correction=True), RATES)
    np.testing.assert_allclose(corrected, default, rtol=1e-10, atol=1e-12)


def test_weight_step_ignores_the_gradient_scale_biases_do_not():
    """Without decay a weight tensor's step is c*lr*|w| whatever |g|; a bias (ratio 1) steps lr*g."""
    steps = []
    for scale in (1.0, 1000.0):
        flat = make()
        w0 = flat.params.copy()
        lars = LARS(flat, trust_coef=0.01)
        flat.grads[...] = grad_of(flat.params, scale)
        lars.step(0.1)
        steps.append(flat.params - w0)
    weights, bias = slice(0, 30), slice(30, 35)
    np.testing.assert_allclose(steps[1][weights], steps[0][weights], rtol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(steps[0][weights]), 0.01 * 0.1 * np.linalg.norm(make().params[weights]))
    np.testing.assert_allclose(steps[1][bias], 1000.0 * steps[0][bias], rtol=1e-12)


def test_only_one_dimensional_tensors_is_plain_sgd_bitwise():
    """Every tensor excluded (ratio 1): the same operations as SGD, the same bits."""
    runs = []
    for cls in (SGD, LARS):
        flat = FlatBuffer([(40,), (7,)], np.float64, np)
        flat.params[...] = np.random.default_rng(1).standard_normal(flat.size)
        opt = cls(flat, momentum=0.9, weight_decay=0.01)
        for lr in RATES:
            flat.grads[...] = grad_of(flat.params)
            opt.step(lr)
        runs.append(flat.params.copy())
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("zero", ["weights", "gradient", "both"])
def test_zero_norms_give_ratio_one_and_no_nan(zero, wd):
    flat = make()
    layer = slice(0, 30)  # the first weight tensor
    if zero in ("weights", "both"):
        flat.params[layer] = 0.0
    lars = LARS(flat, momentum=0.9, weight_decay=wd)
    flat.grads[...] = grad_of(flat.params)
    if zero in ("gradient", "both"):
        flat.grads[layer] = 0.0
    g = flat.grads[layer].copy()
    w = flat.params[layer].copy()
    ratios = lars.trust_ratios(lars.sq_norms([(0, flat.size, flat.grads)], whole_norms(flat)))
    lars.step(0.5)
    assert ratios[0] == 1.0 and all(np.isfinite(ratios)) and ratios[1] != 1.0
    assert np.isfinite(flat.params).all() and np.isfinite(lars.velocity).all()
    np.testing.assert_allclose(flat.params[layer], w - 0.5 * (g + wd * w), rtol=1e-12, atol=1e-15)  # SGD's step


def test_sharded_steps_with_summed_norms_equal_the_whole_step():
    """Shards that split tensors anywhere, the pieces' squared norms summed (as the ranks' are): the
    same update as one whole step; bitwise where the shards split only between tensors."""
    whole = make()
    w0 = whole.params.copy()
    lars = LARS(whole, momentum=0.9, weight_decay=0.01)
    for cuts in ([0, 13, 50, 51, 77, whole.size], [0, 30, 35, 75, 79, 103, whole.size]):  # splits; boundaries
        whole.params[...] = w0
        lars.velocity[...] = 0.0
        run(lars, RATES[:5])
        expected = whole.params.copy()
        flat = make()
        sharded = LARS(flat, momentum=0.9, weight_decay=0.01)
        for lr in RATES[:5]:
            g = grad_of(flat.params)
            shards = [(lo, hi, g[lo:hi].copy()) for lo, hi in zip(cuts, cuts[1:])]
            # each "rank" sums its own pieces; the parts are then added in rank order
            sharded.step_shards(lr, shards, TensorNorms(flat.offsets, [(lo, hi) for lo, hi, _ in shards]))
        if 13 in cuts:
            np.testing.assert_allclose(flat.params, expected, rtol=1e-13, atol=1e-14)
        else:
            np.testing.assert_array_equal(flat.params, expected)


def test_norms_of_one_shard_alone_are_wrong_when_it_splits_a_layer():
    """Why the sharded step must sum the ranks' norms: one piece's own norms give another ratio."""
    flat = make()
    lars = LARS(flat)
    flat.grads[...] = grad_of(flat.params)
    whole = lars.trust_ratios(lars.sq_norms([(0, flat.size, flat.grads)], whole_norms(flat)))
    piece = lars.trust_ratios(lars.sq_norms([(0, 13, flat.grads[:13])], TensorNorms(flat.offsets, [(0, 13)])))
    assert abs(piece[0] - whole[0]) > 1e-3 * whole[0]


def test_float32_step_is_close_to_float64():
    f64, f32 = make(), make(dtype=np.float32)
    ours = run(LARS(f32, momentum=0.9, weight_decay=0.01), RATES)
    np.testing.assert_allclose(ours, run(LARS(f64, momentum=0.9, weight_decay=0.01), RATES), rtol=1e-4, atol=1e-4)


def test_state_round_trip_resumes_bitwise():
    full = run(LARS(make(), momentum=0.9, weight_decay=0.01, momentum_correction=True), RATES)
    flat = make()
    lars = LARS(flat, momentum=0.9, weight_decay=0.01, momentum_correction=True)
    run(lars, RATES[:6])
    saved, buffers = lars.state(), {k: v.copy() for k, v in lars.state_buffers().items()}
    assert list(buffers) == ["velocity"]  # SGD's state: the momentum and the previous rate
    flat2 = make()
    flat2.params[...] = flat.params
    resumed = LARS(flat2, momentum=0.9, weight_decay=0.01, momentum_correction=True)
    resumed.load_state(saved, buffers)
    np.testing.assert_array_equal(run(resumed, RATES[6:]), full)


@pytest.mark.parametrize("level1", [True, False])
def test_step_allocates_no_parameter_sized_temporary(level1):
    if level1 and level1_for(np.zeros(4)) is None:
        pytest.skip("no BLAS level 1 here")
    n = 1 << 19
    flat = FlatBuffer([(n // 512, 512), (512,), (512, 512)], np.float64, np)
    flat.params[...] = 1.0
    lars = LARS(flat, momentum=0.9, weight_decay=1e-4, level1=level1)
    peak = step_peak_bytes(lars, flat)
    assert peak < n * 8 // 16, f"step allocated {peak} bytes at peak"


@pytest.mark.parametrize(("kw", "message"), [
    (dict(trust_coef=0.0), "trust"), (dict(trust_coef=float("nan")), "trust"), (dict(trust_coef=float("inf")), "trust"),
    (dict(weight_decay=-1.0), "weight decay"), (dict(momentum=1.0), "momentum")])
def test_bad_hyperparameters(kw, message):
    with pytest.raises(ValueError, match=message):
        LARS(make(), **kw)
