"""GELU, in GPT-2's tanh form (Hendrycks & Gimpel 2016):

    gelu(x) = x/2 * (1 + tanh(u)),  u = sqrt(2/pi) * (x + 0.044715 x^3)
    gelu'(x) = (1 + tanh(u))/2 + x/2 * (1 - tanh(u)^2) * sqrt(2/pi) * (1 + 3 * 0.044715 x^2)

Why the tanh form and not the exact x * Phi(x) (PyTorch's default, nanoGPT's ``nn.GELU()``): NumPy has
no erf ufunc (SciPy's would be a new dependency, and a Python loop over math.erf is far too slow),
while tanh is a NumPy and CuPy ufunc; the two differ by less than 1e-3 everywhere, and GPT-2 itself
was trained with this one. The PyTorch twin (benchmarks/gpt_torch.py) uses ``nn.GELU(approximate="tanh")``.
"""

from __future__ import annotations

import math

from mpisgd.backend import xp_of
from mpisgd.nn.module import Array, Module

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


class GELU(Module):
    """The tanh approximation of the Gaussian error linear unit, element-wise."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self) -> None:
        super().__init__()
        self._x: Array = None
        self._t: Array = None

    def forward(self, x: Array) -> Array:
        xp = xp_of(x)
        t = self._buf("tanh", x.shape, x)
        xp.multiply(x, x, out=t)
        t *= x.dtype.type(_A)
        t += 1
        t *= x
        t *= x.dtype.type(_C)
        self.ctx.kernels.tanh(t, out=t)  # tanh(u)
        y = self._buf("y", x.shape, x)
        xp.add(t, 1, out=y)
        y *= x
        y *= x.dtype.type(0.5)
        self._x, self._t = x, t
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        xp = xp_of(dy)
        x, t = self._x, self._t
        d = self._buf("d", x.shape, x)
        # gelu'(x) = (1 + t)/2 * (1 + d (1 - t)),  d = C x (1 + 3A x^2); t is consumed
        xp.multiply(x, x, out=d)
        d *= x.dtype.type(3 * _A * _C)
        d += x.dtype.type(_C)
        d *= x
        xp.subtract(1, t, out=t)  # 1 - t
        d *= t
        d += 1
        xp.subtract(2, t, out=t)  # 1 + t
        d *= t
        d *= x.dtype.type(0.5)
        dy *= d
        return dy
