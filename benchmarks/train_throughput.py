"""Training throughput and weak-scaling efficiency, measured side by side.

    python benchmarks/train_throughput.py [--model mlp|cnn] [--ks 1,2] [--repeats 3] [--compare] [--json PATH]
                                          [-- TRAIN OPTIONS]

Each launch is `mpiexec -n k python -m mpisgd.train --epochs 2 ...`; its
second epoch (the first is the warm-up) gives samples/s over the training steps
only, and the per-step split (forward, backward, exposed communication, total
communication, optimizer). Launches are interleaved (k=1, k=2, k=1, ...), the
order rotated by one each repeat, so that machine noise and drift hit every
configuration alike; the table shows medians. Efficiency = samples/s(k) /
(k * samples/s(1)), same per-rank batch. `--compare` adds, interleaved too, the
plain NumPy loop on 1 and 2 BLAS threads and, when torch is importable, PyTorch
DDP (gloo) at the largest k (`--baselines` picks among them). `--model cnn`
runs LeNet-5 on every side (mpisgd's `--model cnn`, PyTorch's own conv kernels)
and compares with PyTorch in one process at k=1 and DDP (gloo) at the largest
k; the hand-written NumPy loop is the MLP only. Every side trains on the
same samples (`--limit-train` among the train options limits the baselines'
too). The speed
issues' targets are printed last as ratios within each repeat (launches
seconds apart), with their median: steadier than a ratio of medians when the
machine drifts. mpisgd's default at k >= 2 is the sharded step; `--replicated`
adds, interleaved, mpisgd with `--no-shard-optimizer` at each k > 1 ("mpisgd k=2
replicated"), with its own efficiency and its ratio to the default.
`--variant 'NAME=OPTIONS'` (repeatable) adds, interleaved, mpisgd at the largest k
with those extra options, and its paired ratio to plain mpisgd (to the replicated
one when its options shard): an A/B of one option under the same noise.
`--apart` adds the machine's own ceiling: k single-rank trainings started
together, each its own `mpiexec -n 1` with no communication between them
("mpisgd k=2 apart", samples/s summed). What they lose against k times one
rank alone is what sharing the cores, caches and memory bus costs; what k
ranks lose against them is what synchronising costs. Each ratio's median comes
with a 95 % bootstrap interval over the repeats. Memory columns (largest rank):
peak RSS, RSS at start-up before any data ("start": interpreter, NumPy, MPI),
and what training holds ("state": parameters, gradients, optimizer state,
activations and data; the speed issue's bound is 1.5 times this).
Each launch also records how many cores other processes kept busy meanwhile
(from /proc/stat, less the launch's own CPU time); `--max-others CORES` runs a
launch again, up to four tries, when that exceeds CORES: on a machine shared
with other people's jobs, a disturbed launch is retried instead of kept.
`--device gpu` runs mpisgd on CuPy (ranks sharing the GPUs there are), the
hand-written loop on CuPy arrays ("cupy-loop", in place of the two NumPy loops)
and DDP on CUDA (NCCL, or gloo where ranks share a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, NoReturn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from mpisgd.app.options import parse_config  # noqa: E402
from mpisgd.config import Config, at_least  # noqa: E402
from mpisgd.errors import UsageError  # noqa: E402
from mpisgd.files import atomic_write, check_output_file, replaceable  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONPATH": str(ROOT),
       # every launch measures auto's choices afresh: a plan from another run must not decide a comparison
       "MPISGD_PLAN_FILE": os.environ.get("MPISGD_PLAN_FILE", "off")}
BASELINES = ("numpy-1t", "numpy-2t", "torch", "torch-ddp")
DEFAULT_BASELINES = {"mlp": "numpy-1t,numpy-2t,torch-ddp", "cnn": "torch,torch-ddp"}
WORKLOADS = {"cnn": "LeNet-5 (conv 6@5x5 pad 2, max-pool 2, conv 16@5x5, max-pool 2, 120, 84, 10, ReLU)"}
MODELS = ("mlp", "cnn")  # what the baselines, the workload line and the targets know
OWNED = {"metrics_file": "--metrics-file"}  # train options the benchmark sets itself, per launch
MEMORY = ("peak_rss_mib", "rss_start_mib", "state_mib")  # the largest rank's; see mpisgd.app.report
SPLIT = ("forward_ms", "backward_ms", "comm_exposed_ms", "comm_total_ms", "optimizer_ms", "step_ms")


def mpiexec(k: int) -> list[str]:
    exe = shutil.which("mpiexec") or "mpiexec"
    return [exe, "-n", str(k), sys.executable]


def run_mpisgd(k: int, train_args: list[str], tmp: str, replicated: bool = False, variant: str = "") -> dict:
    """One launch; ``variant`` is a --variant's "NAME=OPTIONS" (its options added, its name in the label)."""
    metrics = os.path.join(tmp, f"m{k}.jsonl")
    if replicated:
        train_args = [*train_args, "--no-shard-optimizer"]
    name, _, extra = variant.partition("=")
    train_args = [*train_args, *shlex.split(extra)]
    if os.path.exists(metrics):
        os.unlink(metrics)
    cmd = mpiexec(k) + ["-m", "mpisgd.train", "--epochs", "2", "--progress", "off", "--metrics-file", metrics,
                        *train_args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=900)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    epochs = [json.loads(line) for line in open(metrics) if '"kind":"epoch"' in line]
    last = epochs[-1]
    impl = f"mpisgd k={k}" + (" replicated" if replicated else "") + (f" {name}" if name else "")
    return {"impl": impl, "k": k, "samples_per_s": last["samples_per_s"], **{key: last[key] for key in SPLIT},
            **{key: last.get(key, float("nan")) for key in MEMORY}, "options": extra}


