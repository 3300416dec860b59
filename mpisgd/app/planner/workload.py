"""What one rank's step is made of, and the run's rules: from a profile run's metrics file, or described by
numbers (a workload file, so that a published setup can be planned without running it).

From a metrics file the planner takes the last run in it (a file two runs appended to holds two), its
run record (buckets, overlap, sharding, the device, the optimizer and its rate: docs/metrics.md) and one
epoch record (the times per step). A file of schema 0 (the previous round's, without run records) is read
too, with what it did not record assumed and said: buckets by DataParallel's rule, overlap on, a CPU run,
the rate from the configuration written beside it (``METRICS.config.toml``), else the trainer's defaults.

A workload file (TOML) describes the same by numbers; docs/plan.md ("A workload by numbers") lists its
keys. Both give a :class:`Workload` and the :class:`Rules` of the rate.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from mpisgd.app.metrics import MetricsError, RunLog, read_metrics, read_text
from mpisgd.app.options import _toml as toml_module
from mpisgd.app.planner.errors import PlanError, number
from mpisgd.app.records import EpochRecord

FIRST_BUCKET_BYTES = 2**20  # DataParallel's (and DDP's) first bucket: 1 MiB
MIN_BUCKET_BYTES = 1024  # a workload's bucket or fusion size below this is a mistake, not a plan
MAX_BUCKETS = 100_000  # more buckets than this per step: a bucket size far too small for the model
SHARD_MIN_BYTES = 2**20  # mpisgd.app.run.SHARD_MIN_BYTES, for files that do not record it


@dataclass(frozen=True)
class ShardRule:
    """Whether the update is sharded at k ranks: as asked, else mpisgd's default (mpisgd.app.run.shard_policy):
    on for host buffers at k >= 2 with at least ``min_bytes`` of parameters."""

    asked: bool | None
    min_bytes: int
    device: str
    param_nbytes: int

    def at(self, k: int) -> bool:
        if self.asked is not None:
            return self.asked and k > 1
        return self.device == "cpu" and k > 1 and self.param_nbytes >= self.min_bytes


@dataclass(frozen=True)
class Rules:
    """The learning-rate rule of the run planned, and where each part came from."""

    lr: float = 0.1  # eta0, the rate for base_batch
    base_batch: int = 256  # B0 of lr
    scaling: str = "linear"  # linear, sqrt, none
    optimizer: str = "sgd"
    source: str = "the trainer's defaults"


@dataclass(frozen=True)
class Workload:
    """One rank's step: times per step at the measured m, the gradient and its buckets, and statistics."""

    source: str  # the metrics file (and which run, epoch) or the workload file
    name: str
    device: str  # cpu or gpu: on a CPU node the intra-node reduction is the ranks' own work
    b: int  # samples per micro-batch per rank
    m: int  # micro-batches per step as measured
    k: int  # ranks as measured
    forward_ms: float  # per step (all m micro-batches), one rank
    backward_ms: float
    optimizer_ms: float  # the whole model's update per step (sharded: 1/k of it)
    other_ms: float  # what a step spends outside those and waiting (data, check-in, Python)
    step_ms: float  # the measured step (at k, m)
    grad_nbytes: int  # bytes of the gradient (= the parameters')
    bucket_nbytes: tuple[int, ...]  # bytes reduced per bucket, in the order backward completes them
    buckets_from: str  # where the bucket sizes came from
    overlap: bool  # buckets start during backward
    check_in: bool  # mpisgd's per-step check-in (a small all-gather)
    shard: ShardRule
    noise_scale: float | None  # B_noise, samples (None: no statistics, throughput only)
    samples: int | None  # samples the profiled run trained on (the target: the loss it reached)
    steps_per_epoch: int | None
    train_loss: float | None
    memory_mib: float | None  # per rank, peak
    ranks_per_node: int  # of the measured run (the default layout to plan)
    notes: tuple[str, ...] = ()  # what was assumed, and why

    @property
    def B(self) -> int:  # noqa: N802 - the effective batch's name everywhere in the docs
        return self.k * self.b * self.m

    @property
    def samples_per_s(self) -> float:
        return 1e3 * self.B / self.step_ms


def default_buckets(total: int, cap_mb: float = 25.0) -> tuple[int, ...]:
    """DataParallel's rule by bytes alone: a first bucket of min(1 MiB, cap), then ``cap_mb`` MiB each (the
    real ones end at layer boundaries)."""
    first, cap = int(min(FIRST_BUCKET_BYTES, cap_mb * 2**20, total)), int(cap_mb * 2**20)
    full, rest = divmod(total - first, cap)
    if full > MAX_BUCKETS:
        raise PlanError(f"a gradient of {total:,} bytes makes more than {MAX_BUCKETS:,} buckets of {cap_mb:g} MiB")
    return (first,) + (cap,) * full + ((rest,) if rest else ())


