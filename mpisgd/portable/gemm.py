"""Matrix products that any BLAS computes to the same bits: exact slice products (the Ozaki scheme).

A float GEMM's result depends on how the library orders each dot product's additions (its blocking,
SIMD width, FMA use, threads), so two BLAS kernels give two answers. Here C = A B is computed so that
every addition is exact:

1. The inner dimension k is cut into ``nc`` chunks of at most ``CHUNK`` terms (chunks of near-equal
   length, a function of k alone).
2. In each chunk, each row a of A is scaled by a power of two s_a and rounded to integers,
   q_a = rint(a s_a), with s_a chosen from a's L2 norm so that ||a s_a|| < 2^26; each column b of B
   likewise. Then ||q_a|| <= 2^26 + sqrt(kc)/2, and by Cauchy-Schwarz every partial sum of the dot
   product q_a . q_b is an integer of magnitude at most ||q_a|| ||q_b|| < 2^53: exact in float64,
   whatever order, blocking or fused multiply-add the library uses. So ``matmul`` in float64 (any
   dgemm: OpenBLAS under any core type, MKL, cuBLAS) returns the same integers everywhere.
3. Each chunk's product is scaled back (powers of two: exact), the chunks are added in a fixed order
   (mpisgd.portable.reduce), and the sum is rounded once to the output's dtype.

The norms that choose the scales come from exact squares added in the fixed order, with a margin that
covers that sum's rounding: the scales, hence the integers, are a function of the inputs alone.

Accuracy: each element keeps about 26 bits relative to its row's (column's) norm within its chunk, and
rounding is to nearest, so the error of C is about that of a float32 GEMM or smaller (measured per
layer in docs/reproducible.md). Float32 operands use one slice; float64 operands two (the residual
a s_a - q_a, exact, is scaled and rounded again, and the three products of significance are added),
about 50 bits: enough for float64 gradient checks.

The same code runs on NumPy and CuPy (``xp_of``); float64 is IEEE on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.portable.reduce import fold_

Array = Any
GAMMA = 26  # bits of a scaled row's (column's) norm: two of them and the rounding stay below 2^53
CHUNK = 256  # most terms per chunk of the inner dimension: shorter chunks scale closer to their values
E_BIG = 1024 + 13  # the exponent assumed where a row holds inf or NaN (its products are not finite anyway)
SLICES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}
SPREAD = 2.0  # the widest ratio of norms within a tile of a prepared weight (mpisgd.portable.gemm.Weight)
TINY_SUM = 2.0**-1000  # below: a float64 sum of squares whose flushed terms may matter


def chunking(k: int) -> tuple[int, int]:
    """(chunks, terms per chunk) for an inner dimension of k: near-equal chunks of at most CHUNK."""
    nc = max(1, -(-k // CHUNK))
    return nc, max(1, -(-k // nc))


class Workspace:
    """Scratch arrays kept by (name, shape, dtype) and reused from call to call: a step's products allocate
    nothing after the first. Arrays are made zeroed; the split keeps a short last chunk's padding zero."""

    def __init__(self) -> None:
        self._arrays: dict[tuple[str, tuple[int, ...], str, str], Array] = {}

    def get(self, xp: Any, name: str, shape: tuple[int, ...], dtype: Any = np.float64) -> Array:
        key = (name, shape, np.dtype(dtype).str, xp.__name__)
        a = self._arrays.get(key)
        if a is None:
            a = self._arrays[key] = xp.zeros(shape, dtype=dtype)
        return a

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._arrays.values())


