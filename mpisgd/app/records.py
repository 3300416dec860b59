"""The metrics file's records as types: one run record, a step record per step, an epoch record per epoch,
a test record (docs/metrics.md describes every field, its unit and which records carry it).

A run appends to its ``--metrics-file``, in order: a :class:`RunRecord` (``"kind": "run"``, with the
schema version and what the run is: batch, buckets, overlap, sharding, optimizer, rate), a
:class:`StepRecord` per step, an :class:`EpochRecord` per epoch and, with --val-split, one
:class:`TestRecord`. The records after a run record belong to that run, so a file two runs appended to
reads as two runs. The report, the plots, TensorBoard and the planner read these fields by name; nothing
reads the banner's words.

On disk each record is one JSON object: its fields by name plus ``"kind"``; a field that is None (not
measured, does not apply) is left out, and a non-finite float is written as null (JSON has no NaN). A
reader ignores fields it does not know (added within a schema version); a change that removes a field
or changes its meaning or unit raises :data:`SCHEMA`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

SCHEMA = 1  # the layout below; files of the previous round carry no run record and no version (schema 0)
READABLE = (0, 1)  # the versions read_record understands (0: epoch and step records of the previous round)


class RecordError(ValueError):
    """A record that lacks a field, or holds one of the wrong type: the message names it."""


@dataclass(frozen=True)
class RunRecord:
    """What the run is, written once at its start (before any step)."""

    kind: ClassVar[str] = "run"
    schema: int  # the layout's version: SCHEMA when written
    started: str  # when the run started, ISO 8601 UTC (seconds)
    version: str  # the mpisgd version that wrote it
    world_size: int  # k, ranks
    nodes: int  # nodes the ranks ran on
    ranks_per_node: int  # the most ranks on one node
    device: str  # cpu or gpu
    threads: int  # BLAS threads per rank (CPU)
    model: str  # --model
    dtype: str  # parameter dtype
    parameters: int  # parameter count
    grad_nbytes: int  # bytes of the gradient (the parameters' count times their itemsize)
    bucket_nbytes: tuple[int, ...]  # bytes of each bucket, in the order backward completes them (= reduced)
    bucket_cap_mb: float  # --bucket-cap-mb, MiB
    overlap: bool  # buckets start their reduction during backward (--overlap)
    allreduce: str  # the --allreduce strategy asked (auto, mpi, ring, shared, deterministic, nccl)
    allreduce_plan: str  # what runs, in words, for people (never read by a program)
    reproducible: bool  # --reproducible: int64 fixed-point sums (bucket_nbytes count the integers)
    sharded: bool  # this run's update is sharded (reduce-scatter, 1/k of the update, all-gather)
    shard_min_bytes: int  # parameter bytes from which the default shards at k >= 2 on host buffers
    optimizer: str  # --optimizer: sgd, lars, adamw, lamb
    optimizer_state_nbytes: int  # bytes of the optimizer's parameter-sized state (whole model)
    lr: float  # --lr, eta0: the rate for a batch of base_batch
    base_batch: int  # --base-batch, B0 of lr, samples
    lr_scaling: str  # --lr-scaling: linear, sqrt, none
    peak_lr: float  # the rate after scaling to B (before decay)
    warmup_steps: int  # steps of warmup
    local_batch: int  # b, samples per micro-batch per rank
    accum_steps: int  # m, micro-batches per step
    effective_batch: int  # B = k*b*m, samples per step
    steps_per_epoch: int  # optimizer steps per epoch
    total_steps: int  # optimizer steps of the whole run
    train_samples: int  # training samples per epoch
    noise_scale_every: int  # --noise-scale-every: measure the noise scale every N steps (0: never)
    shard_optimizer: bool | None = None  # --shard-optimizer as given (None: the default policy)
    resumed_from_step: int | None = None  # the checkpoint's step a resumed run continues from


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step (rank 0's view)."""

    kind: ClassVar[str] = "step"
    step: int  # optimizer steps done, this one included, counted over the whole run
    epoch: int  # the epoch it belongs to, from 1
    lr: float  # the learning rate it used
    loss: float  # rank 0's mean loss over its micro-batches
    step_ms: float  # rank 0's wall time of the step, ms
    grad_norm: float | None = None  # the averaged gradient's L2 norm, where the step computed it


