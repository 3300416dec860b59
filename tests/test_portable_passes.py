"""The portable level's two pass strategies (mpisgd.portable.passes) give the same bits: the compiled
passes (mpisgd/portable/_passes.c) against NumPy's ufuncs, pass by pass on every shape, layout and special
value they take, then through whole products, weights and a model's gradients. A run's bits must not
depend on whether its machine had a C compiler when mpisgd was installed."""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import numpy as np
import pytest
from conftest import TINY, train_here

import mpisgd.portable
from mpisgd.errors import UsageError
from mpisgd.kernels import PortableKernels
from mpisgd.portable import gemm, passes
from mpisgd.portable.native import ENV
from mpisgd.portable.passes import CompiledPasses, UfuncPasses, passes_for
from mpisgd.portable.reduce import fold_
from mpisgd.portable.weight import Weight

try:
    from mpisgd.portable import _passes as native  # type: ignore[attr-defined]
except ImportError:  # no C compiler at install: the ufuncs serve alone, and there is nothing to compare
    native = None

built = pytest.mark.skipif(native is None, reason="the C passes are not built (pip install with a C compiler)")
UFUNC = UfuncPasses()


def compiled() -> CompiledPasses:
    return CompiledPasses(native)


def bits(a: np.ndarray) -> bytes:
    """The array's bytes with every NaN made one NaN (which NaN an addition propagates is the operand
    order's, which a C compiler may swap; NaN is not finite either way, and norm_scales treats it so)."""
    a = np.array(a, copy=True)
    a[np.isnan(a)] = np.nan
    return a.tobytes()


