"""SGD against hand-written references; the momentum correction; an allocation-free step."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from conftest import step_peak_bytes

from mpisgd.blas import level1_for
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim import SGD, TensorNorms, clip_grad_norm_, grad_norm

N = 50
RNG = np.random.default_rng(7)
A = RNG.standard_normal((N, N)) / np.sqrt(N)
H = A @ A.T + 0.1 * np.eye(N)  # a convex quadratic: the gradient depends on the path taken
TARGET = RNG.standard_normal(N)
W0 = RNG.standard_normal(N)
WARMUP_THEN_DECAY = [0.01 * (1 + t) for t in range(10)] + [0.1 * 0.7 ** t for t in range(20)]


def grad(w: np.ndarray) -> np.ndarray:
    return H @ (w - TARGET)


def run_sgd(lrs: list[float], **kw: float | bool) -> np.ndarray:
    """Iterates of mpisgd's SGD on the quadratic, one row per step."""
    flat = FlatBuffer([(N,)], np.float64, np)
    flat.params[...] = W0
    opt = SGD(flat, **kw)
    out = []
    for lr in lrs:
        flat.grads[...] = grad(flat.params)
        opt.step(lr)
        out.append(flat.params.copy())
    return np.array(out)


def reference(lrs: list[float], mu: float = 0.0, nesterov: bool = False, wd: float = 0.0,
              form: str = "default") -> np.ndarray:
    """Hand-written SGD. form: default (v = mu v + d; w -= eta v), eta_in_v_corrected, eta_in_v_uncorrected."""
    w, v, prev, out = W0.copy(), np.zeros(N), None, []
    for lr in lrs:
        d = grad(w) + wd * w
        if form == "default":
            v = mu * v + d
            w = w - lr * (mu * v + d if nesterov else v)
        else:
            ratio = lr / prev if (form == "eta_in_v_corrected" and prev) else 1.0
            v = mu * ratio * v + lr * d
            w = w - (mu * v + lr * d if nesterov else v)
        prev = lr
        out.append(w)
    return np.array(out)


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.05), dict(momentum=0.9),
                                dict(momentum=0.9, weight_decay=0.05), dict(momentum=0.9, nesterov=True),
                                dict(momentum=0.8, nesterov=True, weight_decay=0.01)])
def test_sgd_matches_hand_written_reference(kw):
    ours = run_sgd(WARMUP_THEN_DECAY, **kw)
    ref = reference(WARMUP_THEN_DECAY, kw.get("momentum", 0.0), kw.get("nesterov", False),
                    kw.get("weight_decay", 0.0))
    np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_gives_the_default_iterates_under_a_changing_rate(nesterov):
    kw = dict(momentum=0.9, nesterov=nesterov, weight_decay=1e-3)
    default = run_sgd(WARMUP_THEN_DECAY, **kw)
    corrected = run_sgd(WARMUP_THEN_DECAY, momentum_correction=True, **kw)
    np.testing.assert_allclose(corrected, default, rtol=1e-10, atol=1e-12)
    hand = reference(WARMUP_THEN_DECAY, 0.9, nesterov, 1e-3, form="eta_in_v_corrected")
    np.testing.assert_allclose(corrected, hand, rtol=1e-10, atol=1e-12)


def test_without_the_correction_eta_in_velocity_differs_when_the_rate_changes():
    uncorrected = reference(WARMUP_THEN_DECAY, 0.9, form="eta_in_v_uncorrected")
    default = reference(WARMUP_THEN_DECAY, 0.9)
    assert np.abs(uncorrected - default).max() > 1e-2
    constant = [0.05] * 30  # with a constant rate the ratio is 1 and the forms agree
    np.testing.assert_allclose(reference(constant, 0.9, form="eta_in_v_uncorrected"), reference(constant, 0.9),
                               rtol=1e-12, atol=1e-12)


