"""The local update rules' common ground, and SGD: on whole flat buffers, identical inputs give identical
steps on every rank.

Every update rule (SGD, mpisgd.lars.LARS, mpisgd.adam.AdamW and LAMB) offers the :class:`Optimizer`
protocol: ``step``/``step_shards`` for the replicated and the sharded update, and its state split in two
so that data parallelism and checkpoints need not know which rule runs — ``state_buffers()``, the
parameter-sized buffers (SGD's momentum, Adam's two moments), which DataParallel broadcasts and, in
the sharded step, gathers; and ``state()``, the scalars (the previous rate, Adam's step count).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from mpisgd.backend import to_numpy, xp_of
from mpisgd.blas import level1_for
from mpisgd.flatbuf import FlatBuffer

Shards = Sequence[tuple[int, int, Any]]  # (lo, hi, g): flat range [lo, hi) and its gradient (hi - lo elements)


class TensorNorms:
    """Squared norms of each parameter tensor (in ``flat.shapes`` order) of quantities held as pieces of
    the flat buffer: what an optimizer asks for when its step needs whole-tensor norms (LARS's trust
    ratios). This one sums the pieces of this rank only, in piece order — right when the pieces hold
    whole tensors (the replicated step); the sharded step passes one that adds every rank's pieces
    (mpisgd.sharded.RankNorms). Optimizers never reduce across ranks themselves."""

    def __init__(self, offsets: Sequence[int], ranges: Sequence[tuple[int, int]]) -> None:
        self.offsets, self.ranges = list(offsets), list(ranges)

    def partial(self, *quantities: Sequence[Any]) -> np.ndarray:
        """(len(quantities), tensors) float64: each quantity's squared norm per tensor over this rank's
        pieces. A quantity is one array per range, aligned with it (e.g. the weights' and the gradient's)."""
        out = np.zeros((len(quantities), len(self.offsets) - 1))
        where, dots = [], []
        for piece, (lo, hi) in enumerate(self.ranges):
            for t in range(len(self.offsets) - 1):
                x, y = max(self.offsets[t], lo), min(self.offsets[t + 1], hi)
                if x < y:
                    where.append(t)
                    for q in quantities:
                        a = q[piece][x - lo:y - lo]
                        dots.append(a.dot(a))
        if dots:  # one transfer from a GPU, not one per tensor
            values = to_numpy(xp_of(dots[0]).stack(dots)).astype(np.float64).reshape(len(where), len(quantities))
            for i, t in enumerate(where):
                out[:, t] += values[i]
        return out

    def squared(self, *quantities: Sequence[Any]) -> np.ndarray:
        """The whole tensors' squared norms (here: this rank's pieces are the whole)."""
        return self.partial(*quantities)


class Optimizer(Protocol):
    """What DataParallel, the checkpoints and the CLI use of an update rule."""

    flat: FlatBuffer

    def step(self, lr: float) -> None:
        """Update every parameter from the (averaged) gradient buffer ``flat.grads``."""

    def step_shards(self, lr: float, shards: Shards, norms: TensorNorms | None = None) -> None:
        """Update only the ranges ``[lo, hi)`` of ``shards``, each from its own gradient piece; whole-tensor
        norms, where the rule needs them, come from ``norms`` (every rank's pieces in the sharded step)."""

    def state_buffers(self) -> dict[str, Any]:
        """The parameter-sized state by name: the live flat buffers (``flat.size`` elements of its dtype,
        element i belonging to parameter i), not copies. The sharded step keeps only this rank's chunks
        of each current; DataParallel broadcasts and gathers them all."""

    def state(self) -> dict[str, float]:
        """The scalar state, JSON numbers (with :meth:`state_buffers`: what resuming bitwise needs)."""

    def load_state(self, state: Mapping[str, float], buffers: Mapping[str, Any] | None = None) -> None:
        """Continue from :meth:`state`'s scalars and the named buffers (None: keep this rank's, e.g. where
        rank 0's are broadcast next)."""

    def buffer_nbytes(self) -> int:
        """Bytes of the rule's own buffers (state and scratch)."""


def grad_norm(shards: Shards, norms: TensorNorms) -> float:
    """The global L2 norm of a gradient held as ``shards`` (lo, hi, g): every piece ``norms`` adds up."""
    return math.sqrt(float(norms.squared([g for _, _, g in shards]).sum()))


def clip_grad_norm_(shards: Shards, norms: TensorNorms, max_norm: float | None) -> float:
    """Scale the gradient pieces in place so that the global L2 norm is at most ``max_norm`` (None or 0:
    no clipping), as ``torch.nn.utils.clip_grad_norm_`` does: factor max_norm / (norm + 1e-6) where that
    is below 1. Returns the norm before clipping. Every rank that holds the same norms clips alike. A
    norm that overflows the dtype (inf) leaves the gradient as it is."""
    total = grad_norm(shards, norms)
    if max_norm and math.isfinite(total):
        factor = max_norm / (total + 1e-6)
        if factor < 1.0:
            for _, _, g in shards:
                g *= factor
    return total


class SGD:
    """SGD with momentum, Nesterov and L2 weight decay.

    With d = g + wd*w (L2 decay on every parameter, added to the all-reduced gradient,
    as in Goyal et al. eq. 8; no exclusion of biases):

    Default form (PyTorch's, Goyal et al. eq. 10):
        v = mu*v + d;  w -= eta*v            (Nesterov: w -= eta*(mu*v + d))
    With ``momentum_correction`` the rate lives inside the velocity (eq. 9), V = eta*v:
        V = mu*(eta_t/eta_{t-1})*V + eta_t*d;  w -= V      (Nesterov: w -= mu*V + eta_t*d)
    The factor eta_t/eta_{t-1} is Goyal et al.'s momentum correction (section 2.3).
    Without it the eta-in-velocity form keeps stale, too-small (warmup) or too-large
    (decay) steps in V; with it, both forms produce the same iterates up to rounding.
    Corner case: if eta_{t-1} was 0 then V = 0 and the old velocity is lost in that form.

    The step allocates nothing. On contiguous NumPy float buffers each line above is one
    BLAS axpy/axpby pass (mpisgd.blas; last-bit differences from the ufuncs only);
    otherwise the ufuncs run, with one preallocated temporary for
    eta*v (or eta*d). ``level1=False`` forces the ufuncs. Weight decay is added into the
    gradient buffer in place (the next backward overwrites it), so after ``step`` the
    grads hold d, not g.
    """

    def __init__(self, flat: FlatBuffer, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, momentum_correction: bool = False, level1: bool = True) -> None:
        if flat is None:
            raise ValueError("materialize() the model before building its optimizer: SGD(model.flat) needs the "
                             "parameters")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
        self.flat = flat
        self.momentum, self.nesterov, self.weight_decay = momentum, nesterov, weight_decay
        self.momentum_correction = momentum_correction
        xp = flat.xp
        self.velocity = xp.zeros_like(flat.params) if momentum else None
        self.prev_lr: float | None = None  # eta_{t-1}, for the momentum correction
        bufs = (flat.params, flat.grads) if self.velocity is None else (flat.params, flat.grads, self.velocity)
        self.blas = level1_for(*bufs) if level1 else None
        self._tmp = None if self.blas else xp.empty_like(flat.params)  # the ufuncs' one temporary

    def buffer_nbytes(self) -> int:
        """Bytes of the optimizer's own state: momentum, and the ufuncs' temporary where BLAS is not used."""
        return sum(int(b.nbytes) for b in (self.velocity, self._tmp) if b is not None)

    def step(self, lr: float) -> None:
        """Update every parameter from the gradient buffer."""
        self._update(self.flat.params, self.flat.grads, self.velocity, self._tmp, lr)
        self.prev_lr = lr

    def step_shards(self, lr: float, shards: Shards, norms: TensorNorms | None = None) -> None:
        """Update only the parameter ranges ``[lo, hi)`` of ``shards``, each from its own gradient array
        ``g`` (hi - lo elements; the sharded step of mpisgd.sharded). Element by element the same
        update as :meth:`step`, so ranks that update disjoint ranges and exchange them arrive at the
        replicated step's parameters (up to the last bit, where a BLAS kernel's blocking differs).
        ``norms``: where whole-tensor norms come from, for rules that need them (SGD does not)."""
        w, v, tmp = self.flat.params, self.velocity, self._tmp
        for lo, hi, g in shards:
            self._update(w[lo:hi], g, None if v is None else v[lo:hi], None if tmp is None else tmp[lo:hi], lr)
        self.prev_lr = lr

    def _update(self, w: Any, g: Any, v: Any, tmp: Any, lr: float) -> None:
        if self.blas is not None:
            self._update_blas(w, g, v, lr)
        else:
            self._update_ufuncs(w, g, v, tmp, lr)

    def _update_blas(self, w: Any, g: Any, v: Any, lr: float) -> None:
        """The same update as ``_update_ufuncs``, each line one pass (y += a*x, y = a*x + b*y)."""
        b, mu = self.blas, self.momentum
        assert b is not None
        if self.weight_decay:
            b.axpy(self.weight_decay, w, g)  # d = g + wd*w
        if v is None:
            b.axpy(-lr, g, w)
        elif self.momentum_correction:
            prev = self.prev_lr
            b.axpby(lr, g, mu * (1.0 if not prev else lr / prev), v)  # V = mu*ratio*V + eta_t*d
            if self.nesterov:
                b.axpy(-lr, g, w)
                b.axpy(-mu, v, w)
            else:
                b.axpy(-1.0, v, w)
        else:
            b.axpby(1.0, g, mu, v)  # v = mu*v + d
            if self.nesterov:
                b.axpy(-lr * mu, v, w)
                b.axpy(-lr, g, w)
            else:
                b.axpy(-lr, v, w)

    def _update_ufuncs(self, w: Any, g: Any, v: Any, tmp: Any, lr: float) -> None:
        xp, mu = self.flat.xp, self.momentum
        if self.weight_decay:
            xp.multiply(w, self.weight_decay, out=tmp)
            g += tmp  # g becomes d = g + wd*w
        if v is None:
            xp.multiply(g, lr, out=tmp)
            w -= tmp
        elif self.momentum_correction:
            prev = self.prev_lr
            ratio = 1.0 if not prev else lr / prev  # first step: V = 0, any ratio is the same
            v *= mu * ratio
            xp.multiply(g, lr, out=tmp)  # eta_t*d
            v += tmp
            if self.nesterov:
                w -= tmp
                xp.multiply(v, mu, out=tmp)
                w -= tmp
            else:
                w -= v
        else:
            v *= mu
            v += g
            if self.nesterov:
                xp.multiply(v, mu, out=tmp)
                tmp += g
                tmp *= lr
            else:
                xp.multiply(v, lr, out=tmp)
            w -= tmp

    def state_buffers(self) -> dict[str, Any]:
        """The momentum buffer, when there is momentum (the Optimizer protocol)."""
        return {} if self.velocity is None else {"velocity": self.velocity}

    def state(self) -> dict[str, float]:
        """The rate of the last step (-1.0: none yet), for the momentum correction."""
        return {"prev_lr": -1.0 if self.prev_lr is None else self.prev_lr}

    def load_state(self, state: Mapping[str, float], buffers: Mapping[str, Any] | None = None) -> None:
        """Continue from :meth:`state` and :meth:`state_buffers`' values. ``buffers`` None keeps this
        rank's (ranks that take rank 0's by a broadcast next); a buffer it lacks stays as it is (zero
        momentum: a run resumed with momentum switched on), one this optimizer lacks is ignored."""
        load_buffers(self, buffers)
        prev_lr = state.get("prev_lr", -1.0)
        self.prev_lr = None if prev_lr < 0 else float(prev_lr)


def load_buffers(optimizer: Optimizer, buffers: Mapping[str, Any] | None) -> None:
    """Copy each of ``buffers`` into the optimizer's state buffer of that name (same size, any array
    module), those it has; ValueError for a size that does not fit."""
    for name, mine in optimizer.state_buffers().items():
        theirs = None if buffers is None else buffers.get(name)
        if theirs is None:
            continue
        if theirs.shape != mine.shape:
            raise ValueError(f"optimizer state {name!r}: {theirs.shape} elements for a buffer of {mine.shape}")
        mine[...] = optimizer.flat.xp.asarray(theirs)
