"""The planner (mpisgd.plan): its model on hand-made metrics files and workloads, the topology's algorithms,
its CLI, what it reads of the run it plans, and its refusals of bad input (one line, exit 2, no hang)."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env, is_png, mpiexec_cmd, serial_only

from mpisgd.app import plan
from mpisgd.app.planner import model, report, topology
from mpisgd.app.planner.topology import Cluster, Link
from mpisgd.app.planner.workload import Rules, ShardRule, default_buckets, from_description, from_metrics
from mpisgd.app.records import EpochRecord, RunRecord, StepRecord, to_json
from mpisgd.schedule import scaled_lr

GRAD = 7454760  # the default MLP's gradient bytes
BUCKETS = (4236328, 3218432)  # its two buckets (4.04 and 3.07 MiB)
MIB = 2**20


def run_record(**over) -> RunRecord:
    values = dict(schema=1, started="2026-12-02T00:00:00+00:00", version="0.1.0", world_size=1, nodes=1,
                  ranks_per_node=1, device="cpu", threads=1, model="mlp", dtype="float32", parameters=GRAD // 4,
                  grad_nbytes=GRAD, bucket_nbytes=BUCKETS, bucket_cap_mb=25.0, overlap=True, allreduce="auto",
                  allreduce_plan="auto: mpi or ring per size", reproducible=False, sharded=False,
                  shard_min_bytes=MIB, optimizer="sgd", optimizer_state_nbytes=GRAD, lr=0.1, base_batch=256,
                  lr_scaling="linear", peak_lr=0.05, warmup_steps=0, local_batch=128, accum_steps=1,
                  effective_batch=128, steps_per_epoch=100, total_steps=200, train_samples=12800,
                  noise_scale_every=4, shard_optimizer=False)
    values.update(over)
    return RunRecord(**values)


def epoch_record(**over) -> EpochRecord:
    values = dict(epoch=2, step=200, steps=100, lr=0.01, train_loss=0.42, test_acc=0.85, samples_per_s=8000.0,
                  comm_frac=0.0, comm_exposed_ms=0.0, comm_total_ms=0.0, forward_ms=5.0, backward_ms=9.0,
                  optimizer_ms=1.0, step_ms=16.0, epoch_time_s=1.6, skipped_steps=0, world_size=1, effective_batch=128,
                  local_batch=128, accum_steps=1, grad_nbytes=GRAD, bucket_algbw_gbps=0.0, bucket_busbw_gbps=0.0,
                  peak_rss_mib=300.0, rss_start_mib=60.0, state_mib=40.0, noise_scale=1000.0, grad_sqr=0.5,
                  grad_var=500.0)
    values.update(over)
    return EpochRecord(**values)


def write_metrics(path, run=None, epochs=None, *, schema0=False, **over) -> str:
    """A metrics file as mpisgd.train writes it: a run record, step records, an epoch record per epoch."""
    first = epoch_record(**{**over, "epoch": 1, "step": over.get("step", 200) // 2})
    lines = [] if schema0 else [to_json(run or run_record())]
    lines += [to_json(StepRecord(step=i, epoch=1, lr=0.01, loss=1.0, step_ms=16.0)) for i in range(1, 4)]
    lines += [to_json(e) for e in (epochs if epochs is not None else [first, epoch_record(**over)])]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return str(path)


def net(alpha_us=0.0, beta_gbit=8.0, per_node=1, overlap="auto", inter=True, library="mpi", algorithm="auto"):
    link = Link("test", alpha_us * 1e-6, beta_gbit * 1e9 / 8, "test")
    shm = Link("shm", alpha_us * 1e-6, beta_gbit * 1e9 / 8, "test", "shm")
    return Cluster(shm, link if inter else None, per_node, library, algorithm, overlap)


def profile(tmp_path, name="m.jsonl", **over):
    return from_metrics(write_metrics(tmp_path / name, **over))[0]


# -- the model -----------------------------------------------------------------------------------------
def test_one_rank_row_is_the_profile(tmp_path):
    w, rules = from_metrics(write_metrics(tmp_path / "m.jsonl"))
    assert (w.k, w.b, w.m, w.B, w.noise_scale, w.steps_per_epoch, w.samples) == (1, 128, 1, 128, 1000.0, 100, 25600)
    assert w.buckets_from == "the run record" and w.bucket_nbytes == BUCKETS and w.overlap
    assert w.other_ms == pytest.approx(1.0)  # 16 - 5 - 9 - 1
    assert rules == Rules(0.1, 256, "linear", "sgd", "the run record")
    row = model.plan(w, net(), [1], None, rules, w.samples)[0]
    assert row.step_ms == pytest.approx(16.0) and row.exposed_comm_ms == 0
    assert row.samples_per_s == pytest.approx(128 / 0.016) and row.statistical_efficiency == 1.0


def test_exposed_communication_follows_the_buckets(tmp_path):
    """alpha = 0, 8 Gbit/s = 1e9 B/s, k = 2 (one rank per node): each bucket takes n/1e9 s. Bucket 0 is ready
    when backward has produced its bytes (4.04/7.11 of 9 ms), the last one when backward ends."""
    w = profile(tmp_path)
    b0, b1 = (x / 1e9 * 1e3 for x in w.bucket_nbytes)  # ms
    ready0 = 9.0 * w.bucket_nbytes[0] / GRAD
    t = model.step_time(w, net(), 2, 1)
    assert t.exposed_ms == pytest.approx(max(ready0 + b0, 9.0) + b1 - 9.0)  # bucket 0 hidden, the last exposed
    assert t.exposed_ms >= b1 and t.comm_ms == pytest.approx(b0 + b1)
    slow = model.step_time(w, net(beta_gbit=0.8), 2, 1)  # bucket 0 still runs when backward ends
    assert slow.exposed_ms == pytest.approx(ready0 + 10 * b0 + 10 * b1 - 9.0)
    assert model.step_time(w, net(overlap="none"), 2, 1).exposed_ms == pytest.approx(b0 + b1)
    noov = profile(tmp_path, "n.jsonl", run=run_record(overlap=False))  # the run record says: after backward
    assert model.step_time(noov, net(), 2, 1).exposed_ms == pytest.approx(b0 + b1)


def test_intra_node_reduction_is_cpu_work_and_nodes_add_the_network(tmp_path):
    w = profile(tmp_path)
    two_level = net(per_node=4)
    one_node = model.step_time(w, two_level, 4, 1)
    intra = sum(1e3 * two_level.intra.allreduce_s(n, 4) for n in w.bucket_nbytes)
    assert one_node.exposed_ms == pytest.approx(intra)  # nothing hidden within a node (overlap auto, MPI)
    assert model.step_time(w, net(per_node=4, overlap="ideal"), 4, 1).exposed_ms < intra
    eight = model.step_time(w, two_level, 8, 1)  # 2 nodes x 4: the network level on top
    assert eight.comm_ms > one_node.comm_ms
    assert two_level.layout(8) == (2, 4) and two_level.layout(3) == (1, 3)
    with pytest.raises(plan.PlanError, match="link between nodes"):
        model.step_time(w, net(per_node=4, inter=False), 8, 1)


def test_alpha_beta_terms_and_mpi_algorithms():
    link = Link("x", 10e-6, 1e9, "")
    assert link.allreduce_s(1e6, 1) == 0
    assert link.allreduce_s(1e6, 2) == pytest.approx(2 * 10e-6 + 1e-3)
    assert link.allreduce_s(1e6, 8) == pytest.approx(6 * 10e-6 + 2 * 7 / 8 * 1e-3)
    assert link.allreduce_s(1e6, 8, "ring") == pytest.approx(14 * 10e-6 + 2 * 7 / 8 * 1e-3)


def test_nccl_ring_tree_and_hierarchical_as_the_library_costs_them():
    """NCCL's cost model (src/graph/tuning.cc): a flat ring over all k ranks, limited by the slower link, with
    a latency step per hop; a tree with log2(nodes) network hops, at 0.45 of the bus bandwidth, twice the NIC
    at 2 nodes; auto takes the cheaper; hierarchical = reduce-scatter in, all-reduce across, all-gather in."""
    nv, ib = topology.preset("nvlink-v100"), topology.preset("ib-edr")
    c = Cluster(nv, ib, 8, "nccl", "ring")
    n = 100e6
    _, ring, alg = c.allreduce(n, 32)
    lat = (8.4 + (62 - 6) * 3.4 + 6 * 9.6) * 1.9 * 1e-6
    assert alg == "ring" and ring == pytest.approx(lat + 2 * 31 / 32 * n / ib.beta_Bps)
    _, tree, alg = Cluster(nv, ib, 8, "nccl", "tree").allreduce(n, 32)
    assert alg == "tree" and tree == pytest.approx(2 * (7 * 28 + 2 * 50) * 1e-6 + n / (0.45 * ib.beta_Bps))
    _, two, _ = Cluster(nv, ib, 8, "nccl", "tree").allreduce(n, 16)  # two nodes: the tree reaches 2x the NIC
    assert two == pytest.approx(2 * (7 * 28 + 50) * 1e-6 + n / (0.45 * 2 * ib.beta_Bps))
    auto = Cluster(nv, ib, 8, "nccl", "auto")
    assert auto.allreduce(n, 32)[1] == min(ring, tree) and auto.allreduce(n, 16)[2] == "tree"
    assert auto.allreduce(n, 8)[2] == "ring"  # one node: rings
    small = auto.allreduce(1e3, 512)  # latency: 2 log2(64) hops beat 2*511 ring steps
    assert small[2] == "tree"
    _, hier, alg = Cluster(nv, ib, 8, "nccl", "hierarchical").allreduce(n, 32)
    inside = 7 * 3.4e-6 + 7 / 8 * n / nv.beta_Bps
    assert alg == "hierarchical" and hier == pytest.approx(2 * inside + 6 * 9.6e-6 + 2 * 3 / 4 * n / ib.beta_Bps)
    with pytest.raises(plan.PlanError, match="NCCL's"):
        Cluster(nv, ib, 8, "mpi", "tree").allreduce(n, 16)


def test_sharded_step_reduce_scatters_behind_backward_and_gathers_after(tmp_path):
    """The sharded step: each bucket reduce-scattered in its place (half an all-reduce), the update on 1/k,
    the all-gather after it in full; mpisgd's default shards a >= 1 MiB model on CPUs at k >= 2."""
    w = profile(tmp_path, run=run_record(shard_optimizer=None))
    assert w.shard.at(2) and not w.shard.at(1)
    c = net(beta_gbit=8.0)
    t = model.step_time(w, c, 2, 1)
    half = [n / 1e9 * 1e3 / 2 for n in w.bucket_nbytes]  # ms: (k-1)/k n / beta at k = 2
    ready0 = 9.0 * w.bucket_nbytes[0] / GRAD
    hidden = max(ready0 + half[0], 9.0) + half[1] - 9.0
    assert t.sharded and t.algorithm == "reduce-scatter"
    assert t.exposed_ms == pytest.approx(hidden + sum(half))  # + the all-gather, exposed
    assert t.compute_ms == pytest.approx(5 + 9 + 1 / 2 + 1)  # the update on half the parameters
    replicated = model.step_time(profile(tmp_path, "r.jsonl", run=run_record(shard_optimizer=False)), c, 2, 1)
    assert not replicated.sharded and replicated.compute_ms == pytest.approx(16.0)


