"""The arithmetic a model computes with, chosen once per model: ``model.ctx.kernels``.

Layers and losses call their matrix products, sums along an axis and elementary functions through
this object instead of the array module (``self.ctx.kernels.matmul(x, W, out=y)``), so that how they
round is one choice made at set-up:

- ``fast`` (the default): the array module itself, NumPy's BLAS and SIMD loops or CuPy. Its bits
  depend on the BLAS build and kernel, the threads, NumPy's SIMD dispatch (CPU), the GPU and CUDA.
- ``portable``: mpisgd.portable, exact slice GEMMs, fixed-order sums, exp and log from IEEE
  operations. Its bits depend on the inputs alone: any BLAS, CPU, thread count, NumPy version or GPU
  gives the same.

``fast`` calls exactly what the layers called before the choice existed (the same functions with the
same arguments), so the default run's bits and speed are those of the plain array module. What a new
layer must route: every matrix product, every sum along an axis (bias gradients, softmax
denominators, means) and every transcendental function (exp, log, tanh, erf, 1/sqrt). Elementwise
+, -, *, /, max, comparisons and copies are correctly rounded everywhere and need no routing.

An operand used in several products (a convolution's output gradient, multiplied by each kernel
offset's weights) may be prepared once: ``d = ops.right(dy)``, then ``ops.matmul(W_ij, d)`` for each;
``left`` likewise for the first operand. The fast kernels return the array itself; the portable ones
split it into integer slices once (valid until the next ``left``/``right`` of that shape). A layer's
weight matrix, used forward as ``W`` and backward as ``W.T``, is prepared once per forward:
``self._w = ops.weight(W, self._w)``, then ``ops.matmul(x, self._w)`` and ``ops.matmul(dy, self._w.T)``
(the fast kernels return W itself; the portable ones split it once for both products and the layer
keeps the slices until its backward).
The portable kernels' ``samples(x, k, previous)``: a convolution's padded input as integers with one
power of two per sample (mpisgd.portable.samples), whose im2col needs no splitting. A convolution's
products (how it chunks its columns, whether it prepares its samples) are a strategy of their own,
chosen by the kernels' ``name``: mpisgd.nn.conv_products.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.portable import elementwise, gemm, native, reduce
from mpisgd.portable.samples import Samples
from mpisgd.portable.weight import Weight

Array = Any


class FastKernels:
    """The array module's own kernels (NumPy or CuPy): the default."""

    name = "fast"

    def matmul(self, a: Array, b: Array, out: Array = None) -> Array:
        return xp_of(a).matmul(a, b, out=out)

    def left(self, a: Array) -> Array:
        return a

    def right(self, b: Array) -> Array:
        return b

    def weight(self, w: Array, previous: Any = None) -> Array:
        return w

    def sum(self, a: Array, axis: int, out: Array = None, keepdims: bool = False) -> Array:
        return xp_of(a).sum(a, axis=axis, out=out, keepdims=keepdims)

    def mean(self, a: Array) -> Array:
        """The mean of every element, a 0-d array (no transfer from a GPU)."""
        return a.mean()

    def mean_along(self, a: Array, axis: int, keepdims: bool = False) -> Array:
        """The means along ``axis``, in ``a``'s dtype."""
        return a.mean(axis=axis, keepdims=keepdims)

    def dot_along(self, a: Array, b: Array, axis: int) -> Array:
        """For 2-D ``a`` and ``b`` of one shape, the sums of ``a * b`` along ``axis``."""
        return xp_of(a).einsum("ij,ij->i" if axis == 1 else "ij,ij->j", a, b)

    def exp(self, x: Array, out: Array = None) -> Array:
        return xp_of(x).exp(x, out=out)

    def log(self, x: Array, out: Array = None) -> Array:
        return xp_of(x).log(x, out=out)

    def tanh(self, x: Array, out: Array = None) -> Array:
        return xp_of(x).tanh(x, out=out)

    def erf(self, x: Array, out: Array = None) -> Array:
        """NumPy has no erf: the portable one (CuPy's is in cupyx.scipy.special, not a dependency)."""
        return elementwise.erf(x, out=out)

    def rsqrt(self, x: Array, out: Array = None) -> Array:
        xp = xp_of(x)
        y = xp.sqrt(x, out=out)
        return xp.divide(1, y, out=y)

    def scratch_nbytes(self) -> int:
        return 0


