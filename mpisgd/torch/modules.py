"""The torch modules mpisgd runs its own way: BatchNorm's running statistics and Dropout's masks.

:func:`convert` swaps them in a module tree, the way ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``
does, keeping the same parameters and buffers under the same names (a ``state_dict`` still loads):

- ``BatchNorm1d/2d/3d`` -> :class:`StatBatchNorm`: in train mode it normalises by the micro-batch's own
  statistics, as torch's does, and writes the micro-batch's mean and unbiased variance to the model's
  statistics row (``Context.stat_row``); data parallelism averages those rows over every micro-batch of
  the global batch and hands the mean back (``apply_stats``), which updates the running statistics with
  torch's momentum rule once per step: the same on every rank, and the same bits at any k where the
  averaging is exact (``--reproducible``). Without a statistics row it behaves as torch's BatchNorm
  (running statistics updated at each forward). ``num_batches_tracked`` is kept as a float (model state:
  broadcast and checkpointed with the rest).
- ``Dropout`` (element-wise) and ``Dropout1d/2d/3d`` (whole channels) -> :class:`KeyedDropout`: the mask
  is a function of (seed, step, global sample index, module, element) (mpisgd.nn.dropout), as mpisgd's
  own Dropout, so it is the same at any k and on resume, and never draws from torch's generator.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from mpisgd.nn.dropout import keyed_uniform16
from mpisgd.torch.views import array_module, as_tensor

nn = torch.nn
F = torch.nn.functional

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_DROPOUTS = {nn.Dropout: False, nn.Dropout1d: True, nn.Dropout2d: True, nn.Dropout3d: True}  # whole channels?
SWAPPED = (*_BATCH_NORMS, *_DROPOUTS)  # the module types convert() replaces
# modules that draw from torch's generator in train mode and cannot be keyed by sample: refused under
# --reproducible (anything else that draws is caught at start-up by mpisgd.torch.runtime's probe)
UNKEYED = (nn.AlphaDropout, nn.FeatureAlphaDropout, nn.RReLU)


class UnsupportedModule(ValueError):
    """A module mpisgd cannot run as asked; the message names it and says what to do instead."""


class StatBatchNorm(nn.Module):
    """torch's BatchNorm (any of 1d, 2d, 3d) with its running statistics updated by mpisgd: from the mean
    of the statistics of every micro-batch of the step (module docstring)."""

    running_mean: Any  # registered buffers (None without track_running_stats)
    running_var: Any
    num_batches_tracked: Any

    def __init__(self, bn: Any) -> None:
        super().__init__()
        self.kind = type(bn).__name__
        self.num_features, self.eps, self.momentum = bn.num_features, bn.eps, bn.momentum
        self.affine, self.track_running_stats = bn.affine, bn.track_running_stats
        self.weight, self.bias = bn.weight, bn.bias  # the same Parameters (or None)
        if self.track_running_stats:
            self.register_buffer("running_mean", bn.running_mean)
            self.register_buffer("running_var", bn.running_var)
            self.register_buffer("num_batches_tracked", bn.num_batches_tracked.to(bn.running_mean.dtype))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.stat_offset = 0  # where this module's statistics start in the statistics row (bind())
        self._ctx: Any = None
        self._batch: dict[tuple[Any, Any], tuple[Any, Any]] = {}  # scratch the kernel writes the batch's statistics to

    @property
    def stat_size(self) -> int:
        """Floats per micro-batch in the statistics row: the mean and the unbiased variance per channel."""
        return 2 * self.num_features if self.track_running_stats else 0

    def bind(self, ctx: Any, stat_offset: int) -> None:
        """Read the micro-batch's statistics row from ``ctx`` (mpisgd.nn.module.Context), at ``stat_offset``."""
        self._ctx, self.stat_offset = ctx, stat_offset

    def forward(self, x: Any) -> Any:
        if not self.track_running_stats:
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        row = None if self._ctx is None else self._ctx.stat_row
        if row is None:  # as torch's BatchNorm: the running statistics follow every forward
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
            factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, factor, self.eps)
        key = (x.dtype, x.device)
        if key not in self._batch:
            self._batch[key] = (torch.zeros(self.num_features, dtype=x.dtype, device=x.device),
                                torch.zeros(self.num_features, dtype=x.dtype, device=x.device))
        mean, var = self._batch[key]
        # momentum 1: the kernel leaves the batch's mean and unbiased variance in (mean, var), nothing else
        y = F.batch_norm(x, mean, var, self.weight, self.bias, True, 1.0, self.eps)
        c, out = self.num_features, as_tensor(row)
        with torch.no_grad():
            out[self.stat_offset:self.stat_offset + c].copy_(mean)
            out[self.stat_offset + c:self.stat_offset + 2 * c].copy_(var)
        return y

    def apply_stats(self, stats: Any) -> None:
        """The step's mean of the micro-batches' statistics (float64, ``stat_size``): the running
        statistics move towards it by ``momentum`` (a cumulative average when momentum is None), in float64."""
        c = self.num_features
        s = as_tensor(stats)
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            for buf, new in ((self.running_mean, s[:c]), (self.running_var, s[c:2 * c])):
                buf.copy_(buf.double() * (1.0 - m) + new.to(buf.device, torch.float64) * m)

    def extra_repr(self) -> str:
        return (f"{self.kind}: {self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class KeyedDropout(nn.Module):
    """Dropout whose mask is keyed by (seed, step, global sample, module, element): mpisgd.nn.dropout's
    rule, so a sample's mask does not depend on which rank, micro-batch or position it is in. ``channels``:
    whole channels (axis 1) dropped at once, as Dropout1d/2d/3d."""

    def __init__(self, p: float, channels: bool, stream: int, kind: str) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise UnsupportedModule(f"{kind}: p must be in [0, 1], got {p}")
        self.p, self.channels, self.stream, self.kind = float(p), channels, stream, kind
        self._threshold = int(round(self.p * 65536))
        self._ctx: Any = None

    def bind(self, ctx: Any) -> None:
        """Take the seed, the step and the samples' global indices from ``ctx`` (mpisgd.nn.module.Context)."""
        self._ctx = ctx

    def forward(self, x: Any) -> Any:
        if not self.training or self._threshold == 0:
            return x
        if self._threshold >= 65536:
            return x * 0.0
        n = x.shape[0]
        ctx = self._ctx
        ids = ctx.sample_ids if ctx is not None and ctx.sample_ids is not None else np.arange(n, dtype=np.int64)
        if len(ids) != n:
            raise ValueError(f"{self.kind}: {len(ids)} sample ids for a batch of {n}: keyed dropout needs the samples "
                             "on the first axis")
        per_sample = x.shape[1] if self.channels else math.prod(x.shape[1:])
        xp = array_module(x.device)
        seed, step = (ctx.seed, ctx.step) if ctx is not None else (0, 0)
        bits = keyed_uniform16(xp, seed, step, self.stream, ids, per_sample)
        keep = as_tensor(xp.ascontiguousarray(bits >= self._threshold))
        shape = (n, per_sample, *([1] * (x.dim() - 2))) if self.channels else x.shape
        mask = keep.reshape(shape).to(x.dtype).mul_(1.0 / (1.0 - self.p))
        return x * mask

    def extra_repr(self) -> str:
        return f"{self.kind}: p={self.p:g}"


def convert(module: Any) -> dict[str, str]:
    """Swap ``module``'s BatchNorm and Dropout submodules (module docstring) in place; returns {path: what
    it became}. Refuses (UnsupportedModule) SyncBatchNorm and lazy modules. Dropout modules are numbered
    in pre-order: each draws its own stream."""
    done: dict[int, Any] = {}  # a module used twice is swapped once, for the same new module
    swapped: dict[str, str] = {}
    stream = 0
    for path, m in list(module.named_modules()):
        if isinstance(m, nn.SyncBatchNorm):
            raise UnsupportedModule(f"{path or 'the model'} is a SyncBatchNorm, which needs torch.distributed: use "
                                    "BatchNorm1d/2d/3d (mpisgd averages its statistics over the global batch)")
        if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():  # type: ignore[misc]
            raise UnsupportedModule(f"{path or 'the model'} ({type(m).__name__}) has uninitialised parameters: give "
                                    "its sizes, or run one forward in the factory before returning the model")
        for name, child in list(m.named_children()):
            new = done.get(id(child))
            if new is None:
                if type(child) in _BATCH_NORMS:
                    new = StatBatchNorm(child)
                elif type(child) in _DROPOUTS:
                    stream += 1
                    new = KeyedDropout(child.p, _DROPOUTS[type(child)], stream, type(child).__name__)
                else:
                    continue
                done[id(child)] = new
            m._modules[name] = new
            swapped[f"{path}.{name}" if path else name] = type(new).__name__
    return swapped


def unkeyed_randomness(module: Any) -> list[str]:
    """The modules that would draw from torch's generator in train mode and that mpisgd cannot key by
    sample: 'path (Class)' each."""
    found = []
    for path, m in module.named_modules():
        if isinstance(m, UNKEYED) or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0):
            found.append(f"{path or 'the model'} ({type(m).__name__})")
    return found
