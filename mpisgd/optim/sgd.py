"""SGD with momentum, Nesterov, L2 weight decay and Goyal et al.'s momentum correction."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mpisgd.blas import level1_for
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.base import Shards, StateBuffers, StateLayout, load_buffers
from mpisgd.optim.norms import Norms


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

    State: the momentum buffer ``velocity`` (and the ufuncs' temporary) cover the flat ranges of
    :attr:`layout`: every parameter, or after ``keep_state`` only this rank's chunks (the sharded step).
    """

    def __init__(self, flat: FlatBuffer, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, momentum_correction: bool = False, level1: bool = True) -> None:
        if flat is None:
            raise ValueError("materialize() the model before building its optimizer: SGD(model.flat) needs the "
                             "parameters")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight decay must be finite and >= 0, got {weight_decay}")
        self.flat = flat
        self.momentum, self.nesterov, self.weight_decay = momentum, nesterov, weight_decay
        self.momentum_correction = momentum_correction
        self.prev_lr: float | None = None  # eta_{t-1}, for the momentum correction
        self.blas = level1_for(flat.params, flat.grads) if level1 else None  # velocity: their dtype, contiguous
        # momentum, and the ufuncs' one temporary where BLAS is not used: made when first used
        self.buffers = StateBuffers(flat, ["velocity"] if momentum else [], [] if self.blas else ["tmp"])

    @property
    def velocity(self) -> Any:
        """The momentum buffer (None without momentum)."""
        return self.buffers["velocity"] if self.momentum else None

    @property
    def _tmp(self) -> Any:
        return None if self.blas else self.buffers["tmp"]

    @property
    def layout(self) -> StateLayout:
        return self.buffers.layout

    def keep_state(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Keep momentum (and the temporary) only for these flat ranges, values kept (the Optimizer protocol)."""
        self.buffers.keep(ranges)

    def buffer_nbytes(self) -> int:
        """Bytes of the optimizer's own state: momentum, and the ufuncs' temporary where BLAS is not used."""
        return self.buffers.nbytes()

    def step(self, lr: float) -> None:
        """Update every parameter from the gradient buffer (the state must cover every parameter)."""
        self.layout.where(0, self.flat.size)  # ValueError where keep_state left only some ranges
        self._update(self.flat.params, self.flat.grads, self.velocity, self._tmp, lr)
        self.prev_lr = lr

    def step_shards(self, lr: float, shards: Shards, norms: Norms | None = None) -> None:
        """Update only the parameter ranges ``[lo, hi)`` of ``shards``, each from its own gradient array
        ``g`` (hi - lo elements; the sharded step of mpisgd.parallel.sharded). Element by element the same
        update as :meth:`step`, so ranks that update disjoint ranges and exchange them arrive at the
        replicated step's parameters (up to the last bit, where a BLAS kernel's blocking differs).
        ``norms``: where whole-tensor norms come from, for rules that need them (SGD does not)."""
        w, v, tmp = self.flat.params, self.velocity, self._tmp
        for lo, hi, g in shards:
            at = self.layout.where(lo, hi)
            self._update(w[lo:hi], g, None if v is None else v[at], None if tmp is None else tmp[at], lr)
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
        return self.buffers.state()

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