@pytest.mark.parametrize("asked", [None, True, False])
def test_shard_rule_is_the_trainers(asked):
    from mpisgd.app.run import SHARD_MIN_BYTES, shard_policy

    for k in (1, 2, 3, 8):
        for gpu in (False, True):
            for nbytes in (1000, SHARD_MIN_BYTES - 1, SHARD_MIN_BYTES, 10 * SHARD_MIN_BYTES):
                rule = ShardRule(asked, SHARD_MIN_BYTES, "gpu" if gpu else "cpu", nbytes)
                assert rule.at(k) == shard_policy(asked, k, gpu, nbytes)[0], (asked, k, gpu, nbytes)


def test_accumulation_scales_forward_and_backward_only(tmp_path):
    w = profile(tmp_path, run=run_record(accum_steps=2, effective_batch=256), accum_steps=2, effective_batch=256,
                forward_ms=10.0, backward_ms=18.0, step_ms=30.0)
    rows = model.plan(w, net(), [1], [1, 2, 4], Rules(), w.samples)
    assert [r.B for r in rows] == [128, 256, 512]
    assert [r.compute_ms for r in rows] == pytest.approx([14 + 2, 28 + 2, 56 + 2])  # 1 ms optimizer + 1 other


def test_statistics_goodput_time_and_rate(tmp_path):
    w = profile(tmp_path)
    assert model.statistical_efficiency(1000, 128, 128) == 1
    rules = Rules(lr=0.1, base_batch=256, scaling="sqrt")
    rows = model.plan(w, net(alpha_us=20, beta_gbit=10), [1, 2, 4, 8], None, rules, w.samples)
    e0 = 200 * 128  # the profiled run's samples
    for r in rows:
        eff = (1000 + 128) / (1000 + r.B)
        assert r.statistical_efficiency == pytest.approx(eff)
        assert r.goodput == pytest.approx(r.samples_per_s * eff)
        assert r.samples_to_target == pytest.approx(e0 / eff)
        assert r.time_to_target_s == pytest.approx(e0 / r.goodput)
        assert r.steps_to_target == pytest.approx(e0 / eff / r.B)
        assert r.lr == pytest.approx(scaled_lr(0.1, 256, r.B, "sqrt"))
        assert r.scaling_efficiency == pytest.approx(r.compute_ms / r.step_ms)
    assert [r.statistical_efficiency for r in rows] == sorted((r.statistical_efficiency for r in rows), reverse=True)
    target = model.plan(w, net(), [1], None, Rules(), 10 * 100 * 128)[0]
    assert target.steps_to_target == pytest.approx(1000)  # 10 epochs of 100 steps at B0