def wild(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any = np.float32, special: bool = True) -> np.ndarray:
    """Values within a few powers of two of 1 (where the order of additions shows in the sums), a few over
    float32's whole range (subnormal to near overflow, whose squares overflow or flush), and zeros, signed
    zeros, infinities and NaNs sprinkled in."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 8, shape)
    flat = x.reshape(-1)
    if special:
        at = rng.choice(flat.size, size=max(1, flat.size // 25), replace=False)
        flat[at] = rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-149, 3.4e38, 1e-30, 1e30], size=at.size)
        at = rng.choice(flat.size, size=max(1, flat.size // 25), replace=False)
        flat[at] *= 2.0 ** rng.integers(-140, 120, at.size)
    with np.errstate(over="ignore"):  # beyond float32's range: inf, as intended
        return x.astype(dtype)


# -- sums of squares --------------------------------------------------------------------------------
SQUARES = [  # (x's shape, axis, kc: the chunk length; x's summed axis is cut into chunks of kc, the last padded)
    ((7, 64), -1, 64), ((7, 100), -1, 64), ((5, 1), -1, 1), ((5, 3), -1, 8), ((3, 5, 33), -1, 16),
    ((64, 9), -2, 64), ((100, 7), -2, 64), ((1, 5), -2, 1), ((3, 4), -2, 8), ((2, 33, 6), -2, 16),
    ((2, 3, 37, 5), -2, 37), ((513, 3), -2, 512), ((3, 513), -1, 512),
]


def square_sums(p: UfuncPasses, x: np.ndarray, axis: int, kc: int) -> np.ndarray:
    """What gemm.split asks of ``squares``: x's summed axis in chunks of kc, (chunks, ..., 1 along axis), the
    squares summed in x's dtype."""
    k = x.shape[axis]
    nc = -(-k // kc)
    full = (nc - 1) * kc
    if axis == -1:
        work = np.full((nc, *x.shape[:-1], kc), 7.0, x.dtype)  # garbage: the padding must be zeroed
        body = np.moveaxis(x[..., :full].reshape(*x.shape[:-1], nc - 1, kc), -2, 0)
        parts = [(body, slice(0, nc - 1)), (x[..., full:], nc - 1)]
    else:
        work = np.full((nc, *x.shape[:-2], kc, x.shape[-1]), 7.0, x.dtype)
        body = np.moveaxis(x[..., :full, :].reshape(*x.shape[:-2], nc - 1, kc, x.shape[-1]), -3, 0)
        parts = [(body, slice(0, nc - 1)), (x[..., full:, :], nc - 1)]
    return np.array(p.squares(np, parts, axis, kc, work))


@built
@pytest.mark.parametrize("shape,axis,kc", SQUARES)
@pytest.mark.parametrize("layout", ["c", "fortran", "strided"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_sums_of_squares_are_the_ufuncs_bits(shape, axis, kc, layout, dtype):
    """float32 squares summed in float32 (a float32 operand's norms), float64 ones in float64 (a float64
    operand's, such as a convolution's dy over a sample's power of two)."""
    rng = np.random.default_rng(sum(shape) + kc)
    x = wild(rng, shape, dtype)
    if dtype == np.float64:  # float64's own range: squares that overflow and flush to zero, not float32's
        x = x * 2.0 ** rng.integers(-600, 500, shape)
    if layout == "fortran":
        x = np.asfortranarray(x)
    elif layout == "strided":  # every other element of a wider array, in both last axes
        wide = wild(rng, tuple(s * 2 for s in shape), dtype)
        x = wide[(Ellipsis, slice(None, None, 2), slice(1, None, 2))]
        if len(shape) == 1:
            x = wide[::2]
    want = square_sums(UFUNC, x, axis, kc)
    got = square_sums(compiled(), x, axis, kc)
    assert got.shape == want.shape
    assert bits(got) == bits(want)
    assert np.isinf(want).any() or np.isnan(want).any() or x.size < 100  # the specials reached the sums


@built
@pytest.mark.parametrize("shape,axis,kc", [((9, 200), -1, 64), ((200, 9), -2, 64), ((4, 3, 300), -1, 128)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_comparison_can_fail_other_orders_give_other_sums(shape, axis, kc, dtype):
    """The negative control: the same squares summed in another order (NumPy's pairwise sum, which
    np.sum uses) give other bits on these values, so the comparison above tells orders apart."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-10, 10, shape)).astype(dtype)
    got = square_sums(compiled(), x, axis, kc)
    nc = got.shape[0]
    pad = nc * kc - shape[axis]
    padded = np.pad(x, [(0, 0)] * (x.ndim + axis) + [(0, pad)] + [(0, 0)] * (-1 - axis))
    chunked = np.moveaxis(np.stack(np.split(padded, nc, axis=axis)), 0, 0)
    other = np.sum(chunked * chunked, axis=axis, keepdims=True, dtype=dtype)
    tree = fold_(np.array(chunked * chunked), axis)
    assert bits(tree) == bits(got)  # the fixed tree, as reduce.fold_ makes it
    assert bits(other) != bits(got)


# -- the grid ---------------------------------------------------------------------------------------
def grid_scales(rng: np.random.Generator, x: np.ndarray, kind: str) -> np.ndarray:
    """Powers of two as split and Weight make them: one per row, per column, per block, or one in all,
    so that |x s| < 2^51 (most values well inside, some at float32's 24 bits, where ties occur)."""
    shape = {"row": x.shape[:-1] + (1,), "column": (1,) * (x.ndim - 1) + x.shape[-1:],
             "block": x.shape[:-2] + (1,) * min(2, x.ndim), "one": (1,) * x.ndim}[kind]
    finite = np.where(np.isfinite(x), np.abs(x), 0.0).astype(np.float64)
    top = np.broadcast_to(finite.max(axis=tuple(i for i in range(x.ndim) if shape[i] == 1), keepdims=True), shape)
    e = np.frexp(np.maximum(top, 2.0**-1000))[1]
    return np.ldexp(1.0, rng.integers(8, 40, shape) - e)


@built
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(17,), (5, 33), (3, 4, 65), (2, 3, 4, 9)])
@pytest.mark.parametrize("kind", ["row", "column", "block", "one"])
@pytest.mark.parametrize("layout", ["c", "transposed", "in place"])
def test_compiled_grid_is_the_ufuncs_bits(dtype, shape, kind, layout):
    """Into a fresh output, from a column-major view, and in place (Weight's padded rows: x is the
    output, so float64)."""
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    x = wild(rng, shape, dtype)
    if layout == "transposed" and x.ndim > 1:
        x = np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -1, -2)), -1, -2)  # the same values, column-major
    s = grid_scales(rng, x, kind)
    want = np.empty(shape, np.float64)
    UFUNC.on_grid(np, x, s, want)
    if layout == "in place":
        got = x.astype(np.float64)
        want = np.empty(shape, np.float64)
        UFUNC.on_grid(np, got.copy(), s, want)
        compiled().on_grid(np, got, s, got)
    else:
        got = np.full(shape, 3.0, np.float64)
        compiled().on_grid(np, x, s, got)
    assert bits(got) == bits(want)
    finite = np.isfinite(want)
    assert np.array_equal(np.rint(want[finite] * np.broadcast_to(s, shape)[finite]),
                          want[finite] * np.broadcast_to(s, shape)[finite])  # on the grid indeed


@built
def test_ties_round_to_even_in_both():
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 2**-30 * 1.5], np.float32)
    s = np.ones((1,), np.float64)
    want, got = np.empty(x.shape), np.empty(x.shape)
    UFUNC.on_grid(np, x, s, want)
    compiled().on_grid(np, x, s, got)
    assert want.tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, 4.0, 0.0] and bits(got) == bits(want)


