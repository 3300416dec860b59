"""All-reduce bandwidth, nccl-tests style: ``mpiexec -n N python benchmarks/allreduce_bw.py``.

For each backend (an ``--allreduce`` strategy) and size: out-of-place and
in-place time (us, averaged over a block of calls lasting about --block-ms, then
over ranks; with --trials N, the median, or with --stat min the minimum, of N
such blocks, taken round-robin over the backends), algbw = size / time and
busbw = algbw * 2(k-1)/k in GB/s (1e9 bytes/s), and #wrong, the elements that
differ from the exact sum after a checked run (values are small integers, exact
in every dtype). Warm-up calls (where ``auto`` measures a new size class) and a
barrier precede each timing. ``shared`` reduces its own node-shared buffer (in
place only; out of place it is ``mpi``). Exit status 1 if anything was wrong;
2 for bad input (one line from rank 0, on every rank before any measurement).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from mpisgd.backend import Backend, select_backend, sync, to_numpy, xp_of  # noqa: E402
from mpisgd.comm import STRATEGIES, create_reducer  # noqa: E402
from mpisgd.comm.base import Reducer, node_layout  # noqa: E402
from mpisgd.context import AgreedError, agree  # noqa: E402
from mpisgd.data import available_bytes  # noqa: E402
from mpisgd.errors import UsageError  # noqa: E402
from mpisgd.files import atomic_write, check_output_file, replaceable  # noqa: E402

CPU_BACKENDS = ("mpi", "ring", "auto", "deterministic", "shared")
GPU_BACKENDS = ("nccl", "mpi", "ring", "auto")
RECORD = ("backend", "size_bytes", "inplace", "time_us", "busbw_gbps")  # what --summarize reads of a --json row


def parse_size(text: str) -> int:
    """'4', '64K', '256M', '1G' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"size must look like 4, 64K, 256M or 1G, got {text!r}")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


def make_reducer(name: str, comm: Any, backend: Backend, args: argparse.Namespace) -> Reducer:
    return create_reducer(name, comm, device=backend.is_gpu, cuda_aware=args.cuda_aware)


def fill(buf: Any, rank: int) -> None:
    """Rank r holds (r + 1) * (1 + i % 13): the sum over k ranks, k(k+1)/2 * (1 + i % 13), is exact."""
    values = ((np.arange(buf.size, dtype=np.int64) % 13 + 1) * (rank + 1)).astype(buf.dtype)
    buf[...] = xp_of(buf).asarray(values)


