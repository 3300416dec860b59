"""The plot CLI (lr schedule, training curves) and the large-batch benchmark's writer and smoke run."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ONE_THREAD, ROOT

from mpisgd.plot import main, schedule_for

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def clean_env() -> dict[str, str]:
    """This environment without the MPI launcher's variables: when pytest itself runs under mpiexec,
    a child that imports mpisgd (hence mpi4py.MPI) would otherwise try the parent's PMI connection."""
    launcher = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD", "MPIR_CVAR_")
    return {k: v for k, v in os.environ.items() if not k.startswith(launcher)} | ONE_THREAD


def is_png(path: Path) -> bool:
    return path.exists() and path.read_bytes()[:8] == PNG


def test_lr_plot_of_a_training_command(tmp_path):
    out = tmp_path / "lr.png"
    argv = ["lr", "--ranks", "2", "--out", str(out), "--batch-size", "512", "--accum-steps", "4",
            "--warmup-epochs", "1", "--epochs", "5"]
    assert main(argv) == 0 and is_png(out)


def test_lr_schedule_is_the_trainers():
    from mpisgd.config import parse_config

    cfg = parse_config(["--batch-size", "512", "--accum-steps", "4", "--warmup-epochs", "1", "--epochs", "5"])
    sched, spe = schedule_for(cfg, ranks=2)
    assert spe == 60000 // 4096 and sched.total_steps == 5 * spe
    assert sched.peak_lr == pytest.approx(0.1 * 4096 / 256) and sched.warmup_steps == spe


@pytest.mark.parametrize("argv", [["lr", "--warmup-epochs", "9", "--epochs", "2"], ["lr", "--base-batch", "0"],
                                  ["lr", "--ranks", "0"], ["lr", "--no-such-flag"]])
def test_lr_plot_bad_input_exits_2(tmp_path, argv, capsys):
    assert main([*argv, "--out", str(tmp_path / "x.png")]) == 2
    assert "error" in capsys.readouterr().err


