"""Multi-node runs over emulated hosts (scripts/cluster/netcluster.py): network namespaces,
veth links through a bridge, MPICH's ssh launcher pointed at a wrapper.

Serial tests (each launches its own mpiexec); they need root and ``ip netns`` and
skip with the reason otherwise. Every run has a hard timeout. What they check:
the same training run gives the same parameters across 2 or 3 emulated hosts as on
one host, for every all-reduce strategy that can cross hosts (``shared`` refuses, clearly);
the data crossed the links (byte counters); a cut link ends the job, never hangs.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, run_mpi

pytestmark = pytest.mark.alone  # times jobs or waits for them: run apart (pytest.ini)

spec = importlib.util.spec_from_file_location("netcluster", ROOT / "scripts" / "cluster" / "netcluster.py")
assert spec is not None and spec.loader is not None
netcluster = importlib.util.module_from_spec(spec)
sys.modules["netcluster"] = netcluster  # dataclasses look their module up by name
spec.loader.exec_module(netcluster)
NetCluster = netcluster.NetCluster

ALL_STRATEGIES = ("mpi", "ring", "deterministic", "auto")
STEPS = 6
# small and float64: the comparison is about arithmetic, not speed (2 shared cores)
TRAIN = ["-m", "mpisgd.train", "--dataset", "synthetic", "--dtype", "float64", "--hidden", "48,48",
         "--synthetic-samples", "1024", "--limit-test", "200", "--batch-size", "32", "--max-steps", str(STEPS),
         "--progress", "off", "--threads", "1", "--seed", "3"]
MODEL_BYTES = (784 * 48 + 48 + 48 * 48 + 48 + 48 * 10 + 10) * 8  # float64 parameters = gradient bytes per step
RUN_TIMEOUT_S = 120
BANNER = re.compile(r"k=(\d+) rank\(s\) on (\d+) node\(s\)")


@pytest.fixture(scope="module")
def available() -> None:
    try:
        netcluster.check_permitted()
    except netcluster.ClusterUnavailable as exc:
        pytest.skip(str(exc))


def strategies_now() -> tuple[str, ...]:
    """The strategies mpisgd offers at test time."""
    out = subprocess.run([sys.executable, "-c", "from mpisgd.comm import STRATEGIES; print(','.join(STRATEGIES))"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    return tuple(out.stdout.strip().split(",")) if out.returncode == 0 else ()


def train_args(model: Path, *extra: str) -> list[str]:
    return [*TRAIN, "--save-model", str(model), *extra]


def one_host(k: int, model: Path, *extra: str) -> np.ndarray:
    res = run_mpi(k, *train_args(model, *extra), timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert res.returncode == 0, f"one-host run failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return np.load(model)["flat"]


def on_cluster(cluster: NetCluster, model: Path, *extra: str) -> tuple[np.ndarray, str]:
    res = cluster.run([sys.executable, *train_args(model, *extra)], timeout=RUN_TIMEOUT_S)
    assert not res.timed_out, f"cluster run hung (> {RUN_TIMEOUT_S} s):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    assert res.returncode == 0, f"cluster run failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    # the gradients crossed every link: at least one model's worth of bytes per step in total
    cluster.check_traffic(res, min_bytes=STEPS * MODEL_BYTES)
    return np.load(model)["flat"], res.stdout


def layout(stdout: str) -> tuple[int, int]:
    m = BANNER.search(stdout)
    assert m, f"no 'k=N rank(s) on M node(s)' banner in:\n{stdout[:1000]}"
    return int(m.group(1)), int(m.group(2))


def assert_same(cluster_flat: np.ndarray, host_flat: np.ndarray) -> None:
    # float64: the only differences allowed are summation-order roundings (k >= 3), not a wrong reduction
    assert cluster_flat.shape == host_flat.shape
    np.testing.assert_allclose(cluster_flat, host_flat, rtol=1e-10, atol=1e-12)


# --- the tool itself -------------------------------------------------------------------------

def test_cleans_up_everything_even_on_error(available: None) -> None:
    made: dict[str, object] = {}
    with pytest.raises(RuntimeError, match="boom"), NetCluster(hosts=3, ranks_per_host=1, rate="1gbit") as c:
        made = {"namespaces": [h.ns for h in c.hosts] + [c.switch], "workdir": c.workdir}
        # the hosts see each other by name, and each link carries its rate limit
        hosts_file = (netcluster.NETNS_ETC / c.hosts[1].ns / "hosts").read_text()
        assert "10.213.0.1 h1" in hosts_file and "10.213.0.3 h3" in hosts_file
        qdisc = subprocess.run(["tc", "-n", c.hosts[0].ns, "qdisc", "show", "dev", netcluster.IFACE],
                               capture_output=True, text=True, timeout=20).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
        raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    for ns in made["namespaces"]:  # type: ignore[union-attr]
        assert ns not in listed
        assert not (netcluster.NETNS_ETC / ns).exists()
    assert not Path(str(made["workdir"])).exists()


def test_removes_stale_namespaces_of_dead_runs(available: None) -> None:
    """A SIGKILLed run leaves its namespaces; the next cluster removes those whose creator is gone."""
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    stale = f"{netcluster.PREFIX}{dead.pid}x0-h1"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=20)
    (netcluster.NETNS_ETC / stale).mkdir(parents=True, exist_ok=True)
    try:
        with NetCluster(hosts=2):
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
            assert stale not in listed
            assert not (netcluster.NETNS_ETC / stale).exists()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=20)
        shutil.rmtree(netcluster.NETNS_ETC / stale, ignore_errors=True)


def test_cli_cleans_up_when_terminated(available: None) -> None:
    """SIGTERM to the CLI mid-run: the job and every namespace it made are gone afterwards."""
    cli = [sys.executable, str(ROOT / "scripts" / "cluster" / "netcluster.py"), "run", "--hosts", "2", "--",
           "sleep", "600"]
    proc = subprocess.Popen(cli, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        tag = None
        deadline = time.monotonic() + 60
        assert proc.stderr is not None
        while tag is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "the CLI ended before it described the cluster"
            m = re.search(r"namespaces (\S+)-\*", line)
            tag = m.group(1) if m else None
        assert tag, "no cluster description within 60 s"
        deadline = time.monotonic() + 30  # until the ranks (sleep) run on both hosts
        while not all(subprocess.run(["ip", "netns", "pids", f"{tag}-h{i}"], capture_output=True, text=True,
                                     timeout=20).stdout.strip() for i in (1, 2)):
            assert time.monotonic() < deadline, "the job did not start on both hosts"
            time.sleep(0.2)
        proc.terminate()
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert rc != 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert tag not in listed, listed
    assert not any(p.name.startswith(tag) for p in netcluster.NETNS_ETC.iterdir())
    assert not any(p.name.startswith(tag) for p in Path(tempfile.gettempdir()).iterdir())


def test_distinct_host_names_and_node_split(available: None) -> None:
    probe = ("import socket; from mpi4py import MPI; c = MPI.COMM_WORLD; "
             "s = c.Split_type(MPI.COMM_TYPE_SHARED); rows = c.gather(f'{c.rank} {socket.gethostname()} {s.size}'); "
             "print(chr(10).join(rows or []))")
    with NetCluster(hosts=2, ranks_per_host=2) as c:
        res = c.run([sys.executable, "-c", probe], timeout=60)
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.strip()]
    # ranks 0,1 on h1 and 2,3 on h2; MPI's shared-memory split follows the emulated hosts
    assert rows == [["0", "h1", "2"], ["1", "h1", "2"], ["2", "h2", "2"], ["3", "h2", "2"]], res.stdout


def test_byte_counters_catch_shared_memory_fallback(available: None) -> None:
    """With UCX's default transports the data goes through shared memory between namespaces:
    the traffic check must refuse such a run as multi-node."""
    code = ("import numpy as np; from mpi4py import MPI; a = np.ones(1 << 20); "
            "[MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, a) for _ in range(4)]")
    with NetCluster(hosts=2, ranks_per_host=1, extra_env={"UCX_TLS": "all"}) as c:
        res = c.run([sys.executable, "-c", code], timeout=60)
        assert res.returncode == 0, res.stderr
        with pytest.raises(netcluster.TrafficError):
            c.check_traffic(res, min_bytes=8 << 20)
    with NetCluster(hosts=2, ranks_per_host=1) as c:  # UCX_TLS=tcp,self: 4 x 8 MiB cross the link
        res = c.run([sys.executable, "-c", code], timeout=60)
        assert res.returncode == 0, res.stderr
        c.check_traffic(res, min_bytes=8 << 20)


def test_rate_limit_slows_the_link(available: None) -> None:
    """At 100 Mbit/s, two 8 MiB all-reduces between 2 hosts (each rank sends ~8 MiB per all-reduce)
    cannot take less than 16 MiB / 12.5 MB/s = 1.34 s; unlimited, they take a fraction of that here."""
    code = ("import time, numpy as np; from mpi4py import MPI; c = MPI.COMM_WORLD; a = np.ones(1 << 20); "
            "c.Allreduce(MPI.IN_PLACE, a[:8]); c.Barrier(); t = time.perf_counter(); "
            "[c.Allreduce(MPI.IN_PLACE, a) for _ in range(2)]; e = c.allreduce(time.perf_counter() - t, op=MPI.MAX); "
            "print('ELAPSED', e) if c.rank == 0 else None")
    floor_s = 2 * (8 << 20) / (100e6 / 8)
    with NetCluster(hosts=2, ranks_per_host=1, rate="100mbit") as c:
        res = c.run([sys.executable, "-c", code], timeout=60)
    assert res.returncode == 0, res.stderr
    elapsed = float(res.stdout.split("ELAPSED")[1])
    assert elapsed >= 0.8 * floor_s, f"{elapsed:.2f} s for 16 MiB at 100 Mbit/s: the rate limit is not applied"


# --- training across hosts = training on one host -------------------------------------------

@pytest.mark.parametrize(("hosts", "per_host"), [(2, 1), (3, 1)])
def test_training_matches_one_host(available: None, tmp_path: Path, hosts: int, per_host: int) -> None:
    k = hosts * per_host
    ref = one_host(k, tmp_path / "one.npz", "--allreduce", "mpi")
    with NetCluster(hosts=hosts, ranks_per_host=per_host) as c:
        flat, out = on_cluster(c, tmp_path / "cluster.npz", "--allreduce", "mpi")
    assert layout(out) == (k, hosts)
    assert_same(flat, ref)


# ids not equal to "mpi": pytest-mpi treats a bare "mpi" keyword as its marker and skips the test serially
@pytest.mark.parametrize("strategy", ALL_STRATEGIES, ids=[f"allreduce-{s}" for s in ALL_STRATEGIES])
def test_strategy_matches_one_host(available: None, tmp_path: Path, strategy: str) -> None:
    """2 hosts x 2 ranks: the node split is real (2 nodes of 2)."""
    offered = strategies_now()
    if strategy not in offered:
        pytest.skip(f"--allreduce {strategy} is not offered by mpisgd.comm yet (STRATEGIES={offered})")
    # two buckets, so the strategies see several buffers per step
    extra = ("--allreduce", strategy, "--bucket-mb", "0.1")
    ref = one_host(4, tmp_path / "one.npz", *extra)
    with NetCluster(hosts=2, ranks_per_host=2) as c:
        flat, out = on_cluster(c, tmp_path / "cluster.npz", *extra)
    assert layout(out) == (4, 2)
    assert "h1: ranks 0-1 | h2: ranks 2-3" in out, out[:1500]
    if strategy == "auto":  # no node-shared buffer across hosts: mpi or ring, measured for the buckets
        kind = "reduce-scatter float64" if "step sharded" in out else "float64"  # what the step needs
        assert f"all-reduce: auto: {kind}" in out, out[:1500]
    assert_same(flat, ref)


def test_shared_strategy_across_hosts_is_refused_in_one_line(available: None, tmp_path: Path) -> None:
    with NetCluster(hosts=2, ranks_per_host=1) as c:
        r = c.run([sys.executable, *train_args(tmp_path / "x.npz", "--allreduce", "shared")], timeout=RUN_TIMEOUT_S)
    assert not r.timed_out and r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("mpisgd: error") == 1 and "every rank on one node" in r.stderr, r.stderr


# --- a cut cable ------------------------------------------------------------------------------

STALL_S = 5.0
CUT_BOUND_S = 40.0  # after the cut: stall timeout + the abort's own time, with room for a loaded machine


def test_cut_link_ends_the_job(available: None, tmp_path: Path) -> None:
    """Cut h2's cable mid-training. MPICH by itself does not notice (blocked collective, no data in flight,
    no keep-alive: seen hanging > 120 s here); mpisgd's stall watchdog must end the job non-zero."""
    metrics = tmp_path / "metrics.jsonl"
    args = [sys.executable, *TRAIN[:TRAIN.index("--max-steps")], "--max-steps", "1000000", "--epochs", "100000",
            "--progress", "off", "--metrics-file", str(metrics), "--stall-timeout", str(STALL_S), "--stall-abort"]
    with NetCluster(hosts=2, ranks_per_host=1) as c:
        before = c.link_bytes()
        t0 = time.monotonic()
        proc = c.popen(args)
        try:
            deadline = time.monotonic() + 60
            while not (metrics.exists() and metrics.read_text().count('"kind":"step"') >= 3):
                assert proc.poll() is None, f"training ended before the cut: {proc.communicate(timeout=10)}"
                assert time.monotonic() < deadline, "training did not start within 60 s"
                time.sleep(0.2)
            c.link_down("h2")
            t_cut = time.monotonic()
            res = c.wait(proc, CUT_BOUND_S, before, t0)
        finally:
            if proc.poll() is None:
                c.kill_jobs()
        after_cut = time.monotonic() - t_cut
        steps = metrics.read_text().count('"kind":"step"')
        # mpiexec cannot reach the cut-off host: what it left running there (a real cluster keeps those)
        orphans = subprocess.run(["ip", "netns", "pids", c.hosts[1].ns], capture_output=True, text=True,
                                 timeout=20).stdout.split()
    print(json.dumps({"rc": res.returncode, "timed_out": res.timed_out, "s_after_cut": round(after_cut, 1),
                      "steps": steps, "processes_left_on_h2": len(orphans), "stderr": res.stderr[-600:]}))
    text = res.stdout + res.stderr
    assert not res.timed_out, f"job still running {CUT_BOUND_S} s after the cut:\n{res.stderr[-2000:]}"
    assert res.returncode != 0, "a job whose link was cut must not report success"
    assert "stall" in text.lower(), f"no stall report:\n{res.stderr[-2000:]}"
