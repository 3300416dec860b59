"""Layer normalisation (Ba et al. 2016) over the last axis, as a transformer uses it.

    y = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta     mean, var over the last axis (biased var)

Backward, with xhat the normalised input and g = dy * gamma:

    dx = (g - mean(g) - xhat * mean(g * xhat)) / sqrt(var + eps)

Each pass writes into a buffer kept per shape (the hot path allocates only the per-row statistics);
forward keeps xhat and 1/sqrt(var + eps) for backward.
"""

from __future__ import annotations

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.nn.module import Array, Module


class LayerNorm(Module):
    """Normalise (..., dim) inputs over their last axis, then scale by gamma and shift by beta (trained,
    starting at 1 and 0)."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.param_shapes = [("gamma", (dim,)), ("beta", (dim,))]
        self._xhat: Array = None
        self._rstd: Array = None

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {"gamma": np.ones(self.dim, dtype), "beta": np.zeros(self.dim, dtype)}

    def forward(self, x: Array) -> Array:
        if x.ndim == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"{self!r} normalises {self.dim} features on the last axis, got shape {tuple(x.shape)}")
        xp = xp_of(x)
        xhat = self._buf("xhat", x.shape, x)
        ops = self.ctx.kernels  # means and sums: mpisgd.kernels
        xp.subtract(x, ops.mean_along(x, -1, keepdims=True), out=xhat)
        y = self._buf("y", x.shape, x)
        xp.multiply(xhat, xhat, out=y)  # y as scratch for the squares
        rstd = ops.mean_along(y, -1, keepdims=True)
        rstd += self.eps
        xp.sqrt(rstd, out=rstd)
        xp.reciprocal(rstd, out=rstd)
        xhat *= rstd
        self._xhat, self._rstd = xhat, rstd
        xp.multiply(xhat, self.params["gamma"], out=y)
        y += self.params["beta"]
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        xp = xp_of(dy)
        xhat = self._xhat
        rows = (-1, self.dim)
        tmp = self._buf("tmp", dy.shape, dy)
        xp.multiply(dy, xhat, out=tmp)
        dgamma = self._grad_out("gamma", (self.dim,), dy)
        ops = self.ctx.kernels
        ops.sum(tmp.reshape(rows), axis=0, out=dgamma)
        self._grad_done("gamma", dgamma)
        dbeta = self._grad_out("beta", (self.dim,), dy)
        ops.sum(dy.reshape(rows), axis=0, out=dbeta)
        self._grad_done("beta", dbeta)
        if not need_dx:
            return None
        g = dy  # backward may overwrite dy
        g *= self.params["gamma"]
        xp.multiply(g, xhat, out=tmp)
        proj = ops.mean_along(tmp, -1, keepdims=True)  # mean(g * xhat)
        mean_g = ops.mean_along(g, -1, keepdims=True)
        xp.multiply(xhat, proj, out=tmp)
        g -= tmp
        g -= mean_g
        g *= self._rstd
        return g

    def extra_repr(self) -> str:
        return str(self.dim)
