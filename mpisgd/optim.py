"""The local SGD update, on whole flat buffers: identical inputs give identical steps on every rank."""

from __future__ import annotations

from typing import Any

from mpisgd.flatbuf import FlatBuffer


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

    The step allocates nothing: one preallocated temporary holds eta*v (or eta*d), so
    no ``lr * v`` array is created per step. Weight decay is added into the gradient
    buffer in place (the next backward overwrites it), so after ``step`` the grads
    hold d, not g.
    """

    def __init__(self, flat: FlatBuffer, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, momentum_correction: bool = False) -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
        self.flat = flat
        self.momentum, self.nesterov, self.weight_decay = momentum, nesterov, weight_decay
        self.momentum_correction = momentum_correction
        xp = flat.xp
        self.velocity = xp.zeros_like(flat.params) if momentum else None
        self._tmp = xp.empty_like(flat.params)  # the one temporary of every step
        self.prev_lr: float | None = None  # eta_{t-1}, for the momentum correction

    def step(self, lr: float) -> None:
        xp = self.flat.xp
        w, g, v, mu, tmp = self.flat.params, self.flat.grads, self.velocity, self.momentum, self._tmp
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
        self.prev_lr = lr

    def state(self) -> dict[str, Any]:
        """What a checkpoint must keep to resume bitwise."""
        return {"velocity": self.velocity, "prev_lr": -1.0 if self.prev_lr is None else self.prev_lr}

    def load_state(self, velocity: Any, prev_lr: float) -> None:
        if self.velocity is not None:
            self.velocity[...] = self.flat.xp.asarray(velocity)
        self.prev_lr = None if prev_lr < 0 else float(prev_lr)
