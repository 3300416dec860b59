"""--timeline writes a Chrome trace per rank with forward, backward, bucket all-reduces and the step."""

from __future__ import annotations

import json

from conftest import run_mpi, small_tmpfs


def test_timeline_has_every_phase_per_rank(tmp_path):
    path = tmp_path / "trace"
    metrics = tmp_path / "m.jsonl"
    r = run_mpi(2, "-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "1024", "--hidden", "64,64",
                "--epochs", "1", "--bucket-mb", "0.01", "--timeline", str(path), "--metrics-file", str(metrics),
                timeout=120)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        names = {e["name"] for e in events}
        assert {"forward", "backward", "optimizer", "wait comm"} <= names
        buckets = {n for n in names if n.startswith("allreduce b")}
        assert len(buckets) >= 2, names  # the small cap made several buckets
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in events)
        # a bucket's all-reduce starts before backward ends (overlap), on the comm row
        first_bwd = next(e for e in events if e["name"] == "backward")
        first_ar = min((e for e in events if e["name"].startswith("allreduce")), key=lambda e: e["ts"])
        assert first_ar["tid"] == 1 and first_ar["ts"] < first_bwd["ts"] + first_bwd["dur"]
    epoch = json.loads(metrics.read_text().splitlines()[-1])
    assert epoch["bucket_algbw_gbps"] > 0 and epoch["bucket_busbw_gbps"] == epoch["bucket_algbw_gbps"]


def test_a_timeline_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    """A real full file system (a 64 KiB tmpfs; root needed): save raises OSError, nothing is left."""
    import pytest

    from mpisgd.timeline import Timeline

    small = tmp_path / "small"
    with small_tmpfs(small, "64k"):
        t = Timeline()
        for i in range(3000):
            with t.span(f"step {i}"):
                pass
        with pytest.raises(OSError, match="No space left"):
            t.save(str(small / "trace.rank0.json"))
        left = sorted(p.name for p in small.iterdir())
    assert left == []


def test_metrics_on_a_full_disk_warn_once_and_the_run_goes_on(capsys):
    """/dev/full answers every write with ENOSPC: one warning, later writes are dropped, close is clean."""
    from mpisgd.app.metrics import MetricsWriter
    from mpisgd.app.records import StepRecord

    m = MetricsWriter("/dev/full")
    for i in range(5):
        m.write(StepRecord(step=i, epoch=1, lr=0.1, loss=1.0, step_ms=1.0))
    m.close()
    out = capsys.readouterr().out
    assert out.count("warning: --metrics-file /dev/full: write failed (No space left on device); no more metrics") \
        == 1, out
    assert m.failed == "No space left on device"
