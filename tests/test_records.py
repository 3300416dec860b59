"""Records as fields (issue 33): the metrics file's typed records, written and read back by name; its
versioned schema and the doc that lists every field; the epoch's ranks' timings reduced by field name;
what the report prints from a record."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from conftest import ROOT, TINY, run_mpi, serial_only, train_here

from mpisgd.app.metrics import MetricsError, MetricsWriter, read_metrics
from mpisgd.app.records import SCHEMA, EpochRecord, RecordError, RunRecord, StepRecord, TestRecord, from_json, to_json
from mpisgd.app.report import buckets_line, format_epoch

KINDS = (RunRecord, StepRecord, EpochRecord, TestRecord)


def epoch(**over) -> EpochRecord:
    values = dict(epoch=3, step=30, lr=0.05, train_loss=0.5, samples_per_s=1234.0, comm_frac=0.25, comm_exposed_ms=1.0,
                  comm_total_ms=2.0, forward_ms=3.0, backward_ms=4.0, optimizer_ms=0.5, step_ms=9.0, epoch_time_s=0.3,
                  skipped_steps=0, world_size=2, effective_batch=64, local_batch=32, accum_steps=1, grad_nbytes=400,
                  bucket_algbw_gbps=1.5, bucket_busbw_gbps=1.5, peak_rss_mib=90.0, rss_start_mib=50.0, state_mib=2.0)
    values.update(over)
    return EpochRecord(**values)


def test_every_record_round_trips_through_json_by_name():
    step = StepRecord(step=7, epoch=1, lr=0.1, loss=2.0, step_ms=3.5, grad_norm=0.25)
    ep = epoch(val_loss=0.6, val_acc=0.8, noise_scale=321.0, wait_caused_ms=(1.0, 2.0), slowest_rank=1)
    test = TestRecord(step=30, test_acc=0.9, test_loss=0.3)
    for rec in (step, ep, test):
        text = json.dumps(to_json(rec))
        back = from_json(json.loads(text))
        assert back == rec and json.loads(text)["kind"] == rec.kind
    assert "test_acc" not in to_json(ep)  # None: left out
    assert "grad_norm" not in to_json(StepRecord(1, 1, 0.1, 1.0, 1.0))
    assert from_json({"kind": "a later kind", "x": 1}) is None  # ignored, not an error
    assert from_json({**to_json(test), "new_field": 5}) == test  # fields a later version adds: ignored


def test_a_missing_or_mistyped_field_is_named():
    obj = to_json(epoch())
    del obj["step_ms"]
    with pytest.raises(RecordError, match="without step_ms"):
        from_json(obj)
    with pytest.raises(RecordError, match="step record's step is 'seven', not a whole number"):
        from_json({"kind": "step", "step": "seven", "epoch": 1, "lr": 0.1, "loss": 1.0, "step_ms": 1.0})
    with pytest.raises(RecordError, match="is True, not a whole number"):
        from_json({"kind": "step", "step": True, "epoch": 1, "lr": 0.1, "loss": 1.0, "step_ms": 1.0})


def test_non_finite_floats_are_written_as_null_and_read_as_nan_or_none(tmp_path):
    path = tmp_path / "m.jsonl"
    w = MetricsWriter(str(path))
    w.write(epoch(train_loss=float("nan"), noise_scale=float("inf")))
    w.close()
    line = path.read_text()
    assert "NaN" not in line and "Infinity" not in line and json.loads(line)["noise_scale"] is None
    (log,) = read_metrics(str(path))
    assert np.isnan(log.epochs[0].train_loss) and log.epochs[0].noise_scale is None


def _run(**over) -> RunRecord:
    values = {f.name: 1 for f in dataclasses.fields(RunRecord) if f.default is dataclasses.MISSING}
    values.update(schema=SCHEMA, started="t", version="v", device="cpu", model="mlp", dtype="float32",
                  bucket_nbytes=(4,), bucket_cap_mb=25.0, overlap=True, allreduce="auto", allreduce_plan="x",
                  reproducible=False, sharded=False, optimizer="sgd", lr=0.1, lr_scaling="linear", peak_lr=0.1)
    values.update(over)
    return RunRecord(**values)


def test_runs_are_split_at_run_records_and_schema_0_files_where_steps_restart(tmp_path):
    path = tmp_path / "m.jsonl"
    w = MetricsWriter(str(path))
    for rec in (_run(local_batch=8), StepRecord(1, 1, 0.1, 1.0, 1.0), epoch(step=1), _run(local_batch=16),
                StepRecord(1, 1, 0.1, 1.0, 1.0), StepRecord(2, 1, 0.1, 1.0, 1.0)):
        w.write(rec)
    w.close()
    runs = read_metrics(str(path))
    assert [r.run.local_batch for r in runs if r.run] == [8, 16] and [len(r.steps) for r in runs] == [1, 2]
    assert [r.first_line for r in runs] == [1, 4] and runs[0].epochs and not runs[1].epochs
    old = tmp_path / "old.jsonl"  # schema 0: epoch and step records only, a second run appended
    old.write_text("\n".join(json.dumps(to_json(r)) for r in (
        StepRecord(1, 1, 0.1, 1.0, 1.0), StepRecord(2, 1, 0.1, 1.0, 1.0), epoch(step=2),
        StepRecord(1, 1, 0.1, 1.0, 1.0), epoch(step=1))) + "\n")
    runs = read_metrics(str(old))
    assert len(runs) == 2 and all(r.run is None and r.schema == 0 for r in runs)
    assert [len(r.steps) for r in runs] == [2, 1] and runs[1].first_line == 4


def test_unknown_schema_and_what_is_not_a_metrics_file_are_one_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({**to_json(_run()), "schema": 2}) + "\n")
    with pytest.raises(MetricsError, match=r"line 1: metrics schema 2; this mpisgd reads schema 0, 1 \(docs/metrics"):
        read_metrics(str(path))
    path.write_text("epoch 1/2 loss 0.5\n")
    with pytest.raises(MetricsError, match="line 1 is not JSON"):
        read_metrics(str(path))
    path.write_bytes(b"\x93NUMPY\x01\x00\xff\xfe")
    with pytest.raises(MetricsError, match="is not text"):
        read_metrics(str(path))
    with pytest.raises(MetricsError, match="not a regular file"):
        read_metrics(str(tmp_path))


def test_the_schema_doc_lists_every_field_of_every_record():
    """docs/metrics.md has a table per record kind, one row per field (with its unit), and says the version:
    a field added to a record without its line in the doc fails here."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert f"schema {SCHEMA}" in doc and "(metrics.md)" in (ROOT / "docs" / "api.md").read_text()
    for cls in KINDS:
        section = doc.split(f'`"kind": "{cls.kind}"`', 1)
        assert len(section) == 2, f"no section for {cls.kind} records"
        table = section[1].split("\n\n|", 1)[-1].split("\n\n", 1)[0]
        documented = set(re.findall(r"^\| `(\w+)` \|", "|" + table, re.M))
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields == documented, (cls.kind, fields ^ documented)