class PortableKernels:
    """Results that are a function of the inputs alone (mpisgd.portable); one instance per model (it keeps
    the GEMMs' float64 scratch between calls)."""

    name = "portable"

    def __init__(self) -> None:
        native.wanted()  # a bad MPISGD_PORTABLE_PASSES: one UsageError at set-up
        self.workspace = gemm.Workspace()
        # the convolutions' samples, shared by every layer (each set is used by the product that follows
        # its prepare): one set per shape, not per layer and use (a ResNet-20 held 1.7 GiB of them)
        self.sample_space = gemm.Workspace()

    def matmul(self, a: Array | gemm.Split, b: Array | gemm.Split | Weight, out: Array = None) -> Array:
        if isinstance(b, Weight):  # a layer's W, prepared in forward: its split for x @ W
            b = b.right
        return gemm.matmul(a, b, out=out, ws=self.workspace)

    def left(self, a: Array) -> gemm.Split:
        return gemm.split(a, "left", self.workspace, tag="prepared-left")

    def right(self, b: Array) -> gemm.Split:
        return gemm.split(b, "right", self.workspace, tag="prepared-right")

    def weight(self, w: Array, previous: Any = None) -> Weight:
        """``w`` split once for ``matmul(x, w)`` and ``matmul(dy, w.T)``; ``previous``, this layer's last one,
        lends its arrays."""
        return (previous if isinstance(previous, Weight) else Weight()).prepare(w)

    def samples(self, x: Array, k: int, previous: Any = None,
                window: tuple[int, int, int, int] | None = None) -> Samples:
        """A convolution's padded input (C, H, W, N) as integers with one power of two per sample, for
        products whose inner dimension k takes its windows (mpisgd.portable.samples): with ``window``
        (kh, stride, Ho, Wo), for W @ cols only (one slice, scaled by its largest window); without, for the weight
        gradient too (two slices). The arrays are scratch in ``sample_space``, shared by every convolution (one set
        per shape); ``previous``, this layer's last one, is reused as the object."""
        return (previous if isinstance(previous, Samples) else Samples(self.sample_space)).prepare(x, k, window)

    def sum(self, a: Array, axis: int, out: Array = None, keepdims: bool = False) -> Array:
        return reduce.tree_sum(a, axis, out=out, keepdims=keepdims)

    def mean(self, a: Array) -> Array:
        return reduce.tree_mean(a)

    def mean_along(self, a: Array, axis: int, keepdims: bool = False) -> Array:
        means = reduce.tree_mean(a, axis)
        return xp_of(a).expand_dims(means, axis) if keepdims else means

    def dot_along(self, a: Array, b: Array, axis: int) -> Array:
        """The products, each correctly rounded, summed in the fixed tree in float64."""
        return reduce.tree_sum(xp_of(a).multiply(a, b, dtype=np.float64), axis).astype(a.dtype)

    def exp(self, x: Array, out: Array = None) -> Array:
        return elementwise.exp(x, out=out)

    def log(self, x: Array, out: Array = None) -> Array:
        return elementwise.log(x, out=out)

    def tanh(self, x: Array, out: Array = None) -> Array:
        return elementwise.tanh(x, out=out)

    def erf(self, x: Array, out: Array = None) -> Array:
        return elementwise.erf(x, out=out)

    def rsqrt(self, x: Array, out: Array = None) -> Array:
        return elementwise.rsqrt(x, out=out)

    def scratch_nbytes(self) -> int:
        """Bytes of scratch the GEMMs keep (the integer slices and their products, the convolutions' samples)."""
        return self.workspace.nbytes() + self.sample_space.nbytes()


Kernels = FastKernels | PortableKernels
FAST = FastKernels()  # stateless: shared by every model that does not choose
KINDS = ("fast", "portable")


def kernels_for(name: str) -> Kernels:
    """A fresh kernels object of kind ``name`` (``fast`` or ``portable``)."""
    if name == "fast":
        return FAST
    if name == "portable":
        return PortableKernels()
    raise ValueError(f"unknown kernels {name!r}: use {' or '.join(KINDS)}")
