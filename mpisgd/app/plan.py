"""Plan a data-parallel run from one short run: step time, samples/s, statistical efficiency, goodput, time
to a target and the learning rate, for every number of ranks you might buy.

    python -m mpisgd.plan METRICS.jsonl --ranks 1,2,4,8 --link 10gbe
    python -m mpisgd.plan METRICS.jsonl --nodes 8 --ranks-per-node 4 --link allreduce.json --json plan.json
    mpisgd-plan METRICS.jsonl --alpha-us 25 --beta-gbit 9.4 --plot plan.png

METRICS.jsonl is the ``--metrics-file`` of any ``mpisgd.train`` run (k = 1 or more): its epoch record gives
the compute time per step at its micro-batch b, the gradient's bytes and buckets, and the gradient noise
scale at the end of the run. The network is a measured ``benchmarks/allreduce_bw.py --json`` output, a
preset (PRESETS) or alpha and beta. The model, per row (k ranks, m micro-batches of b, B = k*b*m):

  step      = m*(forward + backward) + optimizer + other            the profile's times per micro-batch
            + the all-reduce that overlap does not hide             bucket by bucket, see step_time()
  all-reduce of n bytes over p = s(p)*alpha + 2(p-1)/p * n/beta      s(p) = 2*ceil(log2 p), or 2(p-1) (ring)
  efficiency = (B_noise + B0)/(B_noise + B)                         B0: the profiled batch (Pollux; McCandlish)
  goodput   = samples/s * efficiency                                 samples/s worth of B0's samples
  time to target = E0 / goodput                                     E0: the samples B0 took to the target

Pure computation: no MPI. Bad input is one line on stderr and exit 2. docs/plan.md says how to profile,
how to read the table, and where the model stops holding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mpisgd.errors import UsageError
from mpisgd.schedule import scaled_lr


class PlanError(UsageError):
    """Input the planner cannot use: reported as one line, exit 2."""


# -- links ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """An alpha-beta link: alpha seconds per latency step of the all-reduce, beta bytes/s per rank."""

    name: str
    alpha_s: float
    beta_Bps: float
    source: str

    def allreduce_s(self, nbytes: float, p: int, algorithm: str = "halving-doubling") -> float:
        """One all-reduce of ``nbytes`` over ``p`` ranks: s(p) latency steps and 2(p-1)/p n bytes per rank."""
        if p <= 1:
            return 0.0
        steps = 2 * (p - 1) if algorithm == "ring" else 2 * math.ceil(math.log2(p))
        return steps * self.alpha_s + 2 * (p - 1) / p * nbytes / self.beta_Bps

    def describe(self) -> str:
        return f"{self.name}: alpha {1e6 * self.alpha_s:.3g} us, beta {8 * self.beta_Bps / 1e9:.3g} Gbit/s"


def _gbit(x: float) -> float:
    return x * 1e9 / 8


# alpha (s), beta (bytes/s), where the numbers come from. Only "shm" and the emulated links were measured
# by this project; the others are line rates with a typical small-message MPI latency for that kind of
# link, to be replaced by your own allreduce_bw.py measurement.
PRESETS: dict[str, tuple[float, float, str]] = {
    "shm": (10e-6, _gbit(160), "measured: allreduce_bw.py, shared strategy, k = 2 on this project's 2-core VM, "
                               "256 KiB-8 MiB (docs/plan.md, Presets); 2-3x slower once "
                               "the buffers leave the caches (>= 16 MiB)"),
    "emulated-1gbit": (135e-6, _gbit(0.74), "measured: the emulated cluster's 1 Gbit/s tbf link, alpha-beta fit "
                                            "of its MPI_Allreduce probe (docs/cluster.md)"),
    "emulated-10gbit": (179e-6, _gbit(1.94), "measured: the emulated cluster's 10 Gbit/s tbf link (TCP over veth "
                                             "is CPU-bound at ~2 Gbit/s there; docs/cluster.md)"),
    "1gbe": (50e-6, _gbit(0.94), "nominal: 1 Gbit/s line rate less Ethernet/IP/TCP framing (1448 payload bytes "
                                 "per 1538 on the wire); latency typical of MPI over TCP, tens of us; not measured"),
    "10gbe": (25e-6, _gbit(9.4), "nominal: 10 Gbit/s line rate less TCP framing; latency typical of MPI over TCP "
                                 "on 10 GbE; not measured"),
    "25gbe": (15e-6, _gbit(23.5), "nominal: 25 Gbit/s line rate less TCP framing; not measured"),
    "ib-edr": (1.5e-6, _gbit(97), "nominal: InfiniBand EDR, 100 Gbit/s data rate (after 64b/66b encoding), ~1-2 us "
                                  "MPI latency as fabric vendors quote it; not measured"),
    "ib-hdr": (1.5e-6, _gbit(194), "nominal: InfiniBand HDR, 200 Gbit/s data rate, ~1-2 us MPI latency as fabric "
                                   "vendors quote it; not measured"),
}


def preset(name: str) -> Link:
    alpha, beta, source = PRESETS[name]
    return Link(name, alpha, beta, source)


def _json_lines(path: str, what: str) -> list[tuple[int, Any]]:
    """(line number, value) of each non-empty line of a JSON-lines file; PlanError naming ``what`` the file
    should have been where it cannot be read or a line is not JSON."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise PlanError(f"{path}: cannot read it ({exc.strerror})") from None
    values = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            values.append((i, json.loads(line)))
        except json.JSONDecodeError:
            raise PlanError(f"{path}: line {i} is not JSON: not {what}") from None
    return values


