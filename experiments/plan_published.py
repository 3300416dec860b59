"""The planner against published scaling measurements: each case's workload and cluster described by numbers
(experiments/published/*.toml, every number with its source), mpisgd.plan's predicted scaling efficiency
beside the published one. Feeds docs/plan.md ("Against published scaling results").

    python experiments/plan_published.py            # the table (markdown), and the commands behind it
    python experiments/plan_published.py --json out.json

Scaling efficiency at k = (samples/s at k / k) / (samples/s at the base count / base): the share of the base's
per-device speed each of k devices keeps. The published figure is the paper's own (Goyal et al., Horovod) or
computed from the published throughputs (DLPerf). Pure computation, seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpisgd.app import plan  # noqa: E402

HERE = Path("experiments/published")
DLPERF = "Oneflow-Inc/DLPerf reports/dlperf_benchmark_test_report_v1.md (Aug 2020)"


@dataclass(frozen=True)
class Case:
    source: str  # who published it, and where
    hardware: str
    model: str  # model, framework, per-device batch
    workload: str  # experiments/published/<workload>.toml
    cluster: str  # experiments/published/<cluster>.toml
    base: int  # the device count efficiency is relative to
    published: dict[int, float]  # k -> published scaling efficiency


def _dlperf(rates: dict[int, float]) -> dict[int, float]:
    """Scaling efficiency from DLPerf's published throughputs (k -> samples/s; k = 1 is the base)."""
    return {k: v / (k * rates[1]) for k, v in rates.items() if k > 1}


CASES = [
    Case("Goyal et al. 2017, arXiv:1706.02677 (abstract: ~90 % from 8 to 256 GPUs)",
         "Big Basin: 8 P100 NVLink per server, 50 Gbit Ethernet", "ResNet-50, Caffe2, 32/GPU",
         "goyal-resnet50", "goyal-cluster", 8, {256: 0.90}),
    Case("Horovod docs/benchmarks.rst (Sergeev & Del Balso 2018)", "128 servers x 4 Pascal, 25 Gbit/s RoCE",
         "Inception V3, TF + Horovod, 64/GPU", "horovod-inception3", "horovod-cluster", 1, {512: 0.90}),
    Case("Horovod docs/benchmarks.rst (Sergeev & Del Balso 2018)", "128 servers x 4 Pascal, 25 Gbit/s RoCE",
         "ResNet-101, TF + Horovod, 64/GPU", "horovod-resnet101", "horovod-cluster", 1, {512: 0.90}),
    Case("Horovod docs/benchmarks.rst (Sergeev & Del Balso 2018)", "128 servers x 4 Pascal, 25 Gbit/s RoCE",
         "VGG-16, TF + Horovod, 64/GPU", "horovod-vgg16", "horovod-cluster", 1, {512: 0.68}),
    Case(DLPERF, "4 x 8 V100-SXM2 NVLink, 1 EDR InfiniBand each", "ResNet-50 v1.5 fp32, PyTorch DDP, 128/GPU",
         "dlperf-resnet50", "dlperf-cluster", 1, _dlperf({1: 354.40, 8: 2719.07, 16: 5307.21, 32: 10632.33})),
    Case(DLPERF, "4 x 8 V100-SXM2 NVLink, 1 EDR InfiniBand each", "BERT-base fp32, TF 1.15 + Horovod, 32/GPU",
         "dlperf-bert-tf", "dlperf-cluster", 1, _dlperf({1: 106.80, 8: 806.56, 16: 1090.20, 32: 1923.68})),
    Case(DLPERF, "4 x 8 V100-SXM2 NVLink, 1 EDR InfiniBand each", "BERT-base fp32, OneFlow, 32/GPU",
         "dlperf-bert-oneflow", "dlperf-cluster", 1, _dlperf({1: 145.21, 8: 1042.98, 16: 1890.26, 32: 3715.08})),
]


def argv(case: Case, extra: list[str] | None = None) -> list[str]:
    ranks = ",".join(str(k) for k in sorted({case.base, *case.published}))
    return ["--workload", str(HERE / f"{case.workload}.toml"), "--cluster", str(HERE / f"{case.cluster}.toml"),
            "--ranks", ranks, *(extra or [])]


def predict(case: Case, extra: list[str] | None = None) -> dict[int, dict[str, Any]]:
    """k -> the planner's row (run as the command line runs it, its table swallowed)."""
    with contextlib.redirect_stdout(io.StringIO()):
        result = plan.run(argv(case, extra))
    return {r["k"]: r for r in result["rows"]}


def efficiency(rows: dict[int, dict[str, Any]], k: int, base: int) -> float:
    return (rows[k]["samples_per_s"] / k) / (rows[base]["samples_per_s"] / base)


def compare() -> list[dict[str, Any]]:
    out = []
    for case in CASES:
        rows = predict(case)
        for k, published in sorted(case.published.items()):
            predicted = efficiency(rows, k, case.base)
            out.append({"source": case.source, "hardware": case.hardware, "model": case.model, "k": k,
                        "base": case.base, "published": published, "predicted": predicted,
                        "difference_pp": 100 * (predicted - published), "algorithm": rows[k]["algorithm"],
                        "exposed_comm_ms": rows[k]["exposed_comm_ms"], "step_ms": rows[k]["step_ms"],
                        "command": "python -m mpisgd.plan " + shlex.join(argv(case))})
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| source | hardware | model, framework, batch per device | devices (vs) | published | predicted | "
             "difference | within 10 pp |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ok = "yes" if abs(r["difference_pp"]) <= 10 else "**no**"
        lines.append(f"| {r['source']} | {r['hardware']} | {r['model']} | {r['k']} (vs {r['base']}) | "
                     f"{100 * r['published']:.1f} % | {100 * r['predicted']:.1f} % | {r['difference_pp']:+.1f} pp | "
                     f"{ok} |")
    return "\n".join(lines)


def main(args: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="also write the comparison here")
    ns = p.parse_args(args)
    results = compare()
    print(markdown(results))
    print()
    for command in dict.fromkeys(r["command"] for r in results):
        print(command)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
