"""AdamW and LAMB against hand-written NumPy steps and torch.optim.AdamW; trust ratios, zero norms,
shards and their summed norms; state round trips; an allocation-free step."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import step_peak_bytes

from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim import TensorNorms
from mpisgd.optim.adam import LAMB, AdamW

SHAPES = [(6, 5), (5,), (5, 4, 2), (4,), (8, 3), (3,)]  # weights and biases, one 3-D tensor
OFFSETS = np.cumsum([0] + [int(np.prod(s)) for s in SHAPES])
RATES = [0.01 * (1 + t) for t in range(4)] + [0.05 * 0.8 ** t for t in range(8)]  # warmup, then decay


def make(seed: int = 0, dtype: type = np.float64, xp=np) -> FlatBuffer:
    flat = FlatBuffer(SHAPES, dtype, xp)
    flat.params[...] = xp.asarray(np.random.default_rng(seed).standard_normal(flat.size))
    return flat


def grad_of(w: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """A gradient that depends on the path, of another size per tensor (so the ratios differ)."""
    return scale * (np.sin(3.0 * w) + 0.1 * np.arange(w.size) / w.size)


def run(opt, rates: list[float], scale: float = 1.0) -> np.ndarray:
    flat = opt.flat
    for lr in rates:
        flat.grads[...] = grad_of(flat.params, scale)
        opt.step(lr)
    return flat.params.copy()


def reference(w0: np.ndarray, rates: list[float], b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
              wd: float = 0.0, lamb: bool = False, scale: float = 1.0) -> np.ndarray:
    """AdamW and LAMB by hand, tensor by tensor, with bias-corrected moments m_hat and v_hat.
    AdamW: w *= 1 - lr*wd; w -= lr*m_hat/(sqrt(v_hat) + eps).
    LAMB:  r = m_hat/(sqrt(v_hat) + eps) + wd*w; w -= lr*(|w|/|r|)*r for tensors of 2 or more dimensions
    (ratio 1 for biases, or when a norm is 0)."""
    w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for t, lr in enumerate(rates, start=1):
        g = grad_of(w, scale)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        u = m_hat / (np.sqrt(v_hat) + eps)
        if not lamb:
            w = w * (1 - lr * wd) - lr * u
            continue
        r = u + wd * w
        for (a, b), shape in zip(zip(OFFSETS, OFFSETS[1:]), SHAPES):
            wn, rn = np.linalg.norm(w[a:b]), np.linalg.norm(r[a:b])
            ratio = wn / rn if len(shape) > 1 and wn > 0 and rn > 0 else 1.0
            w[a:b] -= lr * ratio * r[a:b]
    return w


FORMS = [dict(), dict(weight_decay=0.01), dict(betas=(0.8, 0.99)), dict(betas=(0.0, 0.9), eps=1e-3),
         dict(betas=(0.95, 0.999), eps=1e-6, weight_decay=0.1)]


def ref_kw(kw: dict) -> dict:
    b1, b2 = kw.get("betas", (0.9, 0.999))
    return dict(b1=b1, b2=b2, eps=kw.get("eps", 1e-8), wd=kw.get("weight_decay", 0.0))


@pytest.mark.parametrize("kind", [AdamW, LAMB])
@pytest.mark.parametrize("kw", FORMS)
def test_matches_hand_written_reference(kind, kw):
    flat = make()
    w0 = flat.params.copy()
    ours = run(kind(flat, **kw), RATES)
    np.testing.assert_allclose(ours, reference(w0, RATES, lamb=kind is LAMB, **ref_kw(kw)), rtol=1e-12, atol=1e-12)
    assert np.abs(ours - w0).max() > 1e-2  # it moved


def test_lamb_is_not_adamw_and_the_check_sees_it():
    """The trust ratio changes the iterates: each reference check can fail."""
    flat = make()
    w0 = flat.params.copy()
    adamw = run(AdamW(flat, weight_decay=0.01), RATES)
    assert not np.allclose(adamw, reference(w0, RATES, wd=0.01, lamb=True), rtol=1e-3, atol=1e-6)
    flat = make()
    lamb = run(LAMB(flat, weight_decay=0.01), RATES)
    assert not np.allclose(lamb, reference(w0, RATES, wd=0.01), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-13), (np.float32, 1e-5)])
@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.05), dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3)])
def test_adamw_matches_torch(kw, dtype, tol):
    """torch.optim.AdamW on the same inputs (the gradient each takes from its own iterate), rate
    changing every step; its single-tensor path, foreach=False."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: AdamW checked against the NumPy reference "
                                               "only")
    flat = make(dtype=dtype)
    p = torch.tensor(flat.params.copy(), requires_grad=True)
    ours = AdamW(flat, **kw)
    b1, b2 = kw.get("betas", (0.9, 0.999))
    theirs = torch.optim.AdamW([p], lr=1.0, betas=(b1, b2), eps=kw.get("eps", 1e-8),
                               weight_decay=kw.get("weight_decay", 0.0), foreach=False)
    for lr in RATES:
        flat.grads[...] = grad_of(flat.params.astype(np.float64))
        ours.step(lr)
        theirs.param_groups[0]["lr"] = lr
        p.grad = torch.tensor(grad_of(p.detach().numpy().astype(np.float64)).astype(dtype))
        theirs.step()
    np.testing.assert_allclose(flat.params, p.detach().numpy(), rtol=tol, atol=tol)
    state = theirs.state[p]
    np.testing.assert_allclose(ours.exp_avg, state["exp_avg"].numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(ours.exp_avg_sq, state["exp_avg_sq"].numpy(), rtol=tol, atol=tol * tol)
    assert ours.steps == int(state["step"]) == len(RATES)


def test_lamb_weight_step_ignores_the_gradient_scale():
    """Each weight tensor steps lr*|w| whatever |g| (without decay its r is Adam's direction); a bias
    (ratio 1) steps Adam's lr*r, also nearly scale-free, but not of length lr*|b|."""
    steps = []
    for scale in (1.0, 1000.0):
        flat = make()
        w0 = flat.params.copy()
        flat.grads[...] = grad_of(w0, scale)
        LAMB(flat, eps=1e-12).step(0.01)
        steps.append(flat.params - w0)
    w0 = make().params
    for (a, b), shape in zip(zip(OFFSETS, OFFSETS[1:]), SHAPES):
        if len(shape) > 1:
            np.testing.assert_allclose(np.linalg.norm(steps[0][a:b]), 0.01 * np.linalg.norm(w0[a:b]), rtol=1e-12)
    np.testing.assert_allclose(steps[1], steps[0], rtol=1e-6, atol=1e-12)
    bias = slice(OFFSETS[1], OFFSETS[2])
    np.testing.assert_allclose(np.abs(steps[0][bias]), 0.01, rtol=1e-6)  # first step: m_hat/sqrt(v_hat) = sign(g)


@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("zero", ["weights", "gradient", "both"])
def test_lamb_zero_norms_give_ratio_one_and_no_nan(zero, wd):
    flat = make()
    layer = slice(0, 30)  # the first weight tensor
    if zero in ("weights", "both"):
        flat.params[layer] = 0.0
    lamb = LAMB(flat, weight_decay=wd)
    flat.grads[...] = grad_of(flat.params)
    if zero in ("gradient", "both"):
        flat.grads[layer] = 0.0
    g, w = flat.grads[layer].copy(), flat.params[layer].copy()
    lamb.step(0.5)
    assert np.isfinite(flat.params).all() and np.isfinite(lamb.exp_avg_sq).all()
    r = g / (np.abs(g) + 1e-8) + wd * w  # first step: m_hat = g, v_hat = g*g
    if zero == "weights":  # |w| = 0: ratio 1, Adam's step
        np.testing.assert_allclose(flat.params[layer], w - 0.5 * r, rtol=1e-12, atol=1e-15)
    elif wd == 0 or zero == "both":  # r = 0: nothing moves
        np.testing.assert_array_equal(flat.params[layer], w - 0.5 * r)
    else:  # r = wd*w: ratio |w|/|r| = 1/wd, the step lr*w/... = lr*w
        np.testing.assert_allclose(flat.params[layer], w - 0.5 * w, rtol=1e-12)


@pytest.mark.parametrize("kind", [AdamW, LAMB])
def test_sharded_steps_with_summed_norms_equal_the_whole_step(kind):
    """Shards that split tensors anywhere, each "rank's" squared norms summed (as RankNorms does): the
    whole step's iterates; bitwise for AdamW (element by element) and where the shards split only
    between tensors."""
    whole = make()
    expected = run(kind(whole, weight_decay=0.01), RATES[:6])
    for cuts in ([0, 13, 50, 51, 77, whole.size], [0, 30, 35, 75, 79, 103, whole.size]):  # splits; boundaries
        flat = make()
        sharded = kind(flat, weight_decay=0.01)
        for lr in RATES[:6]:
            g = grad_of(flat.params)
            shards = [(lo, hi, g[lo:hi].copy()) for lo, hi in zip(cuts, cuts[1:])]
            sharded.step_shards(lr, shards, TensorNorms(flat.offsets, [(lo, hi) for lo, hi, _ in shards]))
        if kind is LAMB and 13 in cuts:
            np.testing.assert_allclose(flat.params, expected, rtol=1e-13, atol=1e-14)
        else:
            np.testing.assert_array_equal(flat.params, expected)


def test_lamb_norms_of_one_shard_alone_are_wrong_when_it_splits_a_layer():
    """Why the sharded step must add every rank's norms: one piece's own give another step."""
    whole, piece = make(), make()
    g = grad_of(whole.params)
    whole.grads[...] = g
    LAMB(whole).step(0.1)
    LAMB(piece).step_shards(0.1, [(0, 13, g[:13].copy())], TensorNorms(piece.offsets, [(0, 13)]))
    assert np.abs(piece.params[:13] - whole.params[:13]).max() > 1e-4


@pytest.mark.parametrize("kind", [AdamW, LAMB])
def test_float32_step_is_close_to_float64(kind):
    f64, f32 = make(), make(dtype=np.float32)
    ours = run(kind(f32, weight_decay=0.01), RATES)
    assert ours.dtype == np.float32 and kind(f32).exp_avg.dtype == np.float32
    np.testing.assert_allclose(ours, run(kind(f64, weight_decay=0.01), RATES), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", [AdamW, LAMB])
def test_state_round_trip_resumes_bitwise(kind):
    full = run(kind(make(), weight_decay=0.01), RATES)
    flat = make()
    opt = kind(flat, weight_decay=0.01)
    run(opt, RATES[:5])
    buffers, scalars = {k: v.copy() for k, v in opt.state_buffers().items()}, opt.state()
    assert sorted(buffers) == ["exp_avg", "exp_avg_sq"] and scalars == {"step": 5}
    flat2 = make()
    flat2.params[...] = flat.params
    resumed = kind(flat2, weight_decay=0.01)
    resumed.load_state(scalars, buffers)
    np.testing.assert_array_equal(run(resumed, RATES[5:]), full)
    lost = kind(make(), weight_decay=0.01)  # the step count is state: bias correction restarts without it
    lost.flat.params[...] = flat.params
    lost.load_state({}, buffers)
    assert not np.array_equal(run(lost, RATES[5:]), full)


def test_load_state_without_buffers_keeps_this_ranks_and_checks_sizes():
    opt = AdamW(make())
    run(opt, RATES[:2])
    m = opt.exp_avg.copy()
    opt.load_state({"step": 7})  # the ranks that take rank 0's buffers by a broadcast next
    assert opt.steps == 7 and np.array_equal(opt.exp_avg, m)
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state({"step": 1}, {"exp_avg": np.zeros(3)})


@pytest.mark.parametrize("kind", [AdamW, LAMB])
@pytest.mark.parametrize("wd", [0.0, 1e-4])
def test_step_allocates_no_parameter_sized_temporary(kind, wd):
    n = 1 << 19
    flat = FlatBuffer([(n // 512, 512), (512,), (512, 512)], np.float64, np)
    flat.params[...] = 1.0
    opt = kind(flat, weight_decay=wd)
    peak = step_peak_bytes(opt, flat)
    assert peak < n * 8 // 16, f"step allocated {peak} bytes at peak"
    assert opt.buffer_nbytes() == 3 * flat.nbytes  # two moments and the scratch buffer


@pytest.mark.parametrize("kind", [AdamW, LAMB])
def test_gpu_step_equals_the_cpu_step(kind):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: the GPU path (the same ufuncs) is untested here")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA device")
    cpu, gpu = make(), make(xp=cupy)
    a, b = kind(cpu, weight_decay=0.01), kind(gpu, weight_decay=0.01)
    for lr in RATES:
        g = grad_of(cpu.params)
        cpu.grads[...] = g
        gpu.grads[...] = cupy.asarray(g)
        a.step(lr)
        b.step(lr)
    np.testing.assert_allclose(cupy.asnumpy(gpu.params), cpu.params, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", [AdamW, LAMB])
@pytest.mark.parametrize(("kw", "message"), [
    (dict(betas=(1.0, 0.999)), "beta1"), (dict(betas=(0.9, -0.1)), "beta2"), (dict(eps=0.0), "eps"),
    (dict(eps=float("nan")), "eps"), (dict(weight_decay=-1.0), "weight decay")])
def test_bad_hyperparameters(kind, kw, message):
    with pytest.raises(ValueError, match=message):
        kind(make(), **kw)