def count_wrong(result: Any, k: int) -> int:
    got = to_numpy(result)
    want = ((np.arange(got.size, dtype=np.int64) % 13 + 1) * (k * (k + 1) // 2)).astype(got.dtype)
    return int(np.count_nonzero(got != want))


def buffers(reducers: dict[str, Reducer], xp: Any, dtype: np.dtype, max_count: int) -> dict[str, Any]:
    """A source buffer per backend, of the largest size: the node-shared buffer for ``shared``, plain
    arrays elsewhere (auto offers one too, but auto is measured on ordinary buffers), and one plain
    destination (``out``) that the backends take turns to fill out of place."""
    out = {"out": xp.empty(max_count, dtype=dtype)}
    for name, red in reducers.items():
        window = red.shared_buffer(max_count, dtype) if name == "shared" else None
        out[name] = window if window is not None else xp.empty(max_count, dtype=dtype)
    return out


def measure_all(reducers: dict[str, Reducer], bufs: dict[str, Any], comm: Any, count: int, inplace: bool,
                args: argparse.Namespace) -> dict[str, tuple[float, int]]:
    """Per backend: (time per all-reduce in us, #wrong summed over ranks).

    Each backend warms up, then is checked on fresh data; the timed blocks (a number of calls that
    lasts about --block-ms, the same on every rank; averaged, then averaged over ranks) run
    round-robin over the backends, --trials times, and the median (or min) block is reported, so
    that a change of load on a shared machine hits every backend alike.
    """
    k, rank = comm.Get_size(), comm.Get_rank()
    calls: dict[str, tuple[Any, Any]] = {}
    wrong, n_calls = {}, {}
    for name, red in reducers.items():
        src = bufs[name][:count]
        dst = src if inplace else bufs["out"][:count]
        calls[name] = (src, dst)
        fill(src, rank)
        with np.errstate(over="ignore"):  # in place, values double every call: inf is as fast to add
            red.allreduce_(dst) if inplace else red.allreduce(src, dst)  # untimed: auto decides on a first call
        t0 = time.perf_counter()
        with np.errstate(over="ignore"):
            for _ in range(args.warmup):
                red.allreduce_(dst) if inplace else red.allreduce(src, dst)
        sync(dst)
        per_call = comm.allreduce((time.perf_counter() - t0) / max(1, args.warmup), op=MPI.MAX)
        n_calls[name] = args.iters or max(3, min(20_000, int(args.block_ms * 1e-3 / max(per_call, 1e-7))))
        fill(src, rank)  # the checked run
        if not inplace:
            dst[...] = 0
        red.allreduce_(dst) if inplace else red.allreduce(src, dst)
        sync(dst)
        wrong[name] = comm.allreduce(count_wrong(dst, k))
    blocks: dict[str, list[float]] = {name: [] for name in reducers}
    for _ in range(args.trials):
        for name, red in reducers.items():
            src, dst = calls[name]
            n = n_calls[name]
            comm.Barrier()
            t0 = time.perf_counter()
            with np.errstate(over="ignore"):
                if inplace:
                    for _ in range(n):
                        red.allreduce_(dst)
                else:
                    for _ in range(n):
                        red.allreduce(src, dst)
            sync(dst)
            blocks[name].append(comm.allreduce((time.perf_counter() - t0) / n) / k)
    pick = np.min if args.stat == "min" else np.median
    return {name: (float(pick(blocks[name])) * 1e6, wrong[name]) for name in reducers}


class BenchError(ValueError):
    """Bad input to the benchmark: one line from rank 0, exit 2 on every rank."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises BenchError rather than printing usage on every rank and exiting."""

    def __init__(self, *args: Any, quiet: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def error(self, message: str) -> None:  # type: ignore[override]
        raise BenchError(message)

    def _print_message(self, message: str, file: Any = None) -> None:
        if not self.quiet:
            super()._print_message(message, file)


def parse_args(argv: list[str] | None = None, quiet: bool = False) -> argparse.Namespace:
    p = _Parser(description=__doc__.splitlines()[0], quiet=quiet)
    p.add_argument("--min-bytes", type=parse_size, default=4, help="smallest size (e.g. 4, 1K)")
    p.add_argument("--max-bytes", type=parse_size, default=256 << 20, help="largest size (e.g. 256M)")
    p.add_argument("--step-factor", type=int, default=2, help="multiply the size by this each row")
    p.add_argument("--dtype", default="float32", help="float16|float32|float64|int32|int64")
    p.add_argument("--backends", default=None, help=f"comma list; default CPU: {','.join(CPU_BACKENDS)}, "
                   f"GPU: {','.join(GPU_BACKENDS)}")
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="where the buffers live")
    p.add_argument("--cuda-aware", default="auto", choices=("auto", "direct", "staged"),
                   help="GPU buffers to MPI: probe, pass device pointers, or stage through pinned host memory")
    p.add_argument("--inplace", default="both", choices=("both", "yes", "no"), help="in-place, out-of-place or both")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before each measurement")
    p.add_argument("--iters", type=int, default=0, help="calls per timed block (0: as many as last --block-ms)")
    p.add_argument("--block-ms", type=float, default=20.0, help="length of a timed block when --iters is 0")
    p.add_argument("--trials", type=int, default=1,
                   help="timed blocks per row; the median of their rank-averaged means is reported (noisy machines)")
    p.add_argument("--stat", default="median", choices=("median", "min"),
                   help="how --trials are combined: median, or min (latency on a machine shared with others)")
    p.add_argument("--json", type=Path, help="write one JSON record per row here (rank 0; an earlier run's "
                   "output is replaced, any other file refused)")
    p.add_argument("--plot", type=Path, help="write a plot of busbw against size here (rank 0), in the format its "
                   "suffix names (.png, .pdf, .svg, ...; PNG without one)")
    p.add_argument("--summarize", type=Path, nargs="+",
                   help="print a Markdown comparison of --json files and exit (no MPI); several files: auto's "
                        "ratio to the better of mpi and ring in each run, side by side, and the worst")
    args = p.parse_args(argv)
    if args.summarize:
        return args
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes or args.step_factor < 2 or args.trials < 1:
        raise BenchError("need 1 <= --min-bytes <= --max-bytes, --step-factor >= 2 and --trials >= 1")
    if args.iters < 0 or args.warmup < 0:
        raise BenchError(f"--iters and --warmup must be >= 0, got {args.iters} and {args.warmup}")
    if not (math.isfinite(args.block_ms) and args.block_ms > 0):
        raise BenchError(f"--block-ms must be a positive number, got {args.block_ms}")
    try:
        dtype = np.dtype(args.dtype)
    except TypeError:
        raise BenchError(f"--dtype {args.dtype!r} is not a NumPy dtype; use float16, float32, float64, int32 "
                         "or int64") from None
    if dtype.kind not in "fiu":
        raise BenchError(f"--dtype must be a number type (float16, float32, float64, int32, int64), got {dtype}")
    args.names = backend_names(args.backends, args.device)
    check_plot(args.plot, args.json)
    unknown = [b for b in args.names if b not in STRATEGIES]
    if unknown:
        raise BenchError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    if len(set(args.names)) != len(args.names):
        raise BenchError(f"--backends names one twice: {args.backends}")
    return args


def backend_names(text: str | None, device: str) -> list[str]:
    """--backends: the names given (none empty), or the device's defaults when it is not given."""
    if text is None:
        return list(GPU_BACKENDS if device == "gpu" else CPU_BACKENDS)
    names = [b.strip() for b in text.split(",")]
    if not all(names):
        raise BenchError(f"--backends {text!r}: an empty name; give a comma list such as mpi,ring, or leave "
                         "--backends out for every default backend")
    return names


def check_plot(plot: Path | None, json_path: Path | None) -> None:
    """--plot names a format matplotlib writes (its suffix; none: PNG) and is not the --json file (BenchError)."""
    if plot is None:
        return
    if json_path is not None and os.path.realpath(plot) == os.path.realpath(json_path):
        raise BenchError(f"--plot {plot} is also the --json file: give them different paths")
    try:
        from matplotlib.backend_bases import FigureCanvasBase  # noqa: PLC0415 - only for --plot
    except ImportError:
        raise BenchError("--plot needs matplotlib (pip install matplotlib)") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = plot.suffix[1:].lower()
    if suffix and suffix not in formats:
        raise BenchError(f"--plot {plot}: matplotlib cannot write .{suffix} files; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")


def _written_by_us(f: IO[bytes]) -> bool:
    first = json.loads(f.readline(1 << 20))
    return isinstance(first, dict) and set(RECORD) <= set(first)


def output_problem(args: argparse.Namespace) -> str | None:
    """Why rank 0 cannot write --json or --plot (or must not replace --json: someone's file), or None."""
    for what, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        try:
            check_output_file(str(path), what)
        except OSError as exc:  # a path this process may not even look at
            return f"{what} {path}: {exc.strerror or exc}"
        except UsageError as exc:  # about its directory, where it is not about the path itself
            return str(exc) if str(exc).startswith(f"{what} {path} ") else f"{exc}, so {path} cannot be written"
    if args.json is not None and not replaceable(args.json, _written_by_us):
        return (f"--json {args.json} exists and is not allreduce_bw output: the run would replace it; remove it "
                "or choose another path")
    return None


def check_memory(args: argparse.Namespace, local_size: int) -> None:
    """What differs by node: the memory the buffers need here (BenchError)."""
    need = (len(args.names) + 1) * args.max_bytes
    available = available_bytes() / max(1, local_size)
    if need > 0.8 * available:
        raise BenchError(f"--max-bytes {args.max_bytes:,} needs {need / 2**30:.1f} GiB per rank ({len(args.names)} "
                         f"backend buffer(s) and one destination), this node has {available / 2**30:.1f} GiB "
                         f"available per rank ({local_size} here): lower --max-bytes or name fewer --backends")


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD
    k, rank = comm.Get_size(), comm.Get_rank()
    try:
        return _main(argv, comm, k, rank)
    except AgreedError as exc:  # every rank raised it together: rank 0 says why, every rank exits 2
        if rank == 0:
            print(f"allreduce_bw: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _main(argv: list[str] | None, comm: Any, k: int, rank: int) -> int:
    error: Exception | None = None
    args = None
    try:
        args = parse_args(argv, quiet=rank != 0)
    except SystemExit as exc:  # --help: printed by rank 0
        return int(exc.code or 0)
    except BenchError as exc:
        error = exc
    agree(comm, error)  # argv is every rank's: all refuse it alike, before any other collective
    assert args is not None
    if args.summarize:
        return _summarize(args.summarize, comm)

    local_rank, local_size = node_layout(comm)[:2]
    problem = comm.bcast(output_problem(args) if rank == 0 else None)  # one message, every rank's: no "rank 0:"
    backend, error = None, None
    try:
        if problem:
            raise BenchError(problem)
        check_memory(args, local_size)
        backend, _ = select_backend(args.device, local_rank=local_rank)  # GPU local_rank % GPUs
    except (BenchError, UsageError) as exc:
        error = exc
    agree(comm, error)
    assert backend is not None
    dtype = np.dtype(args.dtype)
    names = args.names
    modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.inplace]
    sizes = []
    s = args.min_bytes
    while s <= args.max_bytes:
        sizes.append(max(dtype.itemsize, s // dtype.itemsize * dtype.itemsize))
        s *= args.step_factor

    reducers, error = {}, None
    try:
        for name in names:  # a strategy that cannot run here raises alike on every rank, before its collectives
            reducers[name] = make_reducer(name, comm, backend, args)
    except ValueError as exc:
        error = exc
    agree(comm, error)
    bufs = buffers(reducers, backend.xp, dtype, sizes[-1] // dtype.itemsize)
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
            for name, (t_us, wrong) in measure_all(reducers, bufs, comm, nbytes // dtype.itemsize, inplace,
                                                   args).items():
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
    for name, red in reducers.items():
        if name == "auto":
            out(f"#   {red.describe()}")  # what auto chose, now that it has seen every size
        red.close()
    out(f"# out of bounds values: {total_wrong} {'ERROR' if total_wrong else 'OK'}")
    if rank == 0 and args.json:
        text = "\n".join(json.dumps(r) for r in records) + "\n"
        atomic_write(args.json, lambda f: f.write(text.encode()))
    if rank == 0 and args.plot:
        plot(records, args.plot, k, backend.describe())
    return 1 if total_wrong else 0


def _summarize(paths: list[Path], comm: Any) -> int:
    """--summarize: the table, or one line on what is wrong with the files (every rank reads them alike)."""
    runs, error = None, None
    try:
        runs = load_runs(paths)
    except BenchError as exc:
        error = exc
    agree(comm, error)
    assert runs is not None
    if comm.Get_rank() == 0:
        print(summarize(runs[0]) if len(runs) == 1 else summarize_auto(runs))
    return 0


def load_runs(paths: list[Path]) -> list[list[dict[str, Any]]]:
    """--summarize's files, each allreduce_bw --json output with in-place rows, none named twice; several: each
    with auto, mpi and ring at a size they all measured (BenchError)."""
    real = [os.path.realpath(p) for p in paths]
    twice = [str(p) for i, p in enumerate(paths) if real[i] in real[:i]]
    if twice:
        raise BenchError(f"--summarize names {', '.join(twice)} twice: a run compared with itself says nothing")
    runs = [load_run(p) for p in paths]
    if len(runs) > 1:
        for path, run in zip(paths, runs):
            missing = [b for b in ("mpi", "ring", "auto") if not any(r["backend"] == b and r["inplace"] for r in run)]
            if missing:
                raise BenchError(f"--summarize {path}: no in-place rows of {', '.join(missing)}; several files "
                                 "compare auto with mpi and ring")
        if not _common_sizes(runs):
            raise BenchError("--summarize: the files share no size that each measured with mpi, ring and auto")
    return runs


def load_run(path: Path) -> list[dict[str, Any]]:
    """One --json file's rows (BenchError naming the file and what is wrong)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise BenchError(f"--summarize {path}: no such file") from None
    except IsADirectoryError:
        raise BenchError(f"--summarize {path} is a directory, not an allreduce_bw --json file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"--summarize {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not (isinstance(row, dict) and set(RECORD) <= set(row)):
            raise BenchError(f"--summarize {path}: line {n} is not an allreduce_bw --json row (a JSON object with "
                             f"{', '.join(RECORD)})")
        rows.append(row)
    if not any(r["inplace"] for r in rows):
        raise BenchError(f"--summarize {path}: no in-place rows (empty, or written with --inplace no); the "
                         "comparison is of in-place times")
    return rows


def _common_sizes(runs: list[list[dict[str, Any]]], inplace: bool = True) -> list[int]:
    """The sizes every run measured with mpi, ring and auto."""
    have = [{(r["backend"], r["size_bytes"]) for r in run if r["inplace"] == inplace} for run in runs]
    sizes = {size for _, size in have[0]}
    return sorted(s for s in sizes if all((b, s) in h for h in have for b in ("mpi", "ring", "auto")))


def summarize(records: list[dict[str, Any]], inplace: bool = True) -> str:
    """Markdown: busbw per backend and size, then speed ratios (time of the reference / time of the backend,
    > 1: faster): ring/mpi, auto/best(mpi, ring), shared/mpi and deterministic/mpi."""
    rows = [r for r in records if r["inplace"] == inplace]
    by = {(r["backend"], r["size_bytes"]): r for r in rows}
    names = list(dict.fromkeys(r["backend"] for r in rows))
    ratios = [("ring/mpi", "ring", ("mpi",)), ("auto/best", "auto", ("mpi", "ring")),
              ("shared/mpi", "shared", ("mpi",)), ("det/mpi", "deterministic", ("mpi",))]
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


def summarize_auto(runs: list[list[dict[str, Any]]], inplace: bool = True) -> str:
    """Markdown: per size, auto's speed against the better of mpi and ring in each run, and the worst run."""
    tables = [{(r["backend"], r["size_bytes"]): r["time_us"] for r in run if r["inplace"] == inplace} for run in runs]
    sizes = _common_sizes(runs, inplace)
    head = ["size", *[f"run {i + 1}: mpi / ring / auto (us)" for i in range(len(runs))],
            *[f"run {i + 1} auto/best" for i in range(len(runs))], "worst"]
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for size in sizes:
        times = [[t[(b, size)] for b in ("mpi", "ring", "auto")] for t in tables]
        ratios = [min(m, r) / a for m, r, a in times]
        out.append("| " + " | ".join([_human(size), *[" / ".join(f"{v:.1f}" for v in t) for t in times],
                                      *[f"{x:.2f}" for x in ratios], f"**{min(ratios):.2f}**"]) + " |")
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
    fig.savefig(path, dpi=120, format=path.suffix[1:].lower() or "png")


def _human(v: float) -> str:
    if v <= 0:
        return "0"
    e = int(math.log2(v)) // 10
    return f"{v / 1024 ** e:g}{['B', 'K', 'M', 'G'][min(e, 3)]}"


if __name__ == "__main__":
    sys.exit(main())