@dataclass(frozen=True)
class EpochRecord:
    """One epoch's end: losses and scores, speed, where the time went (the ranks' mean), memory, the
    noise scale and the straggler report where measured."""

    kind: ClassVar[str] = "epoch"
    epoch: int  # the epoch, from 1
    step: int  # optimizer steps done at its end
    lr: float  # the rate of its last step
    train_loss: float  # mean training loss over its steps (the ranks' mean)
    samples_per_s: float  # B times its steps over its wall time
    comm_frac: float  # the share of the epoch's wall time spent waiting for communication
    comm_exposed_ms: float  # per step: time the step waited for communication, ms
    comm_total_ms: float  # per step: buckets' reduction from start to observed completion, ms
    forward_ms: float  # per step: forward passes (all m micro-batches), ms
    backward_ms: float  # per step: backward passes, ms
    optimizer_ms: float  # per step: the update, ms
    step_ms: float  # per step: wall time, ms
    epoch_time_s: float  # the epoch's wall time, s
    skipped_steps: int  # steps skipped so far for a non-finite gradient (--on-nan skip)
    world_size: int  # k
    effective_batch: int  # B
    local_batch: int  # b
    accum_steps: int  # m
    grad_nbytes: int  # bytes of the gradient
    bucket_algbw_gbps: float  # bytes reduced / reduction time, GB/s (nccl-tests' algbw)
    bucket_busbw_gbps: float  # algbw * 2(k-1)/k, GB/s (nccl-tests' busbw)
    peak_rss_mib: float  # the largest rank's peak resident memory, MiB
    rss_start_mib: float  # ... of it at start-up, before any data, MiB
    state_mib: float  # ... of it held for training (parameters, gradients, optimizer, activations, data), MiB
    steps: int | None = None  # steps this epoch ran (fewer than steps_per_epoch at --max-steps or a resume)
    val_loss: float | None = None  # validation loss (--val-split)
    val_acc: float | None = None  # validation accuracy (--val-split)
    test_acc: float | None = None  # test accuracy (without --val-split, or with --test-every-epoch)
    noise_scale: float | None = None  # gradient noise scale B_simple, samples (null: not finite)
    grad_sqr: float | None = None  # |G|^2 estimated, the true gradient's squared norm
    grad_var: float | None = None  # tr(Sigma) estimated, per-sample gradient variance summed over parameters
    noise_steps: int | None = None  # steps whose gradient norms the estimate used
    wait_caused_ms: tuple[float, ...] | None = None  # per rank: the others' mean wait for it per step, ms
    lag_ms: tuple[float, ...] | None = None  # per rank: how late it arrived at the step's sync points, ms
    rank_step_ms: tuple[float, ...] | None = None  # per rank: its step time, check-in to check-in, ms
    slowest_rank: int | None = None  # the rank the others waited for most
    slowest_wait_ms: float | None = None  # how long they waited for it per step, ms
    slowest_share: float | None = None  # that wait as a share of the step
    tokens_per_s: float | None = None  # a language model: samples_per_s times the context, tokens per second
    train_bits_per_token: float | None = None  # a language model: train_loss / ln 2, bits per token (or char)
    val_bits_per_token: float | None = None  # a language model: val_loss / ln 2, bits per token (or char)


@dataclass(frozen=True)
class TestRecord:
    """With --val-split: the test set, scored once after training."""

    __test__ = False  # not a pytest test class, whatever its name
    kind: ClassVar[str] = "test"
    step: int  # optimizer steps done
    test_acc: float  # test accuracy
    test_loss: float  # test loss
    test_bits_per_token: float | None = None  # a language model: test_loss / ln 2, bits per token (or char)


Record = RunRecord | StepRecord | EpochRecord | TestRecord
KINDS: dict[str, Any] = {c.kind: c for c in (RunRecord, StepRecord, EpochRecord, TestRecord)}


def to_json(record: Record) -> dict[str, Any]:
    """The record as the JSON object a metrics file holds: ``kind`` and every field that is not None
    (tuples as lists; non-finite floats are the writer's to turn into null)."""
    out: dict[str, Any] = {"kind": record.kind}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if value is not None:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The fields' types, resolved once per record class (resolving them per record made reading a
    metrics file of 2,000 records take 2.5 s)."""
    return typing.get_type_hints(cls)


def _base(hint: Any) -> tuple[Any, bool]:
    """(the type a field holds, whether None is allowed)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def _convert(value: Any, hint: Any, name: str) -> Any:
    base, optional = _base(hint)
    if value is None:
        if base is float:
            return None if optional else math.nan  # a non-finite float is written as null
        if optional:
            return None
        raise RecordError(f"{name} is null")
    if base is bool:
        if not isinstance(value, bool):
            raise RecordError(f"{name} is {value!r}, not true or false")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"{name} is {value!r}, not a whole number")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecordError(f"{name} is {value!r}, not a number")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise RecordError(f"{name} is {value!r}, not a string")
        return value
    if typing.get_origin(base) is tuple:
        item = typing.get_args(base)[0]
        if not isinstance(value, list):
            raise RecordError(f"{name} is {value!r}, not a list")
        return tuple(_convert(v, item, f"{name}[{i}]") for i, v in enumerate(value))
    raise AssertionError(f"no conversion for {name}: {hint}")  # a field type this module does not use


def from_json(obj: dict[str, Any]) -> Record | None:
    """The typed record of a metrics file's JSON object; None for a kind this version does not know.
    RecordError names the first field that is missing or of the wrong type."""
    cls = KINDS.get(obj.get("kind", "epoch"))  # schema 0's epoch records did not all say their kind
    if cls is None:
        return None
    values = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if f.name not in obj:
            if f.default is dataclasses.MISSING:
                raise RecordError(f"{'an' if cls.kind[0] in 'aeiou' else 'a'} {cls.kind} record without {f.name}")
            continue
        values[f.name] = _convert(obj[f.name], hint, f"{cls.kind} record's {f.name}")
    return typing.cast(Record, cls(**values))
