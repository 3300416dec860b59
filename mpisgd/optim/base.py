"""The local update rules' common ground: on whole flat buffers, identical inputs give identical steps on
every rank.

Every update rule (SGD, mpisgd.optim.lars.LARS, mpisgd.optim.adam.AdamW and LAMB) offers the :class:`Optimizer`
protocol: ``step``/``step_shards`` for the replicated and the sharded update, and its state split in two
so that data parallelism and checkpoints need not know which rule runs — ``state_buffers()``, the
parameter-sized buffers (SGD's momentum, Adam's two moments), which DataParallel broadcasts and, in
the sharded step, gathers; and ``state()``, the scalars (the previous rate, Adam's step count).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from mpisgd.backend import to_numpy, xp_of
from mpisgd.flatbuf import FlatBuffer

Shards = Sequence[tuple[int, int, Any]]  # (lo, hi, g): flat range [lo, hi) and its gradient (hi - lo elements)


class TensorNorms:
    """Squared norms of each parameter tensor (in ``flat.shapes`` order) of quantities held as pieces of
    the flat buffer: what an optimizer asks for when its step needs whole-tensor norms (LARS's trust
    ratios). This one sums the pieces of this rank only, in piece order — right when the pieces hold
    whole tensors (the replicated step); the sharded step passes one that adds every rank's pieces
    (mpisgd.parallel.sharded.RankNorms). Optimizers never reduce across ranks themselves."""

    def __init__(self, offsets: Sequence[int], ranges: Sequence[tuple[int, int]]) -> None:
        self.offsets, self.ranges = list(offsets), list(ranges)

    def partial(self, *quantities: Sequence[Any]) -> np.ndarray:
        """(len(quantities), tensors) float64: each quantity's squared norm per tensor over this rank's
        pieces. A quantity is one array per range, aligned with it (e.g. the weights' and the gradient's)."""
        out = np.zeros((len(quantities), len(self.offsets) - 1))
        where, dots = [], []
        for piece, (lo, hi) in enumerate(self.ranges):
            for t in range(len(self.offsets) - 1):
                x, y = max(self.offsets[t], lo), min(self.offsets[t + 1], hi)
                if x < y:
                    where.append(t)
                    for q in quantities:
                        a = q[piece][x - lo:y - lo]
                        dots.append(a.dot(a))
        if dots:  # one transfer from a GPU, not one per tensor
            values = to_numpy(xp_of(dots[0]).stack(dots)).astype(np.float64).reshape(len(where), len(quantities))
            for i, t in enumerate(where):
                out[:, t] += values[i]
        return out

    def squared(self, *quantities: Sequence[Any]) -> np.ndarray:
        """The whole tensors' squared norms (here: this rank's pieces are the whole)."""
        return self.partial(*quantities)


class Optimizer(Protocol):
    """What DataParallel, the checkpoints and the CLI use of an update rule."""

    flat: FlatBuffer

    def step(self, lr: float) -> None:
        """Update every parameter from the (averaged) gradient buffer ``flat.grads``."""

    def step_shards(self, lr: float, shards: Shards, norms: TensorNorms | None = None) -> None:
        """Update only the ranges ``[lo, hi)`` of ``shards``, each from its own gradient piece; whole-tensor
        norms, where the rule needs them, come from ``norms`` (every rank's pieces in the sharded step)."""

    def state_buffers(self) -> dict[str, Any]:
        """The parameter-sized state by name: the live flat buffers (``flat.size`` elements of its dtype,
        element i belonging to parameter i), not copies. The sharded step keeps only this rank's chunks
        of each current; DataParallel broadcasts and gathers them all."""

    def state(self) -> dict[str, float]:
        """The scalar state, JSON numbers (with :meth:`state_buffers`: what resuming bitwise needs)."""

    def load_state(self, state: Mapping[str, float], buffers: Mapping[str, Any] | None = None) -> None:
        """Continue from :meth:`state`'s scalars and the named buffers (None: keep this rank's, e.g. where
        rank 0's are broadcast next)."""

    def buffer_nbytes(self) -> int:
        """Bytes of the rule's own buffers (state and scratch)."""


def grad_norm(shards: Shards, norms: TensorNorms) -> float:
    """The global L2 norm of a gradient held as ``shards`` (lo, hi, g): every piece ``norms`` adds up."""
    return math.sqrt(float(norms.squared([g for _, _, g in shards]).sum()))


def clip_grad_norm_(shards: Shards, norms: TensorNorms, max_norm: float | None) -> float:
    """Scale the gradient pieces in place so that the global L2 norm is at most ``max_norm`` (None or 0:
    no clipping), as ``torch.nn.utils.clip_grad_norm_`` does: factor max_norm / (norm + 1e-6) where that
    is below 1. Returns the norm before clipping. Every rank that holds the same norms clips alike. A
    norm that overflows the dtype (inf) leaves the gradient as it is."""
    total = grad_norm(shards, norms)
    if max_norm and math.isfinite(total):
        factor = max_norm / (total + 1e-6)
        if factor < 1.0:
            for _, _, g in shards:
                g *= factor
    return total


def load_buffers(optimizer: Optimizer, buffers: Mapping[str, Any] | None) -> None:
    """Copy each of ``buffers`` into the optimizer's state buffer of that name (same size, any array
    module), those it has; ValueError for a size that does not fit."""
    for name, mine in optimizer.state_buffers().items():
        theirs = None if buffers is None else buffers.get(name)
        if theirs is None:
            continue
        if theirs.shape != mine.shape:
            raise ValueError(f"optimizer state {name!r}: {theirs.shape} elements for a buffer of {mine.shape}")
        mine[...] = optimizer.flat.xp.asarray(theirs)
