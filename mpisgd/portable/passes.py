"""The slices' memory-bound passes: sums of squares in the fixed tree, rounding onto a grid, and a float64
slice's integers.

Two strategies with the same results, bit for bit, chosen once per array module (:func:`passes_for`):

- :class:`UfuncPasses`: NumPy's (or CuPy's) ufuncs, one pass through memory per operation (a copy, two
  additions; squares, then each level of the tree; a product, a copy, rint, a subtraction);
- :class:`CompiledPasses`: mpisgd/portable/_passes.c, each pass in one trip through memory, for NumPy
  arrays of float32 or float64 of at most 4 dimensions; the ufuncs for the rest. It makes the same IEEE
  operations in the same order (compiled without fused multiply-adds or reassociation, setup.py), so a
  run's bits do not depend on which strategy it has; tests/test_portable_passes.py checks that on every
  shape and special value it takes.

The extension is built by ``pip install`` where a C compiler exists (setup.py marks it optional);
``MPISGD_PORTABLE_PASSES=ufunc`` chooses the ufuncs even where it is built (mpisgd.portable.native).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.portable.native import FLOATS, serving
from mpisgd.portable.reduce import fold_, fold_into

Array = Any
MAGIC = 1.5 * 2.0**52  # x + MAGIC/s - MAGIC/s rounds x to a multiple of 1/s (on_grid)


class UfuncPasses:
    """The passes as ufuncs of the array's module: any array module, any dtype."""

    name = "ufunc"

    def on_grid(self, xp: Any, x: Array, s: Array, out: Array) -> None:
        """out = rint(x s) / s (float64) for powers of two s with |x s| < 2^51: x + C - C with C = 1.5 2^52 / s.
        x + C lies in [2^52/s, 2^53/s), where float64's spacing is 1/s, so the addition rounds x to the
        nearest multiple of 1/s, ties to even (C s = 1.5 2^52 is even: as rint); the subtraction is exact.
        Two IEEE operations, each its own ufunc (nothing fuses them), so the same bits everywhere. A float32
        x is first copied into out (exact), a scale per block of columns repeated along the row: NumPy's
        loops then run contiguous, without a cast, which is faster."""
        with np.errstate(over="ignore", invalid="ignore"):  # a row holding inf or NaN: not finite anyway
            c = MAGIC / s  # exact: a power of two times 1.5
            if c.shape[-1] == 1 < x.shape[-1] and 8 * c.size * x.shape[-1] <= x.size:  # a few scales: as rows
                c = xp.repeat(c, x.shape[-1], axis=-1)
            if np.dtype(x.dtype) == np.float32:
                xp.copyto(out, x)
                xp.add(out, c, out=out)
            else:
                xp.add(x, c, out=out, dtype=np.float64)
            xp.subtract(out, c, out=out)

    def integers(self, xp: Any, x: Array, s: Array, q: Array, rest: Array = None) -> None:
        """q = rint(x s) in float64 (x float32 or float64, s powers of two broadcast to q's shape) and, where
        ``rest`` is given, rest = x s - q (exact: |x s - rint(x s)| <= 1/2): a float64 slice's integers
        and what is left for the next slice. ``x`` may be ``rest`` itself (the next slice's pass)."""
        with np.errstate(over="ignore", invalid="ignore"):  # a row holding inf or NaN: not finite anyway
            xp.multiply(x, s, out=q, dtype=np.float64)  # exact but where it over- or underflows: as in C
            if rest is not None:
                rest[...] = q
            xp.rint(q, out=q)
            if rest is not None:
                rest -= q

    def squares(self, xp: Any, parts: list[tuple[Array, Any]], axis: int, kc: int, work: Array) -> Array:
        """The fixed-tree sums of the squares of chunks of kc terms along ``axis`` (-1 or -2), in ``work``'s
        dtype: ``parts`` are (part of an operand, its place in work's leading chunk axis), a part shorter
        than kc along ``axis`` padded with zeros. ``work`` (chunks, ..., kc along ``axis``) is the scratch
        space. Returns the sums, (chunks, ...) with ``axis`` of length 1 (a view of work)."""
        for part, dst in placed(parts, work, axis, kc):
            with np.errstate(over="ignore", under="ignore"):  # what norm_scales handles
                xp.multiply(part, part, out=dst, dtype=work.dtype)
        with np.errstate(over="ignore"):
            return fold_(work, axis)

    def tile_squares(self, xp: Any, rows: Array, col: Array, row: Array, sq: Array, by_col: Array,
                     by_row: Array) -> None:
        """A chunk of a float32 weight's rows, padded to kcr rows with zeros: into ``col`` (ncc kcc,) each
        column's sum of squares (a tree of kcr terms), into ``row`` (kcr, ncc) each row's within each chunk
        of kcc columns, the columns past W's zero. ``sq`` (kcr, ncc kcc), ``by_col`` and ``by_row``: scratch
        space (the squares, each tree's first level)."""
        kcr, (r, n), ncc = sq.shape[0], rows.shape, row.shape[1]
        kcc = sq.shape[1] // ncc
        if r < kcr:
            sq[r:] = 0  # the last chunk's padding rows (the padding columns stay zero)
        with np.errstate(over="ignore", under="ignore"):  # what norm_scales handles
            xp.multiply(rows, rows, out=sq[:r, :n])
            col[...] = fold_into(sq, 0, by_col)[0]
            row[...] = fold_into(sq.reshape(kcr, ncc, kcc), 2, by_row)[:, :, 0]


