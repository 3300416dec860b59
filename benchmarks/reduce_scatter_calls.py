"""The gradient buckets' reduction, several ways: the sharded step's reduce-scatter, or the whole all-reduce.

    mpiexec -n 2 python benchmarks/reduce_scatter_calls.py [--mib 4.04,3.07] [--repeats 30] [--op allreduce]

The buffers are the reference MLP's two gradient buckets (MiB, float32). With
``--op reduce-scatter`` (the default) each rank receives its chunk_bounds chunk
of the sum of each, as in DataParallel's sharded step; with ``--op allreduce``
each bucket is summed in place, as in the replicated step. Every bucket is in
flight before the first wait (what the step does). Each way's result is
checked on every rank before it is timed; the ways are timed interleaved, each
after a barrier, and rank 0 prints the median per call.

Ways: the MPI library's call; "direct", what ``auto`` runs on private buffers
when every rank is on one node (mpisgd.comm.direct); "shared", what it runs on
buckets of the node-shared gradient buffer that data parallelism uses there
(mpisgd.comm.shared: peers' memory read in place); and our ring over messages.
"""

from __future__ import annotations

import numpy as np
from calls_common import buckets, exit_if_wrong, parse_args, print_medians, time_interleaved
from mpi4py import MPI

from mpisgd.comm import AutoReducer, MpiReducer, RingReducer


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument("--op", choices=("reduce-scatter", "allreduce"),
                                                        default="reduce-scatter"))
    comm = MPI.COMM_WORLD
    k, r = comm.Get_size(), comm.Get_rank()
    layouts = buckets(args.mib, k)
    private, counts = [b for b, _, _ in layouts], [c for _, c, _ in layouts]
    outs = [np.empty(c[r], np.float32) for c in counts]
    shared_red = AutoReducer(comm)
    arena = shared_red.shared_buffer(sum(b.size for b in private), np.float32)
    if arena is None:
        raise SystemExit("the shared way needs every rank on one node")
    offsets = np.cumsum([0] + [b.size for b in private])
    in_arena = [arena[a:b] for a, b in zip(offsets, offsets[1:])]  # the same buckets, back to back
    mpi_name = "MPI_Ireduce_scatter" if args.op == "reduce-scatter" else "MPI_Iallreduce"
    ways_of = {mpi_name: (MpiReducer(comm), private), "direct (auto, private buffers)": (AutoReducer(comm), private),
               "shared (auto, shared buffer)": (shared_red, in_arena),
               "ring (messages)": (RingReducer(comm, transport="p2p"), private)}

    def way(red, bufs):
        def run() -> None:
            if args.op == "reduce-scatter":
                handles = [red.start_reduce_scatter(b, o, c) for b, o, c in zip(bufs, outs, counts)]
            else:
                handles = [red.start(b) for b in bufs]
            for h in handles:
                h.wait()
        return run

    ways = {name: way(red, bufs) for name, (red, bufs) in ways_of.items()}
    wrong = []
    for name, (_, bufs) in ways_of.items():  # the sum of rank + 1 over ranks, in every element of the result
        for b, o in zip(bufs, outs):
            b[...] = r + 1
            o[...] = -1
        ways[name]()
        results = outs if args.op == "reduce-scatter" else bufs
        if not all(np.all(x == k * (k + 1) / 2) for x in results):
            wrong.append(name)
    exit_if_wrong(comm, wrong)
    times = time_interleaved(comm, ways, args.repeats)
    for red, _ in ways_of.values():
        red.close()
    print_medians(comm, args.mib, args.repeats, times)


if __name__ == "__main__":
    main()
