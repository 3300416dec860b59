"""The one interface every all-reduce strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

Array = Any


class Handle(Protocol):
    def test(self) -> bool:
        """Advance the operation; True once it is complete."""

    def wait(self) -> None:
        """Block until the buffer holds the result."""


def chunk_bounds(n: int, k: int) -> list[int]:
    """k+1 offsets splitting n elements into k near-equal chunks (the first n % k one longer; some empty if n < k)."""
    q, rem = divmod(n, k)
    out = [0]
    for c in range(k):
        out.append(out[-1] + q + (1 if c < rem else 0))
    return out


class Done:
    """A handle for an operation that completed at start (blocking strategies, k = 1)."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Reducer(ABC):
    """In-place SUM all-reduce of contiguous buffers over a communicator.

    A reducer never sees models or optimizers: only buffers. Every rank must
    call the same operations on buffers of the same size and dtype, in the
    same order; implementations may rely on that.
    """

    name = "base"

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()

    @abstractmethod
    def allreduce_(self, buf: Array) -> None:
        """buf <- sum over ranks of buf, in place; blocks."""

    def allreduce(self, src: Array, dst: Array) -> None:
        """dst <- sum over ranks of src (out of place); blocks. The default copies, then reduces in place."""
        dst[...] = src
        self.allreduce_(dst)

    def start(self, buf: Array) -> Handle:
        """Non-blocking form of allreduce_; the default runs the blocking one at once.

        The handle's ``test()`` may advance the operation (MPI progresses only
        inside MPI calls): call it now and then while computing, ``wait()`` before
        reading the buffer.
        """
        self.allreduce_(buf)
        return Done()

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        return None
