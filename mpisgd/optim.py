"""The local SGD update, on whole flat buffers: identical inputs give identical steps on every rank."""

from __future__ import annotations

from typing import Any

from mpisgd.flatbuf import FlatBuffer


class SGD:
    """SGD with momentum, Nesterov and L2 weight decay.

    Default form (PyTorch's, Goyal et al. eq. 10):  v = mu*v + (g + wd*w);  w -= eta*v.
    With ``momentum_correction`` the rate lives inside the velocity,
    v = mu*(eta_t/eta_{t-1})*v + eta_t*(g + wd*w);  w -= v, where the factor
    eta_t/eta_{t-1} is Goyal et al.'s momentum correction (section 2.3): without
    it, that form misbehaves when the rate changes quickly (warmup). Both forms
    produce the same iterates; the second exists to show and test the correction.
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
        self._tmp = xp.empty_like(flat.params) if nesterov else None
        self.prev_lr: float | None = None  # for the momentum correction

    def step(self, lr: float) -> None:
        w, g, v, mu = self.flat.params, self.flat.grads, self.velocity, self.momentum
        if self.weight_decay:
            g += self.weight_decay * w  # g is overwritten by the next backward: safe to modify
        if v is None:
            w -= lr * g
            return
        if self.momentum_correction:
            ratio = 1.0 if self.prev_lr in (None, 0.0) else lr / self.prev_lr
            v *= mu * ratio
            v += lr * g
            if self.nesterov:
                w -= mu * v + lr * g
            else:
                w -= v
        else:
            v *= mu
            v += g
            if self.nesterov:
                xp = self.flat.xp
                xp.multiply(v, mu, out=self._tmp)
                self._tmp += g
                self._tmp *= lr
                w -= self._tmp
            else:
                w -= lr * v
        self.prev_lr = lr

    def state(self) -> dict[str, Any]:
        """What a checkpoint must keep to resume bitwise."""
        return {"velocity": self.velocity, "prev_lr": -1.0 if self.prev_lr is None else self.prev_lr}

    def load_state(self, velocity: Any, prev_lr: float) -> None:
        if self.velocity is not None:
            self.velocity[...] = self.flat.xp.asarray(velocity)
        self.prev_lr = None if prev_lr < 0 else float(prev_lr)
