"""Blocking MPI_Allgatherv against MPI_Iallgatherv + wait, for the sharded step's all-gather.

    mpiexec -n 2 python benchmarks/allgather_calls.py [--mib 4.04,3.07] [--repeats 30]

The buffers are the reference MLP's two gradient buckets (MiB, float32); each
rank owns its chunk_bounds chunk of each, as in DataParallel's sharded step.
The four ways are timed interleaved, each after a barrier, and rank 0 prints
the median per call. Why it exists: the sharded step first used the blocking
call, and was slower than not sharding at all (docs/benchmarks.md, note 6).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import chunk_bounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="4.04,3.07", help="bucket sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    k = comm.Get_size()
    bufs = [np.ones(int(float(m) * 2**20) // 4, np.float32) for m in args.mib.split(",")]
    layouts = []
    for b in bufs:
        bounds = chunk_bounds(b.size, k)
        counts = [bounds[c + 1] - bounds[c] for c in range(k)]
        layouts.append((b, counts, bounds[:-1]))

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
    wrong = sorted({w for per_rank in comm.allgather(wrong) for w in per_rank})
    if wrong:
        if comm.Get_rank() == 0:
            print(f"wrong result from: {', '.join(wrong)}")
        raise SystemExit(1)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if comm.Get_rank() == 0:
        lib = " ".join(MPI.Get_library_version().splitlines()[0].split())
        print(f"k={k}, buckets {args.mib} MiB float32, {args.repeats} interleaved repeats, {lib}")
        for name, ts in times.items():
            print(f"  {name:<34}{statistics.median(ts) * 1e3:8.2f} ms (median)")


if __name__ == "__main__":
    main()
