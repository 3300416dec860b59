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
IEEE additions, :func:`_on_grid`): every term of a dot product of two such vectors is the integer
product q_a q_b times the one power of two 1 / (s_a s_b), so every partial sum is an integer below 2^53
times that power of two: exact too, as long as that power of two stays within float64's range, which
float32 operands guarantee (s_a, s_b between about 2^-113 and 2^175: the grid 1 / (s_a s_b) is far
above float64's smallest subnormal and 2^53 / (s_a s_b) below its largest value). The product then
needs no scaling back. Float64 operands, whose scales may reach 2^1023, are scaled back as in step 3.

The norms that choose the scales come from squares added in the fixed order (float32 operands' in
float32, float64 ones' in float64), with a margin that covers that sum's rounding (:func:`_scales`):
the scales, hence the integers, are a function of the inputs alone. A convolution's columns are not
split: its input is made integer once, with one power of two per sample (:class:`Samples`).

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
from mpisgd.portable.reduce import fold_, fold_into

Array = Any
GAMMA = 26  # bits of a scaled row's (column's) norm: two of them and the rounding stay below 2^53
CHUNK = 256  # most terms per chunk of the inner dimension: shorter chunks scale closer to their values
E_BIG = 1024 + 13  # the exponent assumed where a row holds inf or NaN (its products are not finite anyway)
SLICES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}
LOOP_MIN = 65536  # outputs of at least this many elements: in blocks of rows, chunk by chunk (in cache)
BLOCK = 262144  # elements of output rows made at once (2 MiB of float64: in cache when ranks share the memory bus)
MAGIC = 1.5 * 2.0**52  # x + MAGIC/s - MAGIC/s rounds x to a multiple of 1/s (_on_grid)
SAMPLE_BITS = 23.5  # a float32 sample takes a second slice where its first keeps fewer bits of its largest (Samples)
SPREAD = 4.0  # the widest ratio of norms within a tile of a prepared weight (mpisgd.portable.gemm.Weight)
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


def _scales(xp: Any, sq: Array, kc: int, largest: Any, gamma: int = GAMMA) -> Array:
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


def _on_grid(xp: Any, x: Array, s: Array, out: Array) -> None:
    """out = rint(x s) / s (float64) for powers of two s with |x s| < 2^51: x + C - C with C = 1.5 2^52 / s.
    x + C lies in [2^52/s, 2^53/s), where float64's spacing is 1/s, so the addition rounds x to the nearest
    multiple of 1/s, ties to even (C s = 1.5 2^52 is even: as rint); the subtraction is exact. Two IEEE
    operations, each its own ufunc (nothing fuses them), so the same bits everywhere. A float32 x is first
    copied into out (exact), a scale per block of columns repeated along the row: NumPy's loops then run
    contiguous, without a cast, which is faster."""
    with np.errstate(over="ignore", invalid="ignore"):  # a row holding inf or NaN (E_BIG): not finite anyway
        c = MAGIC / s  # exact: a power of two times 1.5
        if c.shape[-1] == 1 < x.shape[-1] and 8 * c.size * x.shape[-1] <= x.size:  # a few scales: as rows
            c = xp.repeat(c, x.shape[-1], axis=-1)
        if np.dtype(x.dtype) == np.float32:
            xp.copyto(out, x)
            xp.add(out, c, out=out)
        else:
            xp.add(x, c, out=out, dtype=np.float64)
        xp.subtract(out, c, out=out)


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
    other operand's integers are bounded otherwise, :class:`Samples`); ``slices``: how many (by default
    one for float32, two for float64; one for a float64 operand that holds float32's precision). A
    float32 operand's squares are summed in float32 (:func:`_scales` covers their rounding), a float64
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
    square = dtype  # float32: half the bytes of float64 squares, the rounding covered by _scales' margin
    sq = ws.get(xp, f"{tag}:sq", work, square)
    full = (nc - 1) * kc  # chunks 0..nc-2 hold kc terms each, the last the rest (padded with zeros)

    def chunks(a: Array) -> list[tuple[Array, Array]]:
        """(part of x, where it goes in a (nc, ...) buffer): the full chunks as one view, then the last."""
        if nc == 1 and k == kc:  # one chunk, no padding
            return [(x, a[0])]
        if axis == -1:
            a[nc - 1, ..., k - full:] = 0  # the last chunk's padding: zero (an earlier k of this shape left it)
            body = xp.moveaxis(x[..., :full].reshape(*x.shape[:-1], nc - 1, kc), -2, 0)
            return [(body, a[:nc - 1]), (x[..., full:], a[nc - 1, ..., :k - full])]
        a[nc - 1, ..., k - full:, :] = 0
        body = xp.moveaxis(x[..., :full, :].reshape(*x.shape[:-2], nc - 1, kc, x.shape[-1]), -3, 0)
        return [(body, a[:nc - 1]), (x[..., full:, :], a[nc - 1, ..., :k - full, :])]

    def per_chunk(s: Array) -> list[Array]:
        """The scales for the parts :func:`chunks` gives."""
        return [s[0]] if nc == 1 and k == kc else [s[:nc - 1], s[nc - 1]]

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

        s = _scales(xp, fold_(sq, axis), kc, largest, gamma)  # per (chunk, row or column), the inner axis of length 1
        q = ws.get(xp, f"{tag}:q{i}", work)
        if dtype == np.float32:  # the integers with their scale applied: rint(x s) / s (see _on_grid)
            for (part, dst), scale in zip(chunks(q), per_chunk(s), strict=True):
                _on_grid(xp, part, scale, dst)
            out.append((q, s))
            break
        if i == 0:
            for (part, dst), scale in zip(chunks(q), per_chunk(s), strict=True):
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
    return Split(side, tuple(x.shape), dtype, nc, kc, out, dtype == np.float32)


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
        sq = self.ws.get(xp, "sq", (kcr, cols), np.float32)  # squares in float32 (_scales covers their rounding)
        by_col = self.ws.get(xp, "by_col", (kcr - kcr // 2, cols), np.float32)
        by_row = self.ws.get(xp, "by_row", (kcr, ncc, kcc - kcc // 2), np.float32)
        col = self.ws.get(xp, "col", (ncr, cols), np.float32)  # each column within its k chunk
        row = self.ws.get(xp, "row", (rows, ncc), np.float32)  # each row within its n chunk
        for r in range(ncr):
            r0, r1 = r * kcr, min(k, (r + 1) * kcr)
            if r1 - r0 < kcr:
                sq[r1 - r0:] = 0  # the last chunk's padding rows (the padding columns stay zero)
            with np.errstate(over="ignore", under="ignore"):  # what _scales handles
                xp.multiply(w[r0:r1], w[r0:r1], out=sq[:r1 - r0, :n])
                col[r] = fold_into(sq, 0, by_col)[0]
                row[r0:r0 + kcr] = fold_into(sq.reshape(kcr, ncc, kcc), 2, by_row)[:, :, 0]
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
        t = _scales(xp, tile, max(kcr, kcc),
                    lambda: largest().reshape(ncr, kcr, ncc, kcc).max(axis=(1, 3)).astype(np.float64))  # (ncr, ncc)
        for r in range(ncr):
            r0, r1 = r * kcr, min(k, (r + 1) * kcr)
            if n == cols:  # no padding columns: straight into q
                _on_grid(xp, w[r0:r1].reshape(r1 - r0, ncc, kcc), t[r, None, :, None],
                         q[r0:r1].reshape(r1 - r0, ncc, kcc))
            else:
                q[r0:r1, :n] = w[r0:r1]
                by_chunk = q[r0:r1].reshape(r1 - r0, ncc, kcc)
                _on_grid(xp, by_chunk, t[r, None, :, None], by_chunk)
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
        t_col = _scales(xp, col, kcr, lambda: largest().reshape(ncr, kcr, cols).max(axis=1, keepdims=True)
                        [:, :, :n].astype(np.float64))  # (ncr, 1, n)
        t_row = _scales(xp, row[:, :, None], kcc, lambda: largest()[:k].reshape(k, ncc, kcc).max(axis=2, keepdims=True)
                        .astype(np.float64))  # (k, ncc, 1)
        q_col = self.ws.get(xp, "q_col", (rows, n))  # made zeroed: the padding rows stay 0
        q_row = self.ws.get(xp, "q_row", (k, cols))  # and the padding columns
        step = max(1, BLOCK // 4 // cols)  # rows per block: each block's passes stay in a core's own cache
        r0 = 0
        while r0 < k:
            r1 = min(k, r0 + step, (r0 // kcr + 1) * kcr)  # within one chunk of rows: one scale per column
            _on_grid(xp, w[r0:r1], t_col[r0 // kcr], q_col[r0:r1])
            by_chunk = q_row[r0:r1].reshape(r1 - r0, ncc, kcc)
            if n == cols:
                _on_grid(xp, w[r0:r1].reshape(r1 - r0, ncc, kcc), t_row[r0:r1], by_chunk)
            else:
                q_row[r0:r1, :n] = w[r0:r1]
                _on_grid(xp, by_chunk, t_row[r0:r1], by_chunk)
            r0 = r1
        self.right = Split("right", (k, n), np.dtype(np.float32), ncr, kcr,
                           [(q_col.reshape(ncr, kcr, n), t_col)], applied=True)
        self.T = Split("right", (n, k), np.dtype(np.float32), ncc, kcc,
                       [(q_row.reshape(k, ncc, kcc).transpose(1, 2, 0), t_row.transpose(1, 2, 0))], applied=True)
        return self


class Samples:
    """A batch-last array (..., N), a convolution's (padded) input, as integer slices with one power of two
    per sample: the im2col of the integers is the integer columns of the convolution's products, so the
    columns (25 to 150 times the input) need no splitting of their own. Made by :meth:`prepare`; the
    object owns its arrays (a layer keeps it from forward to backward).

    Exactness. The columns enter W @ cols with the inner dimension k = c_in*kh*kw cut into chunks of kc
    (:func:`chunking`), each column a window of one sample n. The scale is s_n = 2^(GAMMA - e_n) with 2^e_n
    >= sqrt(kc) max|x_n| (the sample's largest magnitude, exact), so |x s_n| < 2^GAMMA/sqrt(kc), every
    integer |q| <= ``bound`` = 2^GAMMA/sqrt(kc) + 1/2, and every chunk of a column has norm at most
    2^GAMMA + sqrt(kc)/2: what :func:`split` gives, so the forward product is exact as any other. In
    dW = cols @ dy^T the inner dimension runs over positions and samples, where s_n varies: it moves onto
    dy (dy / s_n, exact in float64: a power of two, float32 values or float64 ones far from its range's
    ends), the columns' chunks of kc' terms have norm at most sqrt(kc') bound, and dy's slices take a
    gamma' with sqrt(kc') bound (2^gamma' + sqrt(kc')/2) < 2^53 (:meth:`weight_grad`): exact too.

    The scale is a function of each sample alone (never of the batch). A sample may take a second
    slice: r = x s - q (exact, |r| <= 1/2) times s2 = 2^(GAMMA - e2), 2^e2 >= sqrt(kc)/2, under the same
    bound; the weight gradient's product stacks the slices as rows (:meth:`weight_grad`). Float64 samples
    always take two. Float32 ones take two where one keeps fewer than SAMPLE_BITS bits of the sample's
    largest element, GAMMA - log2(sqrt(kc)) < 23.5, kc > 36 (a function of k alone): one slice keeps 23.7
    bits for LeNet's first layer (kc 25), 22.4 for its second (150), 2 to 3 bits fewer than a split's 26
    relative to each column's norm; measured on a trained LeNet-5, the second convolution's weight
    gradient came out 1.6x less accurate than float32 BLAS's with one slice, and a "same" convolution's
    input gradient 4x (the first's weight gradient stayed more accurate than BLAS's). With the second
    slice a float32 element is kept whole (to 2^-50 of its sample's largest): the error is dy's rounding.

    For W @ cols alone (``window``, the forward product) one slice scaled by each sample's largest window
    norm (computed from the input: :meth:`_window_exponents`) keeps about a split's accuracy: columns are
    bounded by 2^GAMMA + sqrt(kc)/2 as :func:`split`'s, single integers only by 2^GAMMA (so no weight
    gradient from them). tests/test_portable.py checks every path against float32 BLAS."""

    def __init__(self) -> None:
        self.ws = Workspace()
        self.slices: list[tuple[Array, Array]] = []  # (q, x's shape, float64; its scale per sample, (N,))
        self.steps: list[float] = []  # each slice's scale over the first's: 1, s2
        self.dtype = np.dtype(np.float32)
        self.k, self.nc, self.kc, self.bound = 0, 1, 1, 0.0

    def prepare(self, x: Array, k: int, window: tuple[int, int, int, int] | None = None) -> Samples:
        """``x`` (C, H, W, N) for products whose inner dimension k = C kh kw takes its windows. With
        ``window`` = (kh, stride, Ho, Wo) (a float32 x, for W @ cols only): one slice, each sample's scale
        from the largest norm of its windows (:meth:`_window_exponents`), every column of norm at most
        2^GAMMA + sqrt(kc)/2 (but single integers up to 2^GAMMA: no ``bound`` for a weight gradient);
        without: the largest element's bound above, two slices."""
        xp = xp_of(x)
        self.dtype = np.dtype(x.dtype)
        if self.dtype not in SLICES:
            raise TypeError(f"portable matmul takes float32 or float64 operands, got {x.dtype}")
        n = x.shape[-1]
        self.k = k
        self.nc, self.kc = chunking(k)
        root = float(np.sqrt(self.kc))  # correctly rounded (IEEE): the same everywhere
        self.bound = 2.0**GAMMA / root + 0.5
        mx = self.ws.get(xp, "abs", x.shape, x.dtype)
        xp.abs(x, out=mx)
        big = mx.reshape(-1, n).max(axis=0).astype(np.float64)  # exact, in any order
        _, e = xp.frexp(big * (root * (1.0 + 2.0**-40)))  # sqrt(kc) max|x_n| (margin: the roundings) < 2^e
        by_window = window is not None and self.dtype == np.float32
        if by_window:
            assert window is not None
            e = self._window_exponents(x, window, e)
            self.bound = 2.0**GAMMA + 0.5  # what one integer may reach: not for weight_grad
        xp.maximum(e, GAMMA - 1023, out=e)  # a sample of zeros
        s = xp.ldexp(1.0, GAMMA - e)
        q = self.ws.get(xp, "q0", x.shape)
        with np.errstate(over="ignore", invalid="ignore"):  # inf or NaN in a sample: its products are not finite
            xp.multiply(x, s, out=q, dtype=np.float64)  # exact: a power of two
            self.slices, self.steps = [(q, s)], [1.0]
            two = self.dtype == np.float64 or GAMMA - np.log2(root) < SAMPLE_BITS  # fixed by k alone
            if two and not by_window:  # the per-sample bound costs bits: the second slice restores them
                rest = self.ws.get(xp, "rest", x.shape)
                rest[...] = q
                xp.rint(q, out=q)
                rest -= q  # |r| <= 1/2: exact
                _, e2 = np.frexp(0.5 * root * (1.0 + 2.0**-40))
                s2 = float(2.0 ** (GAMMA - int(e2)))
                q1 = self.ws.get(xp, "q1", x.shape)
                xp.multiply(rest, s2, out=q1)
                xp.rint(q1, out=q1)
                self.slices.append((q1, s * s2))
                self.steps.append(s2)
            else:
                xp.rint(q, out=q)
        return self

    def _window_exponents(self, x: Array, window: tuple[int, int, int, int], by_largest: Array) -> Array:
        """Per sample, e with 2^e >= the largest norm of its windows (over C x kh x kw, ``stride`` apart,
        Ho x Wo of them): float32 squares of x summed over the channels (the fixed tree), then along W and
        along H (kh - 1 adds each, in order). Each square and add rounds by at most 2^-24 on non-negative
        terms, at most ceil(log2 C) + 2 kh - 1 of them, covered as in :func:`_scales` by 2^-18 (asserted:
        fewer than 32), squares in the subnormal range by kc 2^-149. Where a sum overflowed (|x| from 2^63)
        or is tiny (flushed squares may weigh in), ``by_largest`` (sqrt(kc) max|x_n|) instead."""
        xp = xp_of(x)
        kh, stride, ho, wo = window
        c, hp, wp, n = x.shape
        assert int(np.ceil(np.log2(c))) + 2 * kh - 1 < 32, "the float32 margin covers fewer than 32 roundings"
        sq = self.ws.get(xp, "sq", x.shape, np.float32)
        with np.errstate(over="ignore", under="ignore"):
            xp.multiply(x, x, out=sq)
            plane = fold_(sq, 0)[0]  # (Hp, Wp, N): over the channels
            wr, hr = (wo - 1) * stride + 1, (ho - 1) * stride + 1  # the columns and rows where windows start
            along_w = self.ws.get(xp, "along_w", (hp, wr, n), np.float32)
            along_w[...] = plane[:, :wr]
            for j in range(1, kh):
                along_w += plane[:, j:j + wr]
            sums = self.ws.get(xp, "sums", (hr, wr, n), np.float32)
            sums[...] = along_w[:hr]
            for i in range(1, kh):
                sums += along_w[i:i + hr]
        largest = sums[::stride, ::stride].reshape(-1, n).max(axis=0)  # (N,): exact, in any order
        total = largest.astype(np.float64) * (1.0 + 2.0**-18) + self.k * 2.0**-149
        _, e = xp.frexp(xp.sqrt(total) * (1.0 + 2.0**-40))
        fallback = ~(largest < np.inf) | (largest < TINY_SUM32)
        return xp.where(fallback, by_largest, e)

    def padded_rows(self) -> int:
        """Rows of the column buffers for the forward product: k padded to whole chunks (the rest zero)."""
        return self.nc * self.kc

    def columns(self, cols: list[Array]) -> Split:
        """The right operand of W @ cols as one product: ``cols[i]`` the im2col of slice i, (padded_rows(),
        P, N) with the rows from k zero; the operand is (k, P*N), each column's scale its sample's."""
        xp = xp_of(cols[0])
        _, p, n = cols[0].shape
        slices = []
        for i, (c, (_, s)) in enumerate(zip(cols, self.slices, strict=True)):
            tiled = self.ws.get(xp, f"tiled{i}", (p, n))
            tiled[...] = s  # the scale of column (position, sample)
            slices.append((c.reshape(self.nc, self.kc, p * n), tiled.reshape(1, 1, p * n)))
        return Split("right", (self.k, p * n), self.dtype, self.nc, self.kc, slices)

    @staticmethod
    def padded_terms(m: int) -> int:
        """Columns of the buffers for :meth:`weight_grad` over m terms: m padded to whole chunks."""
        nc, kc = chunking(m)
        return nc * kc

    def weight_grad(self, cols: Array, dy: Array) -> tuple[Split, Split]:
        """The operands of the weight gradient's product, cols @ dy^T: ``cols`` the im2col of every slice
        stacked, (slices x k, padded_terms(m)), slice i in rows i k to (i + 1) k, the columns from m zero;
        ``dy`` the output gradient (c_out, ..., N) of the same m = positions x N terms. The slices are one
        operand (one product, each row scaled by its slice's step), so the product is (slices x k, c_out):
        :meth:`combine` adds the slices."""
        xp = xp_of(dy)
        c_out, n = dy.shape[0], dy.shape[-1]
        m = int(np.prod(dy.shape[1:]))
        nc, kc = chunking(m)
        scaled = self.ws.get(xp, "dy", (c_out, m))
        xp.divide(dy.reshape(c_out, -1, n), self.slices[0][1], out=scaled.reshape(c_out, -1, n))  # exact
        root = float(np.sqrt(kc))
        norm = root * self.bound * (1.0 + 2.0**-40)  # the columns' chunks' norms are at most this
        gamma = GAMMA
        while norm * (2.0**gamma + root / 2 * (1.0 + 2.0**-40)) >= 2.0**53:  # IEEE operations only
            gamma -= 1
        right = split(scaled.T, "right", self.ws, "dy", gamma, SLICES[self.dtype])
        right.dtype = self.dtype  # float64 holding dy's values: the product is in dy's dtype
        rows = len(self.slices) * self.k
        steps = self.ws.get(xp, "steps", (1, rows, 1))
        for i, step in enumerate(self.steps):
            steps[0, i * self.k:(i + 1) * self.k] = step
        left = Split("left", (rows, m), self.dtype, nc, kc, [(cols.reshape(rows, nc, kc).transpose(1, 0, 2), steps)])
        return left, right

    def combine(self, stacked: Array, out: Array) -> Array:
        """The weight gradient from :meth:`weight_grad`'s product (float64, (slices x k, c_out)): the slices'
        rows added in order (float64), rounded once into ``out`` (k, c_out)."""
        k = self.k
        for i in range(1, len(self.slices)):
            stacked[:k] += stacked[i * k:(i + 1) * k]
        out[...] = stacked[:k]
        return out


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
