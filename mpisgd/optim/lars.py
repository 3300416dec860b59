"""LARS: SGD with a layer-wise trust ratio (You, Gitman & Ginsburg 2017, "Large Batch Training of
Convolutional Networks"), on the same flat buffers as mpisgd.optim.base.SGD.

For each parameter tensor with weights w and averaged gradient g (wd = weight decay, c = trust_coef):

    ratio = c * ||w|| / (||g|| + wd * ||w||)     1 where ||w|| = 0 or ||g|| = 0, and for 1-D tensors
    d     = ratio * (g + wd * w)

then SGD's update with d: v = mu*v + d; w -= eta*v (or Nesterov, or the momentum-corrected form),
exactly as :class:`~mpisgd.optim.base.SGD` does it with no decay of its own. The ratio makes each layer's
step about c * eta * ||w|| long whatever the size of its gradient, which is what lets the global
rate eta grow with the batch where plain SGD diverges (docs/large_batch.md).

Biases and other 1-D tensors keep ratio 1 (their norms say little about a sensible step; excluding
them is the usual practice) but still take weight decay, as SGD applies it to every parameter. A
zero norm (a layer initialised to zero, or a gradient that vanished) falls back to ratio 1 instead of
stalling the layer or dividing by zero.

The squared norms come from a :class:`~mpisgd.optim.base.TensorNorms`: in the replicated step this rank's
whole tensors; in the sharded step, where a rank holds only its chunks of the averaged gradient, one
that adds every rank's pieces (mpisgd.parallel.sharded), so that every rank applies the same ratios.
"""

from __future__ import annotations

import math

import numpy as np

from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.base import Shards
from mpisgd.optim.norms import Norms, TensorNorms
from mpisgd.optim.sgd import SGD


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
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight decay must be finite and >= 0, got {weight_decay}")
        if not (math.isfinite(trust_coef) and trust_coef > 0):
            raise ValueError(f"trust coefficient must be finite and > 0, got {trust_coef}")
        super().__init__(flat, momentum, nesterov, 0.0, momentum_correction, level1)
        self.lars_weight_decay = weight_decay
        self.trust_coef = trust_coef
        # the adapted tensors: their indices in flat.shapes and element ranges [a, b), in model order
        self.adapted = [i for i, shape in enumerate(flat.shapes) if len(shape) > 1]
        self.layers = [(flat.offsets[i], flat.offsets[i + 1]) for i in self.adapted]

    def step(self, lr: float) -> None:
        """Update every parameter from the gradient buffer (each norm over its whole tensor)."""
        self.step_shards(lr, [(0, self.flat.size, self.flat.grads)])

    def step_shards(self, lr: float, shards: Shards, norms: Norms | None = None) -> None:
        """Update only the ranges ``[lo, hi)`` of ``shards`` (as SGD.step_shards). ``norms`` gives the
        whole tensors' squared norms; without it they come from ``shards`` alone, which is right only
        when the shards hold whole tensors."""
        norms = norms or TensorNorms(self.flat.offsets, [(lo, hi) for lo, hi, _ in shards])
        ratios = self.trust_ratios(self.sq_norms(shards, norms))
        w, wd, b = self.flat.params, self.lars_weight_decay, self.blas
        for lo, hi, g in shards:
            if wd and b is not None:  # d = g + wd*w on all of the shard, biases included
                b.axpy(wd, w[lo:hi], g)
            elif wd:
                tmp = self._tmp[self.layout.where(lo, hi)]
                self.flat.xp.multiply(w[lo:hi], wd, out=tmp)
                g += tmp
            for (x, y), ratio in zip(self._pieces(lo, hi), ratios):
                if x < y and ratio != 1.0:
                    g[x - lo:y - lo] *= ratio
        super().step_shards(lr, shards)  # momentum and the step on d, with no decay of SGD's own

    def sq_norms(self, shards: Shards, norms: Norms) -> np.ndarray:
        """(2, adapted tensors) float64: rows ||w||^2 and ||g||^2 of each adapted tensor (``g`` as given:
        before weight decay), over every piece ``norms`` adds up."""
        w = self.flat.params
        both = norms.squared([w[lo:hi] for lo, hi, _ in shards], [g for _, _, g in shards])
        return both[:, self.adapted]

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