def test_why_the_correction_matters_one_rate_jump():
    """A constant gradient of 1, rate 0.1 then 1.0: the uncorrected form's velocity still carries
    steps sized for the old rate, so right after a warmup jump it steps too little (after a
    decay, too much)."""
    flat = FlatBuffer([(1,)], np.float64, np)
    mu = 0.9
    for correction in (False, True):
        flat.params[...] = 0.0
        opt = SGD(flat, momentum=mu, momentum_correction=correction)
        for lr in (0.1, 1.0):
            flat.grads[...] = 1.0
            opt.step(lr)
        # default form: v1 = 1, v2 = mu + 1; w2 = -(0.1*1 + 1.0*(mu + 1)) whichever form we run
        assert flat.params[0] == pytest.approx(-(0.1 + 1.0 * (mu + 1)))
    uncorrected_w2 = -(0.1 + (mu * 0.1 + 1.0))  # V2 = mu*V1 + eta2*g with V1 = 0.1
    assert uncorrected_w2 == pytest.approx(-1.19) and -(0.1 + 1.0 * (mu + 1)) == pytest.approx(-2.0)


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=1e-4), dict(momentum=0.9, weight_decay=1e-4),
                                dict(momentum=0.9, nesterov=True, weight_decay=1e-4),
                                dict(momentum=0.9, momentum_correction=True),
                                dict(momentum=0.9, nesterov=True, momentum_correction=True)])
def test_step_allocates_no_parameter_sized_temporary(kw):
    n = 1 << 20  # 8 MiB of float64: any lr*v or wd*w temporary would show
    flat = FlatBuffer([(n,)], np.float64, np)
    flat.params[...] = 1.0
    opt = SGD(flat, **kw)
    peak = step_peak_bytes(opt, flat, (0.1, 0.2, 0.05))
    assert peak < n * 8 // 16, f"step allocated {peak} bytes at peak"


def test_state_round_trip_resumes_bitwise():
    lrs = WARMUP_THEN_DECAY
    full = run_sgd(lrs, momentum=0.9, momentum_correction=True)
    flat = FlatBuffer([(N,)], np.float64, np)
    flat.params[...] = W0
    opt = SGD(flat, momentum=0.9, momentum_correction=True)
    for lr in lrs[:12]:
        flat.grads[...] = grad(flat.params)
        opt.step(lr)
    saved, params = opt.state(), flat.params.copy()
    buffers = {k: v.copy() for k, v in opt.state_buffers().items()}
    assert saved == {"prev_lr": lrs[11]} and list(buffers) == ["velocity"] and buffers["velocity"] is not opt.velocity
    flat2 = FlatBuffer([(N,)], np.float64, np)
    flat2.params[...] = params
    opt2 = SGD(flat2, momentum=0.9, momentum_correction=True)
    opt2.load_state(saved, buffers)
    for lr in lrs[12:]:
        flat2.grads[...] = grad(flat2.params)
        opt2.step(lr)
    np.testing.assert_array_equal(flat2.params, full[-1])


def test_fresh_state_has_no_previous_rate():
    opt = SGD(FlatBuffer([(3,)], np.float64, np), momentum=0.9)
    assert opt.state() == {"prev_lr": -1.0}
    opt.load_state({"prev_lr": -1.0}, {"velocity": np.zeros(3)})
    assert opt.prev_lr is None


def test_state_buffers_are_the_live_momentum_or_none():
    flat = FlatBuffer([(3,)], np.float64, np)
    assert SGD(flat).state_buffers() == {}  # no momentum, no buffer
    opt = SGD(flat, momentum=0.9)
    assert opt.state_buffers()["velocity"] is opt.velocity
    opt.load_state({"prev_lr": 0.5}, {"velocity": np.arange(3.0), "exp_avg": np.ones(3)})  # not SGD's: ignored
    np.testing.assert_array_equal(opt.velocity, [0, 1, 2])
    assert opt.prev_lr == 0.5
    opt.load_state({"prev_lr": 0.25})  # None: this rank's buffer stays (rank 0's comes by a broadcast)
    np.testing.assert_array_equal(opt.velocity, [0, 1, 2])
    with pytest.raises(ValueError, match="velocity"):
        opt.load_state({}, {"velocity": np.zeros(4)})


# -- clipping by the global norm ---------------------------------------------------------------
CLIP_SHAPES = [(6, 5), (5,), (8, 3), (3,)]


