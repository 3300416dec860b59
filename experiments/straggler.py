"""Every synchronous step waits for the slowest worker: a delay injected into one rank's compute.

The experiment behind docs/concepts.md ("Every synchronous step waits for the slowest rank"); its runs
are in results/straggler/.

    python experiments/straggler.py [--ks 2,3] [--delays-ms 0,2,5,10,20] [--cluster] [--out results/straggler]

For each k and delay, one rank (the last) sleeps that long before every step's compute
($MPISGD_DELAY_RANK, a switch for this experiment only) in `mpiexec -n k python -m mpisgd.train` on
synthetic data, 60 measured steps after a warm-up epoch. From the straggler report in the metrics file
it shows (a) every rank's step time grows with the delay (claim 2 of docs/concepts.md: a synchronous
step runs at the speed of the slowest rank), and (b) the report books the waiting to the delayed rank.
``--cluster`` also runs k = 2 over two emulated hosts (scripts/cluster/netcluster.py; needs root), where
the ranks' clocks are told apart by the report's ping-pong offsets. Writes straggler.json, .md, .png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONPATH": str(ROOT),
       "MPISGD_PLAN_FILE": "off"}
STEPS = 60


def train_args(metrics: Path, k: int) -> list[str]:
    n = 2 * STEPS * k * 64  # two epochs of STEPS steps: the first warms up
    return ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", str(n), "--hidden", "512,512",
            "--batch-size", "64", "--epochs", "2", "--progress", "off", "--metrics-file", str(metrics)]


def last_epoch(metrics: Path) -> dict[str, Any]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "epoch"][-1]


def run_local(k: int, delay_ms: float, tmp: Path) -> dict[str, Any]:
    metrics = tmp / f"k{k}-{delay_ms}.jsonl"
    env = {**ENV, "MPISGD_DELAY_RANK": f"{k - 1}:{delay_ms}"}
    cmd = [shutil.which("mpiexec") or "mpiexec", "-n", str(k), sys.executable, *train_args(metrics, k)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"k={k} delay {delay_ms} ms failed: {r.stderr[-2000:]}")
    return last_epoch(metrics)


def run_cluster(delay_ms: float, tmp: Path) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("netcluster", ROOT / "scripts" / "cluster" / "netcluster.py")
    assert spec is not None and spec.loader is not None
    nc = importlib.util.module_from_spec(spec)
    sys.modules["netcluster"] = nc
    spec.loader.exec_module(nc)
    metrics = tmp / f"cluster-{delay_ms}.jsonl"
    with nc.NetCluster(hosts=2, ranks_per_host=1, extra_env={"MPISGD_DELAY_RANK": f"1:{delay_ms}",
                                                              "MPISGD_PLAN_FILE": "off"}) as cluster:
        res = cluster.run([sys.executable, *train_args(metrics, 2)], timeout=600)
    if res.returncode or res.timed_out:
        raise RuntimeError(f"cluster run failed (rc {res.returncode}): {res.stderr[-2000:]}")
    return last_epoch(metrics)


def row(where: str, k: int, delay_ms: float, rec: dict[str, Any]) -> dict[str, Any]:
    return {"where": where, "k": k, "delay_ms": delay_ms, "slowed_rank": k - 1, "step_ms": rec["step_ms"],
            "rank_step_ms": rec["rank_step_ms"], "wait_caused_ms": rec["wait_caused_ms"], "lag_ms": rec["lag_ms"],
            "slowest_rank": rec["slowest_rank"], "slowest_share": rec["slowest_share"]}


def write(rows: list[dict[str, Any]], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "straggler.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    lines = [f"# The slowest worker sets the step: `{command}`", "",
             "| where | k | delay on the last rank (ms) | step ms per rank | others waited for each rank (ms/step) "
             "| named slowest | share of the step |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        steps, waits = (", ".join(f"{v:.1f}" for v in r[key]) for key in ("rank_step_ms", "wait_caused_ms"))
        lines.append(f"| {r['where']} | {r['k']} | {r['delay_ms']:g} | {steps} | {waits} | rank {r['slowest_rank']} "
                     f"| {100 * r['slowest_share']:.0f} % |")
    (out / "straggler.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "straggler.png")
    print("\n".join(lines))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for where, k in dict.fromkeys((r["where"], r["k"]) for r in rows):
        sel = [r for r in rows if r["where"] == where and r["k"] == k]
        d = [r["delay_ms"] for r in sel]
        for rank in range(k):
            label = f"{where} k={k} rank {rank}" + (" (delayed)" if rank == k - 1 else "")
            a.plot(d, [r["rank_step_ms"][rank] for r in sel], marker="o", label=label)
            b.plot(d, [r["wait_caused_ms"][rank] for r in sel], marker="o", label=label)
    a.set(xlabel="delay injected into the last rank (ms per step)", ylabel="step time (ms)",
          title="every rank's step grows with the delay")
    b.set(xlabel="delay injected into the last rank (ms per step)", ylabel="others waited for this rank (ms/step)",
          title="the report books the waiting to the delayed rank")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="2,3")
    p.add_argument("--delays-ms", default="0,2,5,10,20")
    p.add_argument("--cluster", action="store_true", help="also k=2 over two emulated hosts (root)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "straggler")
    args = p.parse_args(argv)
    delays = [float(x) for x in args.delays_ms.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="straggler-") as tmp:
        for k in (int(x) for x in args.ks.split(",")):
            for d in delays:
                rows.append(row("one host", k, d, run_local(k, d, Path(tmp))))
                print(f"k={k} delay {d:g} ms: step {rows[-1]['step_ms']:.1f} ms, slowest rank "
                      f"{rows[-1]['slowest_rank']}", flush=True)
        if args.cluster:
            for d in delays:
                rows.append(row("2 emulated hosts", 2, d, run_cluster(d, Path(tmp))))
    write(rows, args.out, "python experiments/straggler.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    wrong = [r for r in rows if r["delay_ms"] >= 5 and r["slowest_rank"] != r["slowed_rank"]]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
