"""Parameters and gradients as views into one contiguous buffer each.

The all-reduce then works on the gradient buffer (or a contiguous slice of it,
a bucket) with no packing copy, and the optimizer updates every parameter in a
handful of whole-buffer operations. Layout: parameters in model order, each at
its element offset; sizes come from the dtype, never a hard-coded itemsize.
"""

from __future__ import annotations

from math import prod
from typing import Any, Protocol

import numpy as np


class FlatBuffer:
    def __init__(self, shapes: list[tuple[int, ...]], dtype: np.dtype, xp: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.xp = xp
        self.shapes = list(shapes)
        sizes = [prod(s) for s in shapes]
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.size = self.offsets[-1]
        self.params = xp.zeros(self.size, dtype=self.dtype)  # the model's weights
        self.grads = xp.zeros(self.size, dtype=self.dtype)  # their gradients, reduced in place
        self.param_views = [self.params[a:b].reshape(s) for a, b, s in self._spans()]
        self.grad_views = [self.grads[a:b].reshape(s) for a, b, s in self._spans()]

    def move_grads(self, buf: Any) -> None:
        """Keep the gradients in ``buf`` (``size`` elements of this dtype) from now on, values copied:
        e.g. node-shared memory that the reducer reads in place. Rebind the layers afterwards."""
        if buf.shape != (self.size,) or buf.dtype != self.dtype:
            raise ValueError(f"gradient buffer must be ({self.size},) {self.dtype}, got {buf.shape} {buf.dtype}")
        buf[...] = self.grads
        self.grads = buf
        self.grad_views = [self.grads[a:b].reshape(s) for a, b, s in self._spans()]

    def _spans(self) -> list[tuple[int, int, tuple[int, ...]]]:
        return [(self.offsets[i], self.offsets[i + 1], s) for i, s in enumerate(self.shapes)]

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def zero_grad(self) -> None:
        self.grads.fill(0)


class Materialized(Protocol):
    """A model whose parameters live in a FlatBuffer once it is materialised (None before)."""

    @property
    def flat(self) -> FlatBuffer | None: ...


def flat_of(model: Materialized) -> FlatBuffer:
    """The model's FlatBuffer; ValueError where it has none yet."""
    if model.flat is None:
        raise ValueError(f"materialize() the model first: {type(model).__name__} has no parameters yet")
    return model.flat
