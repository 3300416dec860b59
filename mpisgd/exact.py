"""Exact, order-free gradient sums: fixed-point integers instead of floats.

A float sum depends on the order of its terms, so the averaged gradient's last bits change with the
number of ranks, the all-reduce algorithm and the bucket layout, and over hundreds of steps so does
the model. Integer addition is associative. So each micro-batch's gradient is converted, tensor by
tensor, to int64 at a scale 2**s that every rank shares; the integers are added (over this rank's
micro-batches, then over the ranks by any all-reduce); the sum is converted back once. Every k, every
algorithm, every bucket layout and every order of the additions gives the same integers, hence the
same floats.

The scale of tensor t is s_t = P - H - E_t with

- P = 62 - ceil(log2 M): M terms (micro-batches, over all ranks) of magnitude < 2**P sum below 2**62;
- E_t: 2**E_t bounds every element of tensor t's gradient in any micro-batch of the previous step,
  the same on every rank (a MAX over the ranks); a maximum, so exact on every machine;
- H = ``HEADROOM_BITS``: the gradient may grow that many binades from one step to the next.

A micro-batch whose largest element exceeds 2**(E_t + H) would overflow: the step is then computed again
with the exponents of the step itself (:class:`FixedPoint` reports it; mpisgd.parallel.fixed_point redoes the
step), as is
the first step, which has no previous one. Conversion truncates g * 2**s toward zero: each element
keeps P - H bits below the bound (50 with M = 64), more than a float32 sum keeps; only what lies more
than that below the tensor's largest element is lost.

Nothing here communicates: the caller agrees the exponents and sums the integers (DataParallel's driver,
mpisgd.parallel.fixed_point). Whole-tensor norms that do not depend on k are mpisgd.optim.norms.BlockNorms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpisgd.backend import to_numpy, xp_of

HEADROOM_BITS = 6
NO_EXPONENT = -(1 << 40)  # a tensor whose gradient was zero in every micro-batch: any scale is exact


def exponent_of(norm: float) -> int:
    """The smallest E with 2**E > norm (norm >= 0, finite); NO_EXPONENT for 0."""
    if norm <= 0:
        return NO_EXPONENT
    return math.frexp(norm)[1]  # norm = f * 2**E with 0.5 <= f < 1


class FixedPoint:
    """The codec for one flat buffer of tensors (``offsets``, as FlatBuffer's) summed from ``terms``
    micro-batch gradients per step."""

    def __init__(self, offsets: Sequence[int], terms: int, headroom_bits: int = HEADROOM_BITS) -> None:
        self.offsets = list(offsets)
        self.n_tensors = len(self.offsets) - 1
        self.headroom_bits = headroom_bits
        self.set_terms(terms)
        self.exponents: np.ndarray | None = None  # E_t, agreed; None before the first step
        self.needed = np.full(self.n_tensors, NO_EXPONENT, dtype=np.int64)  # this step's own, on this rank
        self.overflow = False  # some micro-batch on this rank exceeded the bound
        self.bad = np.zeros(self.n_tensors, dtype=bool)  # tensors that held NaN or Inf in some micro-batch
        self.sq_sum = 0.0  # this step's sum over micro-batches of the squared norm (noise-scale statistics)

    def set_terms(self, terms: int) -> None:
        """How many micro-batch gradients (over all ranks) each step adds up: it sets P."""
        if terms < 1:
            raise ValueError(f"terms must be >= 1, got {terms}")
        self.terms = terms
        self.precision = 62 - math.ceil(math.log2(terms)) - self.headroom_bits  # P - H

    def start_step(self) -> None:
        self.needed[:] = NO_EXPONENT
        self.overflow = False
        self.bad[:] = False
        self.sq_sum = 0.0

    @property
    def nonfinite(self) -> bool:
        """Some micro-batch on this rank held NaN or Inf."""
        return bool(self.bad.any())

    def set_exponents(self, exponents: Sequence[int] | np.ndarray) -> None:
        """The exponents every rank agreed (the MAX over the ranks of :attr:`needed`)."""
        self.exponents = np.asarray(exponents, dtype=np.int64).copy()

    def scale(self, t: int) -> float:
        assert self.exponents is not None
        e = int(self.exponents[t])
        return 1.0 if e == NO_EXPONENT else math.ldexp(1.0, self.precision - e)

    def tensors_in(self, lo: int, hi: int) -> range:
        """The tensors whose elements make up [lo, hi) (buckets hold whole tensors)."""
        first = self.offsets.index(lo)
        last = self.offsets.index(hi)
        return range(first, last)

    def measure(self, g: Any, lo: int, hi: int) -> None:
        """Note the magnitudes of one micro-batch's gradient ``g`` (the flat range [lo, hi)): the exponents it
        needs, and whether it is finite or would overflow at the agreed exponents. The exponent bounds each
        tensor's largest element: a maximum, exact and independent of any kernel's order, so the scales
        (hence the integers) are the same on every machine. The squared norm (the noise scale's statistics
        only) is a BLAS dot."""
        xp = xp_of(g)
        tensors = self.tensors_in(lo, hi)
        pieces = [g[self.offsets[t] - lo:self.offsets[t + 1] - lo] for t in tensors]
        if not pieces:
            return
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            stats = to_numpy(xp.stack([xp.stack([p.max(), -p.min(), p.dot(p)]) if p.size else xp.zeros(3, g.dtype)
                                       for p in pieces])).astype(np.float64)
        for t, (high, low, sq) in zip(tensors, stats):
            if not (math.isfinite(high) and math.isfinite(low)):  # NaN or Inf somewhere in the tensor
                self.bad[t] = True
                continue
            e = exponent_of(max(high, low))
            self.needed[t] = max(int(self.needed[t]), e)
            if self.exponents is not None and e > int(self.exponents[t]) + self.headroom_bits:
                self.overflow = True
            self.sq_sum += sq if math.isfinite(sq) else math.inf

    def encode_(self, g: Any, out: Any, lo: int, hi: int, accumulate: bool, scratch: Any = None) -> None:
        """out (int64, the flat range [lo, hi)) = (or +=) trunc(g * 2**s) per tensor. ``scratch``: an int64
        array of at least hi - lo elements for the accumulating form."""
        xp = xp_of(g)
        for t in self.tensors_in(lo, hi):
            a, b = self.offsets[t] - lo, self.offsets[t + 1] - lo
            x, factor = g[a:b], self.scale(t)  # a power of two: x * factor is exact
            if factor <= float(np.finfo(g.dtype).max):
                factor = g.dtype.type(factor)
            else:  # beyond the dtype's range (a vanishing gradient): scale in float64
                x = x.astype(np.float64)
            target = out[a:b] if not accumulate else scratch[a:b]
            xp.multiply(x, factor, out=target, casting="unsafe")  # float -> int64 truncates toward zero
            if accumulate:
                out[a:b] += target

    def decode(self, q: Any, out: Any, lo: int, hi: int) -> None:
        """out (float, elements [lo, hi) of the flat buffer) = q * 2**-s per tensor (q: int64, same range).
        Ranges may cut tensors (a rank's chunk of the sharded step)."""
        xp = xp_of(q)
        for t in range(self.n_tensors):
            x, y = max(self.offsets[t], lo), min(self.offsets[t + 1], hi)
            if x < y:
                xp.multiply(q[x - lo:y - lo], 1.0 / self.scale(t), out=out[x - lo:y - lo], casting="unsafe")