def test_the_epoch_line_is_read_from_the_records_fields():
    line = format_epoch(epoch(val_loss=0.625, val_acc=0.75, test_acc=0.5, noise_scale=321.4), 12)
    assert line.startswith("epoch   3/12  loss 0.5000  val_loss 0.6250  val_acc 0.7500  test_acc 0.5000")
    assert "samples/s     1234" in line and "waiting for comm 25.0%" in line and "noise scale 321" in line
    assert "noise scale" not in format_epoch(epoch(), 12) and "val_" not in format_epoch(epoch(), 12)


def test_the_buckets_line_says_what_backward_hid_and_never_a_part_larger_than_its_whole():
    """Overlapped: the wait after backward as a part of the buckets' time in flight; a wait longer than that
    (it holds starting buckets and bookkeeping) is not given as a part. Without overlap (F8): nothing is
    hidden, the wait after backward is the step's time for the all-reduce."""
    assert buckets_line(epoch(comm_exposed_ms=0.1, comm_total_ms=0.25), overlap=True) == (
        "gradient buckets: busbw 1.50 GB/s (start to completion, overlapped with backward), 0.10 of 0.25 ms/step "
        "not hidden by backward")
    assert buckets_line(epoch(comm_exposed_ms=0.29, comm_total_ms=0.26), overlap=True) == (
        "gradient buckets: busbw 1.50 GB/s (start to completion, overlapped with backward), 0.26 ms/step in "
        "flight, 0.29 ms/step waited for after backward (the wait includes its bookkeeping)")
    assert buckets_line(epoch(bucket_busbw_gbps=0.00123), overlap=False).startswith(
        "gradient buckets: busbw 1.23 MB/s (start to completion)")  # a tiny model's: it read 0.00 GB/s
    for exposed, total in ((0.29, 0.26), (0.1, 0.25)):
        assert buckets_line(epoch(comm_exposed_ms=exposed, comm_total_ms=total), overlap=False) == (
            f"gradient buckets: busbw 1.50 GB/s (start to completion), {exposed:.2f} ms/step waited for after "
            "backward (--no-overlap: nothing hidden)")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [True, False])
