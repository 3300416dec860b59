"""A layer's weight matrix split once per forward for both of its products, x @ W and dy @ W.T
(mpisgd.portable.gemm's exact slice products; mpisgd.kernels' ``weight``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.portable.gemm import Split, Workspace, chunking, norm_scales, split
from mpisgd.portable.passes import UfuncPasses, passes_for

Array = Any
SPREAD = 4.0  # the widest ratio of norms within a tile of a prepared weight (Weight)


class Weight:
    """A weight matrix W (k, n) split once for the two products a layer needs, x @ W forward and dy @ W.T
    backward: integers Q = rint(W t) with one power of two t per tile of (k chunk) x (n chunk), the chunks
    of both inner dimensions (:func:`chunking`), t chosen so that every column of a tile (x @ W's
    operands) and every row (dy @ W.T's) has norm below 2^GAMMA. Half the work of splitting W for each
    product; a tile's weaker columns or rows give up the bits its strongest needs, so tiles are used only
    where no tile's norms spread wider than SPREAD (at most two bits lost: the weakest column or row keeps
    24 bits of its norm, float32's own precision; a hidden layer's weights spread about 1.2 at start and
    2.2 to 2.5 once trained), and W is split for each product otherwise (a classifier's 10 columns of
    1024 rows spread 10x), in one sweep of row blocks (:meth:`_per_product`). The choice is made from the
    same exact sums everywhere. It owns its arrays (a layer keeps it from forward to backward;
    :meth:`prepare` reuses them). Float32 W; a float64 one is split per product as any operand."""

    def __init__(self) -> None:
        self.ws = Workspace()
        self.right: Split | None = None  # for x @ W
        self.T: Split | None = None  # for dy @ W.T  # noqa: N815 - as ndarray.T

    def prepare(self, w: Array) -> Weight:
        xp = xp_of(w)
        if w.ndim != 2:
            raise ValueError(f"a weight matrix is 2-D, got shape {tuple(w.shape)}")
        if np.dtype(w.dtype) != np.float32:
            self.right, self.T = split(w, "right", self.ws, "w"), split(w.T, "right", self.ws, "wT")
            return self
        (k, n), (ncr, kcr), (ncc, kcc) = w.shape, chunking(w.shape[0]), chunking(w.shape[1])
        rows, cols = ncr * kcr, ncc * kcc
        # One chunk of rows at a time (a few MiB, in cache): every pass over it is made before the next
        # chunk is read, so W crosses the memory bus twice (norms, then integers) instead of once per pass,
        # which matters when ranks share the bus. The trees are those of the whole array: the same bits.
        sq = self.ws.get(xp, "sq", (kcr, cols), np.float32)  # squares in float32 (norm_scales covers their rounding)
        by_col = self.ws.get(xp, "by_col", (kcr - kcr // 2, cols), np.float32)
        by_row = self.ws.get(xp, "by_row", (kcr, ncc, kcc - kcc // 2), np.float32)
        col = self.ws.get(xp, "col", (ncr, cols), np.float32)  # each column within its k chunk
        row = self.ws.get(xp, "row", (rows, ncc), np.float32)  # each row within its n chunk
        passes = passes_for(xp)
        for r in range(ncr):
            r0, r1 = r * kcr, min(k, (r + 1) * kcr)
            passes.tile_squares(xp, w[r0:r1], col[r], row[r0:r0 + kcr], sq, by_col, by_row)
        col_t, row_t = col.reshape(ncr, ncc, kcc), row.reshape(ncr, kcr, ncc)
        tile = xp.maximum(col_t.max(axis=2), row_t.max(axis=1))
        weakest = xp.minimum(xp.where(col_t > 0, col_t, np.inf).min(axis=2),
                             xp.where(row_t > 0, row_t, np.inf).min(axis=1))
        mx: list[Array] = []

        def largest() -> Array:  # |W| padded with zeros (made only where a sum overflowed or is tiny)
            if not mx:
                mx.append(self.ws.get(xp, "largest", (rows, cols), np.float32))
                xp.abs(w, out=mx[0][:k, :n])
            return mx[0]

        if bool((tile > SPREAD**2 * weakest).any()):  # some tile's norms spread too wide: a split per product
            return self._per_product(w, col[:, None, :n], row[:k], largest)
        q = self.ws.get(xp, "q", (rows, cols))  # made zeroed: the padding (rows from k, columns from n) stays 0
        t = norm_scales(xp, tile, max(kcr, kcc),
                    lambda: largest().reshape(ncr, kcr, ncc, kcc).max(axis=(1, 3)).astype(np.float64))  # (ncr, ncc)
        for r in range(ncr):
            r0, r1 = r * kcr, min(k, (r + 1) * kcr)
            _rows_on_grid(passes, xp, w[r0:r1], t[r, None, :, None], q[r0:r1], ncc, kcc)
        per_col = xp.repeat(t, kcc, axis=1)[:, :n]  # (ncr, n): the scale of W[chunk c, j]
        per_row = xp.repeat(t, kcr, axis=0)[:k, :]  # (k, ncc): the scale of W[i, chunk J]
        self.right = Split("right", (k, n), np.dtype(np.float32), ncr, kcr,
                           [(q[:, :n].reshape(ncr, kcr, n), per_col[:, None, :])], applied=True)
        self.T = Split("right", (n, k), np.dtype(np.float32), ncc, kcc,
                       [(q[:k, :].reshape(k, ncc, kcc).transpose(1, 2, 0), per_row.T[:, None, :])], applied=True)
        return self

    def _per_product(self, w: Array, col: Array, row: Array, largest: Any) -> Weight:
        """W split for each product, as :func:`split` splits W for x @ W and W.T for dy @ W.T (the same norms,
        scales and integers, so the same bits), from the norms :meth:`prepare` folded: ``col`` (ncr, 1, n),
        each column within its k chunk, ``row`` (k, ncc), each row within its n chunk; ``largest()``, |W|
        padded. Both integer arrays are made in one sweep of chunks of rows, each in cache."""
        xp = xp_of(w)
        (k, n), (ncr, kcr), (ncc, kcc) = w.shape, chunking(w.shape[0]), chunking(w.shape[1])
        rows, cols = ncr * kcr, ncc * kcc
        t_col = norm_scales(xp, col, kcr, lambda: largest().reshape(ncr, kcr, cols)
                            .max(axis=1, keepdims=True)[:, :, :n].astype(np.float64))  # (ncr, 1, n)
        t_row = norm_scales(xp, row[:, :, None], kcc, lambda: largest()[:k].reshape(k, ncc, kcc)
                            .max(axis=2, keepdims=True).astype(np.float64))  # (k, ncc, 1)
        passes = passes_for(xp)
        q_col = self.ws.get(xp, "q_col", (rows, n))  # made zeroed: the padding rows stay 0
        q_row = self.ws.get(xp, "q_row", (k, cols))  # and the padding columns
        for r in range(ncr):  # a chunk of rows at a time, in cache
            r0, r1 = r * kcr, min(k, (r + 1) * kcr)
            passes.on_grid(xp, w[r0:r1], t_col[r], q_col[r0:r1])
            _rows_on_grid(passes, xp, w[r0:r1], t_row[r0:r1], q_row[r0:r1], ncc, kcc)
        self.right = Split("right", (k, n), np.dtype(np.float32), ncr, kcr,
                           [(q_col.reshape(ncr, kcr, n), t_col)], applied=True)
        self.T = Split("right", (n, k), np.dtype(np.float32), ncc, kcc,
                       [(q_row.reshape(k, ncc, kcc).transpose(1, 2, 0), t_row.transpose(1, 2, 0))], applied=True)
        return self


def _rows_on_grid(passes: UfuncPasses, xp: Any, w_rows: Array, t: Array, dst: Array, ncc: int, kcc: int) -> None:
    """dst (rows, ncc*kcc) = rows of W (rows, n) on the grid of t, a scale per chunk of n (per row or shared
    by the rows), the padding columns from n zero (dst's stay zero: it is made zeroed, and 0 stays 0)."""
    rows, n = w_rows.shape
    by_chunk = dst.reshape(rows, ncc, kcc)
    if n == ncc * kcc:  # no padding columns: straight from W
        passes.on_grid(xp, w_rows.reshape(rows, ncc, kcc), t, by_chunk)
    else:
        dst[:, :n] = w_rows
        passes.on_grid(xp, by_chunk, t, by_chunk)
