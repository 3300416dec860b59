"""Checking a module's backward against float64 finite differences.

``check_gradients(module, x)`` materialises ``module`` in float64 on NumPy (so pass a fresh one: it
is re-bound to new buffers), takes the scalar L = sum(w * forward(x)) for a fixed random w, and
compares what ``backward`` gives for dL/dx and dL/dparameter with central differences
(L(v + h) - L(v - h)) / 2h at a sample of coordinates of the input and of every parameter tensor.
Random modules (Dropout) draw the same mask for the same (seed, step, samples), so the function is
deterministic between the two evaluations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpisgd.nn.module import Module, parameter_shapes


@dataclass(frozen=True)
class GradientError:
    """The worst coordinate of one checked quantity."""

    name: str  # "input" or a parameter's qualified name ("1.Linear.W")
    worst: float  # the largest |analytic - numeric| / (atol + rtol * max(|analytic|, |numeric|)): <= 1 passes
    analytic: float  # at that coordinate
    numeric: float

    @property
    def ok(self) -> bool:
        return self.worst <= 1.0


def check_gradients(module: Module, x: Any, *, seed: int = 0, samples: int = 12, h: float = 1e-6,
                    rtol: float = 1e-5, atol: float = 1e-8, training: bool = True,
                    sample_ids: Any = None, kernels: Any = None) -> list[GradientError]:
    """One :class:`GradientError` per checked quantity (the input, if floating point, then each parameter
    tensor), from ``samples`` coordinates of each. ``x``: a small input batch (cast to float64 when it
    is floating point; integer inputs, such as token ids, are passed as they are and not checked).
    ``kernels``: what the model computes with (mpisgd.kernels; the fast ones when None)."""
    model = module.materialize(np, "float64", seed)
    if kernels is not None:
        model.ctx.kernels = kernels
    model.train(training)
    ids = np.arange(len(x), dtype=np.int64) if sample_ids is None else np.asarray(sample_ids)
    model.begin_batch(step=0, sample_ids=ids, stat_row=None if not model.stat_size else np.zeros(model.stat_size))
    return check_in_place(module, x, seed=seed, samples=samples, h=h, rtol=rtol, atol=atol)


def check_in_place(module: Module, x: Any, *, seed: int = 0, samples: int = 12, h: float = 1e-6,
                   rtol: float = 1e-5, atol: float = 1e-8) -> list[GradientError]:
    """The same check on a module that is already part of a float64 model, as it is bound there (its
    context, mode and layout as the model gave them): how the start-up check tests a module of yours
    inside the model it came in (mpisgd.nn.usercheck). Its parameters' gradients are overwritten."""
    x = np.array(x, dtype=np.float64) if np.issubdtype(np.asarray(x).dtype, np.floating) else np.asarray(x)
    rng = np.random.default_rng(seed + 7919)
    w = rng.standard_normal(np.shape(_forward(module, x)))

    def loss(inp: Any) -> float:
        return float(np.sum(w * _forward(module, inp)))

    _forward(module, x)
    accumulate, module.ctx.accumulate = module.ctx.accumulate, False
    try:
        dx = module.backward(w.copy(), need_dx=np.issubdtype(x.dtype, np.floating))
    finally:
        module.ctx.accumulate = accumulate
    analytic_x = None if dx is None else np.array(dx, dtype=np.float64)
    owned = [(m, name) for _, m in module.named_modules() for name, _ in m.param_shapes]
    analytic_p = [np.array(m.grads[name], dtype=np.float64) for m, name in owned]
    out = []
    if analytic_x is not None:  # x is perturbed in place
        out.append(_compare("input", x, analytic_x, lambda: loss(x), rng, samples, h, rtol, atol))
    for (qualified, _), (m, name), analytic in zip(parameter_shapes(module), owned, analytic_p, strict=True):
        out.append(_compare(qualified, m.params[name], analytic, lambda: loss(x), rng, samples, h, rtol, atol))
    return out


def _forward(module: Module, x: Any) -> np.ndarray:
    return np.array(module.forward(x.copy()), dtype=np.float64)  # outputs are reused buffers: copy


def _compare(name: str, values: np.ndarray, analytic: np.ndarray, loss: Any, rng: np.random.Generator,
             samples: int, h: float, rtol: float, atol: float) -> GradientError:
    """Central differences of ``loss()`` at ``samples`` coordinates of ``values`` (perturbed in place and
    restored)."""
    flat_vals = values.reshape(-1)
    flat_ana = analytic.reshape(-1)
    picks = rng.choice(flat_vals.size, size=min(samples, flat_vals.size), replace=False)
    worst = GradientError(name, 0.0, 0.0, 0.0)
    for i in picks:
        old = float(flat_vals[i])
        flat_vals[i] = old + h
        up = loss()
        flat_vals[i] = old - h
        down = loss()
        flat_vals[i] = old
        numeric = (up - down) / (2 * h)
        a = float(flat_ana[i])
        score = abs(a - numeric) / (atol + rtol * max(abs(a), abs(numeric)))
        if score > worst.worst:
            worst = GradientError(name, score, a, numeric)
    return worst
