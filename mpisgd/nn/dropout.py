"""Dropout whose mask is a function of what it is for: (seed, step, global sample, module, element).

A process's random stream depends on how the samples were dealt to ranks, so a stream-drawn mask
changes with k and on resume. Here each element's keep/drop bit comes from a counter-based hash
(SplitMix64's finaliser) of the model's seed, the optimizer step, the sample's index in the data
set, the module's position in the model and the element's position in the sample: the same sample at
the same step gets the same mask at any k, after a resume, and on NumPy or CuPy (integer arithmetic
only). Each 64-bit hash gives four 16-bit uniforms, so the drop probability is resolved in steps of
1/65536.
"""

from __future__ import annotations

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.nn.module import Array, Module

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: Array) -> Array:
    """SplitMix64's finaliser, in place on a uint64 array (wrapping arithmetic)."""
    xp = xp_of(z)
    z ^= z >> np.uint64(30)
    xp.multiply(z, _M1, out=z)
    z ^= z >> np.uint64(27)
    xp.multiply(z, _M2, out=z)
    z ^= z >> np.uint64(31)
    return z


def keyed_uniform16(xp: object, seed: int, step: int, stream: int, sample_ids: Array, per_sample: int) -> Array:
    """(len(sample_ids), per_sample) uint16 uniforms, each a function of (seed, step, stream, sample id,
    position) only."""
    base = np.uint64((seed * 0x632BE59BD9B4E019 + step * 0xD1342543DE82EF95 + stream * 0xA0761D6478BD642F)
                     & 0xFFFF_FFFF_FFFF_FFFF)
    ids = xp.asarray(sample_ids).astype(np.uint64)  # type: ignore[attr-defined]
    with np.errstate(over="ignore"):
        keys = _mix(ids * _GOLDEN + base)  # one key per sample
        words = -(-per_sample // 4)
        z = keys[:, None] + (xp.arange(1, words + 1, dtype=np.uint64) * _GOLDEN)[None, :]  # type: ignore[attr-defined]
        z = _mix(z)
    return z.view(np.uint16).reshape(len(ids), 4 * words)[:, :per_sample]


class Dropout(Module):
    """Zeroes each element with probability ``p`` in train mode and scales the rest by 1/(1 - p);
    the identity in eval mode. The mask is keyed by (seed, step, global sample index, this module,
    element), so it is the same at any number of ranks (mpisgd.nn.module.Context's ``sample_ids``;
    where they are not given, the micro-batch's own positions are used)."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = float(p)
        self._threshold = int(round(self.p * 65536))
        self._keep: Array = None

    def forward(self, x: Array) -> Array:
        if not self.training or self._threshold == 0:
            self._keep = None
            return x
        xp = xp_of(x)
        n = x.shape[0]
        ids = self.ctx.sample_ids if self.ctx.sample_ids is not None else np.arange(n, dtype=np.int64)
        if len(ids) != n:
            raise ValueError(f"Dropout: {len(ids)} sample ids for a batch of {n}")
        per_sample = int(np.prod(x.shape[1:], dtype=np.int64))
        bits = keyed_uniform16(xp, self.ctx.seed, self.ctx.step, self.index, ids, per_sample)
        keep = self._buf("keep", x.shape, x, dtype=np.bool_)
        xp.greater_equal(bits.reshape(x.shape), self._threshold, out=keep)
        self._keep = keep
        y = self._buf("y", x.shape, x)
        xp.multiply(x, keep, out=y)
        y *= x.dtype.type(1.0 / (1.0 - self.p))
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        if self._keep is None:
            return dy
        xp = xp_of(dy)
        xp.multiply(dy, self._keep, out=dy)
        dy *= dy.dtype.type(1.0 / (1.0 - self.p))
        return dy

    def extra_repr(self) -> str:
        return f"p={self.p:g}"
