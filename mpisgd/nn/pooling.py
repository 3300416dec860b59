"""Average pooling: AvgPool2d (k x k windows) and GlobalAvgPool2d (the whole image, to (N, C): the head
of a ResNet). Both take (N, C, H, W) batches and run batch last inside, as the other image layers
(mpisgd.nn.layout); MaxPool2d is in mpisgd.nn.layers.
"""

from __future__ import annotations

from mpisgd.backend import xp_of
from mpisgd.nn.layers import window_view
from mpisgd.nn.layout import SpatialModule
from mpisgd.nn.module import Array


class AvgPool2d(SpatialModule):
    """The mean of each k x k window, windows ``stride`` apart (default: k, non-overlapping); no padding,
    so the rows and columns a last window would overhang are dropped (PyTorch's floor rule)."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, kernel: int = 2, stride: int | None = None) -> None:
        super().__init__()
        self.k, self.stride = kernel, kernel if stride is None else stride
        if self.k < 1 or self.stride < 1:
            raise ValueError(f"AvgPool2d: kernel and stride must be >= 1, got {kernel} and {stride}")
        self._xshape: tuple[int, ...] = ()

    def _out_hw(self, h: int, w: int) -> tuple[int, int]:
        return (h - self.k) // self.stride + 1, (w - self.k) // self.stride + 1

    def forward_bl(self, x: Array) -> Array:
        c, h, w, n = x.shape
        ho, wo = self._out_hw(h, w)
        if ho < 1 or wo < 1:
            raise ValueError(f"{self!r}: the {h} x {w} input is smaller than the window")
        self._xshape = x.shape
        windows = window_view(x, self.k, self.stride, ho, wo)
        y = self._buf("y", (c, ho, wo, n), x)
        y[...] = windows[:, 0, 0]
        for i in range(self.k):
            for j in range(self.k):
                if i or j:
                    y += windows[:, i, j]
        y *= x.dtype.type(1.0 / (self.k * self.k))
        return y

    def backward_bl(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        xp = xp_of(dy)
        c, h, w, n = self._xshape
        ho, wo = dy.shape[1:3]
        share = self._buf("share", dy.shape, dy)
        xp.multiply(dy, dy.dtype.type(1.0 / (self.k * self.k)), out=share)
        dx = self._buf("dx", self._xshape, dy)
        if self.stride == self.k and h == ho * self.k and w == wo * self.k:  # the windows tile the input
            dx.reshape(c, ho, self.k, wo, self.k, n)[...] = share[:, :, None, :, None, :]
            return dx
        dx.fill(0)
        targets = window_view(dx, self.k, self.stride, ho, wo)
        for i in range(self.k):
            for j in range(self.k):
                targets[:, i, j] += share
        return dx

    def __repr__(self) -> str:
        return f"AvgPool2d({self.k}" + (f", stride={self.stride})" if self.stride != self.k else ")")


class GlobalAvgPool2d(SpatialModule):
    """The mean of each channel over the whole image: (N, C, H, W) -> (N, C), ready for a Linear. It ends
    a batch-last run: its output is batch first whatever the layout of its input."""

    portable = True  # through ctx.kernels, or elementwise only

    ends_run = True

    def __init__(self) -> None:
        super().__init__()
        self._xshape: tuple[int, ...] = ()

    def forward_bl(self, x: Array) -> Array:
        c, h, w, n = x.shape
        self._xshape = x.shape
        means = self._buf("means", (c, n), x)
        self.ctx.kernels.sum(x.reshape(c, h * w, n), axis=1, out=means)
        means *= x.dtype.type(1.0 / (h * w))
        y = self._buf("y", (n, c), x)
        y[...] = means.T
        return y

    def backward_bl(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        c, h, w, n = self._xshape
        share = self._buf("share", (c, n), dy)
        share[...] = dy.T
        share *= dy.dtype.type(1.0 / (h * w))
        dx = self._buf("dx", self._xshape, dy)
        dx.reshape(c, h * w, n)[...] = share[:, None, :]
        return dx