def clip_case(seed: int = 0) -> tuple[FlatBuffer, np.ndarray]:
    flat = FlatBuffer(CLIP_SHAPES, np.float64, np)
    g = np.random.default_rng(seed).standard_normal(flat.size)
    flat.grads[...] = g
    return flat, g


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 100.0])
def test_clip_grad_norm_scales_to_the_bound_and_returns_the_norm_before(max_norm):
    flat, g = clip_case()
    whole = [(0, flat.size, flat.grads)]
    before = clip_grad_norm_(whole, TensorNorms(flat.offsets, [(0, flat.size)]), max_norm)
    assert before == pytest.approx(np.linalg.norm(g), rel=1e-14)
    expected = g * (max_norm / (before + 1e-6)) if before > max_norm else g  # torch's factor, applied below 1
    np.testing.assert_array_equal(flat.grads, expected)
    assert np.linalg.norm(flat.grads) <= max_norm * (1 + 1e-12)


@pytest.mark.parametrize("off", [None, 0.0])
def test_clip_off_only_measures(off):
    flat, g = clip_case()
    norm = clip_grad_norm_([(0, flat.size, flat.grads)], TensorNorms(flat.offsets, [(0, flat.size)]), off)
    assert norm == pytest.approx(np.linalg.norm(g)) and np.array_equal(flat.grads, g)


def test_clip_of_pieces_needs_every_pieces_norm():
    """Pieces that split tensors, their squared norms added (as the ranks' are): the whole gradient's
    norm, and each piece clipped by the same factor; one piece's norm alone is another."""
    flat, g = clip_case()
    cuts = [0, 13, 31, 40, flat.size]
    shards = [(lo, hi, g[lo:hi].copy()) for lo, hi in zip(cuts, cuts[1:])]
    ranges = [(lo, hi) for lo, hi, _ in shards]
    assert grad_norm(shards, TensorNorms(flat.offsets, ranges)) == pytest.approx(np.linalg.norm(g), rel=1e-14)
    assert grad_norm(shards[:1], TensorNorms(flat.offsets, ranges[:1])) < 0.9 * np.linalg.norm(g)
    clip_grad_norm_(shards, TensorNorms(flat.offsets, ranges), 1.0)
    clip_grad_norm_([(0, flat.size, flat.grads)], TensorNorms(flat.offsets, [(0, flat.size)]), 1.0)
    np.testing.assert_allclose(np.concatenate([p for _, _, p in shards]), flat.grads, rtol=1e-14)


@pytest.mark.parametrize(("kw", "message"), [(dict(momentum=1.0), "momentum"), (dict(momentum=-0.1), "momentum"),
                                             (dict(weight_decay=-1e-4), "weight decay")])
def test_bad_hyperparameters(kw, message):
    with pytest.raises(ValueError, match=message):
        SGD(FlatBuffer([(3,)], np.float64, np), **kw)


# -- the BLAS path (mpisgd.blas) ---------------------------------------------------------------
FORMS = [dict(), dict(weight_decay=1e-3), dict(momentum=0.9), dict(momentum=0.9, weight_decay=1e-3),
         dict(momentum=0.9, nesterov=True, weight_decay=1e-3), dict(momentum=0.9, momentum_correction=True),
         dict(momentum=0.9, nesterov=True, momentum_correction=True)]


def _blas_or_skip(dtype: type) -> None:
    if level1_for(np.zeros(4, dtype)) is None:
        pytest.skip("NumPy's BLAS has no usable axpy/axpby here (or MPISGD_BLAS_LEVEL1=0): ufuncs only")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", FORMS)
def test_blas_step_matches_the_ufunc_step(kw, dtype):
    """Same iterates on the quadratic, through a warmup and a decay, up to rounding."""
    _blas_or_skip(dtype)
    runs = []
    for level1 in (True, False):
        flat = FlatBuffer([(N,)], dtype, np)
        flat.params[...] = W0
        opt = SGD(flat, level1=level1, **kw)
        assert (opt.blas is not None) == level1
        for lr in WARMUP_THEN_DECAY:
            flat.grads[...] = grad(flat.params.astype(np.float64))
            opt.step(lr)
        runs.append(flat.params.copy())
    rtol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(runs[0], runs[1], rtol=rtol, atol=rtol)
    assert not np.array_equal(runs[1], W0.astype(dtype))  # it moved


