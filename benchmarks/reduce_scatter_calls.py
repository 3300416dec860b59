"""The sharded step's reduce-scatter, three ways: MPI_Ireduce_scatter, the direct one, and the ring's.

    mpiexec -n 2 python benchmarks/reduce_scatter_calls.py [--mib 4.04,3.07] [--repeats 30]

The buffers are the reference MLP's two gradient buckets (MiB, float32); each
rank receives its chunk_bounds chunk of the sum of each, as in DataParallel's
sharded step, and every bucket is in flight before the first wait (what the
step does). Each way's result is checked on every rank before it is timed;
the ways are timed interleaved, each after a barrier, and rank 0 prints the
median per call. "direct" is what ``auto`` runs when every rank is on one
node (mpisgd.comm.direct); the ring runs over messages, as in training.
"""

from __future__ import annotations

import numpy as np
from calls_common import buckets, exit_if_wrong, parse_args, print_medians, time_interleaved
from mpi4py import MPI

from mpisgd.comm import AutoReducer, MpiReducer, RingReducer


def main() -> None:
    args = parse_args(__doc__)
    comm = MPI.COMM_WORLD
    k, r = comm.Get_size(), comm.Get_rank()
    layouts = buckets(args.mib, k)
    bufs, counts = [b for b, _, _ in layouts], [c for _, c, _ in layouts]
    outs = [np.empty(c[r], np.float32) for c in counts]
    reducers = {"MPI_Ireduce_scatter": MpiReducer(comm), "direct (auto, one node)": AutoReducer(comm),
                "ring (messages)": RingReducer(comm, transport="p2p")}

    def way(red):
        def run() -> None:
            handles = [red.start_reduce_scatter(b, o, c) for b, o, c in zip(bufs, outs, counts)]
            for h in handles:
                h.wait()
        return run

    ways = {name: way(red) for name, red in reducers.items()}
    wrong = []
    for name, fn in ways.items():  # the sum of rank + 1 over ranks, in every element of this rank's chunks
        for b, o in zip(bufs, outs):
            b[...] = r + 1
            o[...] = -1
        fn()
        if not all(np.all(o == k * (k + 1) / 2) for o in outs):
            wrong.append(name)
    exit_if_wrong(comm, wrong)
    times = time_interleaved(comm, ways, args.repeats)
    for red in reducers.values():
        red.close()
    print_medians(comm, args.mib, args.repeats, times)


if __name__ == "__main__":
    main()