def read_allreduce_json(path: str, backend: str | None = None) -> tuple[list[dict[str, Any]], str, int]:
    """The rows of one backend (in place where there are any) of an ``allreduce_bw.py --json`` file, the
    backend's name and the ranks it ran on."""
    rows = []
    for i, r in _json_lines(path, "an allreduce_bw.py --json output"):
        if not isinstance(r, dict) or not all(isinstance(r.get(k), int | float) for k in ("size_bytes", "time_us",
                                                                                            "ranks")) \
                or not isinstance(r.get("backend"), str):
            raise PlanError(f"{path}: line {i} lacks size_bytes, time_us, ranks or backend: not an allreduce_bw.py "
                            "--json output")
        rows.append(r)
    if not rows:
        raise PlanError(f"{path}: no rows: not an allreduce_bw.py --json output")
    names = list(dict.fromkeys(r["backend"] for r in rows))
    name = backend or ("auto" if "auto" in names else names[0])
    rows = [r for r in rows if r["backend"] == name]
    if not rows:
        raise PlanError(f"{path}: no rows for backend {name!r}; it has {', '.join(names)} (--backend)")
    if any(r.get("inplace") for r in rows):
        rows = [r for r in rows if r.get("inplace")]  # training reduces its gradient buffer in place
    ranks = {int(r["ranks"]) for r in rows}
    if len(ranks) != 1 or min(ranks) < 2:
        raise PlanError(f"{path}: the rows must come from one run of 2 or more ranks, got ranks {sorted(ranks)}")
    if any(r["size_bytes"] <= 0 or not r["time_us"] > 0 for r in rows):
        raise PlanError(f"{path}: sizes and times must be > 0")
    return rows, name, ranks.pop()


def fit_link(rows: Sequence[dict[str, Any]], p: int, lo: float = 0, hi: float = math.inf,
             algorithm: str = "halving-doubling", name: str = "measured", source: str = "") -> Link:
    """alpha and beta fitted to measured all-reduce times at p ranks, least squares on the relative error,
    over the sizes in [lo, hi] (widened to the 3 sizes nearest that range when it holds fewer)."""
    chosen = [r for r in rows if lo <= r["size_bytes"] <= hi]
    if len(chosen) < 3:
        mid = math.sqrt(max(lo, 1.0) * min(hi, 1e12))
        chosen = sorted(rows, key=lambda r: abs(math.log(r["size_bytes"] / mid)))[:3]
    steps = 2 * (p - 1) if algorithm == "ring" else 2 * math.ceil(math.log2(p))
    # minimise sum ((steps*a + c*n*x)/t - 1)^2 over a = alpha, x = 1/beta: 2x2 normal equations
    c = 2 * (p - 1) / p
    s11 = s12 = s22 = b1 = b2 = 0.0
    for r in chosen:
        t = r["time_us"] * 1e-6
        u, v = steps / t, c * r["size_bytes"] / t
        s11, s12, s22, b1, b2 = s11 + u * u, s12 + u * v, s22 + v * v, b1 + u, b2 + v
    det = s11 * s22 - s12 * s12
    alpha, inv_beta = ((s22 * b1 - s12 * b2) / det, (s11 * b2 - s12 * b1) / det) if det > 0 else (0.0, 0.0)
    if alpha <= 0 or inv_beta <= 0:  # one term alone fits better: bandwidth-only (or latency-only) through them
        inv_beta = max(sum(r["time_us"] * 1e-6 / (c * r["size_bytes"]) for r in chosen) / len(chosen), 1e-15)
        alpha = max(min(r["time_us"] * 1e-6 - c * r["size_bytes"] * inv_beta for r in chosen) / steps, 1e-9)
    return Link(name, alpha, 1.0 / inv_beta, source)


