"""LARS: SGD with a layer-wise trust ratio (You, Gitman & Ginsburg 2017, "Large Batch Training of
Convolutional Networks"), on the same flat buffers as mpisgd.optim.SGD.

For each parameter tensor with weights w and averaged gradient g (wd = weight decay, c = trust_coef):

    ratio = c * ||w|| / (||g|| + wd * ||w||)     1 where ||w|| = 0 or ||g|| = 0, and for 1-D tensors
    d     = ratio * (g + wd * w)

then SGD's update with d: v = mu*v + d; w -= eta*v (or Nesterov, or the momentum-corrected form),
exactly as :class:`~mpisgd.optim.SGD` does it with no decay of its own. The ratio makes each layer's
step about c * eta * ||w|| long whatever the size of its gradient, which is what lets the global
rate eta grow with the batch where plain SGD diverges (docs/large_batch.md).

Biases and other 1-D tensors keep ratio 1 (their norms say little about a sensible step; excluding
them is the usual practice) but still take weight decay, as SGD applies it to every parameter. A
zero norm (a layer initialised to zero, or a gradient that vanished) falls back to ratio 1 instead of
stalling the layer or dividing by zero.

The squared norms are sums over pieces of each tensor, so that the sharded step, where a rank holds
only its chunks of the averaged gradient, can add up every rank's pieces: ``partial_sq_norms`` gives
this rank's part and ``step_shards`` takes the whole-layer sums (mpisgd.parallel gathers them). One
piece per tensor, as in :meth:`LARS.step`, is the replicated step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpisgd.backend import to_numpy
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim import SGD


class LARS(SGD):
    """SGD whose step for every weight tensor (2-D and up) is scaled by the layer's trust ratio.

    The interface is SGD's (``step``, ``step_shards``, ``state``, ``load_state``, ``velocity``,
    ``prev_lr``): the optimizer state is the same momentum buffer, so checkpoints do not change.
    SGD's own weight decay is left at 0: LARS adds ``wd * w`` itself, inside the ratio. The default
    ``trust_coef`` is the CLI's (mpisgd.config, which says why it is not the paper's 0.001).
    """

    def __init__(self, flat: FlatBuffer, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, momentum_correction: bool = False, trust_coef: float = 0.1,
                 level1: bool = True) -> None:
        if weight_decay < 0:
            raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
        if not (math.isfinite(trust_coef) and trust_coef > 0):
            raise ValueError(f"trust coefficient must be finite and > 0, got {trust_coef}")
        super().__init__(flat, momentum, nesterov, 0.0, momentum_correction, level1)
        self.lars_weight_decay = weight_decay
        self.trust_coef = trust_coef
        # the adapted tensors: element ranges [a, b) of the flat buffer, in model order
        self.layers = [(flat.offsets[i], flat.offsets[i + 1]) for i, s in enumerate(flat.shapes) if len(s) > 1]

    def step(self, lr: float) -> None:
        """Update every parameter from the gradient buffer (each norm over its whole tensor)."""
        self.step_shards(lr, [(0, self.flat.size, self.flat.grads)])

    def step_shards(self, lr: float, shards: Sequence[tuple[int, int, Any]],
                    sq_norms: np.ndarray | None = None) -> None:
        """Update only the ranges ``[lo, hi)`` of ``shards`` (as SGD.step_shards). ``sq_norms`` are the
        whole tensors' squared norms, ``partial_sq_norms`` summed over every piece of them; without it
        they are taken from ``shards``, which is right only when the shards hold whole tensors."""
        if sq_norms is None:
            sq_norms = self.partial_sq_norms(shards)
        ratios = self.trust_ratios(sq_norms)
        w, wd, b = self.flat.params, self.lars_weight_decay, self.blas
        for lo, hi, g in shards:
            if wd and b is not None:  # d = g + wd*w on all of the shard, biases included
                b.axpy(wd, w[lo:hi], g)
            elif wd:
                tmp = self._tmp[lo:hi]
                self.flat.xp.multiply(w[lo:hi], wd, out=tmp)
                g += tmp
            for (x, y), ratio in zip(self._pieces(lo, hi), ratios):
                if x < y and ratio != 1.0:
                    g[x - lo:y - lo] *= ratio
        super().step_shards(lr, shards)  # momentum and the step on d, with no decay of SGD's own

    def partial_sq_norms(self, shards: Sequence[tuple[int, int, Any]]) -> np.ndarray:
        """(2, layers) float64: rows ||w||^2 and ||g||^2 of each adapted tensor, summed over the parts
        of it inside ``shards`` (``g`` as given: before weight decay). Pieces are added in shard order."""
        xp, w = self.flat.xp, self.flat.params
        where, dots = [], []
        for lo, hi, g in shards:
            for layer, (x, y) in enumerate(self._pieces(lo, hi)):
                if x < y:
                    where.append(layer)
                    dots += [xp.dot(w[x:y], w[x:y]), xp.dot(g[x - lo:y - lo], g[x - lo:y - lo])]
        out = np.zeros((2, len(self.layers)))
        if dots:
            values = to_numpy(xp.stack(dots)).astype(np.float64)  # one transfer from a GPU, not one per tensor
            for i, layer in enumerate(where):
                out[0, layer] += values[2 * i]
                out[1, layer] += values[2 * i + 1]
        return out

    def trust_ratios(self, sq_norms: np.ndarray) -> list[float]:
        """c * ||w|| / (||g|| + wd * ||w||) per adapted tensor; 1 where either norm is 0."""
        out = []
        for ww, gg in zip(*sq_norms):
            wn, gn = math.sqrt(ww), math.sqrt(gg)
            out.append(self.trust_coef * wn / (gn + self.lars_weight_decay * wn) if wn > 0 and gn > 0 else 1.0)
        return out

    def _pieces(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Each adapted tensor's overlap [x, y) with [lo, hi) (x >= y: none)."""
        return [(max(a, lo), min(b, hi)) for a, b in self.layers]
