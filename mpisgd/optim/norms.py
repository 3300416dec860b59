"""Whole-tensor squared norms of quantities held as pieces of a flat buffer: what an update rule that
needs them (LARS's and LAMB's trust ratios) or clipping by the global norm asks for.

``Norms`` is the protocol an optimizer is given. Two implementations:

- :class:`TensorNorms`: the pieces of this rank only, each tensor's part a BLAS dot, added in piece
  order; right when the pieces hold whole tensors, any cut allowed (an optimizer on its own, tests).
- :class:`BlockNorms`: each tensor cut into blocks of ``BLOCK`` elements from its start, each block's
  squared norm computed from that block alone (the same bits wherever the block lies in memory), a
  tensor's norm the exactly rounded sum of its blocks' (``math.fsum``, independent of their order),
  every rank's blocks brought together by ``gather``. So the norms do not depend on how the tensors
  are cut among ranks, as long as no block is cut (:func:`block_boundaries`): DataParallel's replicated
  and sharded steps give the same ratios and clipping factors, bitwise, at any k. How a block's sum is
  formed is a choice: :func:`native_block_sums` (in the array's dtype, NumPy's einsum: float mode) or
  :func:`float64_block_sums` (float64 pairwise sums: the reproducible mode, the same bits on any k).

Nothing here communicates: ``gather`` is the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from mpisgd.backend import to_numpy, xp_of
from mpisgd.portable.reduce import fold_

Array = Any  # numpy.ndarray or cupy.ndarray
Pieces = Sequence[Array]  # one array per range of a Norms object, aligned with it
BlockSums = Callable[[Array], Array]  # (blocks, BLOCK) array -> each block's squared norm (blocks,)
Blocks = list[tuple[int, float]]  # (tensor, a block's squared norm), in this rank's order
Gather = Callable[[list[Blocks]], list[list[Blocks]]]  # this rank's blocks -> every rank's (an allgather)

BLOCK = 4096  # elements per block of BlockNorms: the sharded step's chunks begin and end on these


class Norms(Protocol):
    """Squared norms of each parameter tensor (in ``flat.shapes`` order) of quantities held as pieces."""

    def squared(self, *quantities: Pieces) -> np.ndarray:
        """(len(quantities), tensors) float64: each quantity's whole-tensor squared norms."""
        ...


class TensorNorms:
    """This rank's pieces only, in piece order: right when they hold whole tensors. Any cut allowed."""

    def __init__(self, offsets: Sequence[int], ranges: Sequence[tuple[int, int]]) -> None:
        self.offsets, self.ranges = list(offsets), list(ranges)

    def partial(self, *quantities: Pieces) -> np.ndarray:
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

    def squared(self, *quantities: Pieces) -> np.ndarray:
        """The whole tensors' squared norms (here: this rank's pieces are the whole)."""
        return self.partial(*quantities)


def native_block_sums(blocks: Array) -> Array:
    """Each row's sum of squares in the array's own dtype (one pass, no temporary): NumPy's (or CuPy's)
    einsum, whose result for a row depends on its values only, not on where the row lies in memory."""
    return xp_of(blocks).einsum("ij,ij->i", blocks, blocks)


def float64_block_sums(blocks: Array) -> Array:
    """Each row's sum of squares in float64, added in one fixed order (mpisgd.portable.reduce: no library's
    summation, which may be dispatched by CPU): the reproducible mode's, the same bits on any machine."""
    wide = blocks.astype(np.float64)
    wide *= wide
    return fold_(wide, 1)[:, 0]


class BlockNorms:
    """Norms that do not depend on how the tensors are cut among ranks (see the module doc).

    ``ranges``: the flat ranges this rank holds, each beginning and ending on a block boundary of the
    tensors it overlaps; ``gather``: every rank's block lists from this rank's (an allgather), or None
    where this rank holds every tensor whole; ``block_sums``: how one block's squared norm is formed."""

    BLOCK = BLOCK

    def __init__(self, offsets: Sequence[int], ranges: Sequence[tuple[int, int]], gather: Gather | None = None,
                 block_sums: BlockSums = float64_block_sums) -> None:
        self.offsets, self.ranges, self.gather, self.block_sums = list(offsets), list(ranges), gather, block_sums

    def _blocks(self, q: Pieces) -> Blocks:
        """(tensor, squared norm) of every block inside this rank's ranges."""
        out: Blocks = []
        for piece, (lo, hi) in enumerate(self.ranges):
            for t in range(len(self.offsets) - 1):
                a, b = self.offsets[t], self.offsets[t + 1]
                x, y = max(a, lo), min(b, hi)
                if x >= y:
                    continue
                assert (x - a) % self.BLOCK == 0 and (y == b or (y - a) % self.BLOCK == 0), \
                    "chunks must begin and end on block boundaries"
                values = q[piece][x - lo:y - lo]
                xp = xp_of(values)
                full = (y - x) // self.BLOCK * self.BLOCK
                sums = []
                if full:
                    sums.append(self.block_sums(values[:full].reshape(-1, self.BLOCK)).astype(np.float64))
                if full < y - x:
                    sums.append(self.block_sums(values[full:].reshape(1, -1)).astype(np.float64))
                out += [(t, float(v)) for v in to_numpy(xp.concatenate(sums))]
        return out

    def squared(self, *quantities: Pieces) -> np.ndarray:
        mine = [self._blocks(q) for q in quantities]
        every = self.gather(mine) if self.gather is not None else [mine]
        out = np.zeros((len(quantities), len(self.offsets) - 1))
        for i in range(len(quantities)):
            per_tensor: dict[int, list[float]] = {}
            for rank_blocks in every:
                for t, v in rank_blocks[i]:
                    per_tensor.setdefault(t, []).append(v)
            for t, values in per_tensor.items():
                out[i, t] = math.fsum(values)
        return out


def block_boundaries(offsets: Sequence[int], block: int = BLOCK) -> list[int]:
    """Where the sharded step's parts may begin and end: every block boundary of every tensor (blocks
    counted from each tensor's start), so that no block is cut between ranks."""
    return sorted({p for t in range(len(offsets) - 1) for p in range(offsets[t], offsets[t + 1], block)}
                  | {offsets[-1]})
