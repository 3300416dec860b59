"""The experiments behind the docs (experiments/): each one's helpers, and a quick real run that checks
what it prints and writes (the large-batch sweep, the step profile, the straggler experiment)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, clean_env, is_png, script, serial_only

# what starts its own processes runs once, in the serial pass (not on every rank under mpiexec)
pytestmark = serial_only


def _large_batch():
    return script("experiments", "large_batch")


def test_large_batch_split_keeps_micro_batch_bounded():
    lb = _large_batch()
    assert lb.split_batch(64, 2, 512) == (32, 1)
    assert lb.split_batch(8192, 2, 512) == (512, 8)
    with pytest.raises(ValueError):
        lb.split_batch(63, 2, 512)


def test_large_batch_recipes_take_their_own_rate_and_scaling():
    lb = _large_batch()
    args = lb.parse_args(["--quick"])
    lamb = " ".join(lb.point_command(4096, "lamb+warmup", args, "M"))
    assert "--optimizer lamb --lr-scaling sqrt --lr 0.0070711 " in lamb and "--warmup-epochs 1.0" in lamb
    lars = " ".join(lb.point_command(4096, "lars+warmup", args, "M"))
    assert "--optimizer lars --lr-scaling sqrt --trust-coef 0.1 --lr 0.014142 " in lars
    assert "--lr 0.1 " in " ".join(lb.point_command(4096, "linear+warmup", args, "M"))


def test_large_batch_report_writer(tmp_path):
    lb = _large_batch()
    recs = [{"batch": B, "recipe": r, "ranks": 2, "micro_batch": min(B // 2, 512), "accum_steps": max(1, B // 1024),
             "command": f"cmd {B} {r}", "epochs_budget": 2, "epochs_done": 0 if div else 2,
             "test_acc": [] if div else [0.8, 0.85], "steps": 10, "diverged": div,
             "diverged_at_step": 3 if div else None, "wall_s": 1.0}
            for B in (64, 2048) for r, div in (("none", False), ("linear", B == 2048))]
    for rec in recs:
        rec["command"] += " --lr-scaling none --lr 0.1" if rec["recipe"] == "none" else " --lr-scaling linear --lr 0.1"
    lars = {**recs[0], "recipe": "lars+warmup", "test_acc": [0.8, 0.88],
            "command": "cmd --seed 3 --optimizer lars --lr-scaling sqrt --trust-coef 0.01 --lr 2.0 --warmup-epochs 1.0"}
    lb.write_report([*recs, lars], tmp_path, "test")
    table = (tmp_path / "large_batch.md").read_text()
    assert "| 2048 | linear | linear | 0.1 | - | 0 | 0 | 2x512x2 | 90.0 | 90.0 | 0/2 | 3 | 1.0 | diverged at step 3 |" \
        in table
    assert "| 64 | none | none | 0.1 | - | 0 | 0 | 2x32x1 | 15.0 | 15.0 | 2/2 |" in table
    assert "| 64 | lars+warmup | sqrt | 2.0 | 0.01 | 1.0 | 3 | 2x32x1 | 12.0 | 12.0 | 2/2 |" in table
    assert is_png(tmp_path / "large_batch.png") and (tmp_path / "large_batch.csv").exists()


def test_large_batch_quick_run(tmp_path):
    r = subprocess.run([sys.executable, "experiments/large_batch.py", "--quick", "--batches", "64,1024",
                        "--recipes", "none,linear+warmup,lars+warmup", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr + r.stdout
    data = json.loads((tmp_path / "large_batch.json").read_text())
    assert {(x["batch"], x["recipe"]) for x in data["runs"]} == {(b, r) for b in (64, 1024)
                                                                  for r in ("none", "linear+warmup", "lars+warmup")}
    assert all("--optimizer lars --lr-scaling sqrt --trust-coef 0.1 --lr 0.014142" in x["command"]
               for x in data["runs"] if x["recipe"] == "lars+warmup")
    assert all(len(x["test_acc"]) == 2 for x in data["runs"])
    assert is_png(tmp_path / "large_batch.png")
    again = subprocess.run([sys.executable, "experiments/large_batch.py", "--quick", "--batches", "64",
                            "--recipes", "none", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert "skipped" in again.stdout  # finished points are not rerun


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="dataset-fashion-mnist absent")
def test_profile_step_reports_phases_gemm_efficiency_and_spread():
    r = subprocess.run([sys.executable, "experiments/profile_step.py", "--hidden", "64", "--steps", "40"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    phases = {line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")}
    assert {"data", "forward", "backward", "optimizer"} <= phases
    eff = float(r.stdout.split("GEMM efficiency ")[1].split()[0])
    assert 0 < eff < 2
    spread = r.stdout.split("spread from pass to pass (sd): GEMMs alone ")[1]
    assert float(spread.split(" ms")[0]) > 0 and "forward+backward" in spread


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="dataset-fashion-mnist absent")
def test_profile_step_tables_a_cnns_layers_on_the_portable_kernels():
    r = subprocess.run([sys.executable, "experiments/profile_step.py", "--model", "cnn", "--kernels", "portable",
                        "--steps", "22"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("LeNet-5, b=128, float32, 1 BLAS thread(s), portable kernels: median step ")
    conv = [line.split(")")[-1].split() for line in r.stdout.splitlines() if "Conv2d(6, 16" in line]
    assert len(conv) == 1 and float(conv[0][1]) > 0  # its backward
    assert "GEMM efficiency" not in r.stdout


@pytest.mark.timing  # compares step times: run apart, one at a time (pytest.ini)
def test_straggler_experiment_books_the_wait_to_the_delayed_rank(tmp_path):
    r = subprocess.run([sys.executable, "experiments/straggler.py", "--ks", "2", "--delays-ms", "0,10",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "straggler.json").read_text())["rows"]
    slow = next(x for x in rows if x["delay_ms"] == 10)
    fast = next(x for x in rows if x["delay_ms"] == 0)
    assert slow["slowest_rank"] == 1 and slow["wait_caused_ms"][1] > 7
    assert min(slow["rank_step_ms"]) > min(fast["rank_step_ms"]) + 5  # every rank's step grew
    assert is_png(tmp_path / "straggler.png") and "| one host | 2 | 10 |" in (tmp_path / "straggler.md").read_text()


def _experiment(name):
    return script("experiments", name)


def test_critical_batch_fit_recovers_the_tradeoff():
    cb = _experiment("critical_batch")
    batches = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    steps = [200 * (1 + 700 / b) for b in batches]  # S_min = 200, B_crit = 700
    fit = cb.fit_tradeoff(batches, steps)
    assert fit["B_crit"] == pytest.approx(700, rel=0.01) and fit["S_min"] == pytest.approx(200, rel=0.01)
    assert fit["E_min"] == pytest.approx(140_000, rel=0.02) and fit["rms_log_residual"] < 0.01
    # (S/S_min - 1)(E/E_min - 1) = 1 at every point of the fitted curve
    for b, s in zip(batches, steps, strict=True):
        assert (s / fit["S_min"] - 1) * (s * b / fit["E_min"] - 1) == pytest.approx(1, rel=0.03)


def test_critical_batch_crossing_and_noise_scale_interpolate():
    cb = _experiment("critical_batch")
    evals = [[0, 0, 2.0, math.nan, math.nan], [10, 640, 1.0, 1.0, 100.0], [20, 1280, 0.25, 1.0, 300.0]]
    steps, i = cb.crossing(evals, 0.5)
    assert i == 2 and steps == pytest.approx(15)  # halfway in log loss from 1.0 to 0.25
    assert cb.crossing(evals, 0.1) is None and cb.crossing(evals, 3.0) == (0.0, 0)
    # the interval means come back exactly from the exponential averages a run stores
    B, tau = 64, 1000.0
    beta = math.exp(-B / tau)
    xs = [(4.0 / (1 + t), 50.0 + t) for t in range(1, 41)]  # |G|^2 falling, tr(Sigma) rising, per step
    u, w, evals = [0.0, 0.0], 0.0, [[0, 0, 2.0, math.nan, math.nan]]
    for t, (g, v) in enumerate(xs, 1):
        u = [beta * u[0] + (1 - beta) * g, beta * u[1] + (1 - beta) * v]
        w = beta * w + (1 - beta)
        if t % 10 == 0:
            evals.append([t, t * B, 1.0 / t, u[0] / w, u[1] / w])
    rec = {"settings": {"batch": B, "noise_tau": tau}, "evals": evals}
    rows = cb.intervals(rec)
    assert [(r[0], r[1]) for r in rows] == [(1, 10), (11, 20), (21, 30), (31, 40)]
    def weighted(lo, hi, j):  # what an interval's mean is: beta^(hi - t)-weighted over its steps
        wts = [beta ** (hi - t) for t in range(lo, hi + 1)]
        return np.dot(wts, [xs[t - 1][j] for t in range(lo, hi + 1)]) / sum(wts)

    for lo, hi, _, g, v in rows:
        assert g == pytest.approx(weighted(lo, hi, 0), rel=1e-9) and v == pytest.approx(weighted(lo, hi, 1), rel=1e-9)
    # B_simple at step 38: the last fifth of the run (steps 31-40, the interval holding it), ratio of the means
    assert cb.noise_at(rec, 38.0) == pytest.approx(weighted(31, 40, 1) / weighted(31, 40, 0), rel=1e-9)
    assert math.isnan(cb.noise_at(rec, 0.0))  # before any interval
    assert cb.split_batch(64, 512) == (32, 2) and cb.split_batch(8192, 512) == (512, 16)
    with pytest.raises(ValueError):
        cb.split_batch(96, 512)


def test_critical_batch_quick_run_resumes(tmp_path):
    cmd = [sys.executable, "experiments/critical_batch.py", "--quick", "--batches", "64,256", "--mults", "1,2",
           "--extend", "1", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr + r.stdout
    runs = sorted(p.name for p in (tmp_path / "runs").glob("*.json"))
    assert "B00064-sgd-x1.json" in runs and "B00256-sgd-x2.json" in runs
    rec = json.loads((tmp_path / "runs" / "B00064-sgd-x1.json").read_text())
    assert rec["command"].startswith("python -m mpisgd.train ") and "--decay none" in rec["command"]
    assert rec["evals"][0][0] == 0 and rec["status"] in ("reached", "pruned", "budget", "diverged")
    summary = json.loads((tmp_path / "critical_batch.json").read_text())
    assert set(summary["targets"]) == {"0.8", "0.6"}
    (trainer,) = summary["trainer"]  # the trainer's own noise scale, from a real mpisgd.train run at B = 256
    assert trainer["B"] == 256 and trainer["command"].startswith("mpiexec -n 2 python -m mpisgd.train ")
    assert "--dataset synthetic" in trainer["command"] and all(e[2] for e in trainer["epochs"])
    assert is_png(tmp_path / "critical_batch.png") and "B_crit" in (tmp_path / "critical_batch.md").read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env())
    assert again.returncode == 0 and again.stdout.count("skipped") >= len(runs)  # nothing is run twice
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.json")) == runs


def test_plan_validation_quick_run(tmp_path):
    r = subprocess.run([sys.executable, "experiments/plan_validation.py", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    (stamp,) = tmp_path.iterdir()
    result = json.loads((stamp / "validation.json").read_text())
    (series,) = result["series"]
    pair = series["pairs"][0]
    assert pair["predicted_samples_per_s"] > 0 and pair["measured_samples_per_s"] > 0
    plan = json.loads((stamp / "plans" / "local-mlp-r1.json").read_text())
    assert plan["command"].startswith(sys.executable) and [row["k"] for row in plan["rows"]] == [1, 2]
    run = json.loads((stamp / "runs" / "local-mlp-k2-r1.json").read_text())
    assert "mpisgd.train" in run["command"] and run["epochs"][-1]["world_size"] == 2
    assert "| this machine, 1 node | mlp |" in (stamp / "validation.md").read_text()


def test_noise_cost_times_the_norm_per_measured_step_and_per_step():
    r = subprocess.run([sys.executable, "experiments/noise_cost.py", "--hidden", "64", "--every", "4",
                        "--bucket-mb", "0.1", "--repeats", "40"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert "in 2 bucket(s)" in r.stdout, r.stdout
    measured = float(r.stdout.split("takes ")[1].split(" ms")[0])
    per_step = float(r.stdout.split("every 4 steps: ")[1].split(" ms")[0])
    assert measured > 0 and per_step == pytest.approx(measured / 4, abs=1e-3), r.stdout


def test_gpt_steps_samples_quick_run_and_its_arithmetic(tmp_path):
    """The GPT's steps-vs-samples experiment end to end on README.md (two batches, a few steps), and the
    pieces its numbers come from: the smoothed first crossing and the S = S_min + E_min / B fit."""
    gss = script("experiments", "gpt_steps_samples")
    assert gss.steps_to([5.0, 4.0, 3.0, 2.0, 1.0], 2.5, 1) == pytest.approx(3.5)  # between steps 3 and 4
    assert gss.steps_to([5.0, 4.0, 3.0], 0.5, 1) is None
    s_min, e_min = gss.fit([(16, 10 + 800 / 16), (64, 10 + 800 / 64), (256, 10 + 800 / 256)])
    assert (s_min, e_min) == (pytest.approx(10), pytest.approx(800))
    r = subprocess.run([sys.executable, "experiments/gpt_steps_samples.py", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["rows"]) == {"8", "16"} and summary["rows"]["8"]["steps_run"] == 40
    assert "| 8 | 0.0005 |" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_portable_products_prints_each_product_and_the_step(model):
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "portable_products.py"), "--model", model,
                        "--batch-size", "8", "--repeats", "2"], capture_output=True, text=True, timeout=300,
                       env={**clean_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if " @ " in line]  # the MLP's product table
    assert len(rows) == (5 if model == "mlp" else 0) and all(len(line.split()[-4:]) == 4 for line in rows), r.stdout
    if model == "mlp":
        total = [float(v) for v in next(x for x in r.stdout.splitlines() if x.startswith("sum")).split()[1:]]
        assert len(total) == 4 and all(v > 0 for v in total)
    step = re.search(r"default ([0-9.]+) \(its BLAS calls ([0-9.]+)\), portable ([0-9.]+) \(its float64 BLAS calls "
                     r"([0-9.]+), the rest ([0-9.]+) against the default's ([0-9.]+)\)", r.stdout)
    assert step, r.stdout
    fast, fast_blas, portable, portable_blas, rest, fast_rest = map(float, step.groups())
    assert 0 < fast_blas < fast and 0 < portable_blas < portable  # the clock saw each kernel's products
    assert rest == pytest.approx(portable - portable_blas, abs=0.011)
    assert fast_rest == pytest.approx(fast - fast_blas, abs=0.011)
    ratios = re.findall(r"([0-9.]+)x$", r.stdout, re.M)  # the step's ratio, then the two ceilings
    assert len(ratios) == 3 and all(0 < float(v) for v in ratios), r.stdout


@pytest.mark.parametrize("model,only", [("cnn", None), ("gpt", "functions")])
def test_portable_compiled_compares_the_strategies_and_their_bits(model, only):
    from mpisgd.portable.native import extension

    if extension("_passes") is None or extension("_functions") is None:
        pytest.skip("the C passes and functions are not built")
    if model == "gpt" and not Path("/usr/local/share/mpisgd/kjv.txt").is_file():
        pytest.skip("the King James Bible (scripts/install.sh) absent")
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "portable_compiled.py"), "--model", model,
                        "--steps", "2", "--batch-size", "4", *(["--only", only] if only else [])],
                       capture_output=True, text=True, timeout=300,
                       env={**clean_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert f"({only or 'passes and functions'})" in r.stdout
    assert re.search(r"NumPy's [0-9.]+ ms, compiled [0-9.]+ ms: [0-9.]+x; paired saving -?[0-9.]+ ms", r.stdout)
    assert "the same loss and gradients, bit for bit: yes" in r.stdout