def test_blas_routines_agree_with_numpy():
    _blas_or_skip(np.float32)
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal(100_003).astype(np.float32) for _ in range(2))
    b = level1_for(x, y)
    assert b is not None
    got = y.copy()
    b.axpy(-0.3, x, got)
    np.testing.assert_allclose(got, y - np.float32(0.3) * x, rtol=1e-6, atol=1e-6)
    got = y.copy()
    b.axpby(0.5, x, 0.9, got)
    np.testing.assert_allclose(got, np.float32(0.5) * x + np.float32(0.9) * y, rtol=1e-6, atol=1e-6)


def test_finite_check_and_squared_norm_in_one_pass():
    from mpisgd.blas import finite_sq_norm

    x = np.random.default_rng(1).standard_normal(100_003).astype(np.float32)
    ok, sq = finite_sq_norm(x)
    assert ok and sq == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-4)
    for bad in (np.nan, np.inf, -np.inf):
        z = x.copy()
        z[77_777] = bad
        assert not finite_sq_norm(z)[0]
    huge = np.full(8, np.finfo(np.float32).max / 2, np.float32)  # finite, but the squares overflow
    ok, sq = finite_sq_norm(huge)
    assert ok and not np.isfinite(sq)


def test_ufuncs_where_blas_cannot_go():
    x = np.zeros(10, np.float32)
    assert level1_for(x[::2]) is None  # strided
    assert level1_for(np.zeros(10, np.float16)) is None  # no such BLAS
    assert level1_for(x, np.zeros(10, np.float64)) is None  # mixed dtypes
    assert level1_for(x, np.zeros(9, np.float32)) is None  # mixed sizes
    assert level1_for([0.0] * 10) is None  # not a NumPy array (CuPy arrays take the ufuncs too)


@pytest.mark.parametrize("momentum,level1,buffers", [(0.9, True, 1), (0.0, True, 0), (0.9, False, 2)])
def test_optimizer_state_bytes_are_what_it_keeps(momentum, level1, buffers):
    """Counted for the speed issue's memory bound: momentum, and the ufuncs' one temporary without BLAS."""
    flat = FlatBuffer([(30, 20), (20,)], np.float32, np)
    opt = SGD(flat, momentum=momentum, level1=level1)
    assert opt.buffer_nbytes() == buffers * flat.nbytes


def test_clipping_allocates_no_parameter_sized_temporary():
    n = 1 << 20
    flat = FlatBuffer([(n // 1024, 1024), (1024,)], np.float64, np)
    whole, norms = [(0, flat.size, flat.grads)], TensorNorms(flat.offsets, [(0, flat.size)])
    flat.grads[...] = 0.5
    clip_grad_norm_(whole, norms, 1.0)
    tracemalloc.start()
    try:
        flat.grads[...] = 0.5
        norm = clip_grad_norm_(whole, norms, 1.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert norm == pytest.approx(0.5 * np.sqrt(flat.size)) and peak < n * 8 // 16, f"allocated {peak} bytes"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blas_gives_every_element_the_same_bits_wherever_a_call_is_cut(dtype):
    """The sharded step cuts the buffers elsewhere than the replicated step: with a kernel's scalar tail,
    an element's bits would depend on where its call ended. Every cut gives one call's bits."""
    rng = np.random.default_rng(7)
    n = 100_003
    x, y = (rng.standard_normal(n).astype(dtype) for _ in range(2))
    b = level1_for(x, y)
    if b is None:
        pytest.skip("no BLAS level 1 here")
    whole_axpy, whole_axpby = y.copy(), y.copy()
    b.axpy(-0.3, x, whole_axpy)
    b.axpby(0.7, x, 0.9, whole_axpby)
    cut_axpy, cut_axpby = y.copy(), y.copy()
    for lo, hi in [(0, 777), (777, 50_001), (50_001, 50_002), (50_002, 99_999), (99_999, n)]:
        b.axpy(-0.3, x[lo:hi], cut_axpy[lo:hi])
        b.axpby(0.7, x[lo:hi], 0.9, cut_axpby[lo:hi])
    assert np.array_equal(whole_axpy, cut_axpy) and np.array_equal(whole_axpby, cut_axpby)