def _row(k, goodput, sps=None, eff=None, exposed=0.0, fits=True):
    return model.Row(k=k, nodes=1, ranks_per_node=k, b=1, m=1, B=k, lr=0.1, compute_ms=1.0, allreduce_ms=0.0,
                     exposed_comm_ms=exposed, step_ms=1.0 + exposed, samples_per_s=sps or goodput,
                     scaling_efficiency=1 / (1 + exposed), statistical_efficiency=eff, goodput=goodput,
                     samples_to_target=None, steps_to_target=None, time_to_target_s=None, speedup=None,
                     algorithm="-", sharded=False, memory_mib_per_node=100.0 * k, fits=fits)


def test_recommendation_is_the_fewest_ranks_within_the_margin_and_names_its_constraint():
    rows = [_row(k, g) for k, g in ((1, 100.0), (2, 180.0), (4, 196.0), (8, 200.0))]
    assert model.recommend(rows, 0.05).row.k == 4
    assert model.recommend(rows, 0.0).row.k == 8 and "the most" in model.recommend(rows, 0.0).reason
    assert model.recommend(rows, 0.15).row.k == 2 and model.recommend(rows, 0.5).row.k == 1
    assert model.recommend(rows, 0.0).constraint == "ranks available"
    # samples/s keeps doubling, the statistical efficiency halves: a goodput plateau
    stats = [_row(k, g, sps=100.0 * k, eff=g / (100.0 * k)) for k, g in ((1, 100.0), (2, 150.0), (4, 160.0))]
    assert model.recommend(stats, 0.1).constraint == "goodput plateau"
    # samples/s stops growing with exposed communication: the link
    link = [_row(k, g, sps=g, eff=1.0, exposed=e) for k, g, e in ((1, 100.0, 0), (2, 190.0, 0.1), (4, 200.0, 3.0))]
    rec = model.recommend(link, 0.1)
    assert rec.row.k == 2 and rec.constraint == "link" and "exposed communication" in rec.reason
    # the next row would need more memory than a node has
    mem = [_row(1, 100.0), _row(2, 300.0, fits=False)]
    assert model.recommend(mem, 0.1).constraint == "memory"


def test_fit_link_recovers_alpha_and_beta():
    link = Link("true", 30e-6, 2e9, "")
    rows = [{"size_bytes": n, "time_us": 1e6 * link.allreduce_s(n, 4), "ranks": 4} for n in (2**e for e in
                                                                                              range(10, 26))]
    fit = topology.fit_link(rows, 4)
    assert fit.alpha_s == pytest.approx(30e-6, rel=1e-6) and fit.beta_Bps == pytest.approx(2e9, rel=1e-6)
    assert topology.fit_link(rows, 4, lo=2**20, hi=2**24).beta_Bps == pytest.approx(2e9, rel=1e-6)