# -- a float64 slice's integers --------------------------------------------------------------------
@built
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(17,), (5, 33), (3, 4, 65), (2, 3, 4, 9)])
@pytest.mark.parametrize("kind", ["row", "column", "block", "one"])
@pytest.mark.parametrize("layout", ["c", "transposed", "rest", "rest in place"])
def test_compiled_integers_are_the_ufuncs_bits(dtype, shape, kind, layout):
    """q = rint(x s) into a fresh output, from a column-major view, with what is left (x s - q) for the next
    slice, and that next slice's pass made in place on what was left (split's second slice)."""
    rng = np.random.default_rng(len(shape) * 10 + shape[-1])
    x = wild(rng, shape, dtype)
    if dtype == np.float64:  # x s reaching float64's ends: products that overflow or round as subnormals
        x = x * 2.0 ** rng.integers(-900, 900, shape)
    if layout == "transposed" and x.ndim > 1:
        x = np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -1, -2)), -1, -2)  # the same values, column-major
    s = grid_scales(rng, x, kind)
    results = []
    for p in (UFUNC, compiled()):
        q = np.full(shape, 3.0)
        rest = np.full(shape, 5.0) if layout.startswith("rest") else None
        if layout == "rest in place":
            rest = x.astype(np.float64)  # the next slice's input is what the last left
            p.integers(np, rest, s, q, rest)
        else:
            p.integers(np, x, s, q, rest)
        results.append(bits(q) + (b"" if rest is None else bits(rest)))
    assert results[0] == results[1]
    q = np.frombuffer(results[0][:8 * int(np.prod(shape))]).reshape(shape)
    finite = np.isfinite(q)
    assert finite.any() and (not finite.all() or x.size < 100)  # the specials reached it
    assert np.array_equal(np.rint(q[finite]), q[finite])  # integers indeed


@built
def test_integers_round_ties_to_even_and_keep_the_sign_of_zero():
    """The rounding the compiled pass makes from additions (mpisgd/portable/_passes.c's round_even) is
    NumPy's rint: ties to even, -0.3 to -0.0, from 2^52 on and for inf and NaN the value itself. The
    comparison can fail: rounding ties away from zero, or losing the sign of zero, gives other bits."""
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -0.3, -0.0, 0.0, 2.0**52 + 1, -(2.0**53) - 2, 2.0**51 + 0.5,
                  -(2.0**51) - 0.5, 2.0**52 - 0.5, np.inf, -np.inf, np.nan, 5e-324])
    s = np.ones(1)
    want, got, rest = np.empty(x.shape), np.empty(x.shape), np.empty(x.shape)
    UFUNC.integers(np, x, s, want)
    compiled().integers(np, x, s, got, rest)
    assert bits(got) == bits(want) == bits(np.rint(x))
    assert bits(got[:9]) == bits(np.array([0.0, 2.0, 2.0, -0.0, -2.0, 4.0, -0.0, -0.0, 0.0]))
    away = np.where(np.isfinite(x), np.copysign(np.floor(np.abs(x) + 0.5), x), x)
    unsigned = np.where(np.rint(x) == 0, 0.0, np.rint(x))
    assert bits(away) != bits(got) and bits(unsigned) != bits(got)
    finite = np.isfinite(x)
    assert np.array_equal((x - got)[finite], rest[finite]) and np.all(np.abs(rest[finite]) <= 0.5)


