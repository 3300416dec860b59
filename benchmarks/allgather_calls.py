"""Blocking MPI_Allgatherv against MPI_Iallgatherv + wait, for the sharded step's all-gather.

    mpiexec -n 2 python benchmarks/allgather_calls.py [--mib 4.04,3.07] [--repeats 30]

The buffers are the reference MLP's two gradient buckets (MiB, float32); each
rank owns its chunk_bounds chunk of each, as in DataParallel's sharded step.
The four ways are timed interleaved, each after a barrier, and rank 0 prints
the median per call. Why it exists: the sharded step first used the blocking
call, and was slower than not sharding at all (docs/benchmarks.md, note 6).
"""

from __future__ import annotations

import numpy as np
from calls_common import buckets, exit_if_wrong, parse_args, print_medians, time_interleaved
from mpi4py import MPI


def main() -> None:
    args = parse_args(__doc__)
    comm = MPI.COMM_WORLD
    k = comm.Get_size()
    layouts = buckets(args.mib, k)

    def blocking() -> None:
        for b, counts, displs in layouts:
            comm.Allgatherv(MPI.IN_PLACE, [b, counts, displs, MPI.FLOAT])

    def nonblocking_each() -> None:  # one in flight at a time
        for b, counts, displs in layouts:
            comm.Iallgatherv(MPI.IN_PLACE, [b, counts, displs, MPI.FLOAT]).Wait()

    def nonblocking_all() -> None:  # what DataParallel does: every bucket in flight, then wait
        MPI.Request.Waitall([comm.Iallgatherv(MPI.IN_PLACE, [b, counts, displs, MPI.FLOAT])
                             for b, counts, displs in layouts])

    ways = {"Allgatherv (blocking)": blocking, "Iallgatherv + Wait, one by one": nonblocking_each,
            "Iallgatherv all, then Waitall": nonblocking_all}
    wrong = []
    for name, fn in ways.items():  # each way must deliver every rank's chunk before it is timed
        for b, counts, _ in layouts:
            owner = np.repeat(np.arange(k, dtype=np.float32), counts)
            b[...] = np.where(owner == comm.Get_rank(), owner + 1, -1)
        fn()
        if not all(np.array_equal(b, np.repeat(np.arange(1, k + 1, dtype=np.float32), counts))
                   for b, counts, _ in layouts):
            wrong.append(name)
    exit_if_wrong(comm, wrong)
    print_medians(comm, args.mib, args.repeats, time_interleaved(comm, ways, args.repeats))


if __name__ == "__main__":
    main()