def test_the_closing_buckets_line_agrees_with_the_banner(overlap):
    r = train_here([*TINY, "--max-steps", "4", *(() if overlap else ("--no-overlap",))])
    assert r.status == 0, r
    lines = r.out.splitlines()
    banner = next(x for x in lines if x.startswith("all-reduce: "))
    line = next(x for x in lines if x.startswith("gradient buckets: "))
    if overlap:
        assert banner.endswith(", overlapped with backward") and "overlapped with backward)" in line, (banner, line)
        part = re.search(r"([\d.]+) of ([\d.]+) ms/step not hidden by backward$", line)
        assert part is None or float(part[1]) <= float(part[2]), line
    else:
        assert banner.endswith(", after backward"), banner
        assert re.fullmatch(r"gradient buckets: busbw [\d.e+-]+ [GM]B/s \(start to completion\), [\d.]+ ms/step waited "
                            r"for after backward \(--no-overlap: nothing hidden\)", line), line


@pytest.mark.mpi(min_size=2)
def test_epoch_timings_are_averaged_over_ranks_by_field_name():
    """Trainer's reduction of the ranks' StepStats: one Allreduce, each field's mean under its own name. The
    negative control: rank 1 swaps two of its values, and exactly those two means move (an array read by
    position would not notice which is which)."""
    from mpi4py import MPI

    from mpisgd.app.trainer import mean_over_ranks
    from mpisgd.parallel.data_parallel import StepStats

    comm = MPI.COMM_WORLD
    rank, k = comm.Get_rank(), comm.Get_size()
    numeric = [f.name for f in dataclasses.fields(StepStats) if type(getattr(StepStats(), f.name)) in (int, float)]
    local = StepStats(**{name: (i + 1) * (rank + 1) if type(getattr(StepStats(), name)) is int
                         else (i + 1) * (rank + 1) + 0.5 for i, name in enumerate(numeric)})
    local.small_sq = np.float64(local.small_sq)  # DataParallel's norms are NumPy scalars: reduced all the same
    local.arrived_check_in.append(float(rank))
    mean, extra = mean_over_ranks(comm, local, {"loss_sum": float(rank), "another": 2.0})
    scale = sum(r + 1 for r in range(k)) / k
    for i, name in enumerate(numeric):
        want = (i + 1) * scale + (0 if type(getattr(StepStats(), name)) is int else 0.5)
        assert getattr(mean, name) == pytest.approx(want, abs=0.5), name
        assert type(getattr(mean, name)) is type(getattr(StepStats(), name)), name
    assert extra == {"loss_sum": pytest.approx((k - 1) / 2), "another": pytest.approx(2.0)}
    assert mean.arrived_check_in == [float(rank)]  # lists stay this rank's
    a, b = "forward_s", "backward_s"
    swapped = dataclasses.replace(local, **({a: local.backward_s, b: local.forward_s} if rank == 1 else {}))
    moved, _ = mean_over_ranks(comm, swapped, {})
    changed = {n for n in numeric if getattr(moved, n) != getattr(mean, n)}
    assert changed == {a, b}


@serial_only
def test_a_runs_metrics_file_starts_with_what_the_run_is(tmp_path):
    """The trainer's own file: a run record first (this schema, the bucket bytes adding up to the gradient,
    overlap, the sharding it ran, the rate), then step and epoch records that read back as records; a
    second run appended to the file is a second run. --no-overlap and --reproducible are fields too (the
    reproducible buckets hold int64 integers: twice the float32 gradient's bytes)."""
    path = tmp_path / "m.jsonl"
    base = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "512", "--hidden", "16",
            "--batch-size", "32", "--epochs", "1", "--progress", "off", "--metrics-file", str(path)]
    r = run_mpi(2, *base, "--optimizer", "adamw", "--lr", "0.003", timeout=120)
    assert r.returncode == 0, r.stderr
    r = run_mpi(2, *base, "--no-overlap", "--reproducible", timeout=120)
    assert r.returncode == 0, r.stderr
    first = json.loads(path.read_text().splitlines()[0])
    assert first["kind"] == "run" and first["schema"] == SCHEMA
    runs = read_metrics(str(path))
    assert len(runs) == 2
    one, two = runs[0], runs[1]
    assert one.run is not None and two.run is not None
    assert (one.run.world_size, one.run.local_batch, one.run.accum_steps, one.run.effective_batch) == (2, 32, 1, 64)
    assert sum(one.run.bucket_nbytes) == one.run.grad_nbytes == 4 * one.run.parameters
    assert one.run.overlap and not two.run.overlap and two.run.reproducible
    assert sum(two.run.bucket_nbytes) == 2 * two.run.grad_nbytes  # int64 integers
    assert (one.run.optimizer, one.run.lr, one.run.peak_lr) == ("adamw", 0.003, pytest.approx(0.003 * 64 / 256))
    assert not one.run.sharded and one.run.device == "cpu" and one.run.ranks_per_node == 2
    assert len(one.steps) == one.run.total_steps == one.epochs[-1].step and one.epochs[-1].steps == len(one.steps)
    assert one.epochs[-1].world_size == 2 and one.epochs[-1].step_ms > 0