def test_presets_say_where_their_numbers_come_from():
    for name, (alpha, beta, kind, source) in topology.PRESETS.items():
        assert alpha > 0 and beta > 0 and kind in topology.NCCL_RING_STEP_US and len(source) > 30, name
        assert source.startswith(("measured:", "published:", "derived:", "nominal:")), name
        if source.startswith(("published:", "derived:")):
            assert "github.com/NVIDIA/nccl" in source, name  # the figure's citation


def test_default_buckets_follow_dataparallel():
    assert default_buckets(GRAD) == (MIB, GRAD - MIB)
    assert default_buckets(100 * MIB) == (MIB, 25 * MIB, 25 * MIB, 25 * MIB, 24 * MIB)
    assert sum(default_buckets(12345)) == 12345


# -- a workload by numbers, a cluster file -------------------------------------------------------------
def test_a_workload_by_numbers_predicts_what_the_same_profile_does(tmp_path):
    """The same step described by numbers (no check-in: not an mpisgd run) is the profile's prediction."""
    desc = tmp_path / "w.toml"
    desc.write_text('device = "cpu"\nbatch_per_rank = 128\nstep_ms = 16.0\nbackward_share = 0.6\n'
                    f"optimizer_ms = 1.0\ngrad_nbytes = {GRAD}\nbucket_nbytes = [{BUCKETS[0]}, {BUCKETS[1]}]\n"
                    "noise_scale = 1000.0\nlr = 0.003\noptimizer = \"adamw\"\n")
    w, rules = from_description(str(desc))
    assert (w.forward_ms, w.backward_ms, w.optimizer_ms) == pytest.approx((6.0, 9.0, 1.0))
    assert rules.lr == 0.003 and rules.optimizer == "adamw" and not w.check_in
    prof = profile(tmp_path, forward_ms=6.0)  # other_ms 0 then
    c = net(alpha_us=20, beta_gbit=10)
    for k in (2, 4):
        got = model.step_time(w, c, k, 1)
        want = model.step_time(prof, c, k, 1)
        assert got.step_ms == pytest.approx(want.step_ms - 1e3 * c.small_collective_s(k))


