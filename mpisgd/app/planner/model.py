"""The planner's model: a step's time at k ranks, samples/s, statistical efficiency, goodput, time to the
target, the rate; and which row to recommend, and which constraint chose it.

  step      = m*(forward + backward) + optimizer (/k sharded) + other + the communication not hidden
  buckets   : reduced in the order backward completes them; bucket i is ready once the last micro-batch's
              backward has produced its bytes (backward time taken as proportional to the bytes done, from
              the output layer back); the links reduce one bucket at a time, and what is still running when
              backward ends is exposed (at least the last bucket, ready only then)
  sharded   : each bucket reduce-scattered in its place (half an all-reduce), the update on 1/k of the
              parameters, then the parameters all-gathered after it, where nothing hides them
  efficiency = (B_noise + B0)/(B_noise + B)   (McCandlish et al. 2018; Pollux's EFFICIENCY_t)
  goodput   = samples/s * efficiency; time to target = E0 / goodput (E0: the samples B0 took to the target)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mpisgd.app.planner.errors import PlanError
from mpisgd.app.planner.topology import Cluster
from mpisgd.app.planner.workload import Rules, Workload
from mpisgd.schedule import scaled_lr


@dataclass(frozen=True)
class StepTime:
    """One predicted step, ms."""

    compute_ms: float  # forward, backward, the update and the rest, as one rank computes them
    comm_ms: float  # every reduction's whole time (hidden or not)
    exposed_ms: float  # the communication the step waits for
    algorithm: str  # the all-reduce algorithm of the buckets (or "reduce-scatter" sharded)
    sharded: bool

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.exposed_ms


def step_time(w: Workload, net: Cluster, k: int, m: int) -> StepTime:
    """Predicted step at k ranks and m micro-batches of the workload's b (each rank computing as fast as
    the measured one). The links' part runs behind backward (unless overlap is off in the workload or
    ``net.overlap`` is none); an MPI run's intra-node part is its cores' work, added in full unless
    ``net.overlap`` is ideal."""
    fwd, bwd = w.forward_ms / w.m, w.backward_ms / w.m
    sharded = w.shard.at(k)
    optimizer = w.optimizer_ms / k if sharded else w.optimizer_ms
    compute = m * (fwd + bwd) + optimizer + w.other_ms
    if k == 1:
        return StepTime(compute, 0.0, 0.0, "-", False)
    hide = w.overlap and net.overlap != "none"
    hide_cores = hide and net.overlap == "ideal"
    exposed, links_end, total, done = 0.0, 0.0, 0.0, 0
    algorithms = set()
    for nbytes in w.bucket_nbytes:
        if sharded:
            cores_s, links_s = net.half(nbytes, k)
            algorithms.add("reduce-scatter")
        else:
            cores_s, links_s, alg = net.allreduce(nbytes, k)
            algorithms.add(alg)
        cores, links = 1e3 * cores_s, 1e3 * links_s
        done += nbytes
        total += cores + links
        ready = bwd * min(1.0, done / sum(w.bucket_nbytes))
        if hide_cores:
            links += cores
        else:
            exposed += cores
        if hide:
            links_end = max(ready, links_end) + links
        else:
            exposed += links
    if hide:
        exposed += max(0.0, links_end - bwd)
    if sharded:  # the parameters come back after the update: nothing hides the all-gather
        for nbytes in w.bucket_nbytes:
            gather = 1e3 * sum(net.half(nbytes, k))
            exposed += gather
            total += gather
        exposed += 1e3 * net.small_collective_s(k)  # the finite vote
    if w.check_in:
        exposed += 1e3 * net.small_collective_s(k)
    return StepTime(compute, total, exposed, "/".join(sorted(algorithms)), sharded)


def statistical_efficiency(noise_scale: float, b0: int, b: int) -> float:
    """(B_noise + B0)/(B_noise + B): the progress a sample at batch B makes relative to one at B0
    (McCandlish et al. 2018, eq. 2.7 in samples; Pollux's EFFICIENCY_t). 1 at B0, < 1 above it."""
    return (noise_scale + b0) / (noise_scale + b)


@dataclass(frozen=True)
class Row:
    """One (k, m) predicted."""

    k: int  # ranks
    nodes: int  # nodes they fill
    ranks_per_node: int
    b: int
    m: int
    B: int  # noqa: N815 - the effective batch's name everywhere
    lr: float  # the scaling rule's rate at B
    compute_ms: float
    allreduce_ms: float  # every reduction's time, hidden or not
    exposed_comm_ms: float
    step_ms: float
    samples_per_s: float
    scaling_efficiency: float  # compute / step: the share of one rank's speed each of k keeps
    statistical_efficiency: float | None  # None without a noise scale
    goodput: float  # samples/s * statistical efficiency (samples/s without a noise scale)
    samples_to_target: float | None
    steps_to_target: float | None
    time_to_target_s: float | None
    speedup: float | None  # time to target of the first row / this row's (samples/s where no target)
    algorithm: str
    sharded: bool
    memory_mib_per_node: float | None  # the ranks of a node together, peak
    fits: bool  # within the cluster's memory per node (True where not known)


def plan(w: Workload, net: Cluster, ranks: Sequence[int], accum: Sequence[int] | None, rules: Rules,
         target_samples: float | None) -> list[Row]:
    """One row per (k, m). Raises PlanError when the inputs make a number that is not finite."""
    rows: list[Row] = []
    for k in ranks:
        nodes, local = net.layout(k)
        for m in accum or (w.m,):
            B = k * w.b * m
            t = step_time(w, net, k, m)
            sps = 1e3 * B / _positive(k, m, "step_ms", t.step_ms)
            _positive(k, m, "samples_per_s", sps)  # divides the time to the target
            eff = statistical_efficiency(w.noise_scale, w.B, B) if w.noise_scale else None
            if target_samples:  # at B, the samples to the loss B0 reaches after E0 (E = E_min (1 + B/B_noise))
                samples = target_samples / (eff or 1.0)
                to_target: tuple[float | None, float | None, float | None] = (samples, samples / B, samples / sps)
            else:
                to_target = (None, None, None)
            memory = local * w.memory_mib if w.memory_mib else None
            fits = memory is None or net.node_memory_gib is None or memory <= net.node_memory_gib * 1024
            rows.append(_checked(Row(
                k=k, nodes=nodes, ranks_per_node=local, b=w.b, m=m, B=B,
                lr=scaled_lr(rules.lr, rules.base_batch, B, rules.scaling), compute_ms=t.compute_ms,
                allreduce_ms=t.comm_ms, exposed_comm_ms=t.exposed_ms, step_ms=t.step_ms, samples_per_s=sps,
                scaling_efficiency=t.compute_ms / t.step_ms, statistical_efficiency=eff,
                goodput=sps * (eff if eff is not None else 1.0), samples_to_target=to_target[0],
                steps_to_target=to_target[1], time_to_target_s=to_target[2], speedup=None, algorithm=t.algorithm,
                sharded=t.sharded, memory_mib_per_node=memory, fits=fits)))
    first = rows[0]
    out = []
    for r in rows:  # against the first row (the fewest ranks): what the extra ranks buy
        if r.time_to_target_s is not None and first.time_to_target_s is not None:
            speedup = first.time_to_target_s / r.time_to_target_s
        else:
            speedup = r.goodput / first.goodput
        out.append(_with(r, speedup=speedup))
    for r in out:
        _check_finite(r)
    return out


def _with(r: Row, **changes: object) -> Row:
    from dataclasses import replace  # noqa: PLC0415

    return replace(r, **changes)  # type: ignore[arg-type]


# what the next rows and the recommendation divide by: a row where one of these is 0 (a step of 5e-324 ms, a
# link of 1e-320 Gbit/s: a step of inf ms, so 0 samples/s) is refused before anything divides by it
DIVISORS = ("step_ms", "samples_per_s", "goodput", "samples_to_target", "steps_to_target", "time_to_target_s")


def _checked(r: Row) -> Row:
    """``r``, once every number in it is finite and >= 0 and those DIVISORS it has are > 0: PlanError otherwise."""
    _check_finite(r)
    for name in DIVISORS:
        value = getattr(r, name)
        if value is not None:
            _positive(r.k, r.m, name, value)
    return r


def _positive(k: int, m: int, name: str, value: float) -> float:
    """``value`` where it is finite and > 0; PlanError naming the row and the number otherwise."""
    if not (math.isfinite(value) and value > 0):
        raise PlanError(f"k={k}, m={m}: {name} comes out {value}: the inputs are out of range (check the link's "
                        "bandwidth, the profile's or the workload's step times, and --target-epochs)")
    return value


def _check_finite(r: Row) -> None:
    """Every number of a row finite and >= 0: inputs that make one that is not (a rate of 1e308 scaled up,
    a target of 1e-300 epochs) give one line, not a row of inf or nan with a recommendation."""
    for name, value in vars(r).items():
        if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
            raise PlanError(f"k={r.k}, m={r.m}: {name} comes out {value}: the inputs are out of range "
                            "(check --lr, --target-epochs, --noise-scale and the profile's times)")


@dataclass(frozen=True)
class Recommendation:
    row: Row
    constraint: str  # goodput plateau, link, memory, ranks available
    reason: str


def recommend(rows: Sequence[Row], margin: float) -> Recommendation:
    """The row with the fewest ranks (then the fewest micro-batches) whose goodput is within ``margin`` of
    the most goodput any row that fits in memory has; and which constraint stopped it there: the link
    (the next row's step grows with exposed communication), the statistics (a goodput plateau: the next
    row's batch buys fewer steps), memory (the next row does not fit) or the ranks planned (none larger)."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        raise PlanError("no row fits the cluster's memory per node: fewer ranks per node, or more memory")
    best = max(r.goodput for r in fitting)
    ok = [r for r in fitting if r.goodput >= (1 - margin) * best]
    pick = min(ok, key=lambda r: (r.k, r.m, -r.goodput))
    top = max(fitting, key=lambda r: r.goodput)
    stats = pick.statistical_efficiency is not None
    what = "goodput" if stats else "samples/s (no noise scale: throughput only)"
    near = (f"the most {what} ({top.goodput:.0f})" if pick is top else
            f"the fewest ranks within {100 * margin:g} % of the most {what} ({top.goodput:.0f} at k={top.k}, "
            f"m={top.m})")
    bigger = sorted((r for r in rows if r.m == pick.m and r.k > pick.k), key=lambda r: r.k)
    if not bigger:
        return Recommendation(pick, "ranks available", f"{near}; no more ranks planned (--ranks, --nodes)")
    nxt = bigger[0]
    if not nxt.fits:
        return Recommendation(pick, "memory", f"{near}; k={nxt.k} needs {nxt.memory_mib_per_node:.0f} MiB per node, "
                                              "more than the cluster's memory")
    # what the next doubling loses, in log terms: to communication (samples/s short of k's growth) and to
    # statistics (the efficiency it drops); the larger loss is the constraint
    link_loss = math.log(nxt.k / pick.k) - math.log(nxt.samples_per_s / pick.samples_per_s)
    stat_loss = -math.log(nxt.statistical_efficiency / pick.statistical_efficiency) if stats and \
        nxt.statistical_efficiency and pick.statistical_efficiency else 0.0
    if link_loss >= stat_loss:
        return Recommendation(pick, "link", f"{near}; at k={nxt.k} exposed communication is "
                                            f"{nxt.exposed_comm_ms:.3g} of {nxt.step_ms:.3g} ms per step "
                                            f"(scaling efficiency {nxt.scaling_efficiency:.2f})")
    return Recommendation(pick, "goodput plateau", f"{near}; at k={nxt.k} B={nxt.B} buys fewer steps "
                                                   f"(statistical efficiency {nxt.statistical_efficiency:.2f}, "
                                                   f"scaling efficiency {nxt.scaling_efficiency:.2f})")