# -- tiles of a weight ------------------------------------------------------------------------------
@built
@pytest.mark.parametrize("r,n,kcr,kcc", [(64, 128, 64, 64), (50, 100, 64, 64), (1, 3, 8, 4), (33, 7, 64, 8)])
def test_compiled_tile_norms_are_the_ufuncs_bits(r, n, kcr, kcc):
    rng = np.random.default_rng(r * n)
    rows = wild(rng, (r, n))
    ncc = -(-n // kcc)
    results = []
    for p in (UFUNC, compiled()):
        col = np.full(ncc * kcc, 5.0, np.float32)
        row = np.full((kcr, ncc), 5.0, np.float32)
        sq = np.full((kcr, ncc * kcc), 0.0, np.float32)  # Weight makes it zeroed: the padding columns stay 0
        by_col = np.empty((kcr - kcr // 2, ncc * kcc), np.float32)
        by_row = np.empty((kcr, ncc, kcc - kcc // 2), np.float32)
        p.tile_squares(np, rows, col, row, sq, by_col, by_row)
        results.append((bits(col), bits(row)))
    assert results[0] == results[1]


# -- whole products, weights, a model ----------------------------------------------------------------
@pytest.fixture
def strategy(monkeypatch):
    """Run with one strategy for NumPy, then restore the choice."""
    def use(p: UfuncPasses) -> None:
        monkeypatch.setitem(passes._CHOSEN, np.__name__, p)
    return use


def digest(*arrays: np.ndarray) -> str:
    return hashlib.sha256(b"".join(bits(np.asarray(a)) for a in arrays)).hexdigest()


PRODUCTS = [((8, 100), (100, 30), False), ((3, 70, 50), (50, 9), False), ((300, 64), (300, 20), True),
            ((4, 1100), (1100, 5), False), ((2, 2, 9, 40), (40, 3), False)]  # the last: float64 slices past 4-D


@built
@pytest.mark.parametrize("a_shape,b_shape,transposed", PRODUCTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_have_the_same_bits_under_both_strategies(a_shape, b_shape, transposed, dtype, strategy):
    rng = np.random.default_rng(sum(a_shape))
    a = (rng.standard_normal(a_shape) * np.exp(2 * rng.standard_normal(a_shape[:-1] + (1,)))).astype(dtype)
    b = rng.standard_normal(b_shape).astype(dtype)
    if transposed:  # a.T @ b, as a layer's weight gradient
        a = a.T
    out = []
    for p in (UFUNC, compiled()):
        strategy(p)
        out.append(digest(gemm.matmul(a, b)))
    assert out[0] == out[1]


@built
@pytest.mark.parametrize("spread", [1.0, 30.0])  # tiles, then a split per product
def test_weights_have_the_same_bits_under_both_strategies(spread, strategy):
    rng = np.random.default_rng(int(spread))
    w = (rng.standard_normal((300, 200)) * spread ** rng.uniform(0, 1, (1, 200))).astype(np.float32)
    x = rng.standard_normal((16, 300)).astype(np.float32)
    dy = rng.standard_normal((16, 200)).astype(np.float32)
    out = []
    for p in (UFUNC, compiled()):
        strategy(p)
        weight = Weight().prepare(w)
        out.append(digest(gemm.matmul(x, weight.right), gemm.matmul(dy, weight.T)))
    assert out[0] == out[1]


@built
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_a_models_gradients_have_the_same_bits_under_both_strategies(model, strategy):
    from mpisgd.kernels import kernels_for
    from mpisgd.nn import SoftmaxCrossEntropy, cnn, mlp

    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((6, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 6)
    out = []
    for p in (UFUNC, compiled()):
        strategy(p)
        net = (mlp((300, 100)) if model == "mlp" else cnn()).materialize(np, "float32", seed=0)
        net.ctx.kernels = kernels_for("portable")
        loss = SoftmaxCrossEntropy(net.ctx.kernels)
        value = loss.forward_array(net.forward(x), y)
        net.backward(loss.backward())
        out.append(digest(np.asarray(value), net.flat.grads))
    assert out[0] == out[1]


# -- choosing, and bad input ---------------------------------------------------------------------------
def test_the_strategy_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.setattr(passes, "_CHOSEN", {})
    monkeypatch.setenv(ENV, "ufunc")
    assert type(passes_for(np)) is UfuncPasses
    monkeypatch.setattr(passes, "_CHOSEN", {})
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(UsageError, match="MPISGD_PORTABLE_PASSES='fast': use ufunc"):
        passes_for(np)
    with pytest.raises(UsageError, match="MPISGD_PORTABLE_PASSES='fast'"):  # at set-up, before any product
        PortableKernels()
    monkeypatch.setattr(passes, "_CHOSEN", {})
    monkeypatch.setenv(ENV, "compiled")
    monkeypatch.setitem(sys.modules, "mpisgd.portable._passes", None)  # as if not built
    monkeypatch.delattr(mpisgd.portable, "_passes", raising=False)
    with pytest.raises(UsageError, match="not built"):
        passes_for(np)
    monkeypatch.setattr(passes, "_CHOSEN", {})
    monkeypatch.delenv(ENV)
    assert type(passes_for(np)) is UfuncPasses  # not built, not asked for: the ufuncs, silently


@pytest.mark.mpi
def test_a_bad_choice_is_one_line_on_every_rank(monkeypatch):
    """The training CLI with a bad MPISGD_PORTABLE_PASSES: refused at set-up, one line naming it, exit 2
    on every rank (not a model check's complaint about the samples' shape)."""
    monkeypatch.setenv(ENV, "avx")
    r = train_here([*TINY, "--reproducible", "portable", "--max-steps", "2"])
    assert r.statuses == (2,) * len(r.statuses), (r.statuses, r.err)
    assert r.error.startswith("mpisgd: error: ") and "MPISGD_PORTABLE_PASSES='avx'" in r.error
    assert "cannot take samples" not in r.error


@built
def test_the_extension_refuses_what_it_does_not_take():
    x = np.ones((3, 4), np.float32)
    with pytest.raises(TypeError, match="float32 or float64"):
        native.sum_squares(np.ones((3, 4), np.int32), np.empty(3, np.float32), 4, -1)
    with pytest.raises(TypeError, match="at most 4"):
        native.sum_squares(np.ones((1, 1, 1, 1, 4), np.float32), np.empty((1, 1, 1, 1), np.float32), 4, -1)
    with pytest.raises(ValueError, match="terms >= its length"):
        native.sum_squares(x, np.empty(3, np.float32), 3, -1)
    with pytest.raises(ValueError, match="terms >= its length"):
        native.sum_squares(x, np.empty(4, np.float32), 3, -1)  # the wrong output shape
    with pytest.raises(ValueError):
        native.sum_squares(x, np.empty(3, np.float32).view(), 4, 0)
    with pytest.raises(ValueError, match="of one shape"):
        native.on_grid(x, np.ones((3, 4)), np.empty((3, 5)))
    with pytest.raises(ValueError, match="of one shape"):
        native.on_grid(x, np.ones((3, 4), np.float32), np.empty((3, 4)))
    with pytest.raises(TypeError, match="float32 or float64"):  # not native byte order
        native.on_grid(x.astype(">f4"), np.ones((3, 4)), np.empty((3, 4)))
    frozen = np.empty((3, 4))
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        native.on_grid(x, np.ones((3, 4)), frozen)
    with pytest.raises(ValueError, match="of one dtype"):
        native.sum_squares(x, np.empty(3), 4, -1)  # float32 squares into float64
    with pytest.raises(ValueError, match="of one shape"):
        native.integers(x, np.ones((3, 4)), np.empty((3, 4), np.float32), None)  # q must be float64
    with pytest.raises(ValueError, match="of one shape"):
        native.integers(x, np.ones((3, 4)), np.empty((3, 4)), np.empty((3, 5)))
    with pytest.raises((ValueError, BufferError)):
        native.integers(x, np.ones((3, 4)), frozen, None)