def _scales(xp: Any, sq: Array, kc: int, largest: Any) -> Array:
    """Powers of two s such that every row (column) x of a chunk has ||x s|| < 2^GAMMA, from ``sq``: the
    fixed-order float64 sums of the squares (exact squares for float32 operands). The sum's rounding (at
    most log2(kc) + 1 additions, and rounded squares of float64 operands) is covered by a relative margin
    of 2^-40, squares flushed below the smallest normal (float64 operands under 2^-511) by kc of them,
    so that the bound holds and is the same bits everywhere. Where the sum overflowed (float64 values
    from 2^511) or lies where flushing may weigh in, the bound is sqrt(kc) times the largest element
    instead (``largest()``: exact, made only then)."""
    total = sq * (1.0 + 2.0**-40) + kc * float(np.finfo(np.float64).tiny)
    bound = xp.sqrt(total) * (1.0 + 2.0**-40)  # and sqrt's own rounding
    _, e = xp.frexp(bound)  # bound < 2^e
    xp.maximum(e, GAMMA - 1023, out=e)  # a vanishing norm: a scale of at most 2^1023
    over = ~(bound < np.inf) | ((sq < TINY_SUM) & (sq > 0))  # 0: a row of zeros (float32: exactly)
    if bool(over.any()):
        big = largest()  # max |x| per row (column), exact: ||x|| <= sqrt(kc) max |x| < 2^(e_max + 4.5)
        _, e_max = xp.frexp(big)
        fallback = e_max + int(np.ceil(np.log2(np.sqrt(kc)))) + 1
        e[over] = xp.where(big < np.inf, fallback, E_BIG)[over]  # inf or NaN in the row: any scale
    return xp.ldexp(1.0, GAMMA - e)


@dataclass
class Split:
    """An operand cut into integer slices: ``slices[i] = (q, scale)``, q of shape (nc, ..., r, c) with the
    inner dimension cut into nc chunks of kc (the last padded with zeros), ``scale`` the power of two
    per (chunk, row) of a left operand, shaped (nc, ..., r, 1), or per (chunk, column) of a right one,
    (nc, ..., 1, c). Made by :func:`split`; a product may take it instead of the array, so an operand
    used in several products is split once."""

    side: str  # "left" (A: its rows are split) or "right" (B: its columns)
    shape: tuple[int, ...]  # the operand's
    dtype: np.dtype
    nc: int
    kc: int
    slices: list[tuple[Array, Array]]


def split(x: Array, side: str, ws: Workspace, tag: str | None = None) -> Split:
    """``x`` as integer slices for the ``side`` ("left" or "right") of a product. The slices live in ``ws``
    under ``tag`` (default: the side): valid until the next split with the same tag and shape. A
    transposed view (x.T of a C-ordered array, as in x.T @ dy) is split as its transpose, for the other
    side, so that every pass reads memory in order; the slices are then transposed views themselves,
    which BLAS takes as they are."""
    if x.ndim >= 2 and x.shape[-1] > 1 and x.shape[-2] > 1 and abs(x.strides[-2]) < abs(x.strides[-1]):
        t = split(x.swapaxes(-1, -2), "right" if side == "left" else "left", ws, tag or side)
        return Split(side, tuple(x.shape), t.dtype, t.nc, t.kc,
                     [(q.swapaxes(-1, -2), scale.swapaxes(-1, -2)) for q, scale in t.slices])
    xp = xp_of(x)
    dtype = np.dtype(x.dtype)
    slices = SLICES.get(dtype)
    if slices is None:
        raise TypeError(f"portable matmul takes float32 or float64 operands, got {x.dtype}")
    axis = -1 if side == "left" else -2
    k = x.shape[axis]
    nc, kc = chunking(k)
    tag = tag or side
    shape = list(x.shape)
    shape[axis] = kc
    work = (nc, *shape)
    square = np.float64  # float32 values' squares are exact in float64: no flushing, no overflow
    sq = ws.get(xp, f"{tag}:sq", work, square)
    full = (nc - 1) * kc  # chunks 0..nc-2 hold kc terms each, the last the rest (padded with zeros)

    def chunks(a: Array) -> list[tuple[Array, Array]]:
        """(part of x, where it goes in a (nc, ...) buffer): the full chunks as one view, then the last."""
        if axis == -1:
            body = xp.moveaxis(x[..., :full].reshape(*x.shape[:-1], nc - 1, kc), -2, 0)
            return [(body, a[:nc - 1]), (x[..., full:], a[nc - 1, ..., :k - full])]
        body = xp.moveaxis(x[..., :full, :].reshape(*x.shape[:-2], nc - 1, kc, x.shape[-1]), -3, 0)
        return [(body, a[:nc - 1]), (x[..., full:, :], a[nc - 1, ..., :k - full, :])]

    out: list[tuple[Array, Array]] = []
    rest: Array = None  # (slices > 1) what is still to split, scaled: x s - q, exact
    total: Array = None
    for i in range(slices):
        with np.errstate(over="ignore", under="ignore"):  # overflow and flushing are what _scales handles
            if i == 0:  # straight from x
                for part, dst in chunks(sq):
                    xp.multiply(part, part, out=dst, dtype=square)
            else:
                xp.multiply(rest, rest, out=sq)

        def largest(src: Array = rest, first: bool = i == 0) -> Array:
            mx = ws.get(xp, f"{tag}:largest", work, x.dtype)
            if first:
                for part, dst in chunks(mx):
                    xp.abs(part, out=dst)
            else:
                xp.abs(src, out=mx)
            return mx.max(axis=axis, keepdims=True).astype(np.float64)

        s = _scales(xp, fold_(sq, axis), kc, largest)  # per (chunk, row or column), the inner axis of length 1
        q = ws.get(xp, f"{tag}:q{i}", work)
        if i == 0:
            for (part, dst), scale in zip(chunks(q), (s[:nc - 1], s[nc - 1]), strict=True):
                xp.multiply(part, scale, out=dst, dtype=np.float64)  # exact: a power of two
        else:
            xp.multiply(rest, s, out=q)
        if i + 1 < slices:
            rest = ws.get(xp, f"{tag}:rest", work)
            rest[...] = q
        xp.rint(q, out=q)
        if i + 1 < slices:
            rest -= q  # |x s - rint(x s)| <= 1/2: exact
        with np.errstate(over="ignore"):  # a vanishing row's (below 1e-290) second scale overflows: dropped
            total = s if total is None else total * s
        out.append((q, total))
    return Split(side, tuple(x.shape), dtype, nc, kc, out)


