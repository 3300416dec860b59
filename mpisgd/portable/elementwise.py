"""exp, expm1, log, tanh, erf and rsqrt from IEEE +, -, *, /, sqrt only: the same bits everywhere.

NumPy's exp, log and tanh are SIMD kernels chosen at run time (its AVX-512, AVX2 and baseline paths
round differently), the C library's have FMA and non-FMA variants, and CuPy's are CUDA's: each may
differ in the last bit. Here each function is a range reduction and a polynomial evaluated in float64
with one NumPy (or CuPy) ufunc per operation: every operation is correctly rounded, none is fused,
their order is fixed, so the float64 result is a function of the input alone; it is then rounded once
to the input's dtype. Accuracy: within a few float64 ulps (tests/test_portable.py measures it against
the C library over many points), so float32 results are correctly rounded but in rare near-ties.

Two strategies give these bits, chosen once per array module (:func:`functions_for`): :class:`UfuncFunctions`,
the operations as ufuncs as above, and :class:`CompiledFunctions`, mpisgd/portable/_functions.c, which
makes the same operations element by element (exp, expm1 and tanh in blocks the compiler vectorizes, for
the widest instruction set the CPU has), for NumPy arrays where the extension is built; several times
faster, since each ufunc here is a pass through memory. tests/test_portable_functions.py compares them.

The polynomials are truncated Taylor series (coefficients 1/k! and 2/(2k+1), correctly rounded when
Python divides), long enough that the truncation lies below float64's rounding on the reduced range.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.portable.native import FLOATS, serving

Array = Any

# ln 2 split so that n * LN2_HI is exact for |n| < 2^11 (fdlibm's split); LN2_LO the rest
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
EXP_MAX = 709.782712893383973096  # above: inf
EXP_MIN = -745.13321910194110842  # below: 0
EXP_TERMS = [1.0 / math.factorial(k) for k in range(14)]  # e^r, |r| <= ln2/2: r^14/14! < 2^-58
EXPM1_TERMS = [1.0 / math.factorial(k) for k in range(2, 16)]  # (e^x - 1 - x) / x^2, |x| <= ln2/2
LOG_TERMS = [2.0 / (2 * k + 1) for k in range(1, 13)]  # log(1+f) = f - f^2/2 + s (f^2/2 + R(s^2))
ERF_SERIES = 30  # Taylor terms of erf below ERF_SPLIT
ERF_SPLIT = 2.0
ERF_CF = 60  # continued-fraction levels of erfc at and above ERF_SPLIT
ERF_ONE = 6.0  # erf is 1 in float64 from here
TWO_OVER_SQRT_PI = 1.12837916709551257390
INV_SQRT_PI = 0.56418958354775628695
ERF_TERMS = [(-1.0) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(ERF_SERIES)]  # of a^2, times a
LOG_LOW = 0.70710678118654752440  # mantissas below: doubled (log64)


def _work(x: Array) -> tuple[Any, Array]:
    xp = xp_of(x)
    return xp, xp.array(x, dtype=np.float64, copy=True)


def _quiet(fn: Any) -> Any:
    """Run ``fn`` without NumPy's warnings: overflow, 0/0 and inf arise inside on purpose and are replaced."""
    def run(x: Array) -> Array:
        with np.errstate(all="ignore"):
            return fn(x)
    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


def _result(xp: Any, y: Array, like: Array, out: Array) -> Array:
    """y (float64) rounded once to like's dtype, into ``out`` when given."""
    if out is None:
        return y if like.dtype == np.float64 else y.astype(like.dtype)
    out[...] = y
    return out


