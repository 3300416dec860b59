"""The local update rules' common ground: on whole flat buffers, identical inputs give identical steps on
every rank.

Every update rule (SGD, mpisgd.optim.lars.LARS, mpisgd.optim.adam.AdamW and LAMB) offers the :class:`Optimizer`
protocol: ``step``/``step_shards`` for the replicated and the sharded update, and its state split in two
so that data parallelism and checkpoints need not know which rule runs — ``state_buffers()``, the
parameter-sized buffers (SGD's momentum, Adam's two moments), and ``state()``, the scalars (the previous
rate, Adam's step count).

Which parameters the buffers cover is a :class:`StateLayout`: all of them by default; ``keep_state(ranges)``
keeps only some flat ranges, back to back (the sharded step's chunks of one rank: ZeRO stage 1, each rank
holding 1/k of the optimizer state). DataParallel gathers the whole buffers for a checkpoint and
scatters them back on resume.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from mpisgd.backend import xp_of
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.norms import Norms, TensorNorms

Array = Any  # numpy.ndarray or cupy.ndarray
Shards = Sequence[tuple[int, int, Array]]  # (lo, hi, g): flat range [lo, hi) and its gradient (hi - lo elements)

__all__ = ["Norms", "Optimizer", "Shards", "StateBuffers", "StateLayout", "TensorNorms", "clip_grad_norm_", "grad_norm",
           "load_buffers"]


class StateLayout:
    """The flat ranges an optimizer keeps state for, back to back in its state buffers in the order given:
    [(0, n)] for every parameter, a rank's chunks in the sharded step."""

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges = [(int(lo), int(hi)) for lo, hi in ranges]
        if any(hi < lo for lo, hi in self.ranges):
            raise ValueError(f"state ranges must have lo <= hi, got {self.ranges}")
        starts, at = [], 0
        for lo, hi in self.ranges:
            starts.append(at)
            at += hi - lo
        self.size = at  # elements of each state buffer
        kept = sorted((lo, hi, start) for (lo, hi), start in zip(self.ranges, starts) if hi > lo)
        if any(a[1] > b[0] for a, b in zip(kept, kept[1:])):
            raise ValueError(f"state ranges must not overlap, got {self.ranges}")
        self._kept, self._los = kept, [lo for lo, _, _ in kept]

    def where(self, lo: int, hi: int) -> slice:
        """Where the flat range [lo, hi) lies in the state buffers (it must lie inside one kept range)."""
        if hi <= lo:
            return slice(0, 0)
        i = bisect_right(self._los, lo) - 1
        if i < 0 or hi > self._kept[i][1]:
            raise ValueError(f"no optimizer state for the flat range [{lo}, {hi}): it keeps {self.ranges}")
        a, _, start = self._kept[i]
        return slice(start + lo - a, start + hi - a)

    def moved(self, buf: Array, to: StateLayout) -> Array:
        """``buf`` (laid out as self) laid out as ``to``: the values of the ranges ``to`` keeps, copied into a
        new buffer (they must lie inside self's ranges)."""
        out = xp_of(buf).zeros(to.size, dtype=buf.dtype)
        for lo, hi in to.ranges:
            out[to.where(lo, hi)] = buf[self.where(lo, hi)]
        return out