@pytest.mark.parametrize("line,says", [
    ("bucket_cap_mb = 1e-9", "bucket_cap_mb = 1e-09 MiB is under 1024 bytes"),
    ("fusion_mb = 1e-6", "fusion_mb = 1e-06 MiB is under 1024 bytes"),
    ("fusion_mb = 0.001\nparameters = 1000000000", "cuts the 4,000,000,000-byte gradient into more than 100,000"),
    ("bucket_cap_mb = 0.00098\nparameters = 1000000000", "cuts the 4,000,000,000-byte gradient into more than"),
])
def test_a_workloads_bucket_size_too_small_for_a_plan_is_one_line(tmp_path, capsys, line, says):
    """A bucket or fusion size under 1 KiB, or one cutting the gradient into more than 100,000 buckets: one
    line and exit 2. The bucket list had been built by a loop that never ended (a cap under 1 byte) or took
    seconds to minutes (O(n^2): a GPT-3-sized workload 4 s)."""
    desc = tmp_path / "w.toml"
    params = "" if "parameters" in line else "parameters = 1000000\n"
    desc.write_text(f"batch_per_rank = 32\nstep_ms = 10\n{params}{line}\n")
    assert plan.main(["--workload", str(desc), "--link", "10gbe", "--ranks", "1,2"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_a_gpt3_sized_workload_plans_at_once(tmp_path):
    """175 billion float16 parameters in 25 MiB buckets: 13,353 of them, made in O(n)."""
    from mpisgd.app.planner.workload import default_buckets

    buckets = default_buckets(175_000_000_000 * 2)
    assert sum(buckets) == 350_000_000_000 and len(buckets) == 13_353 and buckets[0] == 2**20
    with pytest.raises(plan.PlanError, match="more than 100,000 buckets"):
        default_buckets(4 * 10**30)


def test_cluster_file_and_flags_over_it(tmp_path, capsys):
    m = write_metrics(tmp_path / "m.jsonl")
    cluster = tmp_path / "c.toml"
    cluster.write_text('name = "test"\nranks_per_node = 4\nnodes = 2\nintra = "shm"\n'
                       'inter = { alpha_us = 20, busbw_gbs = 1.0, source = "a test" }\n')
    data = plan.run([m, "--cluster", str(cluster), "--json", str(tmp_path / "p.json")])
    assert [(r["k"], r["nodes"]) for r in data["rows"]] == [(1, 1), (2, 1), (4, 1), (8, 2)]
    assert data["cluster"]["inter"]["beta_Bps"] == 1e9 and data["cluster"]["ranks_per_node"] == 4
    data = plan.run([m, "--cluster", str(cluster), "--ranks-per-node", "2", "--link", "ib-edr"])
    assert [(r["k"], r["nodes"]) for r in data["rows"]] == [(1, 1), (2, 1), (4, 2)]
    assert data["cluster"]["inter"]["name"] == "ib-edr"
    cluster.write_text('ranks_per_node = 4\nspeed = "fast"\n')
    assert plan.main([m, "--cluster", str(cluster)]) == 2 and "unknown key(s) speed" in capsys.readouterr().err


# -- it reads the run it plans -------------------------------------------------------------------------
def test_rules_come_from_the_run_record_then_its_config_then_flags(tmp_path):
    m = write_metrics(tmp_path / "m.jsonl", run=run_record(lr=0.003, optimizer="adamw", base_batch=64,
                                                           lr_scaling="sqrt"))
    data = plan.run([m, "--ranks", "1,2", "--link", "10gbe"])
    assert data["rules"]["lr"] == 0.003 and data["rules"]["optimizer"] == "adamw"
    assert data["rows"][1]["lr"] == pytest.approx(scaled_lr(0.003, 64, 256, "sqrt"))
    data = plan.run([m, "--ranks", "1,2", "--link", "10gbe", "--lr", "0.01"])
    assert data["rules"]["lr"] == 0.01 and data["rules"]["optimizer"] == "adamw" and "--lr over" in \
        data["rules"]["source"]
    legacy = write_metrics(tmp_path / "old.jsonl", schema0=True)  # no run record: the config.toml beside it
    (tmp_path / "old.jsonl.config.toml").write_text('lr = 0.002\noptimizer = "lamb"\nbase_batch = 128\n')
    data = plan.run([legacy, "--ranks", "1,2", "--link", "10gbe"])
    assert (data["rules"]["lr"], data["rules"]["optimizer"], data["rules"]["base_batch"]) == (0.002, "lamb", 128)
    assert "config.toml" in data["rules"]["source"]


@serial_only
def test_planning_a_saved_adamw_run_uses_its_own_rate_and_optimizer(tmp_path):
    """Issue 39: an AdamW run at lr 0.003 was planned with the planner's --lr default (0.1: "lr 1.6" at
    B = 4096). The trainer's own metrics file now says its rate and optimizer, and the plan uses them."""
    metrics = tmp_path / "m.jsonl"
    r = subprocess.run([*mpiexec_cmd(1, "-m", "mpisgd.train"), "--dataset", "synthetic", "--synthetic-samples",
                        "2048", "--hidden", "32", "--batch-size", "32", "--accum-steps", "2", "--epochs", "2",
                        "--optimizer", "adamw", "--lr", "0.003", "--progress", "off", "--metrics-file", str(metrics)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "mpisgd.plan", str(metrics), "--ranks", "1,2,4", "--link", "1gbe",
                        "--json", str(out)], capture_output=True, text=True, timeout=60, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["rules"]["lr"] == 0.003 and data["rules"]["optimizer"] == "adamw"
    for row in data["rows"]:
        assert row["lr"] == pytest.approx(scaled_lr(0.003, 256, row["B"], "linear"))
    rec = data["recommended"]
    assert f"lr {rec['lr']:.4g} (adamw)" in r.stdout and "chosen by " + rec["constraint"] in r.stdout
    prof = data["workload"]
    assert (prof["k"], prof["b"], prof["m"]) == (1, 32, 2) and prof["noise_scale"] > 0
    assert prof["buckets_from"] == "the run record" and sum(prof["bucket_nbytes"]) == prof["grad_nbytes"]
    assert data["rows"][0]["step_ms"] == pytest.approx(prof["step_ms"])  # k = 1 at the profile's m is the profile


def test_a_file_two_runs_appended_to_plans_the_last_and_says_so(tmp_path, capsys):
    """Issue 38: the planner took the first run's steps with the last run's profile. Two runs appended to one
    file (the second at b=64, 300 steps): the plan is the second's alone, and the table says so."""
    path = tmp_path / "m.jsonl"
    write_metrics(path, step=400)
    second = run_record(local_batch=64, effective_batch=64, steps_per_epoch=150)
    lines = path.read_text() + "\n".join(json.dumps(to_json(r)) for r in [
        second, StepRecord(step=1, epoch=1, lr=0.1, loss=2.0, step_ms=9.0),
        epoch_record(epoch=1, step=150, local_batch=64, effective_batch=64, step_ms=9.0, noise_scale=500.0),
        epoch_record(epoch=2, step=300, local_batch=64, effective_batch=64, step_ms=8.0, noise_scale=600.0)]) + "\n"
    path.write_text(lines)
    data = plan.run([str(path), "--ranks", "1"])
    w = data["workload"]
    assert (w["b"], w["samples"], w["noise_scale"], w["step_ms"], w["steps_per_epoch"]) == (64, 300 * 64, 600.0,
                                                                                             8.0, 150)
    assert "the file holds 2 runs; planned: the last (line 7 on)" in capsys.readouterr().out
    legacy = tmp_path / "old.jsonl"  # schema 0: no run records; the second run's steps start again at 1
    write_metrics(legacy, schema0=True, step=400)
    legacy.write_text(legacy.read_text() + "\n".join(json.dumps(to_json(r)) for r in [
        StepRecord(step=1, epoch=1, lr=0.1, loss=2.0, step_ms=9.0),
        epoch_record(epoch=1, step=50, local_batch=64, effective_batch=64, noise_scale=700.0)]) + "\n")
    w = plan.run([str(legacy), "--ranks", "1"])["workload"]
    assert (w["b"], w["samples"], w["noise_scale"]) == (64, 50 * 64, 700.0)
    assert "assumed" in w["buckets_from"]


def test_the_plan_reads_the_run_records_fields_not_its_words(tmp_path):
    """The run record's allreduce_plan is for people: a sentence that says other bucket sizes or "after
    backward" changes nothing; bucket_nbytes and overlap decide."""
    words = "mpi (9 bucket(s): 1.00, 1.00 MiB), after backward"
    a = plan.run([write_metrics(tmp_path / "a.jsonl"), "--ranks", "1,2", "--link", "10gbe"])
    b = plan.run([write_metrics(tmp_path / "b.jsonl", run=run_record(allreduce_plan=words)), "--ranks", "1,2",
                  "--link", "10gbe"])
    assert a["rows"] == b["rows"] and tuple(b["workload"]["bucket_nbytes"]) == BUCKETS


# -- the command line ----------------------------------------------------------------------------------
def allreduce_json(path, ranks=2, backends=("auto", "mpi")):
    link = Link("t", 20e-6, 5e9, "")
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
    for key in ("k", "b", "m", "B", "step_ms", "samples_per_s", "statistical_efficiency", "scaling_efficiency",
                "goodput", "lr", "time_to_target_s", "steps_to_target", "exposed_comm_ms", "algorithm", "sharded"):
        assert all(key in r for r in data["rows"]), key
    assert data["recommended"]["k"] in (1, 2, 4, 8) and data["recommended"]["reason"]
    assert data["recommended"]["constraint"] in ("goodput plateau", "link", "memory", "ranks available")
    inter = data["cluster"]["inter"]
    assert inter["alpha_s"] == pytest.approx(20e-6, rel=1e-3) and inter["beta_Bps"] == pytest.approx(5e9, rel=1e-3)
    assert is_png(png)


def test_cli_defaults_follow_the_nodes(tmp_path):
    m = write_metrics(tmp_path / "m.jsonl")
    data = plan.run([m, "--nodes", "4", "--ranks-per-node", "2", "--alpha-us", "25", "--beta-gbit", "10"])
    assert [(r["k"], r["nodes"]) for r in data["rows"]] == [(1, 1), (2, 1), (4, 2), (8, 4)]


def test_console_script_is_declared():
    assert "mpisgd-plan=mpisgd.app.plan:main" in (ROOT / "setup.py").read_text()


def _bad_metrics(path, case):
    if case == "not json":
        path.write_text('{"kind": "epoch"}\nepoch 1/2 loss 0.5\n')
    elif case == "no epochs":
        path.write_text('{"kind": "step", "step": 1, "epoch": 1, "lr": 0.1, "loss": 0.3, "step_ms": 1.0}\n')
    elif case == "other program":
        path.write_text('{"kind": "epoch", "epoch": 1, "loss": 0.3, "accuracy": 0.9}\n')
    elif case == "no noise":
        write_metrics(path, epochs=[epoch_record(noise_scale=None)])
    elif case == "bad batch":
        write_metrics(path, epochs=[epoch_record(effective_batch=100)])
    elif case == "schema 9":
        write_metrics(path)
        path.write_text(path.read_text().replace('"schema": 1', '"schema": 9'))
    elif case == "nan bucket":
        write_metrics(path)
        path.write_text(path.read_text().replace(f"[{BUCKETS[0]}, ", "[null, "))  # how NaN is written
    elif case == "negative bucket":
        write_metrics(path, run=run_record(bucket_nbytes=(-5, 9)))
    elif case == "negative time":
        write_metrics(path, forward_ms=-3.0)
    elif case == "infinite time":
        write_metrics(path)
        path.write_text(path.read_text().replace('"backward_ms": 9.0', '"backward_ms": Infinity'))
    elif case == "step 0":
        write_metrics(path, epochs=[epoch_record(step=0, epoch=1)])
    elif case == "zero times":  # every phase 0 ms and a step of 5e-324 ms: 1e3 * B / step is inf samples/s
        write_metrics(path, forward_ms=0.0, backward_ms=0.0, optimizer_ms=0.0, comm_exposed_ms=0.0, step_ms=5e-324)
    elif case == "npz":
        import numpy as np

        with open(path, "wb") as f:  # np.savez(path) would append .npz to the name
            np.savez(f, flat=np.zeros(3))
    else:
        write_metrics(path)


@pytest.mark.parametrize("case,args,message", [
    ("not json", [], "not JSON"),
    ("no epochs", [], "no epoch records"),
    ("other program", [], "without"),
    ("no noise", [], "no noise_scale"),
    ("no noise", ["--ranks", "1,2,x"], "--ranks must be comma-separated whole numbers"),  # the option first
    ("no noise", ["--accum-steps", "0"], "--accum-steps must be whole numbers >= 1"),
    ("bad batch", [], "do not make B"),
    ("schema 9", [], "metrics schema 9; this mpisgd reads schema 0, 1"),
    ("nan bucket", [], "bucket_nbytes[0] is null"),
    ("negative bucket", ["--ranks", "1"], "must be a finite number > 0"),
    ("negative time", ["--ranks", "1"], "forward_ms is -3.0"),
    ("infinite time", ["--ranks", "1"], "backward_ms is inf"),
    ("step 0", ["--ranks", "1"], "at step 0"),
    ("npz", [], "is not text"),
    ("ok", ["--ranks", "0,2"], "--ranks must be whole numbers >= 1"),
    ("ok", ["--ranks", "1,two"], "--ranks must be comma-separated whole numbers"),
    ("ok", ["--ranks", ","], "--ranks must be whole numbers"),
    ("ok", ["--ranks", "9" * 400], "--ranks must be at most"),
    ("ok", ["--ranks", "16", "--nodes", "2", "--ranks-per-node", "4", "--link", "10gbe"], "is more than 2 nodes"),
    ("ok", ["--ranks", "1,2", "--alpha-us", "3"], "go together"),
    ("ok", ["--ranks", "1,2", "--link", "carrier-pigeon"], "neither a preset"),
    ("ok", ["--ranks", "1,2,4"], "give the link between them"),
    ("ok", ["--noise-scale", "-3", "--ranks", "1"], "--noise-scale must be > 0"),
    ("ok", ["--noise-scale", "inf", "--ranks", "1"], "--noise-scale must be a finite number"),
    ("ok", ["--lr", "1e308", "--ranks", "1,64", "--link", "10gbe"], "lr comes out inf"),
    ("ok", ["--target-epochs", "1e-300", "--ranks", "1"], "less than one sample"),
    ("ok", ["--epoch", "7", "--ranks", "1"], "no epoch 7"),
    ("ok", ["--ranks", "2", "--link", "BAD_AR"], "not an allreduce_bw.py --json output"),
    ("ok", ["--ranks", "2", "--link", "WRONG_SHAPE"], "lacks size_bytes"),
    ("ok", ["--ranks", "2", "--link", "AR", "--backend", "ring"], "no rows for backend 'ring'"),
    ("ok", ["--ranks", "1", "--plot", "PLOT_XYZ"], "is not one of .png"),
    ("ok", ["--ranks", "1", "--json", "DIR"], "is a directory"),
    ("ok", ["--ranks", "1", "--json", "METRICS"], "is an input of this plan"),
    ("ok", ["--ranks", "1", "--cluster", "CONFIG_PNG", "--plot", "CONFIG_PNG"], "is an input of this plan"),
    ("ok", ["--ranks", "1", "--workload", "AR"], "give one workload"),
    # a link of 1e-320 Gbit/s: a step of inf ms, 0 samples/s, and a ZeroDivisionError after it
    ("ok", ["--alpha-us", "0", "--beta-gbit", "1e-320"], "k=2, m=1: step_ms comes out inf: the inputs are out of "
                                                         "range (check the link's bandwidth"),
    ("zero times", ["--ranks", "1,2", "--link", "10gbe"], "k=1, m=1: samples_per_s comes out inf"),
    ("ok", ["--ranks", "1", "--target-epochs", "0"], "--target-epochs must be > 0, got 0.0"),
    ("ok", ["--ranks", "1", "--target-epochs", "-1"], "--target-epochs must be > 0, got -1.0"),
    ("ok", ["--ranks", "1,2", "--link", "10gbe", "--backend", "nosuch"], "--backend nosuch picks the rows of a "
                                                                         "link measured by allreduce_bw.py"),
    ("ok", ["--ranks", "", "--link", "10gbe"], "--ranks is empty: give comma-separated whole numbers (an unset "
                                               "shell variable?)"),
    ("ok", ["--ranks", "1", "--accum-steps", ""], "--accum-steps is empty"),
    ("ok", ["--ranks", "1,2", "--link", ""], "--link is empty: give a path (an unset shell variable?)"),
    ("ok", ["--ranks", "1", "--json", ""], "--json is empty"),
    ("ok", ["--ranks", "1", "--optimizer", "adam"], "argument --optimizer: invalid choice: 'adam' (choose from "
                                                    "'sgd', 'lars', 'adamw', 'lamb')"),
    ("ok", ["--ranks", "1", "--library", "gloo"], "argument --library: invalid choice"),  # one line, no usage
    ("ok", ["--ranks", "1", "--cluster", "C_ZERO"], "c0.toml: ranks_per_node is 0: it must be a finite number > 0"),
    ("ok", ["--ranks", "1", "--cluster", "C_FALSE"], "cf.toml: ranks_per_node is False, not a number"),
    ("ok", ["--ranks", "1", "--cluster", "C_HALF"], "ch.toml: ranks_per_node is 1.5: it must be a whole number"),
    ("ok", ["--ranks", "1", "--json", "NOTES"], "notes.txt exists and is not a plan this tool wrote: the plan "
                                                "would replace it; remove it or choose another path"),
    ("ok", ["--ranks", "1", "--plot", "NOTES_PNG"], "notes.png exists and is not a plot (matplotlib's)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, args, message):
    path = tmp_path / "m.jsonl"
    _bad_metrics(path, case)
    (tmp_path / "bad.json").write_text("# allreduce_bw: k=2\n")
    (tmp_path / "shape.json").write_text(json.dumps({"rows": [{"size": 4}]}) + "\n")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "c.png").write_text('ranks_per_node = 1\n')
    for name, value in (("c0.toml", "0"), ("cf.toml", "false"), ("ch.toml", "1.5")):
        (tmp_path / name).write_text(f"ranks_per_node = {value}\n")
    for name in ("notes.txt", "notes.png"):
        (tmp_path / name).write_text("my notes\n")
    allreduce_json(tmp_path / "ar.json")
    subst = {"BAD_AR": tmp_path / "bad.json", "WRONG_SHAPE": tmp_path / "shape.json", "AR": tmp_path / "ar.json",
             "PLOT_XYZ": tmp_path / "p.xyz", "DIR": tmp_path / "dir.json", "METRICS": path,
             "CONFIG_PNG": tmp_path / "c.png", "C_ZERO": tmp_path / "c0.toml", "C_FALSE": tmp_path / "cf.toml",
             "C_HALF": tmp_path / "ch.toml", "NOTES": tmp_path / "notes.txt", "NOTES_PNG": tmp_path / "notes.png"}
    args = [str(subst.get(a, a)) for a in args]
    before = path.read_bytes()
    assert plan.main([str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mpisgd.plan: error: ") and message in err, err
    assert path.read_bytes() == before  # an input is never written over
    for name in ("notes.txt", "notes.png"):  # nor a file of the user's
        assert (tmp_path / name).read_text() == "my notes\n"


@pytest.mark.parametrize("line,args,says", [
    ("", [], "w.toml: batch_per_rank is missing"),  # was "batch_per_rank is None, not a number"
    ("batch_per_rank = 32\ntarget_samples = 100000\nnoise_scale = 100", ["--step-ms", "5e-324"],
     "k=1, m=1: samples_per_s comes out inf"),  # a ZeroDivisionError in the speedup
    ("batch_per_rank = 32", ["--epoch", "7"], "--epoch 7 applies to a metrics file (which epoch's times to "
                                              "profile); a --workload gives its times itself: drop --epoch"),
])
def test_a_workloads_bad_numbers_and_ignored_flags_are_one_line(tmp_path, capsys, line, args, says):
    desc = tmp_path / "w.toml"
    step = args[1] if args[:1] == ["--step-ms"] else "10"
    desc.write_text(f"{line}\nstep_ms = {step}\nparameters = 1000000\n")
    flags = [] if args[:1] == ["--step-ms"] else args
    assert plan.main(["--workload", str(desc), "--link", "10gbe", "--ranks", "1,2", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpisgd.plan: error: ") and says in err and err.count("\n") == 1, err


def test_json_and_plot_replace_only_an_earlier_plans(tmp_path, capsys):
    """--json notes.txt replaced the user's file: an output is replaced only when empty or the plan's own."""
    m = write_metrics(tmp_path / "m.jsonl")
    out, image = tmp_path / "p.json", tmp_path / "p.png"
    out.write_text("")
    for _ in range(2):  # an empty file, then the earlier plan: both replaced (a rerun of one command)
        assert plan.main([m, "--ranks", "1", "--json", str(out), "--plot", str(image)]) == 0
        assert set(json.loads(out.read_text())) >= report.PLAN_KEYS and is_png(image)
    assert report.is_plan_json(io.BytesIO(out.read_bytes())) and not report.is_plan_json(io.BytesIO(b"[1, 2]"))
    assert not report.is_plan_json(io.BytesIO(json.dumps({"rows": []}).encode()))
    assert not report.is_plan_json(io.BytesIO(b"\xff\xfe notes"))


def test_ctrl_c_is_one_line_and_130(tmp_path, capsys, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "plan", interrupted)
    try:
        assert plan.main([write_metrics(tmp_path / "m.jsonl"), "--ranks", "1"]) == 130
    except KeyboardInterrupt:  # pytest would take it for its own Ctrl-C
        pytest.fail("a KeyboardInterrupt traceback")
    assert capsys.readouterr().err == "mpisgd.plan: interrupted (SIGINT) (exit 130)\n"


def test_json_on_a_full_disk_is_one_line_and_leaves_no_file(tmp_path, capsys, monkeypatch):
    m = write_metrics(tmp_path / "m.jsonl")
    real = report.atomic_write

    def full(path, write):
        def short(f):
            write(f)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, short)

    monkeypatch.setattr(report, "atomic_write", full)
    assert plan.main([m, "--ranks", "1", "--json", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]  # no half-written file, no temporary


def test_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    m = write_metrics(tmp_path / "m.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # Python's own mark for "cannot be imported"
    assert plan.main([m, "--ranks", "1", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--plot needs matplotlib" in err
    assert not (tmp_path / "p.png").exists()


def test_a_fifo_is_refused_not_read_for_ever(tmp_path):
    """Issue 38: `python -m mpisgd.plan FIFO` blocked in open(). A FIFO (and a FIFO as the link's file) is
    refused in one line, at once."""
    fifo = tmp_path / "m.jsonl"
    os.mkfifo(fifo)
    good = write_metrics(tmp_path / "good.jsonl")
    for argv in ([str(fifo), "--ranks", "1"], [good, "--ranks", "2", "--link", str(fifo)]):
        r = subprocess.run([sys.executable, "-m", "mpisgd.plan", *argv], capture_output=True, text=True,
                           timeout=30, cwd=ROOT, env=clean_env())
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a regular file" in r.stderr, r.stderr


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


# -- against published results -------------------------------------------------------------------------
def test_published_cases_are_planned_and_the_doc_shows_this_table():
    """experiments/plan_published.py plans every published case from its described workload and cluster;
    docs/plan.md shows the very table it prints (the doc cannot drift from the model)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import plan_published

    results = plan_published.compare()
    assert len({(r["source"], r["model"]) for r in results}) >= 4
    for r in results:
        assert 0 < r["predicted"] <= 1.0 + 1e-9 and math.isfinite(r["difference_pp"]), r
    doc = (ROOT / "docs" / "plan.md").read_text()
    missing = [line for line in plan_published.markdown(results).splitlines() if line not in doc]
    assert not missing, "docs/plan.md's published table differs from experiments/plan_published.py:\n" + \
        "\n".join(missing)


@pytest.mark.parametrize("optimizer,says", [("sgd", "plain SGD may need warmup or LARS there"),
                                            ("lars", "lars may need warmup there"),
                                            ("adamw", "AdamW may need warmup or LAMB there")])
def test_the_large_batch_note_names_the_runs_own_optimizer(tmp_path, capsys, optimizer, says):
    """With --optimizer lars the note still advised LARS."""
    m = write_metrics(tmp_path / "m.jsonl")
    assert plan.main([m, "--ranks", "1,64", "--link", "10gbe", "--optimizer", optimizer]) == 0
    note = [x for x in capsys.readouterr().out.splitlines() if "are the scaling rule's" in x]
    assert len(note) == 1 and says in note[0], note
