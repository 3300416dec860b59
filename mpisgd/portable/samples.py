"""A convolution's (padded) input as integers with one power of two per sample, so that the im2col
columns of its products are integers already (mpisgd.portable.gemm's exact slice products;
mpisgd.kernels' ``samples``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.portable.gemm import GAMMA, SLICES, TINY_SUM32, Split, Workspace, chunking, split
from mpisgd.portable.passes import passes_for
from mpisgd.portable.reduce import fold_

Array = Any
SAMPLE_BITS = 23.5  # a float32 sample takes a second slice where its first keeps fewer bits of its largest (Samples)


class Samples:
    """A batch-last array (..., N), a convolution's (padded) input, as integer slices with one power of two
    per sample: the im2col of the integers is the integer columns of the convolution's products, so the
    columns (25 to 150 times the input) need no splitting of their own. Made by :meth:`prepare`, for the
    product that follows at once: its arrays are scratch in ``ws``, which the model's convolutions share
    (one set per shape, as the portable kernels give it), valid until the next prepare of that shape.

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

    def __init__(self, ws: Workspace | None = None) -> None:
        self.ws = ws if ws is not None else Workspace()
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
        passes = passes_for(xp)
        self.slices, self.steps = [(q, s)], [1.0]  # x s: exact, a power of two (inf or NaN: not finite anyway)
        two = self.dtype == np.float64 or GAMMA - np.log2(root) < SAMPLE_BITS  # fixed by k alone
        if two and not by_window:  # the per-sample bound costs bits: the second slice restores them
            rest = self.ws.get(xp, "rest", x.shape)
            passes.integers(xp, x, s, q, rest)  # rest = x s - q, |rest| <= 1/2: exact
            _, e2 = np.frexp(0.5 * root * (1.0 + 2.0**-40))
            s2 = float(2.0 ** (GAMMA - int(e2)))
            q1 = self.ws.get(xp, "q1", x.shape)
            passes.integers(xp, rest, s2, q1)
            self.slices.append((q1, s * s2))
            self.steps.append(s2)
        else:
            passes.integers(xp, x, s, q)
        return self

    def _window_exponents(self, x: Array, window: tuple[int, int, int, int], by_largest: Array) -> Array:
        """Per sample, e with 2^e >= the largest norm of its windows (over C x kh x kw, ``stride`` apart,
        Ho x Wo of them): float32 squares of x summed over the channels (the fixed tree), then along W and
        along H (kh - 1 adds each, in order). Each square and add rounds by at most 2^-24 on non-negative
        terms, at most ceil(log2 C) + 2 kh - 1 of them, covered as in :func:`norm_scales` by 2^-18 (asserted:
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
