"""The cluster the planner plans for: ranks per node, the links within and between nodes, and what one
reduction of n bytes costs on them with the algorithm the library would run.

A link is alpha-beta: ``alpha_s`` per latency step, ``beta_Bps`` its bus bandwidth as nccl-tests reports
it (busbw: an all-reduce of n bytes over p ranks moves 2(p-1)/p n bytes through each rank's link, so it
takes 2(p-1)/p n / busbw plus latency). Presets (PRESETS) come from published nccl-tests figures or
measurements here, each with its source; ``kind`` says which of NCCL's latency classes it is.

Two libraries, as a run would use them:

* ``mpi`` (a CPU run, mpisgd's own strategies): within a node, then across nodes, one after the other
  (MPI libraries' SMP-aware all-reduce: reduce to one rank per node, all-reduce among them, broadcast),
  each level recursive halving-doubling (2 ceil(log2 p) latency steps) or a ring (2(p-1)).
* ``nccl`` (a GPU run): a flat ring over all ranks, whose bandwidth is the slower of the two links; a
  double binary tree (latency log2 of the nodes); hierarchical (reduce-scatter in the node, all-reduce
  across nodes, all-gather in the node). ``auto`` takes the cheaper of ring and tree per message, as NCCL's
  tuner does (src/graph/tuning.cc: same latency constants, trees at 0.45 of the bus bandwidth).

A reduce-scatter or an all-gather (the sharded step) costs half an all-reduce of the same bytes: half
the latency steps, (p-1)/p n bytes per rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpisgd.app.metrics import MetricsError, json_lines
from mpisgd.app.planner.errors import PlanError, number


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: ``alpha_s`` seconds per latency step of an MPI all-reduce, ``beta_Bps`` its bus
    bandwidth (bytes/s, nccl-tests' busbw), ``kind`` NCCL's latency class (shm, nvlink, pcie, net)."""

    name: str
    alpha_s: float
    beta_Bps: float
    source: str
    kind: str = "net"

    def allreduce_s(self, nbytes: float, p: int, algorithm: str = "halving-doubling") -> float:
        """One MPI all-reduce of ``nbytes`` over ``p`` ranks on this link alone."""
        if p <= 1:
            return 0.0
        steps = 2 * (p - 1) if algorithm == "ring" else 2 * math.ceil(math.log2(p))
        return steps * self.alpha_s + 2 * (p - 1) / p * nbytes / self.beta_Bps

    def describe(self) -> str:
        return f"{self.name}: alpha {1e6 * self.alpha_s:.3g} us, busbw {self.beta_Bps / 1e9:.3g} GB/s"


def _gbit(x: float) -> float:
    return x * 1e9 / 8