def _bucket_size(t: dict[str, Any], key: str, default: float | None, grad: int, path: str) -> float:
    """``key`` (MiB) of a workload, checked: at least MIN_BUCKET_BYTES, and at most MAX_BUCKETS of them."""
    mib = number(t.get(key, default), f"{path}: {key}", positive=True)
    if mib * 2**20 < MIN_BUCKET_BYTES:
        raise PlanError(f"{path}: {key} = {mib:g} MiB is under {MIN_BUCKET_BYTES} bytes: give the size in MiB "
                        "(25 is DDP's default)")
    if grad / (mib * 2**20) > MAX_BUCKETS:
        given = f"{key} = {mib:g} MiB" if key in t else f"the default {key} of {mib:g} MiB"
        raise PlanError(f"{path}: {given} cuts the {grad:,}-byte gradient into more than {MAX_BUCKETS:,} "
                        f"buckets: check the parameter count, or give a larger {key}")
    return mib


def read_toml(path: str, what: str) -> dict[str, Any]:
    try:
        text = read_text(path, what)
    except MetricsError as exc:
        raise PlanError(str(exc)) from None
    toml = toml_module()
    try:
        return dict(toml.loads(text))
    except toml.TOMLDecodeError as exc:
        raise PlanError(f"{path}: not TOML ({exc}): not {what}") from None


def rules_from_config(path: str) -> Rules | None:
    """The rate rule from a run's saved configuration (``METRICS.config.toml``), None where there is none."""
    if not os.path.exists(path):
        return None
    table = read_toml(path, "a configuration an mpisgd.train run wrote")
    lr = number(table.get("lr", 0.1), f"{path}: lr", positive=True)
    base = int(number(table.get("base_batch", 256), f"{path}: base_batch", positive=True, whole=True))
    scaling, optimizer = table.get("lr_scaling", "linear"), table.get("optimizer", "sgd")
    if scaling not in ("linear", "sqrt", "none") or not isinstance(optimizer, str):
        raise PlanError(f"{path}: lr_scaling {scaling!r} or optimizer {optimizer!r} is not a run's")
    return Rules(lr, base, scaling, optimizer, f"the run's configuration {path}")


# -- from a metrics file -------------------------------------------------------------------------------
def _epoch(log: RunLog, path: str, epoch: int | None) -> EpochRecord:
    if not log.epochs:
        raise PlanError(f"{path}: its last run (line {log.first_line} on) has no epoch records: it ended before "
                        "its first epoch did; profile a run of 2 epochs or more")
    if epoch is None:
        return log.epochs[-1]
    rec = next((r for r in log.epochs if r.epoch == epoch), None)
    if rec is None:
        raise PlanError(f"{path}: no epoch {epoch}; its last run has epochs "
                        f"{', '.join(str(r.epoch) for r in log.epochs)}")
    return rec


