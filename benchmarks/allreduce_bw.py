"""All-reduce bandwidth, nccl-tests style: ``mpiexec -n N python benchmarks/allreduce_bw.py``.

For each backend and size: out-of-place and in-place time (us, averaged over
iterations and then over ranks; with --trials N, the median, or with --stat min
the minimum, of N such means, taken round-robin over the backends), algbw =
size / time and busbw = algbw * 2(k-1)/k in GB/s (1e9 bytes/s), and #wrong,
the elements that differ from the exact sum after a checked run (values are
small integers, exact in every dtype). Warm-up iterations and a barrier
precede each timing. Exit status 1 if anything was wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from mpisgd.backend import Backend, select_backend, to_numpy  # noqa: E402
from mpisgd.comm import create_reducer  # noqa: E402
from mpisgd.comm.base import Reducer  # noqa: E402
from mpisgd.comm.ring import RingReducer  # noqa: E402

CPU_BACKENDS = ("mpi", "ring", "ring-p2p", "auto", "deterministic", "hierarchical")
# ring-p2p: our ring with its point-to-point transport forced (what `ring` is between nodes; on one node
# `ring` passes chunks through a shared-memory window, mpisgd.comm.shm)
GPU_BACKENDS = ("nccl", "mpi", "ring", "auto")


def parse_size(text: str) -> int:
    """'4', '64K', '256M', '1G' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"size must look like 4, 64K, 256M or 1G, got {text!r}")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


def make_reducer(name: str, comm: Any, backend: Backend, args: argparse.Namespace) -> Reducer:
    if name == "deterministic":  # the mechanism itself (create_reducer skips it at k <= 2, where it is not needed)
        if backend.is_gpu:
            from mpisgd.comm.cuda import DirectReducer, StagedReducer, probe_cuda_aware  # noqa: PLC0415

            direct, why = probe_cuda_aware(comm, args.cuda_aware)
            ring = RingReducer(comm, deterministic=True)
            return DirectReducer(ring, why) if direct else StagedReducer(ring, why)
        return RingReducer(comm, deterministic=True)
    if name == "ring-p2p":
        return RingReducer(comm, transport="p2p")
    return create_reducer(name, comm, backend=backend, cuda_aware=args.cuda_aware, compress=args.compress)


def fill(xp: Any, buf: Any, rank: int) -> None:
    """Rank r holds (r + 1) * (1 + i % 13): the sum over k ranks, k(k+1)/2 * (1 + i % 13), is exact."""
    n = buf.size
    buf[...] = ((xp.arange(n, dtype=np.int64) % 13 + 1) * (rank + 1)).astype(buf.dtype)