def _horner(xp: Any, t: Array, coeffs: list[float]) -> Array:
    """sum(coeffs[i] * t**i), Horner's rule, highest first; one ufunc per operation."""
    p = xp.full_like(t, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        xp.multiply(p, t, out=p)
        xp.add(p, c, out=p)
    return p


@_quiet
def exp64(x: Array) -> Array:
    """e^x in float64 (x float64): x = n ln2 + r, |r| <= ln2/2, e^x = 2^n e^r."""
    xp = xp_of(x)
    xc = xp.clip(x, EXP_MIN - 1.0, EXP_MAX + 1.0)  # NaN stays NaN
    n = xp.rint(xc * INV_LN2)
    r = xc - n * LN2_HI  # exact (Sterbenz; n * LN2_HI is exact)
    r -= n * LN2_LO
    y = xp.ldexp(_horner(xp, r, EXP_TERMS), xp.nan_to_num(n).astype(np.int32))
    y = xp.where(x > EXP_MAX, np.inf, y)
    return xp.where(x < EXP_MIN, 0.0, y)


@_quiet
def expm1_64(x: Array) -> Array:
    """e^x - 1 in float64 without cancellation near 0: a series where |x| <= ln2/2, exp - 1 elsewhere."""
    xp = xp_of(x)
    small = xp.abs(x) <= 0.5 * LN2_HI
    t = xp.where(small, x, 0.0)
    series = t + t * t * _horner(xp, t, EXPM1_TERMS)
    return xp.where(small, series, exp64(x) - 1.0)


@_quiet
def log64(x: Array) -> Array:
    """ln x in float64: x = 2^e m, m in [sqrt(1/2), sqrt(2)), f = m - 1 (exact), s = f / (2 + f),
    log(1 + f) = f - f^2/2 + s (f^2/2 + R(s^2)) with R the atanh series (fdlibm's arrangement)."""
    xp = xp_of(x)
    m, e = xp.frexp(x)
    low = m < LOG_LOW
    m = xp.where(low, m * 2.0, m)
    e = (e - low).astype(np.float64)
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    r = z * _horner(xp, z, LOG_TERMS)
    hfsq = 0.5 * f * f
    y = e * LN2_HI - ((hfsq - (s * (hfsq + r) + e * LN2_LO)) - f)
    y = xp.where(x == 0, -np.inf, y)
    y = xp.where(x < 0, np.nan, y)
    return xp.where(xp.isinf(x) & (x > 0), np.inf, y)


@_quiet
def tanh64(x: Array) -> Array:
    """tanh in float64: with t = expm1(-2|x|), tanh|x| = -t / (t + 2); the sign restored."""
    xp = xp_of(x)
    t = expm1_64(-2.0 * xp.abs(x))
    return xp.copysign(-t / (t + 2.0), x)


@_quiet
def erf64(x: Array) -> Array:
    """erf in float64: the Taylor series below ERF_SPLIT, 1 - erfc (a continued fraction of fixed depth,
    evaluated from the bottom) from there, 1 from ERF_ONE."""
    xp = xp_of(x)
    a = xp.abs(x)
    # series: (2/sqrt(pi)) sum (-1)^n a^(2n+1) / (n! (2n+1)) = (2/sqrt(pi)) a sum c_n (a^2)^n
    t = xp.minimum(a, ERF_SPLIT)
    series = TWO_OVER_SQRT_PI * (t * _horner(xp, t * t, ERF_TERMS))
    # Laplace's continued fraction: erfc(a) = e^(-a^2)/sqrt(pi) / (a + (1/2)/(a + 1/(a + (3/2)/(a + ...))))
    z = xp.maximum(a, ERF_SPLIT)
    d = xp.array(z, copy=True)
    for level in range(ERF_CF, 0, -1):
        d = z + (0.5 * level) / d
    erfc = exp64(-(z * z)) * INV_SQRT_PI / d
    y = xp.where(a < ERF_SPLIT, series, 1.0 - erfc)
    y = xp.where(a >= ERF_ONE, 1.0, y)
    y = xp.where(xp.isnan(x), np.nan, y)
    return xp.copysign(y, x)


class UfuncFunctions:
    """The functions as above: one ufunc of the array's module per operation, any array module."""

    name = "ufunc"

    def apply(self, name: str, x: Array, out: Array = None) -> Array:
        """``name`` (exp, expm1, log, tanh or erf) of x, in float64, rounded once into ``out`` (or returned
        in x's dtype)."""
        xp, w = _work(x)
        return _result(xp, FUNCTIONS64[name](w), x, out)


class CompiledFunctions(UfuncFunctions):
    """The same operations per element in C (mpisgd/portable/_functions.c), for NumPy arrays of float32 or
    float64 of at most 4 dimensions; the ufuncs otherwise."""

    name = "compiled"

    def __init__(self, native: Any) -> None:
        self.native = native
        native.constants(LN2_HI, LN2_LO, INV_LN2, EXP_MAX, EXP_MIN, EXP_MIN - 1.0, EXP_MAX + 1.0, 0.5 * LN2_HI,
                         LOG_LOW, ERF_SPLIT, ERF_ONE, TWO_OVER_SQRT_PI, INV_SQRT_PI, ERF_CF, EXP_TERMS,
                         EXPM1_TERMS, LOG_TERMS, ERF_TERMS)

    def apply(self, name: str, x: Array, out: Array = None) -> Array:
        if not isinstance(x, np.ndarray) or x.ndim > 4 or np.dtype(x.dtype) not in FLOATS or (out is not None and (
                out.ndim > 4 or np.dtype(out.dtype) not in FLOATS or out.shape != x.shape)):
            return super().apply(name, x, out)
        if out is None:
            out = np.empty(x.shape, x.dtype)
        elif out is not x and np.may_share_memory(x, out):  # each element is read before it is written, not others
            x = x.copy()
        getattr(self.native, name)(x, out)
        return out


_CHOSEN: dict[str, UfuncFunctions] = {}


def functions_for(xp: Any) -> UfuncFunctions:
    """The functions for arrays of module ``xp``: compiled for NumPy where the extension is built (and
    MPISGD_PORTABLE_PASSES is not ``ufunc``: mpisgd.portable.native), the ufuncs otherwise. Chosen once per
    module."""
    chosen = _CHOSEN.get(xp.__name__)
    if chosen is None:
        native = serving("_functions", xp)
        chosen = _CHOSEN[xp.__name__] = UfuncFunctions() if native is None else CompiledFunctions(native)
    return chosen


def exp(x: Array, out: Array = None) -> Array:
    return functions_for(xp_of(x)).apply("exp", x, out)


def expm1(x: Array, out: Array = None) -> Array:
    return functions_for(xp_of(x)).apply("expm1", x, out)


def log(x: Array, out: Array = None) -> Array:
    return functions_for(xp_of(x)).apply("log", x, out)


def tanh(x: Array, out: Array = None) -> Array:
    return functions_for(xp_of(x)).apply("tanh", x, out)


def erf(x: Array, out: Array = None) -> Array:
    return functions_for(xp_of(x)).apply("erf", x, out)


FUNCTIONS64 = {"exp": exp64, "expm1": expm1_64, "log": log64, "tanh": tanh64, "erf": erf64}


def rsqrt(x: Array, out: Array = None) -> Array:
    """1 / sqrt(x): two correctly rounded float64 operations, rounded once to x's dtype."""
    xp, w = _work(x)
    xp.sqrt(w, out=w)
    xp.divide(1.0, w, out=w)
    return _result(xp, w, x, out)