class CompiledPasses(UfuncPasses):
    """The passes in C (mpisgd/portable/_passes.c) for the NumPy arrays it takes; the ufuncs otherwise."""

    name = "compiled"

    def __init__(self, native: Any) -> None:
        self.native = native

    def on_grid(self, xp: Any, x: Array, s: Array, out: Array) -> None:
        if out.ndim > 4 or np.dtype(out.dtype) != np.float64:
            return super().on_grid(xp, x, s, out)
        with np.errstate(over="ignore", invalid="ignore"):
            c = np.divide(MAGIC, s, dtype=np.float64)
        self.native.on_grid(x, np.broadcast_to(c, out.shape), out)

    def integers(self, xp: Any, x: Array, s: Array, q: Array, rest: Array = None) -> None:
        if q.ndim > 4 or np.dtype(q.dtype) != np.float64 or np.dtype(x.dtype) not in FLOATS:
            return super().integers(xp, x, s, q, rest)
        self.native.integers(x, np.broadcast_to(np.asarray(s, dtype=np.float64), q.shape), q, rest)

    def squares(self, xp: Any, parts: list[tuple[Array, Any]], axis: int, kc: int, work: Array) -> Array:
        dtype = np.dtype(work.dtype)
        if dtype not in FLOATS or any(part.ndim > 4 or part.dtype != dtype for part, _ in parts):
            return super().squares(xp, parts, axis, kc, work)
        sums = _along(work, axis, slice(0, 1))
        for part, at in parts:
            self.native.sum_squares(part, np.squeeze(sums[at], axis=axis), kc, axis)
        return sums

    def tile_squares(self, xp: Any, rows: Array, col: Array, row: Array, sq: Array, by_col: Array,
                     by_row: Array) -> None:
        if rows.dtype != np.float32:
            return super().tile_squares(xp, rows, col, row, sq, by_col, by_row)
        (r, n), ncc = rows.shape, row.shape[1]
        kcc = sq.shape[1] // ncc
        self.native.sum_squares(rows, col[:n], sq.shape[0], -2)
        col[n:] = 0
        full = n // kcc * kcc  # the columns in whole chunks; then the last, padded
        if full:
            self.native.sum_squares(rows[:, :full].reshape(r, full // kcc, kcc), row[:r, :full // kcc], kcc, -1)
        if full < n:
            self.native.sum_squares(rows[:, full:], row[:r, full // kcc], kcc, -1)
        row[r:] = 0


def placed(parts: list[tuple[Array, Any]], buffer: Array, axis: int, kc: int) -> list[tuple[Array, Array]]:
    """(part, where it goes in ``buffer``) for each (part, its place along buffer's leading chunk axis): a
    part shorter than kc along ``axis`` gets the first of its chunk's kc places, the rest zeroed (an
    earlier operand of another length may have written there)."""
    out = []
    for part, at in parts:
        dst = buffer[at]
        length = part.shape[axis]
        if length < kc:
            _along(dst, axis, slice(length, None))[...] = 0
            dst = _along(dst, axis, slice(0, length))
        out.append((part, dst))
    return out


def _along(a: Array, axis: int, index: slice) -> Array:
    """a[..., index] along ``axis`` (-1 or -2)."""
    return a[..., index] if axis == -1 else a[..., index, :]


_CHOSEN: dict[str, UfuncPasses] = {}


def passes_for(xp: Any) -> UfuncPasses:
    """The passes for arrays of module ``xp``: compiled for NumPy where the extension is built (and
    MPISGD_PORTABLE_PASSES is not ``ufunc``), the ufuncs otherwise. Chosen once per module."""
    chosen = _CHOSEN.get(xp.__name__)
    if chosen is None:
        chosen = _CHOSEN[xp.__name__] = _choose(xp)
    return chosen


def _choose(xp: Any) -> UfuncPasses:
    native = serving("_passes", xp)
    return UfuncPasses() if native is None else CompiledPasses(native)