def run_apart(k: int, train_args: list[str], tmp: str) -> dict:
    """k single-rank trainings at once, no communication: the machine's ceiling for k ranks. Three
    epochs each and the middle one counted, so that every counted epoch runs beside the others'."""
    procs, files = [], []
    for i in range(k):
        metrics = os.path.join(tmp, f"apart{i}.jsonl")
        if os.path.exists(metrics):
            os.unlink(metrics)
        cmd = mpiexec(1) + ["-m", "mpisgd.train", "--epochs", "3", "--progress", "off", "--metrics-file", metrics,
                            *train_args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV))
        files.append(metrics)
    try:
        errors = [(p.args, p.communicate(timeout=900)[1]) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # none left running behind the next launches
            p.kill()
            p.wait()
        raise SystemExit("an --apart launch ran past 900 s") from None
    for p, (cmd, err) in zip(procs, errors):
        if p.returncode:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{err[-2000:]}")
    epochs = [[json.loads(line) for line in open(f) if '"kind":"epoch"' in line] for f in files]
    middles = [e[len(e) // 2] for e in epochs]  # the middle of three (the last of two, if --epochs 2 is given)
    return {"impl": f"mpisgd k={k} apart", "k": k, "samples_per_s": sum(m["samples_per_s"] for m in middles),
            **{key: statistics.mean(m[key] for m in middles) for key in SPLIT},
            **{key: max(m.get(key, float("nan")) for m in middles) for key in MEMORY}}


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has been busy since boot, all cores and steal time included
    (/proc/stat), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch_measured(launch: object) -> tuple[dict | None, float]:
    """Run ``launch()``; also return how many cores other processes kept busy meanwhile, on average (the
    machine's busy time less this launch's own): 0 on a machine left alone, NaN where unknown."""
    busy0, own0, t0 = busy_cpu_s(), children_cpu_s(), time.perf_counter()
    res = launch()  # type: ignore[operator]
    busy1, own1, wall = busy_cpu_s(), children_cpu_s(), time.perf_counter() - t0
    if busy0 is None or busy1 is None:
        return res, float("nan")
    return res, max(0.0, (busy1 - busy0) - (own1 - own0)) / wall


def median_ci(values: list[float], level: float = 0.95, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median: how far the median of this many repeats can be
    trusted on a noisy machine (a target is met with confidence only when the whole interval is)."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1) + 0.5)]


def run_baseline(impl: str, k: int, threads: int, hidden: str, batch: str, device: str,
                 model: str = "mlp", limit: str = "") -> dict | None:
    """One baseline's launch; ``limit``: its training samples (mpisgd's --limit-train), all where empty."""
    cmd = (mpiexec(k) if impl == "torch-ddp" else [sys.executable]) + [
        str(ROOT / "benchmarks" / "baselines.py"), impl, "--model", model, "--threads", str(threads),
        "--hidden", hidden, "--batch-size", batch, "--device", device, *(["--limit", limit] if limit else [])]
    env = {**ENV, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode:
        print(f"# {impl} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def baseline_jobs(chosen: list[str], model: str, device: str, k: int) -> list[tuple[str, int, int]]:
    """--compare's launches: (impl, ranks, BLAS threads) of the chosen baselines that apply here."""
    # on a GPU one hand-written loop (CuPy arrays) stands for both: BLAS threads do not apply
    threads = [t for t in (1, 2) if f"numpy-{t}t" in chosen][:1 if device == "gpu" else 2]
    if threads and model != "mlp":
        print(f"# the hand-written NumPy loop is the MLP only: skipped for --model {model}")
        threads = []
    jobs = [("numpy", 1, t) for t in threads]
    torches = [("torch", 1, 1)] if "torch" in chosen else []
    torches += [("torch-ddp", k, 1)] if "torch-ddp" in chosen else []
    # looked up, not imported: an import costs seconds of a launch's start-up
    if torches and importlib.util.find_spec("torch") is None:
        print("# torch not installed: PyTorch skipped (pip install torch; the CPU build is enough)")
        return jobs
    return jobs + torches


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (no usage screen) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_ks(text: str) -> list[int]:
    """'1,2' -> [1, 2]: rank counts, each a positive integer, none twice."""
    items = [t.strip() for t in text.split(",")]
    if not all(re.fullmatch(r"[1-9][0-9]*", t) for t in items):
        raise argparse.ArgumentTypeError(f"expected rank counts >= 1, comma-separated (1,2), got {text!r}")
    ks = [int(t) for t in items]
    if len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(f"names a rank count twice: {text!r}")
    return ks


def train_config(argv: list[str], where: str) -> Config:
    """``argv`` parsed and checked as mpisgd.train does (``--model=cnn`` is ``--model cnn``, a --config file is
    read); UsageError naming ``where`` for what mpisgd.train would refuse, --help, --print-config, and the
    options the benchmark sets itself."""
    try:
        cfg = parse_config(argv, quiet=True)
    except SystemExit:
        raise UsageError(f"{where}: --help and --print-config train nothing: drop them") from None
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    owned = [flag for name, flag in OWNED.items() if name in cfg.given]  # type: ignore[attr-defined]
    if owned:
        raise UsageError(f"{where}: {' and '.join(owned)} is the benchmark's own (it reads each launch's metrics "
                         "from a file of its own): drop it")
    return cfg


def train_options(train_args: list[str], model: str | None, device: str) -> tuple[list[str], Config]:
    """The options every mpisgd launch takes, checked before any launch, with the reference workload's
    defaults for what they leave out: the model (``model``, else mlp), one BLAS thread per rank, ``device``."""
    argv = [a for a in train_args if a != "--"]
    cfg = train_config(argv, "train options")
    given = cfg.given  # type: ignore[attr-defined]
    if model and "model" in given and cfg.model != model:
        raise UsageError(f"--model {model} and the train option --model {cfg.model} differ")
    model = model or cfg.model
    if model not in MODELS:
        raise UsageError(f"--model {model}: this benchmark measures {' and '.join(MODELS)} only (the baselines, "
                         "the workload line and the targets are theirs)")
    defaults = {"model": model, "threads": "1", "device": device}
    argv += [x for name, value in defaults.items() if name not in given for x in (f"--{name}", value)]
    return argv, train_config(argv, "train options")


def check_variant(variant: str, train_args: list[str]) -> None:
    """A --variant is NAME=OPTIONS, NAME none of the benchmark's own labels, OPTIONS what mpisgd.train takes."""
    name, eq, extra = variant.partition("=")
    if not eq or name.strip() in ("", "replicated", "apart"):
        raise UsageError(f"--variant {variant!r}: expected NAME=OPTIONS, NAME neither empty nor replicated nor apart")
    try:
        options = shlex.split(extra)
    except ValueError as exc:
        raise UsageError(f"--variant {variant!r}: {exc}") from None
    train_config([*train_args, *options], f"--variant {variant!r}")


def _written_by_us(f: IO[bytes]) -> bool:
    value = json.loads(f.read())
    return isinstance(value, dict) and {"summary", "runs", "ratios"} <= set(value)


def check_json(path: str) -> None:
    """--json can be written and replacing it loses nothing (absent, empty, or an earlier run's); UsageError."""
    try:
        check_output_file(path, "--json")
    except OSError as exc:  # a path this process may not even look at
        raise UsageError(f"--json {path}: {exc.strerror or exc}") from None
    except UsageError as exc:  # about its directory, where it is not about the path itself
        if str(exc).startswith(f"--json {path} "):
            raise
        raise UsageError(f"{exc}, so {path} cannot be written") from None
    if not replaceable(path, _written_by_us):
        raise UsageError(f"--json {path} exists and is not train_throughput output: the run would replace it; "
                         "remove it or choose another path")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str], Config]:
    """The benchmark's options, the train options (checked, completed) and their configuration; exit 2 with
    one line for anything wrong, before any launch."""
    parser = _Parser(prog="train_throughput.py", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default=None,
                        help="the workload of every side (default: --model among the train options, else mlp)")
    parser.add_argument("--ks", type=parse_ks, default=[1, 2], help="rank counts, comma-separated")
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--compare", action="store_true", help="add the NumPy loop and PyTorch DDP")
    parser.add_argument("--baselines", default=None,
                        help=f"with --compare, which of {', '.join(BASELINES)} (comma-separated; default "
                             f"{DEFAULT_BASELINES['mlp']} for the MLP, {DEFAULT_BASELINES['cnn']} for the CNN)")
    parser.add_argument("--replicated", action="store_true",
                        help="add mpisgd --no-shard-optimizer (the replicated step) at each k > 1")
    parser.add_argument("--apart", action="store_true",
                        help="add k single-rank trainings run together with no communication (the ceiling)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OPTIONS",
                        help="add mpisgd at the largest k with these extra options, interleaved, and its paired "
                             "ratio to plain mpisgd (e.g. 'private=--no-shared-grads'); repeatable")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="where every side computes")
    parser.add_argument("--max-others", type=float, default=None, metavar="CORES",
                        help="rerun a launch (up to 4 tries) while other processes kept more than CORES cores busy "
                             "during it on average: for machines shared with others (default: keep every launch)")
    parser.add_argument("--json", help="write all launches and the summary here (an earlier run's output is "
                                       "replaced, any other file refused)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: options for mpisgd.train")
    args = parser.parse_args(argv)
    if args.max_others is not None and not (math.isfinite(args.max_others) and args.max_others >= 0):
        parser.error(f"--max-others must be a number of cores >= 0, got {args.max_others}")
    try:
        train_args, cfg = train_options(args.train_args, args.model, args.device)
        for v in args.variant:
            check_variant(v, train_args)
        if args.json is not None:
            check_json(args.json)
        args.chosen = (args.baselines or DEFAULT_BASELINES[cfg.model]).split(",")
    except UsageError as exc:
        parser.error(str(exc))
    unknown = set(args.chosen) - set(BASELINES)
    if args.compare and unknown:
        parser.error(f"--baselines: unknown {', '.join(sorted(unknown))}; choose from {', '.join(BASELINES)}")
    return args, train_args, cfg


def main(argv: list[str] | None = None) -> None:
    args, train_args, cfg = parse_args(argv)
    model, ks = cfg.model, args.ks
    hidden, batch = ",".join(map(str, cfg.hidden)), str(cfg.batch_size)
    limit = str(cfg.limit_train or "")  # the baselines train on as many samples
    jobs = [("mpisgd", k, 1) for k in ks]
    if args.replicated:
        jobs += [("mpisgd-replicated", k, 1) for k in ks if k > 1]
    jobs += [(f"variant:{v}", max(ks), 1) for v in args.variant]
    if args.apart:
        jobs += [("mpisgd-apart", k, 1) for k in ks if k > 1]
    if args.compare:
        jobs += baseline_jobs(args.chosen, model, args.device, max(ks))
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for impl, k, threads in jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]:
                def launch(impl: str = impl, k: int = k, threads: int = threads) -> dict | None:
                    if impl == "mpisgd-apart":
                        return run_apart(k, train_args, tmp)
                    if impl.startswith("variant:"):
                        return run_mpisgd(k, train_args, tmp, variant=impl[len("variant:"):])
                    if impl.startswith("mpisgd"):
                        return run_mpisgd(k, train_args, tmp, impl == "mpisgd-replicated")
                    return run_baseline(impl, k, threads, hidden, batch, args.device, model, limit)

                for attempt in range(4 if args.max_others is not None else 1):
                    if attempt:
                        time.sleep(10)  # give the others a moment to finish
                    res, others = launch_measured(launch)
                    if res is None or args.max_others is None or not others > args.max_others:
                        break
                    print(f"# repeat {rep + 1}: {res['impl']}: others kept {others:.2f} cores busy: run again",
                          flush=True)
                if res:
                    res["repeat"], res["others_cores"] = rep, others
                    runs.setdefault(res["impl"], []).append(res)
                    print(f"# repeat {rep + 1}: {res['impl']}: {res['samples_per_s']:.0f} samples/s (others kept "
                          f"{others:.2f} cores busy)", flush=True)
    summary = {name: {key: statistics.median(r[key] for r in rs)
                      for key in rs[0] if key not in ("impl", "repeat", "options")}
               for name, rs in runs.items()}
    others = [r["others_cores"] for rs in runs.values() for r in rs]
    if others:
        print(f"\nother processes kept {statistics.median(others):.2f} cores busy during the median launch "
              f"(most: {max(others):.2f})")
    base = summary.get("mpisgd k=1", {}).get("samples_per_s")
    workload = WORKLOADS.get(model, f"MLP 784-{hidden.replace(',', '-')}-10")
    print(f"\nworkload: {workload} float32, b={batch} per rank, one BLAS thread per "
          f"rank unless noted; medians of {args.repeats} interleaved launches; extra args: {' '.join(train_args)}")
    name_w = max([22, *(len(name) + 1 for name in summary)])  # --variant names can be long
    print(f"{'implementation':<{name_w}}{'samples/s':>11}{'efficiency':>11}{'fwd ms':>8}{'bwd ms':>8}"
          f"{'comm exp':>9}{'comm tot':>9}{'opt ms':>8}{'step ms':>9}{'peak MiB':>10}{'start':>7}{'state':>7}")
    for name, s in summary.items():
        eff = s["samples_per_s"] / (s["k"] * base) if base and name.startswith("mpisgd") else float("nan")
        cols = "".join(f"{s.get(key, float('nan')):>{w}.2f}" for key, w in zip(SPLIT, (8, 8, 9, 9, 8, 9)))
        mem = "".join(f"{s.get(key, float('nan')):>{w}.0f}" for key, w in zip(MEMORY, (10, 7, 7)))
        print(f"{name:<{name_w}}{s['samples_per_s']:>11.0f}{eff:>11.3f}{cols}{mem}")
        s["efficiency"] = eff
    ratios = paired_ratios(runs, max(ks), model)
    intervals = {label: median_ci(values) for label, values in ratios.items()}
    if ratios:
        print("\nthe speed issue's ratios, within each repeat (then their median and its 95 % bootstrap interval):")
        for label, values in ratios.items():
            lo, hi = intervals[label]
            print(f"  {label:<48}{' '.join(f'{v:.3f}' for v in values)}  median {statistics.median(values):.3f}"
                  f" [{lo:.3f}, {hi:.3f}]")
    if args.json:
        text = json.dumps({"summary": summary, "runs": runs, "ratios": ratios, "ratio_ci95": intervals,
                           "train_args": train_args, "repeats": args.repeats}, indent=1)
        atomic_write(args.json, lambda f: f.write(text.encode()))


def paired_ratios(runs: dict[str, list[dict]], k: int, model: str = "mlp") -> dict[str, list[float]]:
    """Each target's ratio per repeat, from launches of the same repeat only (a repeat missing a side is
    left out). The targets are the speed issue's for the MLP, the CNN issue's for the CNN."""
    by_rep = {name: {r["repeat"]: r for r in rs} for name, rs in runs.items()}
    loop = "cupy-loop" if "cupy-loop" in runs else "numpy-loop-1t"
    ddp = next((name for name in runs if name.startswith("torch-ddp-")), "torch-ddp-gloo")
    single = next((name for name in runs if name in ("torch-cpu", "torch-cuda")), "torch-cpu")
    ddp_bound = {"mlp": 1.6, "cnn": 1.2}[model]
    targets = [  # (label, numerator, denominator, key, factor): value = factor * num[key] / den[key]
        (f"efficiency k={k} (>= 0.93)", f"mpisgd k={k}", "mpisgd k=1", "samples_per_s", 1 / k),
        (f"k=1 step / {loop} step (<= 1.05)", "mpisgd k=1", loop, "step_ms", 1.0),
        (f"k={k} / NumPy loop on 2 BLAS threads (>= 1.0)", f"mpisgd k={k}", "numpy-loop-2t", "samples_per_s", 1.0),
        (f"k=1 / PyTorch {single[6:]} k=1" + (" (>= 0.8)" if model == "cnn" else ""), "mpisgd k=1", single,
         "samples_per_s", 1.0),
        (f"k={k} / PyTorch DDP {ddp[10:]} k={k} (>= {ddp_bound})", f"mpisgd k={k}", ddp, "samples_per_s", 1.0),
    ]
    if f"mpisgd k={k} replicated" in runs:
        targets += [
            (f"efficiency k={k} replicated", f"mpisgd k={k} replicated", "mpisgd k=1", "samples_per_s", 1 / k),
            (f"k={k} / k={k} replicated", f"mpisgd k={k}", f"mpisgd k={k} replicated", "samples_per_s", 1.0),
        ]
    for name, rs in runs.items():  # each --variant against plain mpisgd (replicated, if it does not shard)
        if name.startswith(f"mpisgd k={k} ") and rs[0].get("options"):
            den = f"mpisgd k={k} replicated" if "--no-shard-optimizer" in rs[0]["options"].split() \
                and f"mpisgd k={k} replicated" in runs else f"mpisgd k={k}"
            targets.append((f"{name[7:]} / {den[7:]}", name, den, "samples_per_s", 1.0))
    if f"mpisgd k={k} apart" in runs:  # the ceiling, and how much of it each synchronised run reaches
        targets += [(f"ceiling: k={k} apart / ({k} x k=1)", f"mpisgd k={k} apart", "mpisgd k=1", "samples_per_s",
                     1 / k)]
        targets += [(f"{name[7:]} / k={k} apart", name, f"mpisgd k={k} apart", "samples_per_s", 1.0)
                    for name in (f"mpisgd k={k}", f"mpisgd k={k} replicated") if name in runs]
    out = {}
    for label, num, den, key, factor in targets:
        if num == den or num not in by_rep or den not in by_rep:
            continue
        reps = sorted(set(by_rep[num]) & set(by_rep[den]))
        if reps:
            out[label] = [factor * by_rep[num][r][key] / by_rep[den][r][key] for r in reps]
    return out


if __name__ == "__main__":
    main()