GB = 1e9
NCCL_TUNING = "NCCL's tuning model, github.com/NVIDIA/nccl src/graph/tuning.cc"
NCCL_307 = "NCCL maintainer, github.com/NVIDIA/nccl/issues/307"
# (alpha s, busbw bytes/s, kind, source). "measured" here, "published" a cited nccl-tests figure,
# "derived" a line rate times the share NCCL reaches of it on a link of that kind (cited), "nominal" a
# line rate less protocol framing: replace those with your own allreduce_bw.py or nccl-tests measurement.
PRESETS: dict[str, tuple[float, float, str, str]] = {
    "shm": (10e-6, _gbit(160), "shm", "measured: allreduce_bw.py, shared strategy, k = 2 on this project's 2-core "
                                      "VM, 256 KiB-8 MiB (docs/plan.md, Presets); 2-3x slower once the buffers "
                                      "leave the caches (>= 16 MiB)"),
    "emulated-1gbit": (135e-6, _gbit(0.74), "net", "measured: the emulated cluster's 1 Gbit/s tbf link, alpha-beta "
                                                    "fit of its MPI_Allreduce probe (docs/cluster.md)"),
    "emulated-10gbit": (179e-6, _gbit(1.94), "net", "measured: the emulated cluster's 10 Gbit/s tbf link (TCP over "
                                                     "veth is CPU-bound at ~2 Gbit/s there; docs/cluster.md)"),
    "1gbe": (50e-6, _gbit(0.94), "net", "nominal: 1 Gbit/s line rate less Ethernet/IP/TCP framing (1448 payload "
                                        "bytes per 1538 on the wire); MPI over TCP takes tens of us per message"),
    "10gbe": (25e-6, _gbit(9.4), "net", "nominal: 10 Gbit/s line rate less TCP framing; not measured"),
    "25gbe": (15e-6, _gbit(23.5), "net", "nominal: 25 Gbit/s line rate less TCP framing; not measured"),
    "50gbe": (15e-6, _gbit(47.1), "net", "nominal: 50 Gbit/s line rate less TCP framing; not measured"),
    "roce-25g": (5e-6, 3.0 * GB, "net", "derived: 25 Gbit/s = 3.125 GB/s at the 96 % of line rate NCCL rings reach "
                                        f"on an EDR NIC (12 of 12.5 GB/s, {NCCL_307})"),
    "ib-edr": (1.5e-6, 12 * GB, "net", f"published: ~12 GB/s nccl-tests busbw per EDR (100 Gbit/s) NIC with rings "
                                       f"({NCCL_307}); MPI latency 1-2 us as fabric vendors quote it"),
    "ib-edr-x4": (1.5e-6, 47 * GB, "net", f"published: 47 GB/s nccl-tests busbw between DGX-1 nodes, 4 EDR NICs "
                                          f"each ({NCCL_307})"),
    "ib-hdr": (1.5e-6, 24 * GB, "net", "published: ~24 GB/s nccl-tests busbw between nodes per HDR (200 Gbit/s) NIC "
                                       "at 8 GB, 16 GB/s when the NIC hangs off the CPU (NCCL maintainer, "
                                       "github.com/NVIDIA/nccl/issues/412)"),
    "ib-hdr-x8": (1.5e-6, 192 * GB, "net", "published: 192 GB/s nccl-tests all-reduce busbw between DGX A100 nodes, "
                                           "8 HDR NICs each (NCCL team, github.com/NVIDIA/nccl/issues/812, quoted "
                                           "in issues/1576)"),
    "pcie3": (5e-6, 12.6 * GB, "pcie", "derived: PCIe 3.0 x16 line rate 15.75 GB/s at the ~80 % NCCL reaches of a "
                                       "link's line rate (NVLink: 20 of 25 GB/s, NCCL maintainer, "
                                       "github.com/NVIDIA/nccl-tests/issues/149); GPUs behind the CPU's root "
                                       "complex get less (github.com/NVIDIA/nccl/issues/1639)"),
    "nvlink-p100": (5e-6, 64 * GB, "nvlink", "derived: 4 NVLink 1 links of 20 GB/s a direction per P100 at ~80 % "
                                             "(github.com/NVIDIA/nccl-tests/issues/149)"),
    "nvlink-v100": (5e-6, 120 * GB, "nvlink", "derived: 6 NVLink 2 links of 25 GB/s a direction per V100 (DGX-1 "
                                              "hybrid cube-mesh) at ~20 GB/s each as NCCL reaches them (NCCL "
                                              "maintainer, github.com/NVIDIA/nccl-tests/issues/149)"),
    "nvlink-a100": (5e-6, 230 * GB, "nvlink", "published: ~230 GB/s nccl-tests busbw on 8 A100 SXM4 (NCCL "
                                              "maintainer, github.com/NVIDIA/nccl-tests/issues/149)"),
    "nvlink-h100": (5e-6, 370 * GB, "nvlink", "published: ~370 GB/s nccl-tests busbw with rings on 8 H100 SXM, ~480 "
                                              "with NVLink SHARP (NCCL maintainer, "
                                              "github.com/NVIDIA/nccl-tests/issues/212)"),
}
# NCCL's latencies (us) for its Simple protocol, the one large messages use (NCCL_TUNING): a ring step per
# kind of link, a tree hop (a 256 KiB chunk) per kind, and the base latency of a ring.
NCCL_RING_STEP_US = {"nvlink": 3.4, "pcie": 5.7, "shm": 5.7, "net": 9.6}
NCCL_TREE_HOP_US = {"nvlink": 28.0, "pcie": 28.0, "shm": 28.0, "net": 50.0}
NCCL_RING_BASE_US = 8.4
NCCL_TREE_SHARE = 0.45  # a tree's algorithm bandwidth: 0.5 of 0.9 of the bus bandwidth (NCCL_TUNING)
NCCL_TREE_MAX_GBS = {True: 110.0, False: 80.0}  # the tree's bus bandwidth cap, <= 2 nodes and beyond
NCCL_RING_PLATEAU = 1.9  # multi-node ring latency factor for large all-reduces (NCCL_TUNING)


