"""Which rank the others wait for: each rank's arrival at every step's synchronisation points.

Every synchronous step waits for its slowest rank, and step times cannot say
which rank that was: the collective evens them out. So each rank notes when it
reaches the step's two synchronisation points (the check-in at the step's
start, and the end of its backward, where it starts waiting for the gradients;
``DataParallel.times``), and at an epoch's end rank 0 gathers them. At each
point the last rank to arrive is the one the others waited for; each other rank
waited (last arrival - its own), and the mean of those waits is booked to the
last rank. Clocks: ``perf_counter`` is one clock for the processes of one node
but not across nodes, so :class:`Clock` estimates each rank's offset to rank 0
by ping-pong (the exchange with the shortest round trip wins), again at every
epoch.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

TAG = 7_350
REPORT_SHARE = 0.10  # the epoch's report names the slowest rank when the others waited this share of a step for it


class Clock:
    """This rank's ``perf_counter`` on rank 0's time base (collective to create and to :meth:`sync`)."""

    def __init__(self, comm: Any, rounds: int = 8) -> None:
        self.comm = comm.Dup()
        self.rounds = rounds
        self.offset = 0.0  # rank 0's time = perf_counter() - offset
        self.sync()

    def sync(self) -> None:
        """Estimate the offsets again: rank 0 with each rank in turn, ``rounds`` exchanges each."""
        comm, rank = self.comm, self.comm.Get_rank()
        stamp = np.zeros(1)
        for peer in range(1, comm.Get_size()):
            if rank == 0:
                best, estimate = np.inf, np.zeros(1)
                for _ in range(self.rounds):
                    t0 = time.perf_counter()
                    comm.Send(stamp, peer, TAG)
                    comm.Recv(stamp, peer, TAG)
                    t1 = time.perf_counter()
                    if t1 - t0 < best:  # the peer read its clock about halfway through the exchange
                        best, estimate[0] = t1 - t0, stamp[0] - (t0 + t1) / 2
                comm.Send(estimate, peer, TAG)
            elif rank == peer:
                for _ in range(self.rounds):
                    comm.Recv(stamp, 0, TAG)
                    stamp[0] = time.perf_counter()
                    comm.Send(stamp, 0, TAG)
                comm.Recv(stamp, 0, TAG)
                self.offset = float(stamp[0])

    def common(self, t: Any) -> Any:
        return np.asarray(t) - self.offset

    def close(self) -> None:
        self.comm.Free()


def analyse(arrivals: np.ndarray, step_ms: float) -> dict[str, Any]:
    """From every rank's arrivals (k, steps, points; seconds on one clock): per rank the mean wait per
    step the others had for it (``wait_caused_ms``), how late it came on average (``lag_ms``) and its
    step time from check-in to check-in (``rank_step_ms``); the slowest rank and its cost as a share of
    the step."""
    k, steps, _ = arrivals.shape
    last, who = arrivals.max(axis=0), arrivals.argmax(axis=0)
    others = (last[None] - arrivals).sum(axis=0) / max(1, k - 1)  # the straggler's own wait is 0
    caused = np.zeros(k)
    np.add.at(caused, who.ravel(), others.ravel())
    caused_ms = 1e3 * caused / max(1, steps)
    lag_ms = 1e3 * (arrivals - arrivals.min(axis=0)).mean(axis=(1, 2))
    slowest = int(np.argmax(caused_ms))
    own_step_ms = 1e3 * np.diff(arrivals[:, :, 0], axis=1).mean(axis=1) if steps > 1 else np.zeros(k)
    return {"wait_caused_ms": [round(float(v), 4) for v in caused_ms], "lag_ms": [round(float(v), 4) for v in lag_ms],
            "rank_step_ms": [round(float(v), 4) for v in own_step_ms],
            "slowest_rank": slowest, "slowest_wait_ms": float(caused_ms[slowest]),
            "slowest_share": float(caused_ms[slowest] / step_ms) if step_ms > 0 else 0.0}


def describe(stats: dict[str, Any], places: list[tuple[str, int, Any]]) -> str:
    """'slowest: rank 3 (node b, local 1), others waited 2.4 ms/step for it, 11 % of the step'."""
    r = stats["slowest_rank"]
    host, local = places[r][0], places[r][1]
    return (f"  slowest: rank {r} ({host}, local {local}), others waited {stats['slowest_wait_ms']:.1f} ms/step "
            f"for it, {100 * stats['slowest_share']:.0f} % of the step")