class Weight:
    """A weight matrix W (k, n) split once for the two products a layer needs, x @ W forward and dy @ W.T
    backward: integers Q = rint(W t) with one power of two t per tile of (k chunk) x (n chunk), the chunks
    of both inner dimensions (:func:`chunking`), t chosen so that every column of a tile (x @ W's
    operands) and every row (dy @ W.T's) has norm below 2^GAMMA. Half the work of splitting W for each
    product; a tile's weaker columns or rows give up the bits its strongest needs, so tiles are used only
    where no tile's norms spread wider than SPREAD (at most a bit lost; a hidden layer's weights spread
    about 1.2), and W is split for each product otherwise (a classifier's 10 columns of 1024 rows spread
    10x). The choice is made from the same exact sums everywhere. It owns its arrays (a layer keeps it
    from forward to backward; :meth:`prepare` reuses them). Float32 W; a float64 one is split per
    product as any operand."""

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
        by_col = self.ws.get(xp, "cols", (rows, cols))  # squares (exact in float64), padded with zeros
        by_row = self.ws.get(xp, "rows", (rows, cols))
        xp.multiply(w, w, out=by_col[:k, :n], dtype=np.float64)
        by_row[...] = by_col
        col = fold_(by_col.reshape(ncr, kcr, cols), 1)[:, 0, :]  # (ncr, cols): each column within its k chunk
        row = fold_(by_row.reshape(rows, ncc, kcc), 2)[:, :, 0]  # (rows, ncc): each row within its n chunk
        col_t, row_t = col.reshape(ncr, ncc, kcc), row.reshape(ncr, kcr, ncc)
        tile = xp.maximum(col_t.max(axis=2), row_t.max(axis=1))
        weakest = xp.minimum(xp.where(col_t > 0, col_t, np.inf).min(axis=2),
                             xp.where(row_t > 0, row_t, np.inf).min(axis=1))
        if bool((tile > SPREAD**2 * weakest).any()):  # some tile's norms spread too wide: a split per product
            self.right, self.T = split(w, "right", self.ws, "w"), split(w.T, "right", self.ws, "wT")
            return self
        q = self.ws.get(xp, "q", (rows, cols))

        def largest() -> Array:
            mx = self.ws.get(xp, "largest", (rows, cols), np.float32)  # never for float32 W: no overflow
            xp.abs(w, out=mx[:k, :n])
            return mx.reshape(ncr, kcr, ncc, kcc).max(axis=(1, 3)).astype(np.float64)

        t = _scales(xp, tile, max(kcr, kcc), largest)  # (ncr, ncc)
        q[:k, :n] = w
        q.reshape(ncr, kcr, ncc, kcc)[...] *= t[:, None, :, None]  # exact: powers of two
        xp.rint(q, out=q)
        per_col = xp.repeat(t, kcc, axis=1)[:, :n]  # (ncr, n): the scale of W[chunk c, j]
        per_row = xp.repeat(t, kcr, axis=0)[:k, :]  # (k, ncc): the scale of W[i, chunk J]
        self.right = Split("right", (k, n), np.dtype(np.float32), ncr, kcr,
                           [(q[:, :n].reshape(ncr, kcr, n), per_col[:, None, :])])
        self.T = Split("right", (n, k), np.dtype(np.float32), ncc, kcc,
                       [(q[:k, :].reshape(k, ncc, kcc).transpose(1, 2, 0), per_row.T[:, None, :])])
        return self