class StateBuffers:
    """An optimizer's parameter-sized buffers: its ``state`` (zeros at first: momentum, moments) and its
    ``scratch`` (uninitialised), laid out as :attr:`layout` and made at that size when first used. So a
    sharded step's ``keep_state`` before the first step means the whole buffers are never made: a whole
    buffer made and freed would also leave NumPy's allocator (glibc's malloc, whose mmap threshold rises
    to the size of a freed mapping) serving later allocations from its heap, and the process's peak
    memory would keep what keep_state saved."""

    def __init__(self, flat: FlatBuffer, state: Sequence[str], scratch: Sequence[str] = ()) -> None:
        self.flat, self.layout = flat, StateLayout([(0, flat.size)])
        self.state_names, self.scratch_names = list(state), list(scratch)
        self._bufs: dict[str, Array] | None = None

    def __getitem__(self, name: str) -> Array:
        if self._bufs is None:
            xp, n, dtype = self.flat.xp, self.layout.size, self.flat.dtype
            self._bufs = {**{s: xp.zeros(n, dtype=dtype) for s in self.state_names},
                          **{s: xp.empty(n, dtype=dtype) for s in self.scratch_names}}
        return self._bufs[name]

    def state(self) -> dict[str, Array]:
        """The state buffers by name (made now if not yet)."""
        return {name: self[name] for name in self.state_names}

    def keep(self, ranges: Sequence[tuple[int, int]]) -> None:
        """From now on only these flat ranges, values kept (buffers already made are moved, the others
        will be made at the new size)."""
        layout = StateLayout(ranges)
        if self._bufs is not None:
            self._bufs = {name: self.layout.moved(buf, layout) for name, buf in self._bufs.items()}
        self.layout = layout

    def nbytes(self) -> int:
        """Bytes of every buffer at its layout's size (made or still to be made)."""
        return (len(self.state_names) + len(self.scratch_names)) * self.layout.size * self.flat.dtype.itemsize


class Optimizer(Protocol):
    """What DataParallel, the checkpoints and the CLI use of an update rule."""

    flat: FlatBuffer

    @property
    def layout(self) -> StateLayout:
        """Which flat ranges its state buffers cover."""

    def step(self, lr: float) -> None:
        """Update every parameter from the (averaged) gradient buffer ``flat.grads`` (whole state only)."""

    def step_shards(self, lr: float, shards: Shards, norms: Norms | None = None) -> None:
        """Update only the ranges ``[lo, hi)`` of ``shards``, each from its own gradient piece (within the
        ranges its state covers); whole-tensor norms, where the rule needs them, come from ``norms``
        (every rank's pieces in the sharded step)."""

    def keep_state(self, ranges: Sequence[tuple[int, int]]) -> None:
        """From now on keep state only for these flat ranges, back to back (values kept): the sharded
        step's chunks of this rank, so that each rank holds 1/k of the optimizer state."""

    def state_buffers(self) -> dict[str, Array]:
        """The parameter-sized state by name: the live buffers (``layout.size`` elements of the flat dtype,
        laid out as :attr:`layout`: element i belongs to parameter i when the state is whole), not copies."""

    def state(self) -> dict[str, float]:
        """The scalar state, JSON numbers (with :meth:`state_buffers`: what resuming bitwise needs)."""

    def load_state(self, state: Mapping[str, float], buffers: Mapping[str, Array] | None = None) -> None:
        """Continue from :meth:`state`'s scalars and the named buffers, laid out as :attr:`layout` (None:
        keep this rank's, e.g. where DataParallel distributes rank 0's next)."""

    def buffer_nbytes(self) -> int:
        """Bytes of the rule's own buffers (state and scratch)."""


def grad_norm(shards: Shards, norms: Norms) -> float:
    """The global L2 norm of a gradient held as ``shards`` (lo, hi, g): every piece ``norms`` adds up."""
    return math.sqrt(float(norms.squared([g for _, _, g in shards]).sum()))


def clip_grad_norm_(shards: Shards, norms: Norms, max_norm: float | None) -> float:
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


def load_buffers(optimizer: Optimizer, buffers: Mapping[str, Array] | None) -> None:
    """Copy each of ``buffers`` into the optimizer's state buffer of that name (same size, any array
    module), those it has; ValueError for a size that does not fit."""
    for name, mine in optimizer.state_buffers().items():
        theirs = None if buffers is None else buffers.get(name)
        if theirs is None:
            continue
        if theirs.shape != mine.shape:
            raise ValueError(f"optimizer state {name!r}: {theirs.shape} elements for a buffer of {mine.shape}")
        mine[...] = optimizer.flat.xp.asarray(theirs)
