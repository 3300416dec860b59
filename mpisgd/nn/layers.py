"""Layers with explicit forward and backward on the array module of their input.

A layer owns no parameter memory: :meth:`Layer.bind` hands it views into the
model's flat parameter and gradient buffers. Outputs go to buffers kept per
shape and reused, so the hot path allocates nothing; a returned array is valid
until the layer's next call. Backward writes gradients in place (``out=``), or
adds to them when ``accumulate`` is set (gradient accumulation).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpisgd.backend import xp_of

Array = Any  # numpy.ndarray or cupy.ndarray


class Layer:
    """Base class: no parameters, buffer cache, gradient-accumulation flag."""

    param_shapes: list[tuple[str, tuple[int, ...]]] = []

    def __init__(self) -> None:
        self.params: dict[str, Array] = {}
        self.grads: dict[str, Array] = {}
        self.accumulate = False  # add to .grads instead of overwriting them
        self._bufs: dict[tuple[str, tuple[int, ...]], Array] = {}

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {}

    def bind(self, params: dict[str, Array], grads: dict[str, Array]) -> None:
        self.params, self.grads = params, grads

    def _buf(self, name: str, shape: tuple[int, ...], like: Array) -> Array:
        key = (name, shape)
        buf = self._bufs.get(key)
        if buf is None or buf.dtype != like.dtype:
            buf = xp_of(like).empty(shape, dtype=like.dtype)
            self._bufs[key] = buf
        return buf

    def _grad_out(self, name: str, value_shape: tuple[int, ...], like: Array) -> Array:
        """Where backward writes a gradient: the grad view itself, or scratch to add from."""
        return self._buf("acc_" + name, value_shape, like) if self.accumulate else self.grads[name]

    def _grad_done(self, name: str, out: Array) -> None:
        if self.accumulate:
            self.grads[name] += out

    def forward(self, x: Array) -> Array:
        raise NotImplementedError

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class Linear(Layer):
    """y = x W + b, with W of shape (in, out) so that forward is one GEMM with no transpose copy."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        self.param_shapes = [("W", (n_in, n_out)), ("b", (n_out,))]
        self._x: Array = None

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        # He (Kaiming) uniform for ReLU networks, zero bias
        bound = math.sqrt(6.0 / self.n_in)
        return {"W": rng.uniform(-bound, bound, (self.n_in, self.n_out)).astype(dtype),
                "b": np.zeros(self.n_out, dtype)}

    def forward(self, x: Array) -> Array:
        xp = xp_of(x)
        self._x = x
        y = self._buf("y", (x.shape[0], self.n_out), x)
        xp.matmul(x, self.params["W"], out=y)
        y += self.params["b"]
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        xp = xp_of(dy)
        dW = self._grad_out("W", (self.n_in, self.n_out), dy)
        xp.matmul(self._x.T, dy, out=dW)
        self._grad_done("W", dW)
        db = self._grad_out("b", (self.n_out,), dy)
        xp.sum(dy, axis=0, out=db)
        self._grad_done("b", db)
        if not need_dx:
            return None
        dx = self._buf("dx", self._x.shape, dy)
        xp.matmul(dy, self.params["W"].T, out=dx)
        return dx

    def __repr__(self) -> str:
        return f"Linear({self.n_in}, {self.n_out})"


