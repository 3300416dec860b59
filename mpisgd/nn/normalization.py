"""Batch normalization: BatchNorm1d (N, C), BatchNorm2d (N, C, H, W), and SyncBatchNorm, whose
statistics cover every rank's current micro-batch.

In train mode a layer normalises each channel by the mean and (biased) variance of the micro-batch it
is given, y = gamma * (x - mean) / sqrt(var + eps) + beta; in eval mode by its **running statistics**,
buffers of the model (``model.state``: broadcast, checkpointed, saved with the model). PyTorch's
convention: ``running = (1 - momentum) * running + momentum * statistic``, with the *unbiased*
variance (n / (n - 1) times the biased one) as the variance's statistic; they start at 0 and 1.

What the running statistics are an average of. Under data parallelism each micro-batch's mean and
unbiased variance are written to the step's statistics row (``ctx.stat_row``); DataParallel averages
the rows over all k·m micro-batches of the global batch and hands the average to ``apply_stats``, which
makes one momentum update per optimizer step, the same on every rank. So the running mean is an
exponential average, over steps, of the mean of the micro-batches' means (the global batch's mean), and
the running variance an exponential average of the mean of the micro-batches' unbiased variances
(which leaves out how far the micro-batches' means spread). Without a row (a model used on its own)
each forward in train mode updates them at once, from its own micro-batch.

Which statistics to normalise by, across ranks:

- BatchNorm1d / BatchNorm2d: each micro-batch's own statistics ("ghost" batch norm: b samples whatever
  k). k-invariant: a micro-batch is the same samples at any k, so ``--reproducible`` gives the same bits.
- SyncBatchNorm: the k ranks' current micro-batches together (k·b samples). Not k-invariant: the
  statistics change with k, so ``--reproducible`` refuses it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.backend import to_numpy, xp_of
from mpisgd.nn.layout import SpatialModule
from mpisgd.nn.module import Array, Module


class _Norm:
    """The computation of batch normalization on a 2-D view with the channels along ``axis`` (0: (C, M),
    rows per channel, batch last; 1: (M, C)) and the statistics over the other axis. Mixed into the
    layers below, which give it their view."""

    # what the layers below provide
    C: int
    eps: float
    momentum: float
    params: dict[str, Array]
    grads: dict[str, Array]
    buffers: dict[str, Array]
    ctx: Any
    stat_offset: int
    training: bool
    _buf: Any
    _grad_out: Any
    _grad_done: Any

    def _col(self, v: Array, axis: int) -> Array:
        """A per-channel vector shaped to broadcast against the view."""
        return v[:, None] if axis == 0 else v[None, :]

    def _dot(self, a: Array, b: Array, axis: int) -> Array:
        """Per channel, the sum of a * b over the samples."""
        return self.ctx.kernels.dot_along(a, b, 1 - axis)

    # -- across ranks (SyncBatchNorm overrides these) -----------------------------------------------
    def _combine(self, n: int, mean: Array, m2: Array) -> tuple[int, Array, Array]:
        """The statistics the layer normalises by, from this micro-batch's count, mean and summed squared
        deviations: its own."""
        return n, mean, m2

    def _sum_over_ranks(self, sums: Array) -> Array:
        return sums

    # -- forward and backward ------------------------------------------------------------------
    def _norm_forward(self, a: Array, axis: int) -> Array:
        xp = xp_of(a)
        self._axis, self._train = axis, self.training
        gamma, beta = self.params["gamma"], self.params["beta"]
        y = self._buf("y", a.shape, a)
        if not self._train:  # eval: the running statistics, folded into one scale and shift per channel
            inv_std = self._buf("inv_std", (self.C,), a)
            xp.add(self.buffers["running_var"], a.dtype.type(self.eps), out=inv_std)
            xp.sqrt(inv_std, out=inv_std)
            xp.divide(a.dtype.type(1), inv_std, out=inv_std)
            scale = gamma * inv_std
            xp.multiply(a, self._col(scale, axis), out=y)
            y += self._col(beta - self.buffers["running_mean"] * scale, axis)
            self._x, self._inv_std = a, inv_std
            return y
        red = 1 - axis
        n = int(a.shape[red])
        mean = self.ctx.kernels.mean_along(a, red)
        xc = self._buf("xc", a.shape, a)  # the deviations from the mean, kept for backward
        xp.subtract(a, self._col(mean, axis), out=xc)
        m2 = self._dot(xc, xc, axis)
        n_all, mean_all, m2_all = self._combine(n, mean, m2)
        if n_all < 2:
            raise ValueError(f"{self!r} in train mode needs more than one value per channel, got {n_all} (a batch of "
                             "one sample: use a larger batch, or eval mode)")
        if mean_all is not mean:  # the deviations from the statistics' mean, not this micro-batch's
            xc += self._col(mean - mean_all, axis)
        var = m2_all / a.dtype.type(n_all)
        self._record(mean_all, var * a.dtype.type(n_all / (n_all - 1)))
        inv_std = self._buf("inv_std", (self.C,), a)
        xp.add(var, a.dtype.type(self.eps), out=inv_std)
        xp.sqrt(inv_std, out=inv_std)
        xp.divide(a.dtype.type(1), inv_std, out=inv_std)
        xp.multiply(xc, self._col(gamma * inv_std, axis), out=y)  # y = gamma * xhat + beta, xhat = xc / sigma
        y += self._col(beta, axis)
        self._xc, self._inv_std, self._n = xc, inv_std, n_all
        return y

    def _norm_backward(self, dy: Array, need_dx: bool) -> Array | None:
        """The gradients; dx is written over dy (which backward may overwrite), and, in train mode, over the
        deviations kept from forward (no longer needed after)."""
        xp = xp_of(dy)
        axis = self._axis
        red = 1 - axis
        if self._train:
            xc, inv_std = self._xc, self._inv_std
        else:  # the deviations from the running mean
            xc, inv_std = self._buf("xc", dy.shape, dy), self._inv_std
            xp.subtract(self._x, self._col(self.buffers["running_mean"], axis), out=xc)
        sum_dy = self.ctx.kernels.sum(dy, axis=red)
        sum_dy_xhat = self._dot(dy, xc, axis) * inv_std
        g = self._grad_out("gamma", (self.C,), dy)
        g[...] = sum_dy_xhat
        self._grad_done("gamma", g)
        b = self._grad_out("beta", (self.C,), dy)
        b[...] = sum_dy
        self._grad_done("beta", b)
        if not need_dx:
            return None
        scale = self.params["gamma"] * inv_std
        if not self._train:
            dy *= self._col(scale, axis)
            return dy
        # dx = gamma / sigma * (dy - mean(dy) - xhat * mean(dy * xhat)), the means over the statistics' samples
        sums = self._sum_over_ranks(xp.stack([sum_dy, sum_dy_xhat]))
        inv_n = dy.dtype.type(1.0 / self._n)
        dy -= self._col(sums[0] * inv_n, axis)
        dy *= self._col(scale, axis)
        xc *= self._col(-scale * inv_std * sums[1] * inv_n, axis)
        dy += xc
        return dy

    # -- the running statistics -----------------------------------------------------------------
    def _record(self, mean: Array, var: Array) -> None:
        """This micro-batch's statistics: to the step's row when there is one (DataParallel averages the rows
        and calls apply_stats), else into the running statistics at once."""
        row = self.ctx.stat_row
        if row is None:
            self._update_running(mean, var)
            return
        part = row[self.stat_offset:self.stat_offset + 2 * self.C]
        to_row = to_numpy if isinstance(row, np.ndarray) else (lambda v: v)
        part[:self.C] = to_row(mean)
        part[self.C:] = to_row(var)

    def apply_stats(self, stats: Array) -> None:
        """The step's statistics (float64: the mean, then the unbiased variance, averaged over every
        micro-batch of the global batch): one momentum update of the running statistics."""
        rm = self.buffers["running_mean"]
        xp = xp_of(rm)
        values = xp.asarray(stats).astype(rm.dtype)
        self._update_running(values[:self.C], values[self.C:])

    def _update_running(self, mean: Array, var: Array) -> None:
        m = self.buffers["running_mean"].dtype.type(self.momentum)
        for name, value in (("running_mean", mean), ("running_var", var)):
            running = self.buffers[name]
            running *= 1 - m
            running += m * value


class _BatchNormBase(_Norm, Module):
    """Parameters gamma and beta (C each), buffers running_mean and running_var, 2C statistics."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        Module.__init__(self)
        if num_features < 1:
            raise ValueError(f"{type(self).__name__}: num_features must be >= 1, got {num_features}")
        if not eps > 0 or not 0 < momentum <= 1:
            raise ValueError(f"{type(self).__name__}: eps must be > 0 and momentum in (0, 1], got {eps}, {momentum}")
        self.C, self.eps, self.momentum = num_features, float(eps), float(momentum)
        self.param_shapes = [("gamma", (num_features,)), ("beta", (num_features,))]
        self.buffer_shapes = [("running_mean", (num_features,)), ("running_var", (num_features,))]
        self.stat_size = 2 * num_features

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {"gamma": np.ones(self.C, dtype), "beta": np.zeros(self.C, dtype)}

    def init_buffers(self, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {"running_mean": np.zeros(self.C, dtype), "running_var": np.ones(self.C, dtype)}

    def _check(self, x: Array, channel_axis: int) -> None:
        if x.shape[channel_axis] != self.C:
            raise ValueError(f"{self!r} takes {self.C} channels, got {x.shape[channel_axis]} (input shape "
                             f"{tuple(x.shape)})")

    def extra_repr(self) -> str:
        extra = (f", eps={self.eps:g}" if self.eps != 1e-5 else "") + \
            (f", momentum={self.momentum:g}" if self.momentum != 0.1 else "")
        return f"{self.C}{extra}"


class BatchNorm1d(_BatchNormBase):
    """Batch normalization of (N, C) features (after a Linear): statistics per feature over the
    micro-batch's N samples."""

    def forward(self, x: Array) -> Array:
        if x.ndim != 2:
            raise ValueError(f"{self!r} takes (N, C) arrays, got shape {tuple(x.shape)} (images: BatchNorm2d)")
        self._check(x, 1)
        return self._norm_forward(x, axis=1)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        return self._norm_backward(dy, need_dx)


class BatchNorm2d(_BatchNormBase, SpatialModule):
    """Batch normalization of (N, C, H, W) images: statistics per channel over the micro-batch's N·H·W
    values. Batch last inside (an image layer, mpisgd.nn.layout): the channel's values are one
    contiguous row."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        _BatchNormBase.__init__(self, num_features, eps, momentum)
        self.batch_last = False

    def forward_bl(self, x: Array) -> Array:
        self._check(x, 0)
        self._shape = x.shape
        return self._norm_forward(x.reshape(self.C, -1), axis=0).reshape(x.shape)

    def backward_bl(self, dy: Array, need_dx: bool = True) -> Array | None:
        dx = self._norm_backward(dy.reshape(self.C, -1), need_dx)
        return None if dx is None else dx.reshape(self._shape)


class SyncBatchNorm(BatchNorm2d):
    """BatchNorm2d whose train-mode statistics cover every rank's current micro-batch (k·b samples):
    for per-rank micro-batches too small to normalise by. It reduces across ranks in forward (the counts,
    means and summed squared deviations, one Allgather) and in backward (two sums per channel), combined in
    rank order so that every rank has the same bits; on the communicator ``ctx.comm`` (DataParallel sets
    it; None, one process: plain BatchNorm2d). Every rank must run the same micro-batches through it in
    train mode. The statistics change with k, so ``--reproducible`` refuses it: per-micro-batch
    BatchNorm2d is the k-invariant choice."""

    def _allgather(self, local: np.ndarray) -> np.ndarray:
        """Every rank's ``local`` (float64), as rows in rank order."""
        comm = self.ctx.comm
        out = np.empty((comm.Get_size(), local.size), dtype=np.float64)
        comm.Allgather(local, out)
        return out

    def _combine(self, n: int, mean: Array, m2: Array) -> tuple[int, Array, Array]:
        if self.ctx.comm is None:
            return n, mean, m2
        xp, C = xp_of(mean), self.C
        local = np.concatenate([[float(n)], to_numpy(mean).astype(np.float64), to_numpy(m2).astype(np.float64)])
        rows = self._allgather(local)
        counts, means, m2s = rows[:, 0], rows[:, 1:1 + C], rows[:, 1 + C:]
        n_all = float(counts.sum())
        mean_all = (counts[:, None] * means).sum(axis=0) / n_all
        m2_all = m2s.sum(axis=0) + (counts[:, None] * (means - mean_all) ** 2).sum(axis=0)  # Chan et al.
        return int(n_all), xp.asarray(mean_all.astype(mean.dtype)), xp.asarray(m2_all.astype(mean.dtype))

    def _sum_over_ranks(self, sums: Array) -> Array:
        if self.ctx.comm is None:
            return sums
        rows = self._allgather(to_numpy(sums).astype(np.float64).reshape(-1))
        return xp_of(sums).asarray(rows.sum(axis=0).reshape(sums.shape).astype(sums.dtype))