def count_wrong(result: Any, k: int) -> int:
    got = to_numpy(result)
    want = ((np.arange(got.size, dtype=np.int64) % 13 + 1) * (k * (k + 1) // 2)).astype(got.dtype)
    return int(np.count_nonzero(got != want))


def iterations(nbytes: int, args: argparse.Namespace) -> int:
    if args.iters:
        return args.iters
    return max(3, min(200, int(args.bytes_per_size / max(nbytes, 1))))


def measure_all(reducers: dict[str, Reducer], comm: Any, backend: Backend, nbytes: int, dtype: np.dtype,
                inplace: bool, args: argparse.Namespace) -> dict[str, tuple[float, int]]:
    """Per backend: (time per all-reduce in us, #wrong summed over ranks).

    Each backend is checked on fresh data after its warm-up; then the timed
    blocks (iterations averaged, then averaged over ranks) run round-robin over
    the backends, --trials times, and the median (or min) block is reported, so
    that a change of load on a shared machine hits every backend alike.
    """
    xp, k, rank = backend.xp, comm.Get_size(), comm.Get_rank()
    count = max(1, nbytes // dtype.itemsize)
    src = xp.empty(count, dtype=dtype)  # shared by the backends: timing does not need fresh values
    dst = src if inplace else xp.empty(count, dtype=dtype)

    def once(red: Reducer) -> None:
        if inplace:
            red.allreduce_(dst)
        else:
            red.allreduce(src, dst)

    def sync() -> None:
        if backend.is_gpu:
            xp.cuda.get_current_stream().synchronize()

    wrong = {}
    for name, red in reducers.items():
        fill(xp, src, rank)
        with np.errstate(over="ignore"):  # in place, values double every iteration: inf is as fast to add
            for _ in range(args.warmup):
                once(red)
        fill(xp, src, rank)  # the checked run
        if not inplace:
            dst[...] = 0
        once(red)
        sync()
        wrong[name] = comm.allreduce(count_wrong(dst, k))
    n = iterations(nbytes, args)
    blocks: dict[str, list[float]] = {name: [] for name in reducers}
    for _ in range(args.trials):
        for name, red in reducers.items():
            comm.Barrier()
            t0 = time.perf_counter()
            with np.errstate(over="ignore"):
                for _ in range(n):
                    once(red)
            sync()
            blocks[name].append(comm.allreduce((time.perf_counter() - t0) / n) / k)
    pick = np.min if args.stat == "min" else np.median
    return {name: (float(pick(blocks[name])) * 1e6, wrong[name]) for name in reducers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", type=parse_size, default=4, help="smallest size (e.g. 4, 1K)")
    p.add_argument("--max-bytes", type=parse_size, default=256 << 20, help="largest size (e.g. 256M)")
    p.add_argument("--step-factor", type=int, default=2, help="multiply the size by this each row")
    p.add_argument("--dtype", default="float32", help="float16|float32|float64|int32|int64")
    p.add_argument("--backends", default="", help=f"comma list; default CPU: {','.join(CPU_BACKENDS)}, "
                   f"GPU: {','.join(GPU_BACKENDS)}")
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="where the buffers live")
    p.add_argument("--cuda-aware", default="auto", choices=("auto", "direct", "staged"),
                   help="GPU buffers to MPI: probe, pass device pointers, or stage through pinned host memory")
    p.add_argument("--compress", default="none", choices=("none", "fp16"), help="cast for the wire")
    p.add_argument("--inplace", default="both", choices=("both", "yes", "no"), help="in-place, out-of-place or both")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations before each measurement")
    p.add_argument("--iters", type=int, default=0, help="timed iterations (0: about --bytes-per-size / size)")
    p.add_argument("--trials", type=int, default=1,
                   help="timed blocks per row; the median of their rank-averaged means is reported (noisy machines)")
    p.add_argument("--stat", default="median", choices=("median", "min"),
                   help="how --trials are combined: median, or min (latency on a machine shared with others)")
    p.add_argument("--bytes-per-size", type=float, default=1e9, help="bytes to reduce per timed row when --iters 0")
    p.add_argument("--json", type=Path, help="write one JSON record per row here (rank 0)")
    p.add_argument("--plot", type=Path, help="write a PNG of busbw against size here (rank 0)")
    p.add_argument("--summarize", type=Path, help="print a Markdown comparison of a --json file and exit (no MPI)")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize([json.loads(line) for line in args.summarize.read_text().splitlines() if line.strip()]))
        return 0
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes or args.step_factor < 2 or args.trials < 1:
        p.error("need 1 <= --min-bytes <= --max-bytes, --step-factor >= 2 and --trials >= 1")

    comm = MPI.COMM_WORLD
    k, rank = comm.Get_size(), comm.Get_rank()
    backend, _ = select_backend(args.device, local_rank=rank)
    dtype = np.dtype(args.dtype)
    names = [b for b in args.backends.split(",") if b] or list(GPU_BACKENDS if backend.is_gpu else CPU_BACKENDS)
    modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.inplace]
    sizes = []
    s = args.min_bytes
    while s <= args.max_bytes:
        sizes.append(max(dtype.itemsize, s // dtype.itemsize * dtype.itemsize))
        s *= args.step_factor

    reducers = {name: make_reducer(name, comm, backend, args) for name in names}
    out = print if rank == 0 else (lambda *a, **kw: None)
    library = MPI.Get_library_version().splitlines()[0].strip()
    out(f"# allreduce_bw: k={k} ranks, {backend.describe()}, dtype {dtype}, {library}")
    for name, red in reducers.items():
        out(f"#   {name}: {red.describe()}")
    out(f"# {'backend':>13} {'size':>11} {'count':>10} {'type':>8}   "
        + "   ".join(f"{'time_us':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}" for _ in modes)
        + "   (" + ", ".join("in-place" if m else "out-of-place" for m in modes) + "; GB/s)")
    records: list[dict[str, Any]] = []
    total_wrong = 0
    for nbytes in sizes:
        cells: dict[str, list[str]] = {name: [] for name in reducers}
        for inplace in modes:
            for name, (t_us, wrong) in measure_all(reducers, comm, backend, nbytes, dtype, inplace, args).items():
                algbw = nbytes / (t_us * 1e-6) / 1e9
                busbw = algbw * 2 * (k - 1) / k
                total_wrong += wrong
                cells[name].append(f"{t_us:9.1f} {algbw:7.3f} {busbw:7.3f} {wrong:6d}")
                records.append({"backend": name, "size_bytes": nbytes, "count": nbytes // dtype.itemsize,
                                "dtype": str(dtype), "inplace": inplace, "time_us": round(t_us, 3),
                                "algbw_gbps": round(algbw, 4), "busbw_gbps": round(busbw, 4), "wrong": wrong,
                                "ranks": k, "device": backend.device})
        for name in reducers:
            out(f"  {name:>13} {nbytes:11d} {nbytes // dtype.itemsize:10d} {dtype.name:>8}   "
                + "   ".join(cells[name]), flush=True)
    for red in reducers.values():
        red.close()
    out(f"# out of bounds values: {total_wrong} {'ERROR' if total_wrong else 'OK'}")
    if rank == 0 and args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    if rank == 0 and args.plot:
        plot(records, args.plot, k, backend.describe())
    return 1 if total_wrong else 0


def summarize(records: list[dict[str, Any]], inplace: bool = True) -> str:
    """Markdown: busbw per backend and size, then speed ratios (time of the reference / time of the backend):
    ring/mpi, ring-p2p/mpi, auto/best(mpi, ring), deterministic/ring and deterministic/auto (> 1: faster)."""
    rows = [r for r in records if r["inplace"] == inplace]
    by = {(r["backend"], r["size_bytes"]): r for r in rows}
    names = list(dict.fromkeys(r["backend"] for r in rows))
    ratios = [("ring/mpi", "ring", ("mpi",)), ("p2p/mpi", "ring-p2p", ("mpi",)), ("auto/best", "auto", ("mpi", "ring")),
              ("det/ring", "deterministic", ("ring",)), ("det/auto", "deterministic", ("auto",))]
    ratios = [x for x in ratios if x[1] in names and all(b in names for b in x[2])]
    head = ["size", *[f"{n} busbw" for n in names], "mpi time_us" if "mpi" in names else None,
            *[x[0] for x in ratios]]
    head = [h for h in head if h]
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for size in sorted({r["size_bytes"] for r in rows}):
        cells = [_human(size)]
        cells += [f"{by[(n, size)]['busbw_gbps']:.3f}" if (n, size) in by else "" for n in names]
        if "mpi" in names:
            cells.append(f"{by[('mpi', size)]['time_us']:.1f}")
        for _, num, dens in ratios:
            t_best = min(by[(d, size)]["time_us"] for d in dens)
            cells.append(f"{t_best / by[(num, size)]['time_us']:.2f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(records: list[dict[str, Any]], path: Path, k: int, where: str) -> None:
    import matplotlib  # noqa: PLC0415 - only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.2))
    inplace = any(r["inplace"] for r in records)
    for name in dict.fromkeys(r["backend"] for r in records):
        rows = [r for r in records if r["backend"] == name and r["inplace"] == inplace]
        ax.plot([r["size_bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"all-reduce busbw, k={k}, {'in-place' if inplace else 'out-of-place'}, {where}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    lo = min(r["size_bytes"] for r in records)
    ax.set_xlim(lo, max(r["size_bytes"] for r in records))
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: _human(v)))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _human(v: float) -> str:
    if v <= 0:
        return "0"
    e = int(math.log2(v)) // 10
    return f"{v / 1024 ** e:g}{['B', 'K', 'M', 'G'][min(e, 3)]}"


if __name__ == "__main__":
    sys.exit(main())