def preset(name: str) -> Link:
    alpha, beta, kind, source = PRESETS[name]
    return Link(name, alpha, beta, source, kind)


LIBRARIES = ("mpi", "nccl")
ALGORITHMS = ("auto", "halving-doubling", "ring", "tree", "hierarchical")


@dataclass(frozen=True)
class Cluster:
    """Where the ranks run: ``per_node`` ranks to a node on the ``intra`` link, nodes joined by ``inter``,
    reducing with ``library``'s ``algorithm``. ``overlap``: auto (the network's part runs behind backward;
    on a CPU node the intra-node part is the ranks' own work and is not hidden, on a GPU node it is),
    ideal (both hidden), none (nothing hidden)."""

    intra: Link
    inter: Link | None
    per_node: int
    library: str = "mpi"
    algorithm: str = "auto"
    overlap: str = "auto"
    nodes: int | None = None  # nodes available (caps k)
    node_memory_gib: float | None = None  # memory per node, GiB (rows that need more are not recommended)
    source: str = "the command line"

    def layout(self, k: int) -> tuple[int, int]:
        """(nodes, ranks per node) of k ranks."""
        return -(-k // self.per_node), min(k, self.per_node)

    def _need_inter(self, k: int) -> Link:
        if self.inter is None:
            nodes, _ = self.layout(k)
            raise PlanError(f"k={k} needs {nodes} nodes of {self.per_node} ranks: give the link between nodes "
                            "(--link, --alpha-us and --beta-gbit, or --cluster)")
        return self.inter

    # -- MPI: one level after the other -------------------------------------------------------------
    def levels(self, nbytes: float, k: int) -> tuple[float, float]:
        """MPI: (intra-node s, inter-node s) of one all-reduce of ``nbytes`` over k ranks."""
        nodes, local = self.layout(k)
        alg = "ring" if self.algorithm == "ring" else "halving-doubling"
        intra = self.intra.allreduce_s(nbytes, local, alg)
        if nodes == 1:
            return intra, 0.0
        return intra, self._need_inter(k).allreduce_s(nbytes, nodes, alg)

    # -- NCCL ---------------------------------------------------------------------------------------
    def _ring(self, nbytes: float, k: int, half: bool) -> float:
        nodes, local = self.layout(k)
        bw = self.intra.beta_Bps if nodes == 1 else min(self.intra.beta_Bps, self._need_inter(k).beta_Bps)
        inter_steps = 2 * (nodes - 1)
        intra_steps = 2 * (k - 1) - inter_steps
        lat = NCCL_RING_BASE_US + intra_steps * NCCL_RING_STEP_US[self.intra.kind] + \
            inter_steps * NCCL_RING_STEP_US["net"]
        if nodes > 1 and nbytes >= k / 16 * 65536:
            lat *= NCCL_RING_PLATEAU
        share = 2 * (k - 1) / k
        if half:
            return (lat * 1e-6 + share * nbytes / bw) / 2
        return lat * 1e-6 + share * nbytes / bw

    def _tree(self, nbytes: float, k: int) -> float:
        nodes, local = self.layout(k)
        lat = 2 * ((local - 1) * NCCL_TREE_HOP_US[self.intra.kind] +
                   math.ceil(math.log2(nodes)) * NCCL_TREE_HOP_US["net"])
        # two nodes: each byte crosses the network once each way, so a tree reaches up to twice the NIC's
        # busbw there (NCCL maintainer, NVIDIA/nccl issue 307); the bus bandwidth is capped as NCCL_TUNING
        net = self._need_inter(k).beta_Bps * (2 if nodes == 2 else 1) if nodes > 1 else math.inf
        busbw = min(self.intra.beta_Bps, net, NCCL_TREE_MAX_GBS[nodes <= 2] * GB)
        return lat * 1e-6 + nbytes / (NCCL_TREE_SHARE * busbw)

    def _hierarchical(self, nbytes: float, k: int, half: bool) -> tuple[float, float]:
        """(intra-node s, inter-node s): reduce-scatter in the node, all-reduce across nodes, all-gather in
        the node (for a reduce-scatter or all-gather alone: half of each)."""
        nodes, local = self.layout(k)
        step = NCCL_RING_STEP_US[self.intra.kind] * 1e-6 if self.library == "nccl" else self.intra.alpha_s
        inside = (local - 1) * step + (local - 1) / local * nbytes / self.intra.beta_Bps  # one reduce-scatter
        across = 0.0
        if nodes > 1:
            inter = self._need_inter(k)
            net_step = NCCL_RING_STEP_US["net"] * 1e-6 if self.library == "nccl" else inter.alpha_s
            # every rank all-reduces its 1/local share with its peers on the other nodes, all through the NIC
            across = 2 * (nodes - 1) * net_step + 2 * (nodes - 1) / nodes * nbytes / inter.beta_Bps
        return (inside, across / 2) if half else (2 * inside, across)

    # -- the step's collectives ---------------------------------------------------------------------
    def allreduce(self, nbytes: float, k: int) -> tuple[float, float, str]:
        """(s spent by the ranks' own cores, s spent by the links, algorithm) of one all-reduce of
        ``nbytes`` over k ranks. Only an MPI run's intra-node level is the cores' work (a CPU node)."""
        if k <= 1:
            return 0.0, 0.0, "-"
        if self.library == "mpi":
            if self.algorithm in ("tree",):
                raise PlanError("--algorithm tree is NCCL's (a GPU cluster): use --library nccl, or "
                                "halving-doubling, ring or hierarchical")
            if self.algorithm == "hierarchical":
                intra, inter = self._hierarchical(nbytes, k, False)
                return intra, inter, "hierarchical"
            intra, inter = self.levels(nbytes, k)
            return intra, inter, "ring" if self.algorithm == "ring" else "halving-doubling"
        if self.algorithm == "hierarchical":
            return 0.0, sum(self._hierarchical(nbytes, k, False)), "hierarchical"
        if self.algorithm == "halving-doubling":
            raise PlanError("NCCL has no halving-doubling all-reduce: use --algorithm auto, ring, tree or "
                            "hierarchical")
        nodes, _ = self.layout(k)
        ring = self._ring(nbytes, k, False)
        if self.algorithm == "ring" or nodes == 1:
            return 0.0, ring, "ring"
        tree = self._tree(nbytes, k)
        if self.algorithm == "tree" or tree < ring:
            return 0.0, tree, "tree"
        return 0.0, ring, "ring"

    def half(self, nbytes: float, k: int) -> tuple[float, float]:
        """(cores s, links s) of one reduce-scatter (or all-gather) of ``nbytes`` over k ranks: half an
        all-reduce (ring or halving-doubling; NCCL has no tree for these)."""
        if k <= 1:
            return 0.0, 0.0
        if self.algorithm == "hierarchical":
            intra, inter = self._hierarchical(nbytes, k, True)
            return (intra, inter) if self.library == "mpi" else (0.0, intra + inter)
        if self.library == "nccl":
            return 0.0, self._ring(nbytes, k, True)
        intra, inter = self.levels(nbytes, k)
        return intra / 2, inter / 2

    def small_collective_s(self, k: int) -> float:
        """A few-byte collective (the step's check-in, the sharded step's finite vote): one latency per
        doubling, at each level."""
        nodes, local = self.layout(k)
        t = math.ceil(math.log2(local)) * self.intra.alpha_s if local > 1 else 0.0
        if nodes > 1 and self.inter is not None:
            t += math.ceil(math.log2(nodes)) * self.inter.alpha_s
        return t

    def describe(self) -> str:
        links = self.intra.describe() + f" within a node ({self.per_node} rank(s))"
        links += ("; " + self.inter.describe() + " between nodes") if self.inter else "; no link between nodes"
        return f"{links}; {self.library} {self.algorithm} all-reduce; overlap {self.overlap}"


# -- measured links ------------------------------------------------------------------------------------
def read_allreduce_json(path: str, backend: str | None = None) -> tuple[list[dict[str, Any]], str, int]:
    """The rows of one backend (in place where there are any) of an ``allreduce_bw.py --json`` file, the
    backend's name and the ranks it ran on."""
    what = "an allreduce_bw.py --json output"
    try:
        lines = json_lines(path, what)
    except MetricsError as exc:
        raise PlanError(str(exc)) from None
    rows = []
    for i, r in lines:
        if not isinstance(r, dict) or not all(isinstance(r.get(k), int | float) and not isinstance(r.get(k), bool)
                                              for k in ("size_bytes", "time_us", "ranks")) \
                or not isinstance(r.get("backend"), str):
            raise PlanError(f"{path}: line {i} lacks size_bytes, time_us, ranks or backend: not {what}")
        rows.append(r)
    if not rows:
        raise PlanError(f"{path}: no rows: not {what}")
    names = list(dict.fromkeys(r["backend"] for r in rows))
    name = backend or ("auto" if "auto" in names else names[0])
    rows = [r for r in rows if r["backend"] == name]
    if not rows:
        raise PlanError(f"{path}: no rows for backend {name!r}; it has {', '.join(names)} (--backend)")
    if any(r.get("inplace") for r in rows):
        rows = [r for r in rows if r.get("inplace")]  # training reduces its gradient buffer in place
    for r in rows:
        for key in ("size_bytes", "time_us"):
            number(r[key], f"{path}: {key}", positive=True)
    ranks = {r["ranks"] for r in rows}
    if len(ranks) != 1 or not all(isinstance(p, int) and 2 <= p <= 1 << 24 for p in ranks):
        raise PlanError(f"{path}: the rows must come from one run of 2 or more ranks, got ranks {sorted(ranks)}")
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


def size_text(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n:.0f} B"


def parse_link(spec: str, buckets: Sequence[int], backend: str | None, algorithm: str) -> Link:
    """A preset name, or an allreduce_bw.py --json file (fitted around the gradient's bucket sizes)."""
    if spec in PRESETS:
        return preset(spec)
    if not os.path.exists(spec):
        raise PlanError(f"link {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    rows, name, p = read_allreduce_json(spec, backend)
    lo, hi = min(buckets) / 4, max(buckets) * 4
    alg = "ring" if algorithm == "ring" else "halving-doubling"
    return fit_link(rows, p, lo, hi, alg, name=f"{os.path.basename(spec)} ({name}, k={p})",
                    source=f"measured: {spec}, backend {name} at k = {p}, fitted to sizes "
                           f"{size_text(lo)}-{size_text(hi)}")


def link_from_table(value: Any, where: str) -> Link:
    """A cluster file's link: a preset's name, or a table {alpha_us, busbw_gbs, kind, source}."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise PlanError(f"{where}: {value!r} is no link preset ({', '.join(PRESETS)})")
        return preset(value)
    if not isinstance(value, dict):
        raise PlanError(f"{where}: a link is a preset's name or a table with alpha_us and busbw_gbs")
    unknown = set(value) - {"alpha_us", "busbw_gbs", "kind", "source", "name"}
    if unknown:
        raise PlanError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (alpha_us, busbw_gbs, kind, source)")
    kind = value.get("kind", "net")
    if kind not in NCCL_RING_STEP_US:
        raise PlanError(f"{where}: kind {kind!r}: one of {', '.join(NCCL_RING_STEP_US)}")
    alpha = number(value.get("alpha_us"), f"{where}.alpha_us") * 1e-6
    busbw = number(value.get("busbw_gbs"), f"{where}.busbw_gbs", positive=True) * GB
    return Link(str(value.get("name", where)), alpha, busbw, str(value.get("source", "given")), kind)
