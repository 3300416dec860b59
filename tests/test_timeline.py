"""--timeline writes a Chrome trace per rank with forward, backward, bucket all-reduces and the step."""

from __future__ import annotations

import json

from conftest import run_mpi


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