def from_metrics(path: str, epoch: int | None = None, noise_scale: float | None = None) -> tuple[Workload, Rules]:
    """The workload and rules of the last run in metrics file ``path``, timed by its epoch ``epoch``
    (default: the last; the first includes warm-up); the noise scale from its last epoch record (the end of
    the run) unless ``noise_scale`` is given."""
    try:
        runs = [r for r in read_metrics(path) if r.epochs or r.run is not None]
    except MetricsError as exc:
        raise PlanError(str(exc)) from None
    if not runs:
        raise PlanError(f"{path}: no epoch records (kind \"epoch\"): not an mpisgd.train --metrics-file")
    log = runs[-1]
    rec = _epoch(log, path, epoch)
    last = log.epochs[-1]
    notes = []
    if len(runs) > 1:
        notes.append(f"the file holds {len(runs)} runs; planned: the last (line {log.first_line} on)")
    where = f"{path}" + (f" (run from line {log.first_line})" if len(runs) > 1 else "")
    what = f"{path}: epoch {rec.epoch}"
    times = {key: number(getattr(rec, key), f"{what}: {key}") for key in
             ("forward_ms", "backward_ms", "optimizer_ms", "comm_exposed_ms")}
    step_ms = number(rec.step_ms, f"{what}: step_ms", positive=True)
    k, b, m, B = rec.world_size, rec.local_batch, rec.accum_steps, rec.effective_batch
    if min(k, b, m) < 1 or B != k * b * m:
        raise PlanError(f"{what}: k={k}, b={b}, m={m} do not make B={B}")
    grad = int(number(rec.grad_nbytes, f"{what}: grad_nbytes", positive=True))
    if last.step < 1:
        raise PlanError(f"{path}: its last epoch record is at step {last.step}: the run trained nothing to plan from")
    run = log.run
    if run is not None:
        if (run.world_size, run.local_batch, run.accum_steps) != (k, b, m):
            raise PlanError(f"{path}: the run record (k={run.world_size}, b={run.local_batch}, m={run.accum_steps}) "
                            f"and epoch {rec.epoch} (k={k}, b={b}, m={m}) disagree: not one run's records")
        buckets = tuple(int(number(x, f"{path}: run record's bucket_nbytes", positive=True, whole=True))
                        for x in run.bucket_nbytes)
        if not buckets:
            raise PlanError(f"{path}: the run record lists no buckets")
        from_, overlap, device = "the run record", run.overlap, run.device
        shard = ShardRule(run.shard_optimizer, run.shard_min_bytes, run.device, run.grad_nbytes)
        spe = run.steps_per_epoch
        rules = Rules(number(run.lr, f"{path}: lr", positive=True), run.base_batch, run.lr_scaling, run.optimizer,
                      "the run record")
        per_node = run.ranks_per_node
    else:
        buckets, from_ = default_buckets(grad), "assumed: 1 MiB, then 25 MiB (schema 0 does not record them)"
        overlap, device = True, "cpu"
        notes.append("schema 0 (a file without run records): buckets, overlap and the device assumed")
        shard = ShardRule(None, SHARD_MIN_BYTES, device, grad)
        first = log.epochs[0]
        spe = first.steps if first.steps else first.step // max(1, first.epoch)
        config = rules_from_config(f"{path}.config.toml")
        rules = config or Rules()
        per_node = 1
    noise = noise_scale
    if noise is None:
        ns = last.noise_scale
        if ns is None or not math.isfinite(ns) or ns <= 0:
            why = "no noise_scale" if ns is None else f"noise_scale {ns!r}"
            raise PlanError(f"{path}: {why} in its last epoch record (a run at k = 1 needs --accum-steps >= 2 to "
                            "measure it); or pass --noise-scale")
        noise = ns
    other = max(0.0, step_ms - sum(times.values()))
    return Workload(
        source=where, name=os.path.basename(path), device=device, b=b, m=m, k=k,
        forward_ms=times["forward_ms"], backward_ms=times["backward_ms"], optimizer_ms=times["optimizer_ms"],
        other_ms=other, step_ms=step_ms, grad_nbytes=grad, bucket_nbytes=buckets, buckets_from=from_,
        overlap=overlap, check_in=True, shard=shard, noise_scale=noise, samples=last.step * B,
        steps_per_epoch=max(1, spe), train_loss=last.train_loss, memory_mib=rec.peak_rss_mib,
        ranks_per_node=per_node, notes=tuple(notes)), rules


