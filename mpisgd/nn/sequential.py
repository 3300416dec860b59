"""A model as a list of layers; knows nothing of distribution."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from mpisgd.flatbuf import FlatBuffer
from mpisgd.nn.layers import Array, Layer


class Sequential:
    """Layers applied in order; parameters live in one :class:`FlatBuffer`.

    ``backward`` calls ``on_layer_done(i)`` after layer ``i``'s gradients are
    final, in reverse order: the hook data parallelism uses to start a bucket's
    all-reduce while earlier layers are still computing.
    """

    def __init__(self, *layers: Layer) -> None:
        self.layers = list(layers)
        self.flat: FlatBuffer | None = None

    def materialize(self, xp: object, dtype: str | np.dtype = "float32", seed: int = 0) -> Sequential:
        """Allocate the flat buffers on ``xp`` and initialise parameters from ``seed``.

        Initial values are drawn on the host with NumPy, so CPU and GPU runs with
        the same seed start from the same parameters.
        """
        dtype = np.dtype(dtype)
        specs = [(i, name, shape) for i, layer in enumerate(self.layers) for name, shape in layer.param_shapes]
        self.flat = FlatBuffer([shape for _, _, shape in specs], dtype, xp)
        rng = np.random.default_rng(seed)
        for layer, params in zip(self.layers, self._bind(), strict=True):
            init = layer.init_params(rng, dtype)
            for name, p in params.items():
                p[...] = xp.asarray(init[name])
        return self

    def move_grads(self, buf: object) -> None:
        """Keep the gradients in ``buf`` from now on (see FlatBuffer.move_grads); layers follow."""
        assert self.flat is not None, "materialize() first"
        self.flat.move_grads(buf)
        self._bind()

    def _bind(self) -> list[dict[str, object]]:
        """Hand every layer its views of the flat buffers; returns each layer's parameter views."""
        assert self.flat is not None
        views = iter(zip(self.flat.param_views, self.flat.grad_views, strict=True))
        bound = []
        for layer in self.layers:
            params, grads = {}, {}
            for name, _ in layer.param_shapes:
                params[name], grads[name] = next(views)
            layer.bind(params, grads)
            bound.append(params)
        return bound

    def forward(self, x: Array) -> Array:
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dy: Array, on_layer_done: Callable[[int], None] | None = None) -> None:
        # no layer before the first one with parameters needs a gradient: skip its input gradient
        # (for the MLP, Flatten comes first: this saves a whole GEMM per step)
        first = next((i for i, layer in enumerate(self.layers) if layer.param_shapes), 0)
        for i in range(len(self.layers) - 1, -1, -1):
            if i < first:
                if on_layer_done is not None:
                    on_layer_done(i)
                continue
            dy = self.layers[i].backward(dy, need_dx=i > first)
            if on_layer_done is not None:
                on_layer_done(i)

    def buffer_nbytes(self) -> int:
        """Bytes of the activation and scratch buffers the layers keep (allocated at the first step)."""
        return sum(int(buf.nbytes) for layer in self.layers for buf in layer._bufs.values())

    def set_accumulate(self, on: bool) -> None:
        for layer in self.layers:
            layer.accumulate = on

    def layer_param_ranges(self) -> list[tuple[int, int]]:
        """Per layer, the [start, stop) element range of its parameters in the flat buffer."""
        assert self.flat is not None, "materialize() first"
        ranges, k = [], 0
        for layer in self.layers:
            start = self.flat.offsets[k] if layer.param_shapes else None
            k += len(layer.param_shapes)
            stop = self.flat.offsets[k] if layer.param_shapes else None
            ranges.append((start, stop) if start is not None else (-1, -1))
        return ranges

    def named_parameters(self) -> Iterator[tuple[str, Array]]:
        for i, layer in enumerate(self.layers):
            for name, _ in layer.param_shapes:
                yield f"{i}.{type(layer).__name__}.{name}", layer.params[name]

    def __repr__(self) -> str:
        return "Sequential(" + ", ".join(map(repr, self.layers)) + ")"
