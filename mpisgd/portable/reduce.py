"""Sums in one fixed order: a fixed binary tree of elementwise adds.

A library reduction (NumPy's pairwise sum, a BLAS dot, CuPy's block reduction) chooses its own order,
and that order may change with the SIMD width, the array's layout, the library's version or the
device. Here the n terms along ``axis`` are folded in halves: the last n//2 terms are added onto the
first n//2 (term n - n//2 + i onto term i), which leaves ceil(n/2) terms, and so on until one is
left. Each step is one elementwise add of two slices, which every IEEE machine rounds alike, so the
result depends on the values and n only. Sums run in float64 (``dtype``): a pairwise sum's error,
O(log n) roundings of float64, then one rounding to the output's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.backend import xp_of

Array = Any


def fold_(a: Array, axis: int) -> Array:
    """Sum ``a`` along ``axis`` in the fixed tree, in place (``a`` is overwritten); returns the sums, a
    view of ``a`` with ``axis`` of length 1 kept."""
    axis = axis % a.ndim
    n = a.shape[axis]
    before = (slice(None),) * axis
    while n > 1:
        half = n // 2
        lo = a[before + (slice(0, half),)]
        lo += a[before + (slice(n - half, n),)]
        n -= half
    return a[before + (slice(0, 1),)]


def fold_into(a: Array, axis: int, work: Array) -> Array:
    """The sums of :func:`fold_` (the same tree, the same bits) without overwriting ``a``: the first level
    of the tree is written into ``work`` (``a``'s shape with ``axis`` of length ceil(n/2)), the rest folded
    there in place; returns the sums, a view of ``work`` with ``axis`` of length 1."""
    axis = axis % a.ndim
    n = a.shape[axis]
    before = (slice(None),) * axis
    half = n // 2
    if half == 0:
        work[...] = a
        return work
    xp_of(a).add(a[before + (slice(0, half),)], a[before + (slice(n - half, n),)],
                 out=work[before + (slice(0, half),)])
    if n - half > half:  # n odd: the middle term waits for the next level, as in fold_
        work[before + (slice(half, half + 1),)] = a[before + (slice(half, half + 1),)]
    return fold_(work, axis)


def tree_sum(x: Array, axis: int, out: Array = None, keepdims: bool = False, dtype: Any = np.float64) -> Array:
    """The sum of ``x`` along ``axis`` in the fixed tree, accumulated in ``dtype`` (float64 by default), then
    rounded once into ``out`` (or returned in ``x``'s dtype)."""
    xp = xp_of(x)
    work = xp.array(x, dtype=dtype, copy=True)
    if work.shape[axis % work.ndim] == 0:
        total = xp.zeros(_reduced_shape(x.shape, axis, True), dtype=dtype)
    else:
        total = fold_(work, axis)
    if not keepdims:
        total = xp.squeeze(total, axis=axis)
    if out is None:
        return total.astype(x.dtype, copy=False) if x.dtype != total.dtype else total
    out[...] = total
    return out


def tree_mean(x: Array, axis: int | None = None) -> Array:
    """The mean of ``x`` (over every element when ``axis`` is None) as a 0-d or reduced array of x's dtype:
    the fixed-tree sum in float64, divided by the count, rounded once."""
    xp = xp_of(x)
    flat = x.reshape(-1) if axis is None else x
    total = tree_sum(flat, 0 if axis is None else axis, dtype=np.float64)
    n = flat.shape[0 if axis is None else axis]
    return (total / np.float64(n)).astype(x.dtype) if n else xp.asarray(np.nan, dtype=x.dtype)


def _reduced_shape(shape: tuple[int, ...], axis: int, keepdims: bool) -> tuple[int, ...]:
    axis = axis % len(shape)
    return tuple(1 if i == axis else s for i, s in enumerate(shape)) if keepdims else \
        tuple(s for i, s in enumerate(shape) if i != axis)
