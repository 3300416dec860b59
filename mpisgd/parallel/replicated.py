"""The replicated step: every bucket all-reduced in place, every rank updating every parameter with the
whole optimizer state."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from mpi4py import MPI

from mpisgd.agreement import agree, bcast_
from mpisgd.blas import finite_sq_norm
from mpisgd.comm.base import Handle, Reducer
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.base import Optimizer, load_buffers
from mpisgd.optim.norms import BlockNorms, BlockSums
from mpisgd.parallel.protocols import Array, Timeline, Watchdog


class ReplicatedStep:
    """The plain update over ``comm``'s ranks. Whole-tensor norms are block norms (mpisgd.optim.norms) with
    the gradient strategy's ``block_sums``, so that they are the sharded step's bits."""

    what = "all-reduce"

    def __init__(self, flat: FlatBuffer, comm: MPI.Intracomm, reducer: Reducer, block_sums: BlockSums) -> None:
        self.flat, self.comm, self.reducer = flat, comm, reducer
        self._norms = BlockNorms(flat.offsets, [(0, flat.size)], None, block_sums)

    @property
    def shards(self) -> list[tuple[int, int, Array]]:
        """The averaged gradient as (lo, hi, g) pieces: here all of it, on every rank."""
        return [(0, self.flat.size, self.flat.grads)]

    def start(self, index: int, buf: Array) -> Handle:
        return self.reducer.start(buf)

    def landed(self, reduced: Array) -> list[tuple[int, int, Array, Array]]:
        """The reduced buffer holds the whole sum, for the whole gradient."""
        return [(0, self.flat.size, reduced, self.flat.grads)]

    def finite(self, watchdog: Watchdog, step: int) -> tuple[bool, float]:
        """Whether the averaged gradient is finite, and its squared norm: the reduced buffer is the same
        on every rank, so is the verdict."""
        return finite_sq_norm(self.flat.grads, self.flat.xp)

    def sq_norm(self, watchdog: Watchdog, step: int) -> float:
        return finite_sq_norm(self.flat.grads, self.flat.xp)[1]

    def norms(self, watchdog: Watchdog, step: int) -> BlockNorms:
        """Whole-tensor norms of the averaged gradient: this rank holds every tensor whole."""
        return self._norms

    def apply(self, optimizer: Optimizer, lr: float, watchdog: Watchdog, step: int) -> None:
        optimizer.step_shards(lr, self.shards, self._norms)

    def after_step(self, watchdog: Watchdog, timeline: Timeline, step: int) -> float:
        return 0.0

    def own_state(self, optimizer: Optimizer) -> None:
        """Every rank keeps the whole state."""
        return None

    def broadcast_state(self, optimizer: Optimizer, root: int) -> None:
        """Every rank takes ``root``'s state buffers, by name."""
        for _, buf in sorted(optimizer.state_buffers().items()):
            bcast_(self.comm, buf, root)

    def gather_state(self, optimizer: Optimizer, watchdog: Watchdog, root: int) -> dict[str, np.ndarray]:
        """Every rank holds the whole buffers already: the live ones."""
        return dict(optimizer.state_buffers())

    def scatter_state(self, optimizer: Optimizer, buffers: Mapping[str, Array] | None, watchdog: Watchdog,
                      root: int) -> None:
        """``root`` loads its whole buffers (None elsewhere), every rank takes them."""
        error = None
        if self.comm.Get_rank() == root:
            try:
                load_buffers(optimizer, buffers)
            except ValueError as exc:
                error = exc
        with watchdog.watching("optimizer state broadcast"):
            agree(self.comm, error)
            self.broadcast_state(optimizer, root)

    def nbytes(self) -> int:
        return 0
