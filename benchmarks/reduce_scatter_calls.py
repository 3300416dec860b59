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

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpisgd.comm import AutoReducer, MpiReducer, RingReducer
from mpisgd.comm.base import chunk_bounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="4.04,3.07", help="bucket sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    k, r = comm.Get_size(), comm.Get_rank()
    bufs = [np.empty(int(float(m) * 2**20) // 4, np.float32) for m in args.mib.split(",")]
    counts = []
    for b in bufs:
        bounds = chunk_bounds(b.size, k)
        counts.append([bounds[c + 1] - bounds[c] for c in range(k)])
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
    wrong = sorted({w for per_rank in comm.allgather(wrong) for w in per_rank})
    if wrong:
        if r == 0:
            print(f"wrong result from: {', '.join(wrong)}")
        raise SystemExit(1)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for red in reducers.values():
        red.close()
    if r == 0:
        lib = " ".join(MPI.Get_library_version().splitlines()[0].split())
        print(f"k={k}, buckets {args.mib} MiB float32, {args.repeats} interleaved repeats, {lib}")
        for name, ts in times.items():
            print(f"  {name:<34}{statistics.median(ts) * 1e3:8.2f} ms (median)")


if __name__ == "__main__":
    main()