def parse_link(spec: str, buckets: Sequence[int], backend: str | None, algorithm: str) -> Link:
    """A preset name, or an allreduce_bw.py --json file (fitted around the gradient's bucket sizes)."""
    if spec in PRESETS:
        return preset(spec)
    if not os.path.exists(spec):
        raise PlanError(f"link {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    rows, name, p = read_allreduce_json(spec, backend)
    lo, hi = min(buckets) / 4, max(buckets) * 4
    link = fit_link(rows, p, lo, hi, algorithm, name=f"{os.path.basename(spec)} ({name}, k={p})",
                    source=f"measured: {spec}, backend {name} at k = {p}, fitted to sizes {_size(lo)}-{_size(hi)}")
    return link


# -- the profile ---------------------------------------------------------------------------------------
REQUIRED = ("world_size", "local_batch", "accum_steps", "effective_batch", "grad_nbytes", "step_ms", "forward_ms",
            "backward_ms", "optimizer_ms", "comm_exposed_ms", "samples_per_s", "train_loss", "step")


@dataclass(frozen=True)
class Profile:
    """What the planner takes from one epoch record of a metrics file (times in ms per step)."""

    path: str
    epoch: int
    k: int
    b: int
    m: int
    B: int
    step_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    comm_exposed_ms: float
    samples_per_s: float
    grad_nbytes: int
    buckets: tuple[int, ...]  # bytes, in the order backward completes them (bucket 0 first)
    buckets_from: str
    overlap: bool
    noise_scale: float
    train_loss: float
    samples: int  # samples the run had trained on at this record's end
    steps_per_epoch: int

    @property
    def other_ms(self) -> float:
        """What a step spends outside forward, backward, optimizer and waiting (data, check-in, Python)."""
        return max(0.0, self.step_ms - self.comm_exposed_ms - self.forward_ms - self.backward_ms - self.optimizer_ms)


BUCKETS = re.compile(r"\((\d+) bucket\(s\): ([0-9., ]+) MiB\)")


def buckets_of(record: dict[str, Any]) -> tuple[tuple[int, ...], str]:
    """The gradient buckets' bytes: from the record's all-reduce description, else DataParallel's rule by
    bytes alone (a first bucket of 1 MiB, then 25 MiB each; the real ones end at layer boundaries)."""
    total = int(record["grad_nbytes"])
    m = BUCKETS.search(str(record.get("allreduce", "")))
    if m:
        mib = [float(x) for x in m.group(2).split(",")]
        if len(mib) == int(m.group(1)) and sum(mib) > 0:
            raw = [x * 2**20 for x in mib]
            scale = total / sum(raw)  # the description rounds to 0.01 MiB
            return tuple(max(1, round(x * scale)) for x in raw), "the run's buckets"
    first, cap = min(2**20, total), 25 * 2**20
    out = [first]
    while sum(out) < total:
        out.append(min(cap, total - sum(out)))
    return tuple(out), "assumed: 1 MiB, then 25 MiB buckets"


def _number(r: dict[str, Any], key: str) -> float:
    v = r.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise PlanError(f"epoch record {r.get('epoch')}: {key} is {v!r}, not a number")
    return float(v)


def read_profile(path: str, epoch: int | None = None, noise_scale: float | None = None) -> Profile:
    """The profile from epoch ``epoch`` (default: the last; the first includes warm-up) of a metrics file;
    the noise scale from its last epoch record (the end of the run) unless ``noise_scale`` is given."""
    records = []
    for i, r in _json_lines(path, "an mpisgd.train --metrics-file"):
        if not isinstance(r, dict):
            raise PlanError(f"{path}: line {i} is not a JSON object: not an mpisgd.train --metrics-file")
        records.append(r)
    epochs = [r for r in records if r.get("kind") == "epoch"]
    if not epochs:
        raise PlanError(f"{path}: no epoch records (kind \"epoch\"): not an mpisgd.train --metrics-file")
    missing = [k for k in REQUIRED if k not in epochs[-1]]
    if missing:
        raise PlanError(f"{path}: its epoch records lack {', '.join(missing)}: written by another program or an "
                        "older mpisgd")
    rec: dict[str, Any] | None
    if epoch is None:
        rec = epochs[-1]
    else:
        rec = next((r for r in epochs if r.get("epoch") == epoch), None)
        if rec is None:
            raise PlanError(f"{path}: no epoch {epoch}; it has epochs "
                            f"{', '.join(str(r.get('epoch')) for r in epochs)}")
    for key in REQUIRED:
        _number(rec, key)
    if noise_scale is None:
        ns = epochs[-1].get("noise_scale")
        if ns is None or isinstance(ns, bool) or not isinstance(ns, int | float) or not math.isfinite(ns) or ns <= 0:
            why = "no noise_scale" if "noise_scale" not in epochs[-1] else f"noise_scale {ns!r}"
            raise PlanError(f"{path}: {why} in its last epoch record (a run at k = 1 needs --accum-steps >= 2 to "
                            "measure it); or pass --noise-scale")
        noise_scale = float(ns)
    k, b, m, B = (int(_number(rec, key)) for key in ("world_size", "local_batch", "accum_steps", "effective_batch"))
    if min(k, b, m) < 1 or B != k * b * m:
        raise PlanError(f"{path}: epoch {rec.get('epoch')}: k={k}, b={b}, m={m} do not make B={B}")
    if _number(rec, "step_ms") <= 0 or _number(rec, "grad_nbytes") <= 0:
        raise PlanError(f"{path}: epoch {rec.get('epoch')}: step_ms and grad_nbytes must be > 0")
    buckets, from_ = buckets_of(rec)
    step = int(_number(epochs[-1], "step"))
    first = epochs[0]  # a whole epoch (the last may end early, at --max-steps)
    spe = int(_number(first, "step")) // max(1, int(first.get("epoch", 1)))
    return Profile(path=path, epoch=int(rec.get("epoch", 0)), k=k, b=b, m=m, B=B, step_ms=_number(rec, "step_ms"),
                   forward_ms=_number(rec, "forward_ms"), backward_ms=_number(rec, "backward_ms"),
                   optimizer_ms=_number(rec, "optimizer_ms"), comm_exposed_ms=_number(rec, "comm_exposed_ms"),
                   samples_per_s=_number(rec, "samples_per_s"), grad_nbytes=int(_number(rec, "grad_nbytes")),
                   buckets=buckets, buckets_from=from_,
                   overlap="after backward" not in str(rec.get("allreduce", "")), noise_scale=noise_scale,
                   train_loss=_number(epochs[-1], "train_loss"), samples=step * B,
                   steps_per_epoch=max(1, spe))


# -- the model -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Network:
    """Ranks ``per_node`` to a node on the ``intra`` link, nodes joined by ``inter``. A step's all-reduce is
    the two levels one after the other: within each node (the ranks' own cores do it: CPU work, not
    hidden by overlap), then across nodes (the network's: it runs behind the rest of backward)."""

    intra: Link
    inter: Link | None
    per_node: int
    algorithm: str = "halving-doubling"
    overlap: str = "auto"  # auto (as above), ideal (both levels hidden where they can be), none (neither)

    def layout(self, k: int) -> tuple[int, int]:
        """(nodes, ranks per node) of k ranks."""
        nodes = -(-k // self.per_node)
        return nodes, min(k, self.per_node)

    def levels(self, nbytes: float, k: int) -> tuple[float, float]:
        """(intra-node s, inter-node s) of one all-reduce of nbytes over k ranks."""
        nodes, local = self.layout(k)
        intra = self.intra.allreduce_s(nbytes, local, self.algorithm)
        if nodes == 1:
            return intra, 0.0
        if self.inter is None:
            raise PlanError(f"k={k} needs {nodes} nodes of {self.per_node} ranks: give the link between nodes "
                            "(--link, or --alpha-us and --beta-gbit)")
        return intra, self.inter.allreduce_s(nbytes, nodes, self.algorithm)

    def check_in_s(self, k: int) -> float:
        """The per-step check-in (a small all-gather): one latency per doubling, at each level."""
        nodes, local = self.layout(k)
        t = math.ceil(math.log2(local)) * self.intra.alpha_s if local > 1 else 0.0
        if nodes > 1 and self.inter is not None:
            t += math.ceil(math.log2(nodes)) * self.inter.alpha_s
        return t


def step_time(p: Profile, net: Network, k: int, m: int) -> dict[str, float]:
    """Predicted ms per step at k ranks and m micro-batches of the profile's b.

    Compute: m times the profile's forward and backward per micro-batch, plus its optimizer and other
    time per step (each rank computes as fast as the profiled one). Communication: the buckets in the
    order backward completes them; bucket i is ready when the last micro-batch's backward has produced
    its bytes (backward time taken as proportional to the bytes done, from the output layer back), the
    network reduces one bucket at a time, and what it has not finished when backward ends is exposed:
    at least the last bucket, which is ready only then. Intra-node reduction is CPU work and adds to
    the step in full (with overlap "auto" or "none"); without overlap in the profile, or with
    ``net.overlap == "none"``, nothing is hidden."""
    fwd, bwd = p.forward_ms / p.m, p.backward_ms / p.m
    compute = m * (fwd + bwd) + p.optimizer_ms + p.other_ms
    if k == 1:
        return {"compute_ms": compute, "allreduce_ms": 0.0, "exposed_ms": 0.0, "step_ms": compute}
    hide = p.overlap and net.overlap != "none"
    hide_intra = hide and net.overlap == "ideal"
    exposed, net_end, total, done = 0.0, 0.0, 0.0, 0
    for nbytes in p.buckets:
        intra, inter = (1e3 * t for t in net.levels(nbytes, k))
        done += nbytes
        total += intra + inter
        ready = bwd * done / p.grad_nbytes
        if hide_intra:
            inter += intra
        else:
            exposed += intra
        if hide:
            net_end = max(ready, net_end) + inter
        else:
            exposed += inter
    if hide:
        exposed += max(0.0, net_end - bwd)
    exposed += 1e3 * net.check_in_s(k)
    return {"compute_ms": compute, "allreduce_ms": total, "exposed_ms": exposed, "step_ms": compute + exposed}


def statistical_efficiency(noise_scale: float, b0: int, b: int) -> float:
    """(B_noise + B0)/(B_noise + B): the progress a sample at batch B makes relative to one at B0
    (McCandlish et al. 2018, eq. 2.7 in samples; Pollux's EFFICIENCY_t). 1 at B0, < 1 above it."""
    return (noise_scale + b0) / (noise_scale + b)


@dataclass(frozen=True)
class Rules:
    """The learning-rate rule (the run's own --lr, --base-batch, --lr-scaling) and the target."""

    lr: float = 0.1
    base_batch: int = 256
    scaling: str = "linear"
    target_samples: int | None = None  # samples B0 needs to the target (default: the profiled run's)


def plan(p: Profile, net: Network, ranks: Sequence[int], accum: Sequence[int] | None, rules: Rules) -> list[dict]:
    """One row per (k, m): the prediction."""
    e0 = rules.target_samples or p.samples
    rows = []
    for k in ranks:
        for m in accum or (p.m,):
            B = k * p.b * m
            t = step_time(p, net, k, m)
            sps = 1e3 * B / t["step_ms"]
            eff = statistical_efficiency(p.noise_scale, p.B, B)
            samples = e0 / eff  # at B, the samples to the loss B0 reaches after e0 (McCandlish: E = E_min(1+B/B_n))
            nodes, local = net.layout(k)
            rows.append({
                "k": k, "nodes": nodes, "ranks_per_node": local, "b": p.b, "m": m, "B": B,
                "lr": scaled_lr(rules.lr, rules.base_batch, B, rules.scaling),
                "compute_ms": t["compute_ms"], "allreduce_ms": t["allreduce_ms"], "exposed_comm_ms": t["exposed_ms"],
                "step_ms": t["step_ms"], "samples_per_s": sps, "statistical_efficiency": eff,
                "goodput": sps * eff, "samples_to_target": samples, "steps_to_target": samples / B,
                "time_to_target_s": samples / sps,
            })
    for r in rows:  # against the first row (the fewest ranks): what the extra ranks buy
        r["speedup"] = rows[0]["time_to_target_s"] / r["time_to_target_s"]
    return rows


def recommend(rows: Sequence[dict], margin: float) -> dict:
    """The row with the fewest ranks (then the fewest micro-batches) whose goodput is within ``margin`` of
    the most goodput any row has."""
    best = max(r["goodput"] for r in rows)
    ok = [r for r in rows if r["goodput"] >= (1 - margin) * best]
    pick = min(ok, key=lambda r: (r["k"], r["m"], -r["goodput"]))
    top = max(rows, key=lambda r: r["goodput"])
    why = (f"the most goodput ({top['goodput']:.0f})" if pick is top else
           f"the fewest ranks within {100 * margin:g} % of the most goodput ({top['goodput']:.0f} at k={top['k']}, "
           f"m={top['m']})")
    return {**pick, "reason": why}


# -- output --------------------------------------------------------------------------------------------
def _size(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n:.0f} B"


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def table(p: Profile, net: Network, rows: Sequence[dict], rec: dict, rules: Rules) -> str:
    e0 = rules.target_samples or p.samples
    nodes_col = any(r["nodes"] > 1 for r in rows)
    head = ["k", *(["nodes"] if nodes_col else []), "b", "m", "B", "lr", "step ms", "(compute", "exposed)",
            "samples/s", "stat eff", "goodput", "steps", "to target", "speedup"]
    out = [
        f"profile: {p.path} epoch {p.epoch}: k={p.k} x b={p.b} x m={p.m} = B0={p.B}, {p.step_ms:.2f} ms/step "
        f"({p.samples_per_s:.0f} samples/s), gradient {_size(p.grad_nbytes)} in {len(p.buckets)} bucket(s) "
        f"({', '.join(_size(x) for x in p.buckets)}; {p.buckets_from})",
        f"noise scale B_noise = {p.noise_scale:.0f} samples (end of the run, train loss {p.train_loss:.4f})",
        f"target: the loss B0 reaches after {e0:,} samples ({e0 / (p.steps_per_epoch * p.B):.3g} epochs)",
        "links: " + net.intra.describe() + (f" within a node ({net.per_node} ranks); " if net.per_node > 1 or
                                             net.inter is None else " (unused: one rank per node); ")
        + (net.inter.describe() + " between nodes" if net.inter else "no link between nodes")
        + f"; {net.algorithm} all-reduce; overlap {net.overlap}",
        "",
        "  ".join(f"{h:>9}" for h in head),
    ]
    for r in rows:
        cells = [str(r["k"]), *([str(r["nodes"])] if nodes_col else []), str(r["b"]), str(r["m"]), str(r["B"]),
                 f"{r['lr']:.4g}", f"{r['step_ms']:.2f}", f"{r['compute_ms']:.2f}", f"{r['exposed_comm_ms']:.2f}",
                 f"{r['samples_per_s']:.0f}", f"{r['statistical_efficiency']:.3f}", f"{r['goodput']:.0f}",
                 f"{r['steps_to_target']:.0f}", _duration(r["time_to_target_s"]), f"{r['speedup']:.2f}x"]
        mark = "  <- recommended" if r["k"] == rec["k"] and r["m"] == rec["m"] else ""
        out.append("  ".join(f"{c:>9}" for c in cells) + mark)
    out += ["", f"recommended: k={rec['k']}" + (f" ({rec['nodes']} nodes x {rec['ranks_per_node']})" if rec["nodes"] > 1
                                                else "") + f", b={rec['b']}, m={rec['m']}, B={rec['B']}, lr "
            f"{rec['lr']:.4g}: {rec['reason']}; {_duration(rec['time_to_target_s'])} to the target"]
    if any(r["B"] > 4 * p.noise_scale for r in rows):
        out.append(f"note: rows with B well above B_noise ({p.noise_scale:.0f}) buy little: each doubling of B there "
                   "nearly doubles the samples to the target")
    if any(r["B"] > 4 * rules.base_batch for r in rows):
        out.append(f"note: the rates above {4 * rules.base_batch} samples are the scaling rule's, not tested ones: "
                   "plain SGD may need warmup or LARS there (docs/large_batch.md)")
    return "\n".join(out)


def plot(rows: Sequence[dict], rec: dict, path: str, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m in sorted({r["m"] for r in rows}):
        rs = [r for r in rows if r["m"] == m]
        tag = f" (m={m})" if len({r["m"] for r in rows}) > 1 else ""
        ax.plot([r["k"] for r in rs], [r["samples_per_s"] for r in rs], marker="o", ms=3, label="samples/s" + tag)
        ax.plot([r["k"] for r in rs], [r["goodput"] for r in rs], marker="s", ms=3, label="goodput" + tag)
    ax.plot([rec["k"]], [rec["goodput"]], "k*", ms=12, label="recommended")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="ranks k", ylabel="samples/s (goodput: worth of B0's samples)", title=title)
    ax.title.set_fontsize(8)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax2 = ax.twinx()
    for m in sorted({r["m"] for r in rows}):
        rs = [r for r in rows if r["m"] == m]
        ax2.plot([r["k"] for r in rs], [r["statistical_efficiency"] for r in rs], ls=":", color="0.4")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("statistical efficiency (dotted)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ---------------------------------------------------------------------------------------
def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"{what} must be comma-separated whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise PlanError(f"{what} must be whole numbers >= 1, got {text!r}")
    return sorted(set(values))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpisgd.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("metrics", help="the --metrics-file of a short mpisgd.train run (its last epoch is the profile)")
    g = p.add_argument_group("what to plan")
    g.add_argument("--ranks", default=None, help="ranks k to predict, comma-separated (default 1, 2, 4, ... up to "
                                                 "--nodes x --ranks-per-node, or 64)")
    g.add_argument("--accum-steps", default=None, help="micro-batches m per step, comma-separated (default: the "
                                                       "profile's); b stays the profile's")
    g.add_argument("--nodes", type=int, default=None, help="nodes available (caps k at nodes x ranks per node)")
    g.add_argument("--ranks-per-node", type=int, default=1, help="ranks per node R: k <= R share one node")
    g = p.add_argument_group("the network")
    g.add_argument("--link", default=None, help="the link between nodes: a preset (" + ", ".join(PRESETS) +
                                                ") or a benchmarks/allreduce_bw.py --json file")
    g.add_argument("--alpha-us", type=float, default=None, help="the link between nodes as alpha (us) ...")
    g.add_argument("--beta-gbit", type=float, default=None, help="... and beta (Gbit/s per rank)")
    g.add_argument("--intra-link", default="shm", help="the link within a node (preset or allreduce_bw JSON)")
    g.add_argument("--backend", default=None, help="which backend's rows of an allreduce_bw JSON (default auto)")
    g.add_argument("--algorithm", default="halving-doubling", choices=("halving-doubling", "ring"),
                   help="latency steps of the all-reduce: 2*ceil(log2 p) (MPI libraries' large-message "
                        "algorithm) or 2(p-1) (a ring)")
    g.add_argument("--overlap", default="auto", choices=("auto", "ideal", "none"),
                   help="auto: the network's part runs behind backward, the intra-node part is CPU work; ideal: "
                        "both hidden where they can be; none: nothing hidden")
    g = p.add_argument_group("statistics and the rate")
    g.add_argument("--noise-scale", type=float, default=None, help="B_noise in samples (default: the metrics file's)")
    g.add_argument("--epoch", type=int, default=None, help="profile this epoch's times (default: the last)")
    g.add_argument("--target-epochs", type=float, default=None,
                   help="the target: the loss B0 reaches after this many epochs (default: the profiled run's end)")
    g.add_argument("--lr", type=float, default=0.1, help="the run's --lr (eta0)")
    g.add_argument("--base-batch", type=int, default=256, help="the run's --base-batch (B0 of eta0)")
    g.add_argument("--lr-scaling", default="linear", choices=("linear", "sqrt", "none"), help="the run's rule")
    g.add_argument("--margin", type=float, default=0.10,
                   help="recommend the fewest ranks within this fraction of the most goodput")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write the rows and the recommendation here")
    g.add_argument("--plot", default=None, help="write a PNG of samples/s, goodput and efficiency against k")
    return p


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse, plan and print; returns what --json writes. Raises PlanError on bad input."""
    args = parser().parse_args(argv)
    if args.ranks_per_node < 1 or (args.nodes is not None and args.nodes < 1):
        raise PlanError("--nodes and --ranks-per-node must be >= 1")
    if args.noise_scale is not None and not (math.isfinite(args.noise_scale) and args.noise_scale > 0):
        raise PlanError(f"--noise-scale must be > 0, got {args.noise_scale}")
    if not 0 <= args.margin < 1:
        raise PlanError(f"--margin must be in [0, 1), got {args.margin}")
    if not (math.isfinite(args.lr) and args.lr > 0) or args.base_batch < 1:
        raise PlanError("--lr must be > 0 and --base-batch >= 1")
    prof = read_profile(args.metrics, args.epoch, args.noise_scale)
    cap = args.nodes * args.ranks_per_node if args.nodes else None
    if args.ranks:
        ranks = _int_list(args.ranks, "--ranks")
    else:
        top = cap or 64
        ranks = sorted({2**i for i in range(int(math.log2(top)) + 1)} | {top})
    if cap and max(ranks) > cap:
        raise PlanError(f"--ranks {max(ranks)} is more than --nodes {args.nodes} x --ranks-per-node "
                        f"{args.ranks_per_node} = {cap}")
    accum = _int_list(args.accum_steps, "--accum-steps") if args.accum_steps else None
    if (args.alpha_us is None) != (args.beta_gbit is None):
        raise PlanError("--alpha-us and --beta-gbit go together")
    if args.alpha_us is not None and args.link:
        raise PlanError("give the link between nodes once: --link, or --alpha-us and --beta-gbit")
    inter = None
    if args.alpha_us is not None:
        if not (args.alpha_us >= 0 and args.beta_gbit > 0):
            raise PlanError("--alpha-us must be >= 0 and --beta-gbit > 0")
        inter = Link("given", args.alpha_us * 1e-6, _gbit(args.beta_gbit), "given on the command line")
    elif args.link:
        inter = parse_link(args.link, prof.buckets, args.backend, args.algorithm)
    intra = parse_link(args.intra_link, prof.buckets, args.backend, args.algorithm)
    net = Network(intra, inter, args.ranks_per_node, args.algorithm, args.overlap)
    if inter is None and max(ranks) > args.ranks_per_node:
        raise PlanError(f"k={max(ranks)} spans nodes of {args.ranks_per_node} rank(s): give the link between them "
                        f"(--link {'|'.join(PRESETS)}|FILE, or --alpha-us and --beta-gbit)")
    if args.target_epochs is not None and not args.target_epochs > 0:
        raise PlanError(f"--target-epochs must be > 0, got {args.target_epochs}")
    target = round(args.target_epochs * prof.steps_per_epoch * prof.B) if args.target_epochs else None
    rules = Rules(args.lr, args.base_batch, args.lr_scaling, target)
    rows = plan(prof, net, ranks, accum, rules)
    rec = recommend(rows, args.margin)
    print(table(prof, net, rows, rec, rules))
    result = {"profile": {k: v for k, v in asdict(prof).items()}, "links": {
        "intra": asdict(net.intra), "inter": asdict(net.inter) if net.inter else None},
        "ranks_per_node": net.per_node, "algorithm": net.algorithm, "overlap": net.overlap,
        "target_samples": rules.target_samples or prof.samples, "margin": args.margin,
        "rows": rows, "recommended": rec}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, rec, args.plot, f"{os.path.basename(prof.path)}: B0={prof.B}, B_noise={prof.noise_scale:.0f}")
        print(f"wrote {args.plot}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    try:
        run(argv)
    except PlanError as exc:
        print(f"mpisgd.plan: error: {exc}", file=sys.stderr)
        return 2
    return 0