class ReLU(Layer):
    """max(x, 0); ``inplace`` overwrites the input (safe after a layer that owns its output)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace
        self._y: Array = None

    def forward(self, x: Array) -> Array:
        y = x if self.inplace else self._buf("y", x.shape, x)
        xp_of(x).maximum(x, 0, out=y)
        self._y = y
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        # dy belongs to the next layer and is consumed here: zero it in place
        xp_of(dy).multiply(dy, self._y > 0, out=dy)
        return dy


class Flatten(Layer):
    """(N, ...) -> (N, prod(...)), a view."""

    def __init__(self) -> None:
        super().__init__()
        self._shape: tuple[int, ...] = ()

    def forward(self, x: Array) -> Array:
        self._shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        return dy.reshape(self._shape) if need_dx else None


class Conv2d(Layer):
    """2-D convolution (cross-correlation) by im2col + one GEMM; NCHW, square kernel."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, padding: int = 0) -> None:
        super().__init__()
        self.c_in, self.c_out, self.k, self.stride, self.pad = c_in, c_out, kernel, stride, padding
        self.param_shapes = [("W", (c_out, c_in, kernel, kernel)), ("b", (c_out,))]
        self._cols: Array = None
        self._xshape: tuple[int, ...] = ()

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        fan_in = self.c_in * self.k * self.k
        bound = math.sqrt(6.0 / fan_in)
        return {"W": rng.uniform(-bound, bound, (self.c_out, self.c_in, self.k, self.k)).astype(dtype),
                "b": np.zeros(self.c_out, dtype)}

    def _out_hw(self, h: int, w: int) -> tuple[int, int]:
        return (h + 2 * self.pad - self.k) // self.stride + 1, (w + 2 * self.pad - self.k) // self.stride + 1

    def forward(self, x: Array) -> Array:
        xp = xp_of(x)
        n, c, h, w = x.shape
        ho, wo = self._out_hw(h, w)
        self._xshape = x.shape
        if self.pad:
            xpad = self._buf("xpad", (n, c, h + 2 * self.pad, w + 2 * self.pad), x)
            xpad.fill(0)
            xpad[:, :, self.pad:self.pad + h, self.pad:self.pad + w] = x
        else:
            xpad = x
        s = self.stride
        sn, sc, sh, sw = xpad.strides
        # windows as a strided view (N, Ho, Wo, C, k, k), then one copy into the column matrix
        win = xp.lib.stride_tricks.as_strided(
            xpad, (n, ho, wo, c, self.k, self.k), (sn, sh * s, sw * s, sc, sh, sw))
        cols = self._buf("cols", (n * ho * wo, c * self.k * self.k), x)
        cols.reshape(n, ho, wo, c, self.k, self.k)[...] = win
        self._cols = cols
        out = self._buf("out2d", (n * ho * wo, self.c_out), x)
        xp.matmul(cols, self.params["W"].reshape(self.c_out, -1).T, out=out)
        out += self.params["b"]
        y = self._buf("y", (n, self.c_out, ho, wo), x)
        y[...] = out.reshape(n, ho, wo, self.c_out).transpose(0, 3, 1, 2)
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        xp = xp_of(dy)
        n, c, h, w = self._xshape
        ho, wo = dy.shape[2], dy.shape[3]
        dy2 = self._buf("dy2", (n * ho * wo, self.c_out), dy)
        dy2.reshape(n, ho, wo, self.c_out)[...] = dy.transpose(0, 2, 3, 1)
        dW = self._grad_out("W", (self.c_out, c, self.k, self.k), dy)
        xp.matmul(dy2.T, self._cols, out=dW.reshape(self.c_out, -1))
        self._grad_done("W", dW)
        db = self._grad_out("b", (self.c_out,), dy)
        xp.sum(dy2, axis=0, out=db)
        self._grad_done("b", db)
        if not need_dx:
            return None
        dcols = self._buf("dcols", (n * ho * wo, c * self.k * self.k), dy)
        xp.matmul(dy2, self.params["W"].reshape(self.c_out, -1), out=dcols)
        dcols6 = dcols.reshape(n, ho, wo, c, self.k, self.k)
        hp, wp = h + 2 * self.pad, w + 2 * self.pad
        dxpad = self._buf("dxpad", (n, c, hp, wp), dy)
        dxpad.fill(0)
        s = self.stride
        for i in range(self.k):  # col2im: scatter-add each kernel offset
            for j in range(self.k):
                dxpad[:, :, i:i + s * ho:s, j:j + s * wo:s] += dcols6[:, :, :, :, i, j].transpose(0, 3, 1, 2)
        if self.pad:
            return dxpad[:, :, self.pad:self.pad + h, self.pad:self.pad + w]
        return dxpad

    def __repr__(self) -> str:
        return f"Conv2d({self.c_in}, {self.c_out}, kernel={self.k}, stride={self.stride}, padding={self.pad})"


class MaxPool2d(Layer):
    """Non-overlapping max pooling (kernel = stride); odd edges are dropped."""

    def __init__(self, kernel: int = 2) -> None:
        super().__init__()
        self.k = kernel
        self._arg: Array = None
        self._xshape: tuple[int, ...] = ()

    def forward(self, x: Array) -> Array:
        xp = xp_of(x)
        n, c, h, w = x.shape
        k = self.k
        ho, wo = h // k, w // k
        self._xshape = x.shape
        win = x[:, :, :ho * k, :wo * k].reshape(n, c, ho, k, wo, k).transpose(0, 1, 2, 4, 3, 5)
        win = win.reshape(n, c, ho, wo, k * k)
        self._arg = xp.argmax(win, axis=-1)  # the first maximum gets the gradient, as in PyTorch
        return xp.take_along_axis(win, self._arg[..., None], axis=-1)[..., 0]

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        xp = xp_of(dy)
        n, c, h, w = self._xshape
        k = self.k
        ho, wo = h // k, w // k
        dwin = xp.zeros((n * c * ho * wo, k * k), dtype=dy.dtype)
        # scatter each output gradient to its window's arg-max (plain fancy indexing: NumPy and CuPy alike)
        dwin[xp.arange(dwin.shape[0]), self._arg.reshape(-1)] = dy.reshape(-1)
        dx = self._buf("dx", self._xshape, dy)
        dx.fill(0)
        dx[:, :, :ho * k, :wo * k] = dwin.reshape(n, c, ho, wo, k, k).transpose(0, 1, 2, 4, 3, 5).reshape(
            n, c, ho * k, wo * k)
        return dx

    def __repr__(self) -> str:
        return f"MaxPool2d({self.k})"
