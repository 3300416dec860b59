"""The portable level's elementwise functions in C (mpisgd/portable/_functions.c) give NumPy's bits: exp,
expm1, tanh, log and erf against their forms in mpisgd.portable.elementwise (one ufunc per IEEE operation),
in each instruction set this CPU runs the block kernels in, on every layout and special value they take,
then through a GPT's gradients. A run's bits must not depend on whether its machine had a C compiler when
mpisgd was installed, nor on its vector width."""

from __future__ import annotations

import numpy as np
import pytest

from mpisgd.portable import elementwise
from mpisgd.portable.elementwise import CompiledFunctions, UfuncFunctions, functions_for

try:
    from mpisgd.portable import _functions as native  # type: ignore[attr-defined]
except ImportError:  # no C compiler at install: the ufuncs serve alone, and there is nothing to compare
    native = None

built = pytest.mark.skipif(native is None, reason="the C functions are not built (pip install with a C compiler)")
UFUNC = UfuncFunctions()
NAMES = ["exp", "expm1", "tanh", "log", "erf"]
ISAS = native.isas() if native is not None else []


def bits(a: np.ndarray) -> bytes:
    """The array's bytes with every NaN made one NaN (which NaN an operation propagates is not specified)."""
    a = np.array(a, copy=True)
    a[np.isnan(a)] = np.nan
    return a.tobytes()


@pytest.fixture
def compiled():
    """The compiled functions, their instruction set restored afterwards."""
    functions = CompiledFunctions(native)
    before = native.isa()
    yield functions
    native.isa(before)


SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, -5e-324, 1e-310, 2.0**-1022, 709.78, 709.79, 710.0,
            -708.39, -708.4, -720.0, -744.4, -745.13, -745.14, -746.0, 1e300, -1e300, 0.5 * elementwise.LN2_HI,
            -0.5 * elementwise.LN2_HI, np.nextafter(0.5 * elementwise.LN2_HI, 1.0), 2.0, -2.0, 6.0, -6.0,
            np.nextafter(2.0, 0.0), np.nextafter(6.0, 0.0), 0.5, 1.0, 0.70710678118654752440, 88.7, -103.9]


def values(name: str, dtype: type, n: int, seed: int) -> np.ndarray:
    """Values where each function works: a few scales of normal draws (blocks that mix expm1's series and its
    exp, and blocks of one kind), exp's subnormal and overflowing results, log's whole range, the specials."""
    rng = np.random.default_rng(seed)
    parts = [rng.standard_normal(n) * scale for scale in (0.01, 0.1, 1.0, 10.0, 300.0)]
    parts.append(np.linspace(-746.0, -700.0, n))  # exp's results from normal to subnormal to zero
    if name == "log":
        parts = [np.abs(p) * 2.0 ** rng.integers(-1074, 1000, n) for p in parts[:5]]
        parts.append(2.0 ** rng.uniform(-1074, -1022, n))  # subnormal inputs
    x = np.concatenate([*parts, np.array(SPECIALS)])
    with np.errstate(over="ignore", under="ignore"):
        return x.astype(dtype)


@built
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_functions_are_the_ufuncs_bits(isa, name, dtype, compiled):
    native.isa(isa)
    x = values(name, dtype, 3001, NAMES.index(name))  # not a multiple of the block: a short last block
    with np.errstate(all="ignore"):
        want, got = UFUNC.apply(name, x), compiled.apply(name, x)
    assert got.dtype == want.dtype == dtype
    assert bits(got) == bits(want)
    assert np.isnan(want).any() and np.isinf(want).any() or name in ("tanh", "erf")  # the specials reached it


@built
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["4-d", "transposed", "strided", "in place", "float64 out", "float32 out", "5-d"])
def test_every_layout_gives_the_same_bits(name, layout, compiled):
    """Views, in place (out is x, as GELU's tanh), another output dtype (rounded once), and more dimensions
    than the extension takes (the ufuncs serve those)."""
    rng = np.random.default_rng(len(layout))
    x = (rng.standard_normal((3, 4, 5, 70)) * 3).astype(np.float32)
    if name == "log":
        x = np.abs(x)
    out = None
    if layout == "transposed":
        x = np.swapaxes(x, -1, -2)
    elif layout == "strided":
        x = x[:, ::2, :, 1::3]
    elif layout == "5-d":
        x = x.reshape(3, 2, 2, 5, 70)
    elif layout == "float64 out":
        out = np.full(x.shape, 7.0)
    elif layout == "float32 out":
        x = x.astype(np.float64) * 1.000001
        out = np.full(x.shape, 7.0, np.float32)
    want = UFUNC.apply(name, x, None if out is None else out.copy())
    if layout == "in place":
        got = compiled.apply(name, x, x)
        assert got is x
    else:
        got = compiled.apply(name, x, out)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bits(got) == bits(want)


