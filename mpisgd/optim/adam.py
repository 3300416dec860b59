"""AdamW and LAMB, on the same flat buffers as mpisgd.optim.base.SGD.

AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"), as ``torch.optim.AdamW``
computes it; t counts the steps taken (this one included), g is the averaged gradient, wd the decay:

    w *= 1 - lr*wd                                  decoupled: the decay never enters the moments
                                                    (only the tensors ``decay_mask`` marks, if given)
    m  = b1*m + (1 - b1)*g
    v  = b2*v + (1 - b2)*g*g
    w -= lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps)

LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"):
Adam's direction with the decay inside it, scaled per weight tensor by a trust ratio (phi = identity):

    r     = m_hat / (sqrt(v_hat) + eps) + wd*w      m_hat = m/(1 - b1^t), v_hat = v/(1 - b2^t)
    ratio = ||w|| / ||r||                           1 for 1-D tensors (biases) and where a norm is 0
    w    -= lr * ratio * r

so each weight tensor steps lr*||w|| whatever the scale of its gradient, as LARS's steps about
c*lr*||w|| (mpisgd.optim.lars says why biases keep ratio 1 and still take the decay). The squared norms come
from the :class:`~mpisgd.optim.base.TensorNorms` the step is given: in the sharded step every rank's pieces.

State (the Optimizer protocol of mpisgd.optim.base): the moments ``exp_avg`` and ``exp_avg_sq`` (PyTorch's
names), parameter-sized, and the step count t (steps skipped for a non-finite gradient do not count).
One more parameter-sized buffer is scratch, so a step allocates nothing: ufuncs with ``out=``, the
same code on NumPy and CuPy, and LAMB's norms reach the host once per step, not once per tensor.
AdamW leaves the gradient buffer as it was; LAMB leaves there the step it took, lr*ratio*r.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.base import Shards, StateBuffers, StateLayout, load_buffers
from mpisgd.optim.norms import Norms, TensorNorms
from mpisgd.portable.scalar import LIBM, ScalarMath


class AdamW:
    """Adam with decoupled weight decay. ``step(lr)``, ``step_shards(lr, shards, norms)`` and the state
    (``state_buffers``, ``state``, ``load_state``) as every update rule of mpisgd (mpisgd.optim.base.Optimizer)."""

    def __init__(self, flat: FlatBuffer, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay_mask: Sequence[bool] | None = None,
                 scalar_math: ScalarMath = LIBM) -> None:
        """``decay_mask``: per parameter tensor (``flat.shapes`` order), whether weight decay shrinks it
        (None: every one; a transformer decays its matrices only, :func:`matrices`). ``scalar_math``: the
        powers beta^t of the bias corrections, the C library's or portable ones (mpisgd.portable.scalar:
        the reproducible mode's)."""
        if flat is None:
            raise ValueError(f"materialize() the model before building its optimizer: {type(self).__name__}"
                             "(model.flat) needs the parameters")
        b1, b2 = betas
        for name, beta in (("beta1", b1), ("beta2", b2)):
            if not 0 <= beta < 1:
                raise ValueError(f"{name} must be in [0, 1), got {beta}")
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be finite and > 0, got {eps}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight decay must be finite and >= 0, got {weight_decay}")
        if decay_mask is not None and len(decay_mask) != len(flat.shapes):
            raise ValueError(f"decay_mask has {len(decay_mask)} entries for {len(flat.shapes)} parameter tensors")
        self.flat = flat
        self.beta1, self.beta2, self.eps, self.weight_decay = float(b1), float(b2), float(eps), float(weight_decay)
        self.decayed = _runs(flat.offsets, decay_mask)  # [lo, hi) ranges weight decay shrinks
        # the moments m and v, and scratch so that the step allocates nothing: made when first used
        self.buffers = StateBuffers(flat, ["exp_avg", "exp_avg_sq"], ["tmp"])
        self.steps = 0  # t: the steps taken
        self.scalar_math = scalar_math

    @property
    def exp_avg(self) -> Any:
        return self.buffers["exp_avg"]

    @property
    def exp_avg_sq(self) -> Any:
        return self.buffers["exp_avg_sq"]

    @property
    def _tmp(self) -> Any:
        return self.buffers["tmp"]

    @property
    def layout(self) -> StateLayout:
        return self.buffers.layout

    def keep_state(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Keep both moments (and the scratch) only for these flat ranges, values kept (the Optimizer protocol)."""
        self.buffers.keep(ranges)

    def state_buffers(self) -> dict[str, Any]:
        return self.buffers.state()

    def state(self) -> dict[str, float]:
        return {"step": self.steps}

    def load_state(self, state: Mapping[str, float], buffers: Mapping[str, Any] | None = None) -> None:
        load_buffers(self, buffers)
        self.steps = int(state.get("step", 0))

    def buffer_nbytes(self) -> int:
        """The two moments and the scratch buffer."""
        return self.buffers.nbytes()

    def step(self, lr: float) -> None:
        """Update every parameter from the gradient buffer (the state must cover every parameter)."""
        self.step_shards(lr, [(0, self.flat.size, self.flat.grads)])

    def step_shards(self, lr: float, shards: Shards, norms: Norms | None = None) -> None:
        """Update only the ranges ``[lo, hi)`` of ``shards`` from their gradient pieces; element by element
        the whole step's update (AdamW needs no norms)."""
        self.steps += 1
        step_size = lr / (1.0 - self.scalar_math.power(self.beta1, self.steps))
        for lo, hi, g in shards:
            at = self.layout.where(lo, hi)
            w, tmp = self.flat.params[lo:hi], self._tmp[at]
            if self.weight_decay:
                for a, b in self.decayed:
                    x, y = max(a, lo), min(b, hi)
                    if x < y:
                        w[x - lo:y - lo] *= 1.0 - lr * self.weight_decay
            self._denominator(at, g)  # into tmp
            self.flat.xp.divide(self.exp_avg[at], tmp, out=tmp)
            tmp *= step_size
            w -= tmp

    def _denominator(self, at: slice, g: Any) -> None:
        """Both moments at ``at`` (where a flat range lies in the state) from ``g``, then
        sqrt(v)/sqrt(1 - b2^t) + eps into the scratch buffer."""
        xp, b1, b2 = self.flat.xp, self.beta1, self.beta2
        m, v, tmp = self.exp_avg[at], self.exp_avg_sq[at], self._tmp[at]
        m *= b1
        xp.multiply(g, 1.0 - b1, out=tmp)
        m += tmp
        v *= b2
        xp.multiply(g, g, out=tmp)
        tmp *= 1.0 - b2
        v += tmp
        xp.sqrt(v, out=tmp)
        tmp /= math.sqrt(1.0 - self.scalar_math.power(b2, self.steps))
        tmp += self.eps


def matrices(flat: FlatBuffer) -> list[bool]:
    """The decay mask of weight decay on matrices only: True for tensors of 2 dimensions and more
    (weights, embeddings), False for vectors (biases, LayerNorm's gains and shifts), as nanoGPT and
    most transformer recipes decay."""
    return [len(shape) >= 2 for shape in flat.shapes]


def _runs(offsets: Sequence[int], mask: Sequence[bool] | None) -> list[tuple[int, int]]:
    """The flat ranges of the masked tensors, neighbours merged (one range for a mask of all True)."""
    if mask is None:
        return [(offsets[0], offsets[-1])]
    runs: list[tuple[int, int]] = []
    for t, on in enumerate(mask):
        if not on:
            continue
        if runs and runs[-1][1] == offsets[t]:
            runs[-1] = (runs[-1][0], offsets[t + 1])
        else:
            runs.append((offsets[t], offsets[t + 1]))
    return runs


class LAMB(AdamW):
    """Adam's direction plus decay, r, scaled per weight tensor (2-D and up) to step lr*||w||."""

    def __init__(self, flat: FlatBuffer, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, scalar_math: ScalarMath = LIBM) -> None:
        super().__init__(flat, betas, eps, weight_decay, scalar_math=scalar_math)
        self.adapted = [len(shape) > 1 for shape in flat.shapes]  # per tensor, in flat.shapes order

    def step_shards(self, lr: float, shards: Shards, norms: Norms | None = None) -> None:
        """Update only the ranges ``[lo, hi)`` of ``shards``. ``norms`` gives the whole tensors' squared
        norms of w and r; without it they come from ``shards`` alone, right only when those hold whole
        tensors."""
        norms = norms or TensorNorms(self.flat.offsets, [(lo, hi) for lo, hi, _ in shards])
        self.steps += 1
        bc1, w, xp = 1.0 - self.scalar_math.power(self.beta1, self.steps), self.flat.params, self.flat.xp
        for lo, hi, g in shards:  # g becomes r
            at = self.layout.where(lo, hi)
            self._denominator(at, g)
            xp.divide(self.exp_avg[at], self._tmp[at], out=g)
            g /= bc1
            if self.weight_decay:
                tmp = self._tmp[at]
                xp.multiply(w[lo:hi], self.weight_decay, out=tmp)
                g += tmp
        ratios = self.trust_ratios(norms.squared([w[lo:hi] for lo, hi, _ in shards], [g for _, _, g in shards]))
        offsets = self.flat.offsets
        for lo, hi, g in shards:  # w -= lr*ratio*r, tensor by tensor
            for t, ratio in enumerate(ratios):
                x, y = max(offsets[t], lo), min(offsets[t + 1], hi)
                if x < y:
                    g[x - lo:y - lo] *= lr * ratio
            w[lo:hi] -= g

    def trust_ratios(self, sq_norms: Any) -> list[float]:
        """||w|| / ||r|| per tensor (rows ||w||^2 and ||r||^2); 1 for 1-D tensors and where a norm is 0."""
        return [math.sqrt(ww) / math.sqrt(rr) if adapted and ww > 0 and rr > 0 else 1.0
                for adapted, ww, rr in zip(self.adapted, *sq_norms)]
