"""The planner (mpisgd.plan): its model on hand-made metrics files, its CLI, and its refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env, is_png, mpiexec_cmd, serial_only

from mpisgd.app import plan
from mpisgd.schedule import scaled_lr

GRAD = 7454760  # the default MLP's gradient bytes
MIB = 2**20


def epoch_record(**over):
    rec = {"kind": "epoch", "epoch": 2, "step": 200, "lr": 0.01, "train_loss": 0.42, "test_acc": 0.85,
           "samples_per_s": 8000.0, "comm_frac": 0.0, "comm_exposed_ms": 0.0, "comm_total_ms": 0.0,
           "forward_ms": 5.0, "backward_ms": 9.0, "optimizer_ms": 1.0, "step_ms": 16.0, "epoch_time_s": 1.6,
           "world_size": 1, "effective_batch": 128, "local_batch": 128, "accum_steps": 1, "grad_nbytes": GRAD,
           "allreduce": "auto: mpi or ring per size (2 bucket(s): 4.04, 3.07 MiB), overlapped with backward",
           "noise_scale": 1000.0, "grad_sqr": 0.5, "grad_var": 500.0}
    rec.update(over)
    return rec


def write_metrics(path, records=None, **over):
    """A metrics file as mpisgd.train writes it: step records, then one epoch record per epoch."""
    first = epoch_record(**{**over, "epoch": 1, "step": over.get("step", 200) // 2})
    last = epoch_record(**over)
    lines = [{"kind": "step", "step": i, "epoch": 1, "lr": 0.01, "loss": 1.0} for i in range(1, 4)]
    lines += records if records is not None else [first, last]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return str(path)


def net(alpha_us=0.0, beta_gbit=8.0, per_node=1, overlap="auto", inter=True):
    link = plan.Link("test", alpha_us * 1e-6, beta_gbit * 1e9 / 8, "test")
    shm = plan.Link("shm", alpha_us * 1e-6, beta_gbit * 1e9 / 8, "test")
    return plan.Network(shm, link if inter else None, per_node, overlap=overlap)


def test_one_rank_row_is_the_profile(tmp_path):
    prof = plan.read_profile(write_metrics(tmp_path / "m.jsonl"))
    assert (prof.k, prof.b, prof.m, prof.B, prof.noise_scale, prof.steps_per_epoch) == (1, 128, 1, 128, 1000.0, 100)
    assert prof.buckets_from == "the run's buckets" and sum(prof.buckets) == GRAD and len(prof.buckets) == 2
    assert prof.buckets[0] == pytest.approx(4.04 * MIB, rel=1e-3)
    assert prof.other_ms == pytest.approx(1.0)  # 16 - 5 - 9 - 1
    row = plan.plan(prof, net(), [1], None, plan.Rules())[0]
    assert row["step_ms"] == pytest.approx(16.0) and row["exposed_comm_ms"] == 0
    assert row["samples_per_s"] == pytest.approx(128 / 0.016) and row["statistical_efficiency"] == 1.0


def test_exposed_communication_follows_the_buckets(tmp_path):
    """alpha = 0, 8 Gbit/s = 1e9 B/s, k = 2 (one rank per node): each bucket takes n/1e9 s. Bucket 0 is ready
    when backward has produced its bytes (4.04/7.11 of 9 ms), the last one when backward ends."""
    prof = plan.read_profile(write_metrics(tmp_path / "m.jsonl"))
    b0, b1 = (x / 1e9 * 1e3 for x in prof.buckets)  # ms
    ready0 = 9.0 * prof.buckets[0] / GRAD
    t = plan.step_time(prof, net(), 2, 1)
    end0 = ready0 + b0
    assert t["exposed_ms"] == pytest.approx(max(end0, 9.0) + b1 - 9.0)  # bucket 0 hidden, the last exposed
    assert t["exposed_ms"] >= b1  # the last bucket is always exposed
    assert t["allreduce_ms"] == pytest.approx(b0 + b1)
    # a slow link: bucket 0 still runs when backward ends, and the last one queues behind it
    slow = plan.step_time(prof, net(beta_gbit=0.8), 2, 1)
    assert slow["exposed_ms"] == pytest.approx(ready0 + 10 * b0 + 10 * b1 - 9.0)
    # no overlap: everything exposed
    none = plan.step_time(prof, net(overlap="none"), 2, 1)
    assert none["exposed_ms"] == pytest.approx(b0 + b1)
    noov = plan.read_profile(write_metrics(tmp_path / "n.jsonl", allreduce="mpi (2 bucket(s): 4.04, 3.07 MiB), "
                                                                           "after backward"))
    assert plan.step_time(noov, net(), 2, 1)["exposed_ms"] == pytest.approx(b0 + b1)


def test_intra_node_reduction_is_cpu_work_and_nodes_add_the_network(tmp_path):
    prof = plan.read_profile(write_metrics(tmp_path / "m.jsonl"))
    two_level = net(per_node=4)
    one_node = plan.step_time(prof, two_level, 4, 1)
    intra = sum(1e3 * two_level.intra.allreduce_s(n, 4) for n in prof.buckets)
    assert one_node["exposed_ms"] == pytest.approx(intra)  # nothing hidden within a node (overlap auto)
    assert plan.step_time(prof, net(per_node=4, overlap="ideal"), 4, 1)["exposed_ms"] < intra
    eight = plan.step_time(prof, two_level, 8, 1)  # 2 nodes x 4: the network level on top
    assert eight["allreduce_ms"] > one_node["allreduce_ms"]
    assert two_level.layout(8) == (2, 4) and two_level.layout(3) == (1, 3)
    with pytest.raises(plan.PlanError, match="link between nodes"):
        plan.step_time(prof, net(per_node=4, inter=False), 8, 1)


def test_alpha_beta_terms_and_algorithms():
    link = plan.Link("x", 10e-6, 1e9, "")
    assert link.allreduce_s(1e6, 1) == 0
    assert link.allreduce_s(1e6, 2) == pytest.approx(2 * 10e-6 + 1e-3)
    assert link.allreduce_s(1e6, 8) == pytest.approx(6 * 10e-6 + 2 * 7 / 8 * 1e-3)
    assert link.allreduce_s(1e6, 8, "ring") == pytest.approx(14 * 10e-6 + 2 * 7 / 8 * 1e-3)


def test_accumulation_scales_forward_and_backward_only(tmp_path):
    prof = plan.read_profile(write_metrics(tmp_path / "m.jsonl", accum_steps=2, effective_batch=256,
                                           forward_ms=10.0, backward_ms=18.0, step_ms=30.0))
    rows = plan.plan(prof, net(), [1], [1, 2, 4], plan.Rules())
    assert [r["B"] for r in rows] == [128, 256, 512]
    assert [r["compute_ms"] for r in rows] == pytest.approx([14 + 2, 28 + 2, 56 + 2])  # 1 ms optimizer + 1 other


def test_statistics_goodput_time_and_rate(tmp_path):
    prof = plan.read_profile(write_metrics(tmp_path / "m.jsonl"))
    assert plan.statistical_efficiency(1000, 128, 128) == 1
    rows = plan.plan(prof, net(alpha_us=20, beta_gbit=10), [1, 2, 4, 8], None,
                     plan.Rules(lr=0.1, base_batch=256, scaling="sqrt"))
    e0 = 200 * 128  # the profiled run's samples
    for r in rows:
        eff = (1000 + 128) / (1000 + r["B"])
        assert r["statistical_efficiency"] == pytest.approx(eff)
        assert r["goodput"] == pytest.approx(r["samples_per_s"] * eff)
        assert r["samples_to_target"] == pytest.approx(e0 / eff)
        assert r["time_to_target_s"] == pytest.approx(e0 / r["goodput"])
        assert r["steps_to_target"] == pytest.approx(e0 / eff / r["B"])
        assert r["lr"] == pytest.approx(scaled_lr(0.1, 256, r["B"], "sqrt"))
    assert [r["statistical_efficiency"] for r in rows] == sorted((r["statistical_efficiency"] for r in rows),
                                                                 reverse=True)
    target = plan.plan(prof, net(), [1], None, plan.Rules(target_samples=10 * 100 * 128))[0]
    assert target["steps_to_target"] == pytest.approx(1000)  # 10 epochs of 100 steps at B0


def test_recommendation_is_the_fewest_ranks_within_the_margin():
    rows = [{"k": k, "m": 1, "goodput": g} for k, g in ((1, 100.0), (2, 180.0), (4, 196.0), (8, 200.0))]
    assert plan.recommend(rows, 0.05)["k"] == 4
    assert plan.recommend(rows, 0.0)["k"] == 8 and "the most goodput" in plan.recommend(rows, 0.0)["reason"]
    assert plan.recommend(rows, 0.15)["k"] == 2 and plan.recommend(rows, 0.5)["k"] == 1


def test_fit_link_recovers_alpha_and_beta():
    link = plan.Link("true", 30e-6, 2e9, "")
    rows = [{"size_bytes": n, "time_us": 1e6 * link.allreduce_s(n, 4), "ranks": 4} for n in (2**e for e in
                                                                                              range(10, 26))]
    fit = plan.fit_link(rows, 4)
    assert fit.alpha_s == pytest.approx(30e-6, rel=1e-6) and fit.beta_Bps == pytest.approx(2e9, rel=1e-6)
    part = plan.fit_link(rows, 4, lo=2**20, hi=2**24)
    assert part.beta_Bps == pytest.approx(2e9, rel=1e-6)


def test_presets_say_where_their_numbers_come_from():
    for name, (alpha, beta, source) in plan.PRESETS.items():
        assert alpha > 0 and beta > 0 and len(source) > 30, name
        assert source.startswith(("measured:", "nominal:")), name


def allreduce_json(path, ranks=2, backends=("auto", "mpi")):
    link = plan.Link("t", 20e-6, 5e9, "")
    rows = [{"backend": b, "size_bytes": n, "count": n // 4, "dtype": "float32", "inplace": ip,
             "time_us": 1e6 * link.allreduce_s(n, ranks) * (1 if b == "auto" else 2), "algbw_gbps": 1.0,
             "busbw_gbps": 1.0, "wrong": 0, "ranks": ranks, "device": "cpu"}
            for n in (2**e for e in range(12, 27)) for b in backends for ip in (False, True)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_cli_json_plot_and_measured_network(tmp_path, capsys):
    m = write_metrics(tmp_path / "m.jsonl")
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    pytest.importorskip("matplotlib")
    assert plan.main([m, "--ranks", "1,2,4,8", "--link", allreduce_json(tmp_path / "ar.json"), "--json", str(out),
                      "--plot", str(png)]) == 0
    shown = capsys.readouterr().out
    assert "recommended: k=" in shown and "B_noise = 1000" in shown and "auto, k=2" in shown
    data = json.loads(out.read_text())
    assert [r["k"] for r in data["rows"]] == [1, 2, 4, 8]
    for key in ("k", "b", "m", "B", "step_ms", "samples_per_s", "statistical_efficiency", "goodput", "lr",
                "time_to_target_s", "steps_to_target", "exposed_comm_ms"):
        assert all(key in r for r in data["rows"]), key
    assert data["recommended"]["k"] in (1, 2, 4, 8) and data["recommended"]["reason"]
    inter = data["links"]["inter"]
    assert inter["alpha_s"] == pytest.approx(20e-6, rel=1e-3) and inter["beta_Bps"] == pytest.approx(5e9, rel=1e-3)
    assert is_png(png)


def test_cli_defaults_follow_the_nodes(tmp_path, capsys):
    m = write_metrics(tmp_path / "m.jsonl")
    assert plan.main([m, "--nodes", "4", "--ranks-per-node", "2", "--alpha-us", "25", "--beta-gbit", "10",
                      "--json", str(tmp_path / "p.json")]) == 0
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [(r["k"], r["nodes"]) for r in rows] == [(1, 1), (2, 1), (4, 2), (8, 4)]


def test_console_script_is_declared():
    assert "mpisgd-plan=mpisgd.app.plan:main" in (ROOT / "setup.py").read_text()


@pytest.mark.parametrize("case,args,message", [
    ("not json", [], "not JSON"),
    ("no epochs", [], "no epoch records"),
    ("other program", [], "lack"),
    ("no noise", [], "no noise_scale"),
    ("null noise", [], "noise_scale None"),
    ("bad batch", [], "do not make B"),
    ("ok", ["--ranks", "0,2"], "--ranks must be whole numbers >= 1"),
    ("ok", ["--ranks", "1,two"], "--ranks must be comma-separated whole numbers"),
    ("ok", ["--ranks", ","], "--ranks must be whole numbers"),
    ("ok", ["--ranks", "16", "--nodes", "2", "--ranks-per-node", "4", "--link", "10gbe"], "more than --nodes"),
    ("ok", ["--ranks", "1,2", "--alpha-us", "3"], "go together"),
    ("ok", ["--ranks", "1,2", "--link", "carrier-pigeon"], "neither a preset"),
    ("ok", ["--ranks", "1,2,4"], "give the link between them"),
    ("ok", ["--noise-scale", "-3", "--ranks", "1"], "--noise-scale must be > 0"),
    ("ok", ["--epoch", "7", "--ranks", "1"], "no epoch 7"),
    ("ok", ["--ranks", "2", "--link", "BAD_AR"], "not an allreduce_bw.py --json output"),
    ("ok", ["--ranks", "2", "--link", "WRONG_SHAPE"], "lacks size_bytes"),
    ("ok", ["--ranks", "2", "--link", "AR", "--backend", "ring"], "no rows for backend 'ring'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, args, message):
    path = tmp_path / "m.jsonl"
    if case == "not json":
        path.write_text('{"kind": "epoch"}\nepoch 1/2 loss 0.5\n')
    elif case == "no epochs":
        path.write_text('{"kind": "step", "step": 1, "loss": 0.3}\n')
    elif case == "other program":
        path.write_text('{"kind": "epoch", "epoch": 1, "loss": 0.3, "accuracy": 0.9}\n')
    elif case == "no noise":
        rec = epoch_record()
        del rec["noise_scale"]
        write_metrics(path, [rec])
    elif case == "null noise":
        write_metrics(path, [epoch_record(noise_scale=None)])
    elif case == "bad batch":
        write_metrics(path, [epoch_record(effective_batch=100)])
    else:
        write_metrics(path)
    (tmp_path / "bad.json").write_text("# allreduce_bw: k=2\n")
    (tmp_path / "shape.json").write_text(json.dumps({"rows": [{"size": 4}]}) + "\n")
    allreduce_json(tmp_path / "ar.json")
    args = [{"BAD_AR": str(tmp_path / "bad.json"), "WRONG_SHAPE": str(tmp_path / "shape.json"),
             "AR": str(tmp_path / "ar.json")}.get(a, a) for a in args]
    assert plan.main([str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mpisgd.plan: error: ") and message in err, err


def test_module_runs_without_mpi(tmp_path):
    """python -m mpisgd.plan is pure computation: it must not start MPI (no mpi4py.MPI import)."""
    m = write_metrics(tmp_path / "m.jsonl")
    code = (f"import sys; import mpisgd.app.plan as p; rc = p.main([{m!r}, '--ranks', '1,2', '--link', '10gbe']); "
            "assert 'mpi4py.MPI' not in sys.modules; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=clean_env())
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "mpisgd.plan", m, "--ranks", "2"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=clean_env())
    assert r.returncode == 2 and "give the link between them" in r.stderr




@serial_only
def test_plans_from_a_real_training_run(tmp_path):
    """The trainer's own metrics file (k = 1, two micro-batches: it records the noise scale) is a profile."""
    metrics = tmp_path / "m.jsonl"
    r = subprocess.run([*mpiexec_cmd(1, "-m", "mpisgd.train"), "--dataset", "synthetic", "--synthetic-samples",
                        "2048", "--hidden", "32", "--batch-size", "32", "--accum-steps", "2", "--epochs", "2",
                        "--progress", "off", "--metrics-file", str(metrics)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "mpisgd.plan", str(metrics), "--ranks", "1,2,4", "--link", "1gbe",
                        "--json", str(out)], capture_output=True, text=True, timeout=60, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    prof = data["profile"]
    assert (prof["k"], prof["b"], prof["m"], prof["B"]) == (1, 32, 2, 64) and prof["noise_scale"] > 0
    assert prof["buckets_from"] == "the run's buckets" and sum(prof["buckets"]) == prof["grad_nbytes"]
    assert data["rows"][0]["step_ms"] == pytest.approx(prof["step_ms"])  # k = 1 at the profile's m is the profile