def test_curves_from_metrics_files(tmp_path):
    paths = []
    for name, scale in (("a", 1.0), ("b", 2.0)):
        p = tmp_path / f"{name}.jsonl"
        recs = [{"kind": "step", "step": s, "epoch": 1 + s // 10, "lr": 0.1, "loss": scale / s} for s in range(1, 21)]
        recs += [{"kind": "epoch", "epoch": e, "step": 10 * e, "lr": 0.1, "train_loss": 0.5, "test_acc": 0.8 + e / 100}
                 for e in (1, 2)]
        p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        paths.append(str(p))
    out = tmp_path / "curves.png"
    assert main(["curves", *paths, "--labels", "a,b", "--out", str(out)]) == 0 and is_png(out)
    assert main(["curves", *paths, "--labels", "only-one", "--out", str(out)]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["curves", str(empty), "--out", str(out)]) == 2


def test_plot_cli_as_module(tmp_path):
    out = tmp_path / "lr.png"
    r = subprocess.run([sys.executable, "-m", "mpisgd.plot", "lr", "--out", str(out), "--epochs", "2"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert is_png(out)


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import large_batch
    finally:
        sys.path.pop(0)
    return large_batch


def test_split_batch_keeps_micro_batch_bounded():
    lb = _bench()
    assert lb.split_batch(64, 2, 512) == (32, 1)
    assert lb.split_batch(8192, 2, 512) == (512, 8)
    with pytest.raises(ValueError):
        lb.split_batch(63, 2, 512)


def test_report_writer(tmp_path):
    lb = _bench()
    recs = [{"batch": B, "recipe": r, "ranks": 2, "micro_batch": min(B // 2, 512), "accum_steps": max(1, B // 1024),
             "command": f"cmd {B} {r}", "epochs_budget": 2, "epochs_done": 0 if div else 2,
             "test_acc": [] if div else [0.8, 0.85], "steps": 10, "diverged": div,
             "diverged_at_step": 3 if div else None, "wall_s": 1.0}
            for B in (64, 2048) for r, div in (("none", False), ("linear", B == 2048))]
    lb.write_report(recs, tmp_path, "test")
    table = (tmp_path / "large_batch.md").read_text()
    assert "| 2048 | linear | 2x512x2 | 90.0 | 90.0 | 0/2 | 3 | 1.0 | diverged at step 3 |" in table
    assert "| 64 | none | 2x32x1 | 15.0 | 15.0 | 2/2 |" in table
    assert is_png(tmp_path / "large_batch.png") and (tmp_path / "large_batch.csv").exists()


def test_benchmark_quick_smoke_run(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/large_batch.py", "--quick", "--batches", "64,1024",
                        "--recipes", "none,linear+warmup", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr + r.stdout
    data = json.loads((tmp_path / "large_batch.json").read_text())
    assert {(x["batch"], x["recipe"]) for x in data["runs"]} == {(64, "none"), (64, "linear+warmup"),
                                                                  (1024, "none"), (1024, "linear+warmup")}
    assert all(len(x["test_acc"]) == 2 for x in data["runs"])
    assert is_png(tmp_path / "large_batch.png")
    again = subprocess.run([sys.executable, "benchmarks/large_batch.py", "--quick", "--batches", "64",
                            "--recipes", "none", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert "skipped" in again.stdout  # finished points are not rerun


def test_throughput_ratios_are_paired_within_a_repeat():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_throughput as tt
    finally:
        sys.path.pop(0)

    def run(impl, rep, sps, step):
        return {"impl": impl, "repeat": rep, "samples_per_s": sps, "step_ms": step}

    runs = {"mpisgd k=1": [run("mpisgd k=1", 0, 100, 10.0), run("mpisgd k=1", 1, 50, 20.0)],
            "mpisgd k=2": [run("mpisgd k=2", 0, 170, 12.0), run("mpisgd k=2", 1, 90, 22.0)],
            "numpy-loop-1t": [run("numpy-loop-1t", 1, 55, 19.0)],  # repeat 0 failed: left out
            "torch-ddp-gloo": [run("torch-ddp-gloo", 0, 100, 30.0), run("torch-ddp-gloo", 1, 60, 40.0)]}
    ratios = tt.paired_ratios(runs, 2)
    assert ratios["efficiency k=2 (>= 0.85)"] == pytest.approx([0.85, 0.9])
    assert ratios["k=1 step / numpy-loop-1t step (<= 1.05)"] == pytest.approx([20.0 / 19.0])
    assert ratios["k=2 / PyTorch DDP gloo k=2 (>= 1.6)"] == pytest.approx([1.7, 1.5])
    assert not any("2 BLAS threads" in label or "sharded" in label for label in ratios)  # no such runs
    runs["mpisgd k=2 sharded"] = [run("mpisgd k=2 sharded", 0, 120, 0), run("mpisgd k=2 sharded", 1, 126, 0)]
    ratios = tt.paired_ratios(runs, 2)
    assert ratios["efficiency k=2 sharded (>= 0.85)"] == pytest.approx([0.6, 1.26])
    assert ratios["k=2 sharded / k=2"] == pytest.approx([120 / 170, 126 / 90])
    assert not any("apart" in label for label in ratios)
    runs["mpisgd k=2 apart"] = [run("mpisgd k=2 apart", 1, 88, 0)]  # repeat 0 missing: paired on repeat 1 only
    ratios = tt.paired_ratios(runs, 2)
    assert ratios["ceiling: k=2 apart / (2 x k=1)"] == pytest.approx([0.88])
    assert ratios["k=2 / k=2 apart"] == pytest.approx([90 / 88])
    assert ratios["k=2 sharded / k=2 apart"] == pytest.approx([126 / 88])
    # --variant launches: each against plain mpisgd, or the sharded one when its options shard
    runs["mpisgd k=2 private"] = [dict(run("mpisgd k=2 private", 1, 100, 0), options="--no-shared-grads")]
    runs["mpisgd k=2 private sh"] = [dict(run("mpisgd k=2 private sh", 0, 60, 0),
                                          options="--no-shared-grads --shard-optimizer")]
    ratios = tt.paired_ratios(runs, 2)
    assert ratios["k=2 private / k=2"] == pytest.approx([100 / 90])
    assert ratios["k=2 private sh / k=2 sharded"] == pytest.approx([60 / 120])
    # on a GPU: the CuPy loop and DDP over NCCL are the comparisons
    gpu = {"mpisgd k=1": runs["mpisgd k=1"], "mpisgd k=2": runs["mpisgd k=2"],
           "cupy-loop": [run("cupy-loop", 0, 120, 8.0)], "torch-ddp-nccl": [run("torch-ddp-nccl", 0, 85, 9.0)]}
    ratios = tt.paired_ratios(gpu, 2)
    assert ratios["k=1 step / cupy-loop step (<= 1.05)"] == pytest.approx([10.0 / 8.0])
    assert ratios["k=2 / PyTorch DDP nccl k=2 (>= 1.6)"] == pytest.approx([2.0])


def test_median_interval_covers_the_median_and_narrows_with_repeats():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_throughput as tt
    finally:
        sys.path.pop(0)
    assert tt.median_ci([0.8] * 5) == (0.8, 0.8)
    rng = np.random.default_rng(1)
    few, many = list(rng.normal(0.85, 0.05, 6)), list(rng.normal(0.85, 0.05, 60))
    lo6, hi6 = tt.median_ci(few)
    lo60, hi60 = tt.median_ci(many)
    assert lo6 <= float(np.median(few)) <= hi6 and lo60 <= float(np.median(many)) <= hi60
    assert min(few) <= lo6 < hi6 <= max(few)
    assert hi60 - lo60 < hi6 - lo6  # ten times the repeats: a narrower interval
    assert lo60 < 0.85 < hi60


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="dataset-fashion-mnist absent")
def test_throughput_benchmark_smoke_run(tmp_path):
    """The comparison script end to end, small: interleaved launches, the table, the paired ratios."""
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--repeats", "2", "--compare",
                        "--baselines", "numpy-1t", "--sharded", "--apart", "--variant", "private=--no-shared-grads",
                        "--json", str(out), "--", "--hidden", "32", "--limit-train", "8192"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr + r.stdout
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"mpisgd k=1", "mpisgd k=2", "mpisgd k=2 sharded", "mpisgd k=2 apart",
                                    "mpisgd k=2 private", "numpy-loop-1t"}
    assert len(data["ratios"]["k=2 private / k=2"]) == 2
    # the ceiling pairs each apart launch (two ranks' samples/s summed) with the k=1 launch of its repeat; no
    # bound on the value itself: epochs this small last a fraction of a second, so timing noise rules them
    apart = data["runs"]["mpisgd k=2 apart"]
    one = {x["repeat"]: x["samples_per_s"] for x in data["runs"]["mpisgd k=1"]}
    assert [x["repeat"] for x in apart] == [0, 1] and all(x["samples_per_s"] > 0 for x in apart)
    assert data["ratios"]["ceiling: k=2 apart / (2 x k=1)"] == pytest.approx(
        [x["samples_per_s"] / (2 * one[x["repeat"]]) for x in apart])
    lo, hi = data["ratio_ci95"]["k=2 / k=2 apart"]
    assert lo <= statistics.median(data["ratios"]["k=2 / k=2 apart"]) <= hi
    assert len(data["ratios"]["k=2 sharded / k=2"]) == 2
    assert [x["repeat"] for x in data["runs"]["mpisgd k=2"]] == [0, 1]
    assert len(data["ratios"]["efficiency k=2 (>= 0.85)"]) == 2
    assert all(v > 0 for v in data["ratios"]["k=1 step / numpy-loop-1t step (<= 1.05)"])
    assert "the speed issue's ratios" in r.stdout and "torch" not in r.stdout  # DDP not asked for


def test_step_skew_reports_what_each_step_waits_for_its_straggler(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_skew
    finally:
        sys.path.pop(0)
    assert step_skew.straggler_ms([[10.0, 12.0, 11.0], [14.0, 12.0, 11.0]]) == [2.0, 0.0, 0.0]

    def timeline(path, works):
        events = []
        for w in works:  # forward a third of the work, backward the rest
            events += [{"name": "forward", "ph": "X", "ts": 0, "dur": w * 1e3 / 3},
                       {"name": "backward", "ph": "X", "ts": 0, "dur": w * 2e3 / 3}]
        path.write_text(json.dumps({"traceEvents": [{"name": "process_name", "ph": "M"}, *events]}))

    timeline(tmp_path / "t.json.rank0.json", [20.0, 24.0, 20.0])
    timeline(tmp_path / "t.json.rank1.json", [22.0, 20.0, 20.0])
    script = str(ROOT / "benchmarks" / "step_skew.py")
    r = subprocess.run([sys.executable, script, str(tmp_path / "t.json"), "--skip", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "rank 1: forward+backward 20.67 ms" in r.stdout
    assert "slowest rank - mean, per step: mean 1.00 ms, median 1.00 ms" in r.stdout  # (1 + 2 + 0) / 3
    (tmp_path / "t.json.rank1.json").unlink()
    r = subprocess.run([sys.executable, script, str(tmp_path / "t.json"), "--skip", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "two independent ranks with this spread" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, script, str(tmp_path / "none.json")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "no timeline files" in r.stderr


def sync_costs_rows(mpirun, *train_args: str) -> list[dict[str, float]]:
    """Run benchmarks/sync_costs.py at k = 2 on synthetic data; its table, one dict per rank."""
    r = mpirun(2, "benchmarks/sync_costs.py", "--skip", "4", "--", "--dataset", "synthetic", "--synthetic-samples",
               "1024", "--hidden", "64,32", "--batch-size", "32", "--max-steps", "20", "--progress", "off",
               "--threads", "1", *train_args, cwd=ROOT)
    assert r.returncode == 0, r.stderr + r.stdout
    lines = r.stdout[r.stdout.index("ms per step, mean over 16 steps after the first 4"):].splitlines()
    header = lines[1].split()  # two-word names: "sums in hooks" etc. are one column each
    names = ["rank", "step", "forward", "backward", "hooks", "final wait", "all-gather", "check-in",
             "finite check", "optimizer", "sums in hooks", "sums in wait", "copies", "waiting"]
    assert " ".join(header) == " ".join(names)
    rows = [dict(zip(names, map(float, line.split()))) for line in lines[2:4]]
    assert [row["rank"] for row in rows] == [0, 1]
    return rows


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
def test_sync_costs_books_sums_copies_and_waiting_per_step(mpirun):
    """The replicated step sums and copies reduced chunks (shared-memory all-reduce) and gathers nothing;
    the sharded step sums, gathers the parameters, and copies nothing; waiting is the rest."""
    for row in sync_costs_rows(mpirun):
        assert row["step"] > row["forward"] + row["backward"] > 0
        assert row["sums in hooks"] + row["sums in wait"] > 0 and row["copies"] > 0
        assert row["all-gather"] == 0 and row["optimizer"] > 0
        sync = row["hooks"] + row["final wait"] + row["all-gather"] + row["check-in"]
        spent = row["sums in hooks"] + row["sums in wait"] + row["copies"]
        assert row["waiting"] == pytest.approx(sync - spent, abs=0.003)  # each printed to 0.001
    for row in sync_costs_rows(mpirun, "--shard-optimizer"):
        assert row["sums in hooks"] + row["sums in wait"] > 0 and row["copies"] == 0
        assert row["all-gather"] > 0


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="dataset-fashion-mnist absent")
def test_profile_step_reports_phases_gemm_efficiency_and_spread():
    r = subprocess.run([sys.executable, "benchmarks/profile_step.py", "--hidden", "64", "--steps", "40"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    phases = {line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")}
    assert {"data", "forward", "backward", "optimizer"} <= phases
    eff = float(r.stdout.split("GEMM efficiency ")[1].split()[0])
    assert 0 < eff < 2
    spread = r.stdout.split("spread from pass to pass (sd): GEMMs alone ")[1]
    assert float(spread.split(" ms")[0]) > 0 and "forward+backward" in spread
