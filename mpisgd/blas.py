"""BLAS level 1 for the optimizer's whole-buffer updates, from the BLAS that NumPy itself loaded.

NumPy has no axpy: ``w -= lr * v`` is two passes over the buffer (the product into a temporary, then
the subtraction), and ``v = mu * v + g`` two more. BLAS does each in one pass (what that saves:
docs/benchmarks.md, "Where a step's time goes"). No new dependency: the routines are looked up in the
library NumPy already mapped (the wheel's scipy-openblas, or a system OpenBLAS, MKL or reference
BLAS), checked once on a small case, and NumPy's ufuncs are used whenever something is missing or
disagrees, and for every array that is not a contiguous float32/float64 NumPy array (CuPy arrays
included).

Results may differ from the ufuncs in the last bit (BLAS fuses the multiply-add); every rank runs
the same library, so replicas stay identical.
"""

from __future__ import annotations

import ctypes
import math
import os
from functools import cache
from typing import Any

import numpy as np

# symbol spellings, tried in order: the NumPy wheel's prefixed ILP64 OpenBLAS, other ILP64 builds, LP64
_SPELLINGS = ("scipy_cblas_{}64_", "cblas_{}64_", "cblas_{}")
_MAX_N = 2**31 - 1  # what an LP64 library can take; larger buffers use the ufuncs


BLOCK = 256  # a multiple of every kernel's unrolling: a call of a multiple of this many elements has no tail


class Level1:
    """axpy and axpby for one dtype, on contiguous 1-D NumPy arrays.

    A BLAS kernel runs the bulk of a call in its vector body (a fused multiply-add per element) and the
    last n mod its unrolling elements in a scalar tail, which may round differently: where an element
    falls would decide its bits, so the sharded step, which cuts the buffers elsewhere than the
    replicated one, would not give its bits. So every call runs its first n - n mod BLOCK elements in
    one call, and the rest in a second call on a BLOCK-long scratch copy: every element goes through the
    vector body, wherever a range starts or ends, and any cut of a buffer gives the same bits."""

    def __init__(self, axpy: Any, axpby: Any, ctype: Any, dtype: np.dtype) -> None:
        self._axpy, self._axpby, self._c = axpy, axpby, ctype
        self._x, self._y = np.zeros(BLOCK, dtype), np.zeros(BLOCK, dtype)  # the remainder's copies

    def _split(self, call: Any, x: np.ndarray, y: np.ndarray) -> None:
        body = x.size - x.size % BLOCK
        if body:
            call(body, x.ctypes.data, y.ctypes.data)
        rest = x.size - body
        if rest:
            self._x[:rest], self._y[:rest] = x[body:], y[body:]
            call(BLOCK, self._x.ctypes.data, self._y.ctypes.data)
            y[body:] = self._y[:rest]

    def axpy(self, a: float, x: np.ndarray, y: np.ndarray) -> None:
        """y += a * x."""
        ca = self._c(a)
        self._split(lambda n, px, py: self._axpy(n, ca, px, 1, py, 1), x, y)

    def axpby(self, a: float, x: np.ndarray, b: float, y: np.ndarray) -> None:
        """y = a * x + b * y."""
        ca, cb = self._c(a), self._c(b)
        self._split(lambda n, px, py: self._axpby(n, ca, px, 1, cb, py, 1), x, y)


def level1_for(*arrays: Any) -> Level1 | None:
    """The BLAS routines for these arrays' dtype, or None when the ufuncs must do (see module doc)."""
    first = arrays[0]
    if not isinstance(first, np.ndarray) or first.dtype not in (np.float32, np.float64) or first.size > _MAX_N:
        return None
    if any(not isinstance(a, np.ndarray) or a.dtype != first.dtype or a.size != first.size
           or not a.flags.c_contiguous for a in arrays):
        return None
    return _level1(first.dtype.char)


@cache
def _level1(char: str) -> Level1 | None:
    if os.environ.get("MPISGD_BLAS_LEVEL1", "1") == "0":  # escape hatch: the plain ufuncs
        return None
    prefix, ctype = ("s", ctypes.c_float) if char == "f" else ("d", ctypes.c_double)
    for path in _numpy_blas_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for spelling in _SPELLINGS:
            try:
                axpy, axpby = (getattr(lib, spelling.format(prefix + name)) for name in ("axpy", "axpby"))
            except AttributeError:
                continue
            n, p = ctypes.c_int64, ctypes.c_void_p
            axpy.argtypes, axpy.restype = [n, ctype, p, n, p, n], None
            axpby.argtypes, axpby.restype = [n, ctype, p, n, ctype, p, n], None
            found = Level1(axpy, axpby, ctype, np.dtype(char))
            if _agrees(found, np.dtype(char)):
                return found
    return None


def _numpy_blas_paths() -> list[str]:
    """The shared libraries mapped into this process whose name says BLAS (NumPy imported first)."""
    import numpy.linalg  # noqa: F401, PLC0415 - makes sure NumPy's BLAS is loaded

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if line.count(" ") >= 5}
    except OSError:  # no /proc (macOS): the ufuncs
        return []
    names = ("openblas", "blas", "mkl_rt", "flexiblas")
    return sorted(p for p in paths if p.startswith("/") and any(s in os.path.basename(p).lower() for s in names))


def _agrees(l1: Level1, dtype: np.dtype) -> bool:
    """One small case against the ufuncs: right argument types, right answers."""
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(37).astype(dtype) for _ in range(2))
    want = y + np.asarray(0.5, dtype) * x
    l1.axpy(0.5, x, got := y.copy())
    if not np.allclose(got, want, rtol=1e-5):
        return False
    want = np.asarray(2.0, dtype) * x - np.asarray(0.25, dtype) * y
    l1.axpby(2.0, x, -0.25, got := y.copy())
    return bool(np.allclose(got, want, rtol=1e-5))


def finite_sq_norm(x: Any, xp: Any = np) -> tuple[bool, float]:
    """(whether x, an array of module ``xp``, holds no NaN and no Inf; its squared L2 norm): one pass
    (BLAS dot), and the exact test only when the norm is not finite, since huge finite values
    overflow it too (the norm is then inf)."""
    with np.errstate(over="ignore", invalid="ignore"):  # huge or non-finite values: told apart below
        sq = float(x.dot(x)) if x.size else 0.0
    if math.isfinite(sq):
        return True, sq
    return bool(xp.isfinite(x).all()), sq
