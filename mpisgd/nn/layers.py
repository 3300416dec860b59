"""Layers with explicit forward and backward on the array module of their input.

A layer owns no parameter memory: the model (mpisgd.nn.module.Model) hands it views into its flat
parameter and gradient buffers. Outputs go to buffers kept per
shape and reused, so the hot path allocates nothing; a returned array is valid
until the layer's next call. Backward writes gradients in place (``out=``), or
adds to them when ``accumulate`` is set (gradient accumulation).

Linear takes (..., in) arrays, ReLU and Flatten (N, ...). Conv2d and MaxPool2d take (N, C, H, W)
batches and run batch last inside, on (C, H, W, N) arrays (see Conv2d for why): along a run of image
layers the model transposes once at each end of the run (mpisgd.nn.layout).

Matrix products and sums along an axis go through the model's kernels (``self.ctx.kernels``,
mpisgd.kernels): the array module's own (fast) or ones whose bits are a function of the inputs alone
(portable). Everything else here is elementwise or a copy, which rounds alike everywhere.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.nn.conv_products import products_for
from mpisgd.nn.layout import SpatialModule
from mpisgd.nn.module import Array, Module

CHUNK_BYTES = 512 * 1024  # im2col columns per chunk: within a core's L2, so the GEMM reads them from cache


def window_view(a: Array, k: int, stride: int, ho: int, wo: int) -> Array:
    """View (C, k, k, Ho, Wo, N) of a (padded) (C, Hp, Wp, N) array: [c, i, j] is the grid of elements at
    kernel offset (i, j) of every k x k window, windows ``stride`` apart. No copy: im2col copies out of
    it, col2im adds into it (each [c, i, j] grid holds no element twice, so ``+=`` on it is safe)."""
    sc, sh, sw, sn = a.strides
    return xp_of(a).lib.stride_tricks.as_strided(
        a, (a.shape[0], k, k, ho, wo, a.shape[3]), (sc, sh, sw, sh * stride, sw * stride, sn))


def floating_input(layer: Module, x: Array) -> None:
    """TypeError unless ``x`` holds floats (raw uint8 pixels or integer ids failed in a ufunc's casting)."""
    if x.dtype.kind != "f":
        raise TypeError(f"{layer!r} takes floating-point inputs, got {x.dtype}: convert them as training did, e.g. "
                        "x.astype(np.float32) standardised (mpisgd.data.PIXEL_MEAN, PIXEL_STD for Fashion-MNIST)")


class Linear(Module):
    """y = x W + b, with W of shape (in, out) so that forward is one GEMM with no transpose copy.

    ``x`` is (..., in): any leading dimensions (a transformer's (N, T, D)) are one GEMM's rows. The
    weights start He (Kaiming) uniform, for ReLU networks, or, with ``init_std``, normal with that
    deviation (GPT-2's 0.02); the bias at zero."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, n_in: int, n_out: int, init_std: float | None = None) -> None:
        super().__init__()
        if n_in < 1 or n_out < 1:
            raise ValueError(f"Linear({n_in}, {n_out}): its input and output widths must be >= 1")
        self.n_in, self.n_out, self.init_std = n_in, n_out, init_std
        self.param_shapes = [("W", (n_in, n_out)), ("b", (n_out,))]
        self._x: Array = None  # the input as (rows, in)
        self._w: Any = None  # W as the kernels prepared it in forward, for backward (mpisgd.kernels.weight)

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        if self.init_std is None:
            bound = math.sqrt(6.0 / self.n_in)
            W = rng.uniform(-bound, bound, (self.n_in, self.n_out))
        else:
            W = rng.normal(0.0, self.init_std, (self.n_in, self.n_out))
        return {"W": W.astype(dtype), "b": np.zeros(self.n_out, dtype)}

    def forward(self, x: Array) -> Array:
        if x.ndim == 0 or x.shape[-1] != self.n_in:  # else reshape makes other rows, or fails obscurely
            raise ValueError(f"{self!r} takes {self.n_in} features on the input's last axis, got shape "
                             f"{tuple(x.shape)}")
        floating_input(self, x)
        self._x = x.reshape(-1, self.n_in)  # a view (x itself when 2-D): rows of one GEMM
        self._w = self.ctx.kernels.weight(self.params["W"], self._w)
        y = self._buf("y", (*x.shape[:-1], self.n_out), x)
        self.ctx.kernels.matmul(self._x, self._w, out=y.reshape(-1, self.n_out))
        y += self.params["b"]
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        ops = self.ctx.kernels
        dy2 = dy.reshape(-1, self.n_out)
        dW = self._grad_out("W", (self.n_in, self.n_out), dy)
        ops.matmul(self._x.T, dy2, out=dW)
        self._grad_done("W", dW)
        db = self._grad_out("b", (self.n_out,), dy)
        ops.sum(dy2, axis=0, out=db)
        self._grad_done("b", db)
        if not need_dx:
            return None
        dx = self._buf("dx", (*dy.shape[:-1], self.n_in), dy)
        ops.matmul(dy2, self._w.T, out=dx.reshape(-1, self.n_in))
        return dx

    def __repr__(self) -> str:
        return f"Linear({self.n_in}, {self.n_out})"


class ReLU(Module):
    """max(x, 0); ``inplace`` overwrites the input (safe after a layer that owns its output)."""

    portable = True  # through ctx.kernels, or elementwise only

    layout_free = True  # elementwise: runs in any layout (inside a batch-last run of image layers too)

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


class Flatten(Module):
    """(N, ...) -> (N, prod(...)), a view."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self) -> None:
        super().__init__()
        self._shape: tuple[int, ...] = ()

    def forward(self, x: Array) -> Array:
        self._shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        return dy.reshape(self._shape) if need_dx else None


class Permute(Module):
    """y = x.transpose(axes), copied into a contiguous buffer: changes the layout between layers."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, axes: tuple[int, ...]) -> None:
        super().__init__()
        self.axes = tuple(axes)
        self._inverse = tuple(int(a) for a in np.argsort(self.axes))

    def forward(self, x: Array) -> Array:
        y = self._buf("y", tuple(x.shape[a] for a in self.axes), x)
        y[...] = x.transpose(self.axes)
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        dx = self._buf("dx", tuple(dy.shape[a] for a in self._inverse), dy)
        dx[...] = dy.transpose(self._inverse)
        return dx

    def __repr__(self) -> str:
        return f"Permute({self.axes})"


def image_shape(model: str, in_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``in_shape`` as (C, H, W) for a convolutional ``model``; ValueError, in one line, for samples that are
    not 3-D, and for ones that look channels-last (H x W x C: 28 x 28 x 1, 32 x 32 x 3), which would train
    as many channels of images a few pixels wide."""
    if len(in_shape) != 3:
        raise ValueError(f"--model {model} takes C x H x W samples (images); the data's are {in_shape}: use --model "
                         "mlp")
    c, h, w = in_shape
    if w in (1, 3, 4) and min(c, h) >= 8:
        raise ValueError(f"--model {model} reads C x H x W samples; the data's are {c} x {h} x {w}, which look like "
                         f"H x W x C (channels last: {w} channel(s) of {c} x {h} images): give the arrays as N x C x H "
                         "x W (numpy: x.transpose(0, 3, 1, 2))")
    return c, h, w


class Conv2d(SpatialModule):
    """2-D convolution (cross-correlation), square kernel: (N, C, H, W) batches, batch last inside.

    im2col copies the k x k windows, through a strided view of the zero-padded input, into columns
    (c_in*k*k, Ho*Wo, N); then, at every output position, ``y[:, pos] = W cols[:, pos]`` with W as
    (c_out, c_in*k*k): one small GEMM per position, all in one batched matmul call.

    Why batch last: im2col, col2im, pooling, bias and ReLU then move runs of N contiguous elements or
    more (in NCHW they move rows of Wo, as short as 5, and numpy pays per run), and each layer's output
    is already in the next one's layout: the model transposes the batch once at the start of a run of
    image layers and once at its end (mpisgd.nn.layout). W keeps PyTorch's (c_out, c_in, k, k) layout;
    ``bias=False`` leaves out b (before a BatchNorm, which has its own shift).

    Why in chunks of output rows: the columns of the whole batch are k*k*c_in times the input (10 MiB
    for LeNet's first layer at N=128); made a few rows at a time (CHUNK_BYTES) they are still in cache
    when the GEMM reads them. Backward makes them again for dW rather than keeping them all, and
    computes dx one kernel offset at a time (see :meth:`_input_grad`): no buffer of the step is larger
    than an activation, which matters most when ranks share a cache.
    """

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, padding: int = 0,
                 bias: bool = True) -> None:
        super().__init__()
        if min(c_in, c_out, kernel, stride) < 1 or padding < 0:
            raise ValueError(f"Conv2d({c_in}, {c_out}, kernel={kernel}, stride={stride}, padding={padding}): "
                             "channels, kernel and stride must be >= 1, padding >= 0")
        self.c_in, self.c_out, self.k, self.stride, self.pad, self.bias = c_in, c_out, kernel, stride, padding, bias
        self.param_shapes = [("W", (c_out, c_in, kernel, kernel))] + ([("b", (c_out,))] if bias else [])
        self._xpad: Array = None  # the padded input, kept for backward
        self._samples: Any = None  # the padded input as the kernels prepared it (portable: integers) for forward
        self._dw_samples: Any = None  # ... for the weight gradient
        self._dy_samples: Any = None  # the padded output gradient so (the "same" input gradient)
        self._xshape: tuple[int, ...] = ()

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        fan_in = self.c_in * self.k * self.k
        bound = math.sqrt(6.0 / fan_in)
        values = {"W": rng.uniform(-bound, bound, (self.c_out, self.c_in, self.k, self.k)).astype(dtype)}
        return {**values, "b": np.zeros(self.c_out, dtype)} if self.bias else values

    def _out_hw(self, h: int, w: int) -> tuple[int, int]:
        return (h + 2 * self.pad - self.k) // self.stride + 1, (w + 2 * self.pad - self.k) // self.stride + 1

    def _padded(self, x: Array, name: str = "xpad") -> Array:
        if not self.pad:
            return x
        c, h, w, n = x.shape
        p = self.pad
        xpad = self._buf(name, (c, h + 2 * p, w + 2 * p, n), x, zeroed=True)  # the border stays zero
        xpad[:, p:p + h, p:p + w] = x
        return xpad

    def _windows(self, a: Array, ho: int, wo: int) -> Array:
        return window_view(a, self.k, self.stride, ho, wo)

    def _row_chunks(self, ho: int, wo: int, n: int, itemsize: int, c: int | None = None,
                    nbytes: int | None = None) -> list[tuple[int, int]]:
        """Output rows [r0, r1) of each chunk: as many rows as keep a chunk's columns (of ``c`` input
        channels, c_in by default) within ``nbytes`` (CHUNK_BYTES by default: mpisgd.nn.conv_products)."""
        per_row = (self.c_in if c is None else c) * self.k * self.k * wo * n * itemsize
        rows = max(1, min(ho, (nbytes or CHUNK_BYTES) // per_row))
        return [(r0, min(ho, r0 + rows)) for r0 in range(0, ho, rows)]

    def _im2col(self, windows: Array, r0: int, r1: int, name: str = "cols", rows: int | None = None) -> Array:
        """Columns (c*k*k, (r1-r0)*Wo, N) of output rows [r0, r1): one copy out of the window view (into a
        buffer of ``rows`` rows, those past c*k*k zero, where the kernels want whole chunks)."""
        c, k, _, _, wo, n = windows.shape
        ckk = c * k * k
        cols = self._buf(name, (rows or ckk, (r1 - r0) * wo, n), windows, zeroed=rows is not None)
        cols[:ckk].reshape(c, k, k, r1 - r0, wo, n)[...] = windows[:, :, :, r0:r1]
        return cols

    def _correlate(self, padded: Array, W: Array, out: Array, state: Any = None, by_window: bool = True) -> Any:
        """out (c', Ho, Wo, N) = the correlation of ``padded`` (c, Hp, Wp, N) with the kernels ``W`` (c', c*k*k),
        chunk by chunk of output rows, by the products of the model's kernels (mpisgd.nn.conv_products);
        returns what they keep for the next call (the portable ones: the input as integers, ``state`` the
        last call's; ``by_window``: each sample scaled by its largest window rather than its largest element)."""
        return products_for(self.ctx.kernels).correlate(self, padded, W, out, state, by_window)

    def forward_bl(self, x: Array) -> Array:
        c, h, w, n = x.shape
        floating_input(self, x)
        if c != self.c_in:
            raise ValueError(f"{self!r} takes {self.c_in} channels, got {c} (input shape {tuple(x.shape)}, batch "
                             f"{'last' if self.batch_last else 'first'})")
        ho, wo = self._out_hw(h, w)
        if ho < 1 or wo < 1:
            raise ValueError(f"{self!r}: the {h} x {w} input is smaller than the kernel")
        self._xshape = x.shape
        self._xpad = self._padded(x)
        y = self._buf("y", (self.c_out, ho, wo, n), x)
        self._samples = self._correlate(self._xpad, self.params["W"].reshape(self.c_out, -1), y, self._samples)
        if self.bias:
            y += self.params["b"][:, None, None, None]
        return y

    def backward_bl(self, dy: Array, need_dx: bool = True) -> Array | None:
        self._weight_grads(dy)
        return self._input_grad(dy) if need_dx else None

    def _weight_grads(self, dy: Array) -> None:
        """dW = sum over chunks of cols (ckk, M) @ dy^T (M, c_out), M = the chunk's positions x N (a long inner
        dimension: what BLAS likes for a reduction), with the columns made again; db = sum of dy."""
        ops = self.ctx.kernels
        c, ckk = self.c_in, self.c_in * self.k * self.k
        dW_chunks, self._dw_samples = products_for(ops).weight_grad_chunks(self, dy, self._dw_samples)
        dW = self._grad_out("W", (self.c_out, c, self.k, self.k), dy)
        ops.sum(dW_chunks, axis=0, out=dW.reshape(self.c_out, ckk).T)
        self._grad_done("W", dW)
        if self.bias:
            db = self._grad_out("b", (self.c_out,), dy)
            ops.sum(dy.reshape(self.c_out, -1), axis=1, out=db)
            self._grad_done("b", db)

    def _input_grad(self, dy: Array) -> Array:
        """dx, by the cheaper of two routes for this convolution's shape (fixed by it): a "same" convolution
        (stride 1, padding (k-1)/2: ResNet's 3 x 3) has as its transpose a "same" convolution of dy with the
        kernels flipped and c_in, c_out swapped, which runs through forward's path (im2col in cache, one
        product per position); any other goes kernel offset by kernel offset."""
        return self._input_grad_same(dy) if self._same else self._input_grad_by_offset(dy)

    @property
    def _same(self) -> bool:
        return self.stride == 1 and 2 * self.pad == self.k - 1

    def _input_grad_same(self, dy: Array) -> Array:
        c, h, w, n = self._xshape
        W_flip = self._buf("W_flip", (c, self.c_out, self.k, self.k), dy)
        W_flip[...] = self.params["W"].transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]
        dx = self._buf("dx", (c, h, w, n), dy)
        # dy's windows vary more than an activation's: scaled by its largest element, two slices
        self._dy_samples = self._correlate(self._padded(dy, "dypad"), W_flip.reshape(c, -1), dx, self._dy_samples,
                                           by_window=False)
        return dx

    def _input_grad_by_offset(self, dy: Array) -> Array:
        """Kernel offset by kernel offset, W[:, :, i, j]^T dy goes back onto the inputs that offset's
        windows read. This is col2im with its GEMM split by offset: each product is added while still
        in cache, and no (c_in*k*k, positions, N) buffer of column gradients is ever made."""
        c, h, w, n = self._xshape
        _, ho, wo, _ = dy.shape
        p = self.pad
        dxpad = self._buf("dxpad", (c, h + 2 * p, w + 2 * p, n), dy)
        dxpad.fill(0)
        targets = self._windows(dxpad, ho, wo)
        W_t = self._buf("W_t", (self.k, self.k, c, self.c_out), dy)  # [i, j] contiguous, as BLAS needs
        W_t[...] = self.params["W"].transpose(2, 3, 1, 0)
        products_for(self.ctx.kernels).add_back(self, dy, W_t, targets)
        return dxpad[:, p:p + h, p:p + w] if p else dxpad

    def __repr__(self) -> str:
        return (f"Conv2d({self.c_in}, {self.c_out}, kernel={self.k}, stride={self.stride}, padding={self.pad}"
                + (")" if self.bias else ", bias=False)"))


class MaxPool2d(SpatialModule):
    """Non-overlapping max pooling (kernel = stride), (N, C, H, W) batches, batch last inside as Conv2d;
    odd edges are dropped.

    Separable: the max over each k x k window is the max along W of k neighbours, then along H of k
    of those. Each pass keeps, per output, the index (0..k-1) of the first maximum (uint8), so backward
    routes each gradient to exactly one input, the first maximum of its window in row-major order, as
    PyTorch does: ties (flat background regions give many) get the gradient once, not once per tie.
    """

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, kernel: int = 2) -> None:
        super().__init__()
        if kernel < 2:
            raise ValueError(f"max pooling needs kernel >= 2, got {kernel}")
        self.k = kernel
        self._xshape: tuple[int, ...] = ()
        self._arg_h: Array = None
        self._arg_w: Array = None

    def _group(self, a: Array, axis: int, q: int) -> Array:
        """Elements q, q+k, q+2k, ... along ``axis``: the q-th member of every group of k."""
        return a[(slice(None),) * axis + (slice(q, None, self.k),)]

    def _max_along(self, x: Array, axis: int, name: str) -> tuple[Array, Array]:
        """Max over groups of k neighbours along ``axis``, and the index of the first maximum in each."""
        xp = xp_of(x)
        first = self._group(x, axis, 0)
        out = self._buf(name, first.shape, x)
        arg = self._buf("arg_" + name, first.shape, x, dtype=np.uint8)
        xp.greater(self._group(x, axis, 1), first, out=arg)  # strictly: the first of equals wins
        xp.maximum(first, self._group(x, axis, 1), out=out)
        if self.k > 2:
            better = self._buf("mask", first.shape, x, dtype=np.bool_)
            for q in range(2, self.k):
                part = self._group(x, axis, q)
                xp.greater(part, out, out=better)
                arg[better] = q
                xp.maximum(out, part, out=out)
        return out, arg

    def _route_along(self, dout: Array, arg: Array, dx: Array, axis: int) -> None:
        """Backward of :meth:`_max_along`: each gradient of ``dout`` to the input that was the maximum."""
        xp = xp_of(dout)
        is_q = self._buf("mask", arg.shape, dout, dtype=np.bool_)
        for q in range(self.k):
            xp.equal(arg, q, out=is_q)
            xp.multiply(dout, is_q, out=self._group(dx, axis, q))

    def forward_bl(self, x: Array) -> Array:
        c, h, w, n = x.shape
        k = self.k
        if h < k or w < k:
            raise ValueError(f"{self!r}: the {h} x {w} input is smaller than the window")
        self._xshape = x.shape
        # along W first, then H: the first maximum of the window in row-major order wins
        maxes, self._arg_w = self._max_along(x[:, :h // k * k, :w // k * k], 2, "row_max")  # (C, H', Wo, N)
        y, self._arg_h = self._max_along(maxes, 1, "y")  # (C, Ho, Wo, N)
        return y

    def backward_bl(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        c, h, w, n = self._xshape
        k = self.k
        dmaxes = self._buf("row_max", self._arg_w.shape, dy)  # forward's row maxima are no longer needed
        self._route_along(dy, self._arg_h, dmaxes, 1)
        dx = self._buf("dx", self._xshape, dy, zeroed=True)  # the dropped odd edges stay zero
        self._route_along(dmaxes, self._arg_w, dx[:, :h // k * k, :w // k * k], 2)
        return dx

    def __repr__(self) -> str:
        return f"MaxPool2d({self.k})"
