"""The planner's throughput model against measurement: a k = 1 profile, mpisgd.plan's prediction for k = 2,
and a measured k = 2 run, side by side. Feeds docs/plan.md ("Validation").

    python experiments/plan_validation.py                       # this machine: MLP and CNN, 3 repeats
    python experiments/plan_validation.py --cluster             # also 2 emulated hosts at 1 and 10 Gbit/s (root)
    python experiments/plan_validation.py --quick               # smoke run: small model, 1 repeat, seconds

Where, and what is measured (every run: `mpisgd.train --epochs 2`, the second epoch's samples/s):
  * this machine: k = 1 and k = 2 (one node; the gradient all-reduce is the node-shared buffer), the network
    an `allreduce_bw.py --backends shared` run at k = 2 (the strategy training uses on one node);
  * --cluster: scripts/cluster/netcluster.py's 2 hosts x 1 rank with links shaped to 1 and 10 Gbit/s; the
    k = 1 profile on host h1, the network an `allreduce_bw.py --backends auto` run across the two hosts,
    the k = 2 run across them (its link counters must show the gradients crossed).
Each repeat is one k = 1 profile and one k = 2 run launched right after it; the prediction from each profile
is compared with the k = 2 run of the same repeat (error = predicted / measured - 1), and the table gives the
median over repeats. The planner is called as a user would: `python -m mpisgd.plan PROFILE --ranks 1,2 ...
--json` (the noise scale, which does not enter samples/s, is the profile's or a stand-in of 1000).

Every run is written to --out/<stamp>/runs/ (the command, the machine's other load during it, its epoch
records), the predictions to plans/, the table to validation.md and validation.json. On a machine shared with
other jobs the figures are noisy: "others" says how many cores other processes kept busy during each pair, and
--max-others CORES measures a disturbed pair again (up to --retries times).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpisgd.app.metrics import read_metrics  # noqa: E402
from mpisgd.app.records import to_json  # noqa: E402
from mpisgd.config import at_least  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "MPISGD_PLAN_FILE": "off"}
LINKS = ("1gbit", "10gbit")


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def netcluster() -> Any:
    return _load(ROOT / "scripts" / "cluster" / "netcluster.py", "netcluster")


@functools.cache
def throughput() -> Any:  # busy_cpu_s, children_cpu_s: the machine's other load during a launch
    return _load(ROOT / "benchmarks" / "train_throughput.py", "train_throughput")


def train_args(model: str, args: argparse.Namespace, metrics: Path) -> list[str]:
    extra = ["--hidden", args.hidden] if model == "mlp" else []
    return [sys.executable, "-m", "mpisgd.train", "--model", model, *extra, "--batch-size", str(args.batch),
            "--epochs", "2", "--limit-train", str(args.limit_train), "--limit-test", "500", "--threads", "1",
            "--progress", "off", "--metrics-file", str(metrics), *args.train_extra]


def allreduce_args(backends: str, out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / "allreduce_bw.py"), "--backends", backends, "--inplace", "yes",
            "--min-bytes", "64K", "--max-bytes", "32M", "--trials", "5", "--json", str(out)]


def mpiexec(k: int) -> list[str]:
    exe = shutil.which("mpiexec")
    if exe is None:
        raise SystemExit("plan_validation: no mpiexec on PATH")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return [exe, *(["--oversubscribe"] if "Open MPI" in version else []), "-n", str(k)]


class Launcher:
    """Runs a command here (mpiexec) or on the emulated cluster, and keeps its record in runs/."""

    def __init__(self, out: Path, cluster: Any = None, where: str = "local") -> None:
        self.out, self.cluster, self.where = out, cluster, where
        (out / "runs").mkdir(parents=True, exist_ok=True)

    def run(self, name: str, k: int, argv: list[str]) -> dict[str, Any]:
        tp = throughput()
        busy0, own0, t0 = tp.busy_cpu_s(), tp.children_cpu_s(), time.perf_counter()
        if self.cluster is None:
            cmd = [*mpiexec(k), *argv]
            r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1800, cwd=ROOT)
            rc, stdout, stderr, link_bytes = r.returncode, r.stdout, r.stderr, None
        else:
            cmd = self.cluster.mpiexec_cmd(argv, n=k)
            res = self.cluster.run(argv, timeout=1800, n=k)
            rc, stdout, stderr, link_bytes = res.returncode, res.stdout, res.stderr, res.link_bytes
        wall = time.perf_counter() - t0
        busy1, own1 = tp.busy_cpu_s(), tp.children_cpu_s()
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall if busy0 is not None and busy1 is not None \
            else float("nan")
        if rc:
            raise RuntimeError(f"{name} failed (exit {rc}): {shlex.join(cmd)}\n{stderr[-3000:]}")
        rec = {"name": name, "where": self.where, "k": k, "command": shlex.join(argv if self.cluster is None
                                                                                else cmd),
               "wall_s": round(wall, 2), "others_cores": round(others, 2), "link_bytes": link_bytes,
               "stdout_tail": stdout.splitlines()[-8:], "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        return rec

    def train(self, name: str, k: int, model: str, args: argparse.Namespace) -> dict[str, Any]:
        metrics = self.out / "runs" / f"{name}.jsonl"
        metrics.unlink(missing_ok=True)
        rec = self.run(name, k, train_args(model, args, metrics))
        log = read_metrics(str(metrics))[-1]  # the profile the planner reads: run record, steps, epochs
        epochs = [to_json(e) for e in log.epochs]
        if self.cluster is not None and k > 1:  # at least half the gradient crossed each link per step
            need = epochs[-1]["grad_nbytes"] * epochs[-1]["step"] // 2
            low = {h: n for h, n in rec["link_bytes"].items() if n < need}
            if low:
                raise RuntimeError(f"{name}: links carried fewer than {need} bytes ({low}): not the emulated network")
        rec["epochs"] = epochs
        rec["sharded"] = bool(log.run and log.run.sharded)
        (self.out / "runs" / f"{name}.json").write_text(json.dumps(rec, indent=1))
        return rec

    def allreduce(self, name: str, backends: str) -> Path:
        path = self.out / "runs" / f"{name}.jsonl"
        rec = self.run(name, 2, allreduce_args(backends, path))
        if self.cluster is not None and min(rec["link_bytes"].values()) < 32 << 20:
            raise RuntimeError(f"{name}: the links carried {rec['link_bytes']} bytes: not the emulated network")
        rec["rows"] = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        (self.out / "runs" / f"{name}.json").write_text(json.dumps(rec, indent=1))
        return path


def predict(out: Path, name: str, profile: Path, network: list[str]) -> dict[str, Any]:
    """mpisgd.plan as a user runs it; returns its k = 2 row."""
    epochs = read_metrics(str(profile))[-1].epochs
    noise = [] if epochs and epochs[-1].noise_scale else ["--noise-scale", "1000"]
    path = out / "plans" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mpisgd.plan", str(profile), "--ranks", "1,2", *network, *noise, "--json",
           str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"plan failed: {shlex.join(cmd)}\n{r.stderr}")
    plan = json.loads(path.read_text())
    plan["command"] = shlex.join(cmd)
    path.write_text(json.dumps(plan, indent=1))
    return next(row for row in plan["rows"] if row["k"] == 2)


def series(launch: Launcher, label: str, model: str, network_args: list[str], args: argparse.Namespace,
           stamp_out: Path) -> dict[str, Any]:
    """Repeats of (k = 1 profile, k = 2 run) and the prediction from each profile."""
    pairs = []
    for r in range(args.repeats):
        for attempt in range(1 + args.retries):  # a pair another process disturbed is measured again
            k1 = launch.train(f"{label}-k1-r{r + 1}", 1, model, args)
            k2 = launch.train(f"{label}-k2-r{r + 1}", 2, model, args)
            busy = max(k1["others_cores"], k2["others_cores"])
            if args.max_others is None or busy <= args.max_others:
                break
            print(f"{label} r{r + 1}: other processes kept {busy:.2f} cores busy (> --max-others "
                  f"{args.max_others:g}): measured again" if attempt < args.retries else
                  f"{label} r{r + 1}: still disturbed after {args.retries} retries: kept", flush=True)
        pred = predict(stamp_out, f"{label}-r{r + 1}", stamp_out / "runs" / f"{label}-k1-r{r + 1}.jsonl",
                       network_args)
        m1, m2 = k1["epochs"][-1], k2["epochs"][-1]
        pairs.append({"repeat": r + 1, "k1_samples_per_s": m1["samples_per_s"],
                      "predicted_samples_per_s": pred["samples_per_s"], "measured_samples_per_s": m2["samples_per_s"],
                      "error": pred["samples_per_s"] / m2["samples_per_s"] - 1,
                      "predicted_step_ms": pred["step_ms"], "predicted_exposed_ms": pred["exposed_comm_ms"],
                      "measured_step_ms": m2["step_ms"], "measured_exposed_ms": m2["comm_exposed_ms"],
                      "measured_compute_ms": m2["step_ms"] - m2["comm_exposed_ms"],
                      "predicted_sharded": pred["sharded"], "measured_sharded": k2["sharded"],
                      "others_cores": max(k1["others_cores"], k2["others_cores"]), "attempts": attempt + 1})
        p = pairs[-1]
        print(f"{label} r{r + 1}: k=1 {p['k1_samples_per_s']:.0f}/s -> predicted k=2 {p['predicted_samples_per_s']:.0f}"
              f"/s, measured {p['measured_samples_per_s']:.0f}/s ({100 * p['error']:+.1f} %); exposed comm "
              f"{p['predicted_exposed_ms']:.2f} predicted, {p['measured_exposed_ms']:.2f} ms measured; "
              f"others {p['others_cores']:.1f} cores", flush=True)
    med = statistics.median(p["error"] for p in pairs)
    return {"label": label, "model": model, "pairs": pairs, "median_error": med,
            "median": {key: statistics.median(p[key] for p in pairs) for key in pairs[0]
                       if key not in ("repeat", "attempts")}}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Planner validation, {result['started']}", "",
             f"`{result['command']}` on {result['machine']}. Each row: medians over {result['repeats']} repeats "
             "of (k = 1 profile, k = 2 run); error = predicted / measured k = 2 samples/s - 1, per repeat, then "
             "the median. 'others': cores other processes kept busy (the noise).", "",
             "| where | model | k=1 samples/s | predicted k=2 | measured k=2 | error (median) | "
             "errors per repeat (others) | predicted step ms (exposed) | measured step ms (exposed) | others |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["series"]:
        m = s["median"]
        per = ", ".join(f"{100 * p['error']:+.1f} ({p['others_cores']:.1f})" for p in s["pairs"])
        lines.append(f"| {s['where']} | {s['model']} | {m['k1_samples_per_s']:.0f} | "
                     f"{m['predicted_samples_per_s']:.0f} | {m['measured_samples_per_s']:.0f} | "
                     f"**{100 * s['median_error']:+.1f} %** | {per} | "
                     f"{m['predicted_step_ms']:.2f} ({m['predicted_exposed_ms']:.2f}) | {m['measured_step_ms']:.2f} "
                     f"({m['measured_exposed_ms']:.2f}) | {m['others_cores']:.1f} |")
    lines += ["", "Commands: each run's file in `runs/` holds its command; each prediction's in `plans/`.", ""]
    return "\n".join(lines)


def repredict(directory: Path) -> str:
    """The current planner on an earlier validation's profiles and links (DIR/runs), against the k = 2 runs
    measured then: what a model change does to the same measurements, without measuring again."""
    result = json.loads((directory / "validation.json").read_text())
    lines = [f"Re-predicted from {directory} (measured {result['started']}; {result['command']}):", "",
             "| where | model | errors per repeat | median | then |", "|---|---|---|---|---|"]
    for s in result["series"]:
        label = s["label"]
        local = label.startswith("local")
        link = directory / "runs" / f"{'local' if local else label.rsplit('-', 1)[0]}-allreduce-k2.jsonl"
        network = ["--ranks-per-node", "2", "--intra-link", str(link), "--backend", "shared"] if local else \
            ["--link", str(link), "--backend", "auto"]
        errors = []
        for pair in s["pairs"]:
            profile = directory / "runs" / f"{label}-k1-r{pair['repeat']}.jsonl"
            row = predict(Path(tempfile.mkdtemp()), label, profile, network)
            errors.append(row["samples_per_s"] / pair["measured_samples_per_s"] - 1)
        lines.append(f"| {s['where']} | {s['model']} | {', '.join(f'{100 * e:+.1f}' for e in errors)} | "
                     f"**{100 * statistics.median(errors):+.1f} %** | {100 * s['median_error']:+.1f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,cnn", help="mlp (--hidden), cnn (LeNet-5)")
    p.add_argument("--hidden", default="1024,1024", help="the MLP's widths")
    p.add_argument("--batch", type=at_least(1), default=128, help="per-rank micro-batch b (the same at k = 1 and 2)")
    p.add_argument("--limit-train", type=at_least(1), default=15360, help="training images per epoch")
    p.add_argument("--repeats", type=at_least(1), default=3, help="(profile, k = 2 run) pairs per row")
    p.add_argument("--cluster", action="store_true", help="also the emulated 2-host cluster (root, ip netns)")
    p.add_argument("--no-local", action="store_true", help="skip this machine's rows")
    p.add_argument("--links", default=",".join(LINKS), help="emulated link rates")
    p.add_argument("--train-extra", default="", help="further mpisgd.train options for every run")
    p.add_argument("--max-others", type=float, default=None, metavar="CORES",
                   help="measure a (profile, k = 2) pair again when other processes kept more than CORES cores "
                        "busy during it (on the emulated cluster the kernel's own network work counts too)")
    p.add_argument("--retries", type=at_least(0), default=3, help="how often, at most, with --max-others")
    p.add_argument("--out", default=str(ROOT / "results" / "plan"), help="output directory (a folder per run)")
    p.add_argument("--quick", action="store_true", help="smoke run: MLP 784-64-10, 1 repeat, few steps")
    p.add_argument("--from-runs", default=None, metavar="DIR",
                   help="measure nothing: re-predict an earlier run's profiles (DIR/runs) with today's planner")
    args = p.parse_args(argv)
    if args.from_runs:
        print(repredict(Path(args.from_runs)))
        return 0
    if args.quick:
        args.models, args.hidden, args.repeats, args.limit_train = "mlp", "64", 1, 2048
        args.links = "1gbit"
        if args.out == p.get_default("out"):
            args.out = str(ROOT / "results" / "tmp" / "plan_validation_quick")
    args.train_extra = shlex.split(args.train_extra)
    models = args.models.split(",")
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    out = Path(args.out) / stamp
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"command": "python experiments/plan_validation.py " + shlex.join(
        sys.argv[1:] if argv is None else argv), "started": stamp, "repeats": args.repeats,
        "machine": f"{os.cpu_count()} CPU core(s), shared with other jobs", "series": []}
    if not args.no_local:
        local = Launcher(out)
        ar = local.allreduce("local-allreduce-k2", "shared")
        for model in models:
            s = series(local, f"local-{model}", model, ["--ranks-per-node", "2", "--intra-link", str(ar),
                                                        "--backend", "shared"], args, out)
            result["series"].append({**s, "where": "this machine, 1 node"})
    if args.cluster:
        nc = netcluster()
        try:
            nc.check_permitted()
        except nc.ClusterUnavailable as exc:
            print(f"plan_validation: cluster rows skipped: {exc}")
        else:
            for link in args.links.split(","):
                # the cluster's ranks get its own environment: pass them ENV's settings (one thread, no
                # plan file: auto measures each link afresh instead of reusing another link's plan)
                own = {k: v for k, v in ENV.items() if os.environ.get(k) != v}
                with nc.NetCluster(hosts=2, ranks_per_host=1, rate=link, extra_env=own) as cluster:
                    launch = Launcher(out, cluster, f"emulated {link}")
                    ar = launch.allreduce(f"cluster-{link}-allreduce-k2", "auto")
                    for model in models:
                        s = series(launch, f"cluster-{link}-{model}", model, ["--link", str(ar), "--backend", "auto"],
                                   args, out)
                        result["series"].append({**s, "where": f"2 emulated hosts x 1, {link}"})
    (out / "validation.json").write_text(json.dumps(result, indent=1))
    (out / "validation.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out}/validation.{{md,json}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