def matmul(a: Array | Split, b: Array | Split | Weight, out: Array = None, ws: Workspace | None = None) -> Array:
    """a @ b (a: (..., m, k), b: (..., k, n), batch dimensions broadcast; either may be a :class:`Split`
    made once for several products) computed exactly in float64 from integer slices, rounded once into
    ``out`` (made in the operands' dtype when None). Float32 and float64 only."""
    ws = ws or Workspace()
    if isinstance(b, Weight):
        b = b.right
    sa = a if isinstance(a, Split) else split(a, "left", ws)
    sb = b if isinstance(b, Split) else split(b, "right", ws)
    if sa.side != "left" or sb.side != "right":
        raise ValueError("matmul: a split operand must be made for its side (split(x, 'left') for a, 'right' for b)")
    if len(sa.shape) < 2 or len(sb.shape) < 2 or sa.shape[-1] != sb.shape[-2]:
        raise ValueError(f"matmul: shapes {sa.shape} and {sb.shape} do not chain")
    xp = xp_of(sa.slices[0][0])
    dtype = np.result_type(sa.dtype, sb.dtype)
    m, n = sa.shape[-2], sb.shape[-1]
    batch = tuple(np.broadcast_shapes(sa.shape[:-2], sb.shape[:-2]))
    if out is None:
        out = xp.empty((*batch, m, n), dtype=dtype)
    if sa.shape[-1] == 0:
        out[...] = 0
        return out
    if len(sa.slices) != len(sb.slices):
        raise TypeError(f"matmul: operands of one dtype, got {sa.dtype} and {sb.dtype}")
    assert (sa.nc, sa.kc) == (sb.nc, sb.kc), "both operands are cut by chunking(k)"
    nc = sa.nc
    pad_a, pad_b = len(batch) - (len(sa.shape) - 2), len(batch) - (len(sb.shape) - 2)

    def lift(x: Array, pad: int) -> Array:  # (nc, batch..., r, c) with the missing batch axes as 1
        return x.reshape(x.shape[0], *((1,) * pad), *x.shape[1:])

    prod = ws.get(xp, "prod", (nc, *batch, m, n))
    acc = ws.get(xp, "acc", (nc, *batch, m, n))
    pairs = significant_pairs(len(sa.slices))
    for p, (i, j) in enumerate(pairs):  # in a fixed order
        (qa, scale_a), (qb, scale_b) = sa.slices[i], sb.slices[j]
        xp.matmul(lift(qa, pad_a), lift(qb, pad_b), out=prod)  # exact: integers below 2^53
        last = p == len(pairs) - 1 and nc == 1
        xp.divide(prod, lift(scale_a, pad_a), out=prod)  # powers of two: exact
        if p == 0 and last:  # one product, one chunk: scaled back and rounded in one pass
            xp.divide(prod[0], lift(scale_b, pad_b)[0], out=out)
            return out
        xp.divide(prod, lift(scale_b, pad_b), out=acc if p == 0 else prod)
        if p:
            acc += prod
    out[...] = fold_(acc, 0)[0]  # the chunks added in the fixed order, then rounded once
    return out


def significant_pairs(slices: int) -> list[tuple[int, int]]:
    """The slice products kept, (i, j) with i + j < slices: the others lie below the last slice's bits."""
    return [(i, j) for i in range(slices) for j in range(slices) if i + j < slices]