# -- described by numbers ------------------------------------------------------------------------------
WORKLOAD_KEYS = {
    "name": "what it is", "source": "where its numbers come from",
    "device": "cpu or gpu", "batch_per_rank": "b, samples per micro-batch per rank",
    "accum_steps": "m, micro-batches per step (default 1)",
    "step_ms": "one rank's step alone at b, ms (or samples_per_s)", "samples_per_s": "one rank alone at b",
    "backward_share": "backward's share of forward + backward (default 2/3)",
    "optimizer_ms": "the update per step, ms (default 0)",
    "parameters": "parameter count (with dtype; or grad_nbytes)", "dtype": "float32 (default), float16, ...",
    "grad_nbytes": "bytes reduced per step", "bucket_nbytes": "bytes per bucket, in backward's order",
    "bucket_cap_mb": "buckets by DDP's rule: 1 MiB, then this (default 25)",
    "fusion_mb": "buckets of a fixed size (Horovod's tensor fusion)",
    "overlap": "reduction starts during backward (default true)",
    "shard_optimizer": "the update sharded (default false)", "noise_scale": "B_noise, samples",
    "target_samples": "samples to the target at the measured batch", "epoch_samples": "samples per epoch",
    "memory_mib": "per rank, peak",
}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def from_description(path: str) -> tuple[Workload, Rules]:
    """The workload a TOML file describes by numbers (WORKLOAD_KEYS; docs/plan.md)."""
    t = read_toml(path, "a workload description (docs/plan.md)")
    unknown = sorted(set(t) - set(WORKLOAD_KEYS) - {"lr", "base_batch", "lr_scaling", "optimizer", "published"})
    if unknown:
        raise PlanError(f"{path}: unknown key(s) {', '.join(unknown)}; it takes {', '.join(WORKLOAD_KEYS)}")
    device = t.get("device", "gpu")
    if device not in ("cpu", "gpu"):
        raise PlanError(f"{path}: device {device!r}: cpu or gpu")
    b = int(number(t.get("batch_per_rank"), f"{path}: batch_per_rank", positive=True, whole=True))
    m = int(number(t.get("accum_steps", 1), f"{path}: accum_steps", positive=True, whole=True))
    if ("step_ms" in t) == ("samples_per_s" in t):
        raise PlanError(f"{path}: give one of step_ms and samples_per_s (one rank alone, at batch_per_rank)")
    step_ms = number(t["step_ms"], f"{path}: step_ms", positive=True) if "step_ms" in t else \
        1e3 * b * m / number(t["samples_per_s"], f"{path}: samples_per_s", positive=True)
    share = number(t.get("backward_share", 2 / 3), f"{path}: backward_share")
    if not 0 <= share <= 1:
        raise PlanError(f"{path}: backward_share must be in [0, 1], got {share}")
    optimizer_ms = number(t.get("optimizer_ms", 0.0), f"{path}: optimizer_ms")
    compute = step_ms - optimizer_ms
    if compute <= 0:
        raise PlanError(f"{path}: optimizer_ms {optimizer_ms} leaves no forward and backward in step_ms {step_ms}")
    if "grad_nbytes" in t:
        grad = int(number(t["grad_nbytes"], f"{path}: grad_nbytes", positive=True, whole=True))
    else:
        dtype = t.get("dtype", "float32")
        if dtype not in ITEMSIZE:
            raise PlanError(f"{path}: dtype {dtype!r}: one of {', '.join(ITEMSIZE)}")
        grad = int(number(t.get("parameters"), f"{path}: parameters (or grad_nbytes)", positive=True, whole=True)) \
            * ITEMSIZE[dtype]
    if "bucket_nbytes" in t:
        raw = t["bucket_nbytes"]
        if not isinstance(raw, list) or not raw:
            raise PlanError(f"{path}: bucket_nbytes must be a list of byte counts")
        buckets = tuple(int(number(x, f"{path}: bucket_nbytes", positive=True, whole=True)) for x in raw)
        from_ = "the description"
    elif "fusion_mb" in t:
        size = _bucket_size(t, "fusion_mb", None, grad, path) * 2**20
        buckets = tuple(int(min(size, grad - i * size)) for i in range(math.ceil(grad / size)))
        from_ = f"fused buffers of {t['fusion_mb']} MiB"
    else:
        cap = _bucket_size(t, "bucket_cap_mb", 25.0, grad, path)
        buckets, from_ = default_buckets(grad, cap), f"DDP's rule: 1 MiB, then {cap:g} MiB"
    overlap, shard = t.get("overlap", True), t.get("shard_optimizer", False)
    if not isinstance(overlap, bool) or not isinstance(shard, bool):
        raise PlanError(f"{path}: overlap and shard_optimizer are true or false")
    noise = number(t["noise_scale"], f"{path}: noise_scale", positive=True) if "noise_scale" in t else None
    target = int(number(t["target_samples"], f"{path}: target_samples", positive=True)) if "target_samples" in t \
        else None
    spe = None
    if "epoch_samples" in t:
        spe = max(1, int(number(t["epoch_samples"], f"{path}: epoch_samples", positive=True)) // (b * m))
    memory = number(t["memory_mib"], f"{path}: memory_mib", positive=True) if "memory_mib" in t else None
    rules = Rules(number(t.get("lr", 0.1), f"{path}: lr", positive=True),
                  int(number(t.get("base_batch", 256), f"{path}: base_batch", positive=True, whole=True)),
                  str(t.get("lr_scaling", "linear")), str(t.get("optimizer", "sgd")), f"the description {path}")
    if rules.scaling not in ("linear", "sqrt", "none"):
        raise PlanError(f"{path}: lr_scaling {rules.scaling!r}: linear, sqrt or none")
    return Workload(
        source=path, name=str(t.get("name", os.path.basename(path))), device=device, b=b, m=m, k=1,
        forward_ms=compute * (1 - share), backward_ms=compute * share, optimizer_ms=optimizer_ms, other_ms=0.0,
        step_ms=step_ms, grad_nbytes=grad, bucket_nbytes=buckets, buckets_from=from_, overlap=overlap,
        check_in=False, shard=ShardRule(shard, SHARD_MIN_BYTES, device, grad), noise_scale=noise,
        samples=target, steps_per_epoch=spe, train_loss=None, memory_mib=memory, ranks_per_node=1,
        notes=(f"described by numbers: {t.get('source', path)}",)), rules
