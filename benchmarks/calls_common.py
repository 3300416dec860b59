"""What allgather_calls.py and reduce_scatter_calls.py share: agree on wrong results, time ways interleaved."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.comm.base import chunk_bounds


def parse_args(doc: str | None, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="4.04,3.07", help="bucket sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def buckets(mib: str, k: int) -> list[tuple[Any, list[int], list[int]]]:
    """(float32 buffer, elements per rank's chunk, chunk offsets) per bucket size, chunks as in
    DataParallel's sharded step (chunk_bounds, rank order)."""
    out = []
    for m in mib.split(","):
        buf = np.ones(int(float(m) * 2**20) // 4, np.float32)
        bounds = chunk_bounds(buf.size, k)
        out.append((buf, [bounds[c + 1] - bounds[c] for c in range(k)], bounds[:-1]))
    return out


def exit_if_wrong(comm: Any, wrong: list[str]) -> None:
    """Every rank's list of ways that gave a wrong result: any at all, and every rank exits with 1."""
    every = sorted({w for per_rank in comm.allgather(wrong) for w in per_rank})
    if every:
        if comm.Get_rank() == 0:
            print(f"wrong result from: {', '.join(every)}")
        raise SystemExit(1)


def time_interleaved(comm: Any, ways: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each way, the ways interleaved within each repeat, each after a barrier."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def print_medians(comm: Any, mib: str, repeats: int, times: dict[str, list[float]]) -> None:
    if comm.Get_rank() == 0:
        lib = " ".join(MPI.Get_library_version().splitlines()[0].split())
        print(f"k={comm.Get_size()}, buckets {mib} MiB float32, {repeats} interleaved repeats, {lib}")
        for name, ts in times.items():
            print(f"  {name:<34}{statistics.median(ts) * 1e3:8.2f} ms (median)")