@built
def test_an_output_overlapping_its_input_otherwise_is_read_first(compiled):
    x = np.linspace(-3, 3, 1000)
    want = UFUNC.apply("exp", x[1:].copy())
    got = compiled.apply("exp", x[1:], x[:-1])  # each element written where the next is read from
    assert bits(got) == bits(want)


@built
@pytest.mark.parametrize("name", ["exp", "tanh", "log"])
def test_the_comparison_can_fail_numpys_own_functions_give_other_bits(name):
    """The negative control: NumPy's own exp, tanh and log (its SIMD loops) differ from the portable ones in
    the last bit on some of these values, so the comparisons above tell such differences apart."""
    x = values(name, np.float64, 20000, 7)
    x = x[np.isfinite(x) & (np.abs(x) < 700) & ((x > 0) if name == "log" else True)]
    with np.errstate(all="ignore"):
        assert bits(getattr(np, name)(x)) != bits(CompiledFunctions(native).apply(name, x))


@built
def test_the_instruction_set_is_chosen_from_what_the_cpu_runs(compiled):
    assert ISAS[0] == "baseline" and native.isa() == ISAS[-1]  # the widest, at import
    for isa in ISAS:
        assert native.isa(isa) == isa
    with pytest.raises(ValueError, match="not an instruction set this CPU runs"):
        native.isa("avx1024")


@built
def test_the_extension_refuses_what_it_does_not_take():
    with pytest.raises(TypeError, match="float32 or float64"):
        native.exp(np.ones(3, np.int32), np.empty(3))
    with pytest.raises(ValueError, match="of one shape"):
        native.tanh(np.ones(3), np.empty(4))
    with pytest.raises(ValueError, match="of one shape"):
        native.log(np.ones(3), np.empty(4))
    with pytest.raises(ValueError, match="1 to 64 terms"):
        native.constants(*[1.0] * 13, 60, [], [1.0], [1.0], [1.0])
    x, out = np.linspace(-5, 5, 300), np.empty(300)
    native.exp(x, out)  # the refused constants changed nothing
    assert bits(out) == bits(UFUNC.apply("exp", x))


def test_the_ufuncs_serve_where_asked(monkeypatch):
    monkeypatch.setattr(elementwise, "_CHOSEN", {})
    monkeypatch.setenv("MPISGD_PORTABLE_PASSES", "ufunc")
    assert type(functions_for(np)) is UfuncFunctions
    monkeypatch.setattr(elementwise, "_CHOSEN", {})
    monkeypatch.delenv("MPISGD_PORTABLE_PASSES")
    assert type(functions_for(np)) is (UfuncFunctions if native is None else CompiledFunctions)


@built
def test_a_gpts_gradients_have_the_same_bits_under_both(monkeypatch):
    """GELU's tanh, attention's and the loss's exp and log: a small GPT's loss and gradients, portable kernels."""
    from mpisgd.kernels import kernels_for
    from mpisgd.nn import GPTShape, TokenCrossEntropy, gpt

    ids = np.random.default_rng(3).integers(0, 13, (4, 8))
    out = []
    for functions in (UFUNC, CompiledFunctions(native)):
        monkeypatch.setitem(elementwise._CHOSEN, np.__name__, functions)
        net = gpt(GPTShape(vocab=13, context=8, layers=2, heads=2, width=16, dropout=0.0)).materialize(
            np, "float32", seed=0)
        net.ctx.kernels = kernels_for("portable")
        loss = TokenCrossEntropy(kernels=net.ctx.kernels)
        value = loss.forward_array(net.forward(ids[:, :-1]), ids[:, 1:])
        net.backward(loss.backward())
        out.append(bits(np.asarray(value)) + bits(net.flat.grads))
    assert out[0] == out[1]
