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
   (mpisgd.portable.reduce, or chunk by chunk for large outputs), and the sum is rounded once to the
   output's dtype.

A float32 operand's slice is held with its scale applied, q_a / s_a = rint(a s_a) / s_a (made by two
IEEE additions, mpisgd.portable.passes' ``on_grid``): every term of a dot product of two such vectors is the integer
product q_a q_b times the one power of two 1 / (s_a s_b), so every partial sum is an integer below 2^53
times that power of two: exact too, as long as that power of two stays within float64's range, which
float32 operands guarantee (s_a, s_b between about 2^-113 and 2^175: the grid 1 / (s_a s_b) is far
above float64's smallest subnormal and 2^53 / (s_a s_b) below its largest value). The product then
needs no scaling back. Float64 operands, whose scales may reach 2^1023, are scaled back as in step 3.

The norms that choose the scales come from squares added in the fixed order (float32 operands' in
float32, float64 ones' in float64), with a margin that covers that sum's rounding (:func:`norm_scales`):
the scales, hence the integers, are a function of the inputs alone. Two operands are prepared by
modules of their own: a layer's weight matrix, split once for its forward and backward products
(mpisgd.portable.weight), and a convolution's input, made integer once with one power of two per
sample so that its im2col columns need no splitting (mpisgd.portable.samples).

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
from mpisgd.portable.passes import passes_for, placed
from mpisgd.portable.reduce import fold_

Array = Any
GAMMA = 26  # bits of a scaled row's (column's) norm: two of them and the rounding stay below 2^53
CHUNK = 256  # most terms per chunk of the inner dimension: shorter chunks scale closer to their values
E_BIG = 1024 + 13  # the exponent assumed where a row holds inf or NaN (its products are not finite anyway)
SLICES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}
LOOP_MIN = 65536  # outputs of at least this many elements: in blocks of rows, chunk by chunk (in cache)
BLOCK = 262144  # elements of output rows made at once (2 MiB of float64: in cache when ranks share the memory bus)
TINY_SUM = 2.0**-1000  # below: a float64 sum of squares whose flushed terms may matter
TINY_SUM32 = 2.0**-100  # below: a float32 sum of squares whose flushed or subnormal terms may matter


def chunking(k: int) -> tuple[int, int]:
    """(chunks, terms per chunk) for an inner dimension of k: near-equal chunks of at most CHUNK."""
    nc = max(1, -(-k // CHUNK))
    return nc, max(1, -(-k // nc))


class Workspace:
    """Scratch arrays kept by (name, shape, dtype) and reused from call to call: a step's products allocate
    nothing after the first. Arrays are made zeroed; the split zeroes a short last chunk's padding on every
    call (another inner dimension with the same chunk shape may have written there)."""

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


def norm_scales(xp: Any, sq: Array, kc: int, largest: Any, gamma: int = GAMMA) -> Array:
    """Powers of two s such that every row (column) x of a chunk has ||x s|| < 2^gamma, from ``sq``: the
    fixed-order sums of the squares, in float64 (exact squares of float32 values, rounded ones of float64
    values) or in float32 (each square and each addition rounded). The sum's rounding is covered by a
    relative margin: float64, at most log2(kc) + 1 roundings, 2^-40; float32, at most log2(kc) + 1
    roundings of 2^-24 each on non-negative terms, (1 - 2^-24)^-(log2(kc) + 1) < 1 + 2^-19 for kc < 2^20,
    hence 2^-18 with the float64 roundings of the margin itself. Squares flushed below the smallest normal
    (float64 operands under 2^-511) are covered by kc of them, float32 squares rounded in the subnormal
    range (operands under 2^-63, each off by at most 2^-150) by kc times 2^-149; so the bound holds and is
    the same bits everywhere. Where the sum overflowed (float64 values from 2^511, float32 ones from 2^63)
    or lies where flushing may weigh in, the bound is sqrt(kc) times the largest element instead
    (``largest()``: exact, made only then)."""
    if np.dtype(sq.dtype) == np.float32:
        assert kc < 2**20, "the float32 margin covers sums of fewer than 2^20 squares"
        total = sq.astype(np.float64) * (1.0 + 2.0**-18) + kc * 2.0**-149
        small = sq < TINY_SUM32  # 0 too: all its squares may have flushed
    else:
        total = sq * (1.0 + 2.0**-40) + kc * float(np.finfo(np.float64).tiny)
        small = (sq < TINY_SUM) & (sq > 0)  # 0: a row of zeros (exactly)
    bound = xp.sqrt(total) * (1.0 + 2.0**-40)  # and sqrt's own rounding
    _, e = xp.frexp(bound)  # bound < 2^e
    xp.maximum(e, gamma - 1023, out=e)  # a vanishing norm: a scale of at most 2^1023
    over = ~(bound < np.inf) | small
    if bool(over.any()):
        big = largest()  # max |x| per row (column), exact: ||x|| <= sqrt(kc) max |x| < 2^(e_max + 4.5)
        _, e_max = xp.frexp(big)
        fallback = e_max + int(np.ceil(np.log2(np.sqrt(kc)))) + 1
        e[over] = xp.where(big < np.inf, fallback, E_BIG)[over]  # inf or NaN in the row: any scale
    return xp.ldexp(1.0, gamma - e)


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
    slices: list[tuple[Array, Array | None]]
    applied: bool = False  # q holds rint(x s) / s, the scale applied already (float32 operands): q s are the integers

    def integers(self, i: int = 0) -> Array:
        """Slice i's integers (q s where the scale is applied already)."""
        q, scale = self.slices[i]
        return q * scale if self.applied else q

    def __getitem__(self, index: int | tuple[int, ...]) -> Split:
        """The operand's matrix at ``index`` of its leading batch axes (W_t[i, j] of a (k, k, c, c') split)."""
        index = index if isinstance(index, tuple) else (index,)
        at = (slice(None), *index)
        return Split(self.side, self.shape[len(index):], self.dtype, self.nc, self.kc,
                     [(q[at], scale[at] if scale is not None and scale.shape[1:-2] == q.shape[1:-2] else scale)
                      for q, scale in self.slices], self.applied)


def split(x: Array, side: str, ws: Workspace, tag: str | None = None, gamma: int = GAMMA,
          slices: int | None = None) -> Split:
    """``x`` as integer slices for the ``side`` ("left" or "right") of a product. The slices live in ``ws``
    under ``tag`` (default: the side): valid until the next split with the same tag and shape. A
    transposed view (x.T of a C-ordered array, as in x.T @ dy) is split as its transpose, for the other
    side, so that every pass reads memory in order; the slices are then transposed views themselves,
    which BLAS takes as they are. ``gamma``: the bound on each chunk's norm, 2^gamma (GAMMA unless the
    other operand's integers are bounded otherwise, mpisgd.portable.samples); ``slices``: how many (by default
    one for float32, two for float64; one for a float64 operand that holds float32's precision). A
    float32 operand's squares are summed in float32 (:func:`norm_scales` covers their rounding), a float64
    one's in float64."""
    if x.ndim >= 2 and x.shape[-1] > 1 and x.shape[-2] > 1 and abs(x.strides[-2]) < abs(x.strides[-1]):
        t = split(x.swapaxes(-1, -2), "right" if side == "left" else "left", ws, tag or side, gamma, slices)
        return Split(side, tuple(x.shape), t.dtype, t.nc, t.kc,
                     [(q.swapaxes(-1, -2), None if scale is None else scale.swapaxes(-1, -2)) for q, scale in t.slices],
                     t.applied)
    xp = xp_of(x)
    dtype = np.dtype(x.dtype)
    if dtype not in SLICES:
        raise TypeError(f"portable matmul takes float32 or float64 operands, got {x.dtype}")
    slices = slices or SLICES[dtype]
    assert dtype == np.float64 or slices == 1, "a float32 operand takes one slice"
    axis = -1 if side == "left" else -2
    k = x.shape[axis]
    nc, kc = chunking(k)
    tag = tag or side
    shape = list(x.shape)
    shape[axis] = kc
    work = (nc, *shape)
    square = dtype  # float32: half the bytes of float64 squares, the rounding covered by norm_scales' margin
    sq = ws.get(xp, f"{tag}:sq", work, square)
    full = (nc - 1) * kc  # chunks 0..nc-2 hold kc terms each, the last the rest (padded with zeros)

    def parts() -> list[tuple[Array, Any]]:
        """(part of x, its place along a (nc, ...) buffer's chunk axis): the full chunks as one view, then
        the last (shorter than kc where k is not a multiple of it: the buffers' padding is zero)."""
        if nc == 1 and k == kc:  # one chunk, no padding
            return [(x, 0)]
        if axis == -1:
            body = xp.moveaxis(x[..., :full].reshape(*x.shape[:-1], nc - 1, kc), -2, 0)
            return [(body, slice(0, nc - 1)), (x[..., full:], nc - 1)]
        body = xp.moveaxis(x[..., :full, :].reshape(*x.shape[:-2], nc - 1, kc, x.shape[-1]), -3, 0)
        return [(body, slice(0, nc - 1)), (x[..., full:, :], nc - 1)]

    def per_chunk(s: Array) -> list[Array]:
        """The scales for the parts :func:`parts` gives."""
        return [s[0]] if nc == 1 and k == kc else [s[:nc - 1], s[nc - 1]]

    out: list[tuple[Array, Array]] = []
    rest: Array = None  # (slices > 1) what is still to split, scaled: x s - q, exact
    total: Array = None
    passes = passes_for(xp)
    for i in range(slices):
        # the squares straight from x, then from what the slices before left (x s - q, exact)
        sums = passes.squares(xp, parts() if i == 0 else [(rest, slice(None))], axis, kc, sq)

        def largest(src: Array = rest, first: bool = i == 0) -> Array:
            mx = ws.get(xp, f"{tag}:largest", work, x.dtype)
            if first:
                for part, dst in placed(parts(), mx, axis, kc):
                    xp.abs(part, out=dst)
            else:
                xp.abs(src, out=mx)
            return mx.max(axis=axis, keepdims=True).astype(np.float64)

        s = norm_scales(xp, sums, kc, largest, gamma)  # per (chunk, row or column): inner axis of 1
        q = ws.get(xp, f"{tag}:q{i}", work)
        if dtype == np.float32:  # the integers with their scale applied: rint(x s) / s (passes' on_grid)
            for (part, dst), scale in zip(placed(parts(), q, axis, kc), per_chunk(s), strict=True):
                passes.on_grid(xp, part, scale, dst)
            out.append((q, s))
            break
        more = i + 1 < slices  # a slice after this one: keep x s - q for it
        if i == 0:
            rest = ws.get(xp, f"{tag}:rest", work) if more else None
            lefts = [left for _, left in placed(parts(), rest, axis, kc)] if more else [None] * len(parts())
            for (part, dst), left, scale in zip(placed(parts(), q, axis, kc), lefts, per_chunk(s), strict=True):
                passes.integers(xp, part, scale, dst, left)  # x s: exact, a power of two
        else:
            passes.integers(xp, rest, s, q, rest if more else None)
        with np.errstate(over="ignore"):  # a vanishing row's (below 1e-290) second scale overflows: dropped
            total = s if total is None else total * s
        out.append((q, total))
    return Split(side, tuple(x.shape), dtype, nc, kc, out, dtype == np.float32)


def matmul(a: Array | Split, b: Array | Split, out: Array = None, ws: Workspace | None = None) -> Array:
    """a @ b (a: (..., m, k), b: (..., k, n), batch dimensions broadcast; either may be a :class:`Split`
    made once for several products) computed exactly in float64 from integer slices, rounded once into
    ``out`` (made in the operands' dtype when None). Float32 and float64 only."""
    ws = ws or Workspace()
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
    if np.dtype(sa.dtype) != np.dtype(sb.dtype):
        raise TypeError(f"matmul: operands of one dtype, got {sa.dtype} and {sb.dtype}")
    assert (sa.nc, sa.kc) == (sb.nc, sb.kc), "both operands are cut by chunking(k)"
    nc = sa.nc
    pad_a, pad_b = len(batch) - (len(sa.shape) - 2), len(batch) - (len(sb.shape) - 2)

    pairs = significant_pairs(len(sa.slices), len(sb.slices))
    size = m * n * int(np.prod(batch, dtype=np.int64))
    if size >= LOOP_MIN and (nc > 1 or not batch):  # in blocks of rows, chunk by chunk: each kept in cache
        rows = m if batch else max(1, min(m, BLOCK // n))  # a batch of products: its rows together
        prod = ws.get(xp, "prod", (*batch, rows, n))
        acc = ws.get(xp, "acc", (*batch, rows, n))
        one = nc == 1 and len(pairs) == 1  # one product: scaled back and rounded into out in one pass
        for r0 in range(0, m, rows):
            r1 = min(m, r0 + rows)
            a_rows, p_rows, o_rows = acc[..., :r1 - r0, :], prod[..., :r1 - r0, :], out[..., r0:r1, :]
            for c in range(nc):  # in a fixed order: the chunks, and in each the pairs
                for p, (i, j) in enumerate(pairs):
                    (qa, scale_a), (qb, scale_b) = _scaled(sa, i), _scaled(sb, j)
                    first = c == 0 and p == 0
                    dst = a_rows if first else p_rows
                    rows_a: Array = _at(qa, c, pad_a)
                    xp.matmul(rows_a[..., r0:r1, :], _at(qb, c, pad_b), out=dst)  # exact (the module's docstring)
                    _unscale(xp, dst, _rows(_at(scale_a, c, pad_a), r0, r1), _at(scale_b, c, pad_b),
                             o_rows if one else None)  # powers of two: exact
                    if not first:
                        a_rows += p_rows
            if not one:
                o_rows[...] = a_rows  # rounded once
        return out

    def lift(x: Array, pad: int) -> Array:  # (nc, batch..., r, c) with the missing batch axes as 1
        return x if x is None else x.reshape(x.shape[0], *((1,) * pad), *x.shape[1:])

    prod = ws.get(xp, "prod", (nc, *batch, m, n))
    acc = ws.get(xp, "acc", (nc, *batch, m, n))
    for p, (i, j) in enumerate(pairs):  # in a fixed order
        (qa, scale_a), (qb, scale_b) = _scaled(sa, i), _scaled(sb, j)
        dst = acc if p == 0 else prod
        xp.matmul(lift(qa, pad_a), lift(qb, pad_b), out=dst)  # exact (see the module's docstring)
        if p == 0 and len(pairs) == 1 and nc == 1:  # one product, one chunk: scaled back and rounded in one pass
            _unscale(xp, dst[0], lift(scale_a, pad_a), lift(scale_b, pad_b), out)
            return out
        _unscale(xp, dst, lift(scale_a, pad_a), lift(scale_b, pad_b))  # powers of two: exact
        if p:
            acc += prod
    out[...] = fold_(acc, 0)[0]  # the chunks added in the fixed order, then rounded once
    return out


def _scaled(x: Split, i: int) -> tuple[Array, Array | None]:
    """Slice i and the scale a product divides by (None where the split applied it)."""
    q, scale = x.slices[i]
    return q, None if x.applied else scale


def _unscale(xp: Any, prod: Array, scale_a: Array | None, scale_b: Array | None, out: Array = None) -> None:
    """prod / scale_a / scale_b into ``out`` (``prod`` itself by default), a scale of None being applied
    already (a prescaled split); scales with a chunk axis of 1 lose it where ``prod`` has none."""
    scales = [x if x is None or x.ndim <= prod.ndim else x[0] for x in (scale_a, scale_b)]
    scales = [x for x in scales if x is not None]
    if not scales:
        if out is not None:
            out[...] = prod
        return
    for k, x in enumerate(scales):  # in float64 until the last, which rounds into out
        xp.divide(prod, x, out=out if out is not None and k == len(scales) - 1 else prod)


def _at(x: Array | None, c: int, pad: int) -> Array | None:
    """Chunk c of a split's (nc, batch..., r, c) array (or its only one, where the chunk axis is 1, as a
    scale shared by every chunk), with the missing batch axes as 1."""
    if x is None:
        return x
    x = x[c] if x.shape[0] > 1 else x[0]
    return x.reshape(*((1,) * pad), *x.shape)


def _rows(scale: Array | None, r0: int, r1: int) -> Array | None:
    """Rows r0 to r1 of a left operand's scale (..., m, 1); a scale shared by every row (..., 1, 1) as it is."""
    return scale if scale is None or scale.shape[-2] == 1 else scale[..., r0:r1, :]


def significant_pairs(left: int, right: int | None = None) -> list[tuple[int, int]]:
    """The slice products kept, (i, j) with i + j < max(left, right): the others lie below the last slice's
    bits (an operand of fewer slices holds all of its bits in them)."""
    right = left if right is None else right
    return [(i, j) for i in range(left) for j in range(right) if i + j < max(left, right)]
