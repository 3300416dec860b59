"""The project's own Slurm batch script, run on a real one-node Slurm started for this test.

Needs root: it installs Debian's slurm-wlm and munge when missing, writes a
slurm.conf and a munge key in a temporary directory, starts munged, slurmctld
and slurmd in the foreground (so their process ids are ours), submits
scripts/slurm/train_cpu.sbatch with ``sbatch --wait``, and stops exactly those
daemons afterwards. Nothing outside the temporary directory is configured.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ONE_THREAD, ROOT

pytestmark = pytest.mark.xdist_group("slurm")  # one worker starts the Slurm daemons for the module

FASHION = Path("/usr/share/datasets/fashion-mnist")
SHM = Path("/dev/shm")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


@pytest.fixture(autouse=True)
def _serial_only(request: pytest.FixtureRequest) -> None:
    """Starts its own daemons and mpiexec: never once per rank under mpiexec."""
    if request.config.getoption("--with-mpi", default=False):
        pytest.skip("starts its own Slurm: serial runs only")


def _ensure_slurm() -> None:
    """Install slurm-wlm and munge with apt-get when missing; skip where that cannot be done."""
    if all(shutil.which(d) for d in DAEMONS):
        return
    if os.geteuid() != 0:
        pytest.skip("Slurm is not installed and installing it (apt-get install slurm-wlm munge) needs root")
    if shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and there is no apt-get to install slurm-wlm and munge")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        if r.returncode != 0:
            pytest.skip(f"could not install Slurm ({' '.join(cmd)} exit {r.returncode}): {r.stderr[-500:]}")
    missing = [d for d in DAEMONS if not shutil.which(d)]
    assert not missing, f"installed slurm-wlm and munge but {missing} are not on PATH"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    dir: Path
    host: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env)

    def logs(self) -> str:
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            p = self.dir / name
            if p.exists():
                parts.append(f"--- {name} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)


def _write_config(d: Path, host: str) -> Path:
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir(mode=0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    conf = d / "slurm.conf"
    conf.write_text(f"""\
ClusterName=mpisgdtest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s; Slurm takes 5 at least)
AuthInfo=socket={d}/munge/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: plain process tracking, no task binding (works in containers)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
# run the scheduler every 2 s: a requeued job becomes eligible with no event to start it
SchedulerParameters=sched_interval=2
KillWait=5
# MPICH names its /dev/shm segment after <job id>.<step id> under srun, and killed jobs leave theirs
# behind: job ids that start where the last test's did would attach to those (see docs/slurm.md)
FirstJobId={secrets.randbelow(6 * 10**7) + 10**6}
NodeName={host} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("needs root: slurmd runs jobs as any user only as root, and munged/slurm need a key")
    _ensure_slurm()
    d = tmp_path_factory.mktemp("slurm")
    d.chmod(0o700)  # munged refuses directories others can write to
    host = socket.gethostname().split(".")[0]
    conf = _write_config(d, host)
    env = {**os.environ, **ONE_THREAD, "SLURM_CONF": str(conf), "PYTHONPATH": str(ROOT)}
    c = Cluster(d, host, env)
    shm_before = set(SHM.glob("mpich_*"))

    def start(name: str, *cmd: str) -> None:
        log = open(d / f"{name}.out", "w")  # noqa: SIM115 - closed with the process
        c.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    try:
        start("munged", "munged", "--foreground", "--force", f"--key-file={d}/munge/munge.key",
              f"--socket={d}/munge/munge.socket", f"--pid-file={d}/munge/munged.pid",
              f"--seed-file={d}/munge/munged.seed", f"--log-file={d}/munged.log")
        _wait_for((d / "munge" / "munge.socket").exists, 20, "munged's socket", c)
        start("slurmctld", "slurmctld", "-D", "-i", "-f", str(conf))
        start("slurmd", "slurmd", "-D", "-f", str(conf), "-N", host)
        _wait_for(lambda: c.run("sinfo", "-h", "-N", "-o", "%t").stdout.strip() == "idle", 90,
                  "the node to be idle in sinfo", c)
        yield c
    finally:
        if "slurmctld" in c.procs and c.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--partition=debug"], env=env, capture_output=True, timeout=30)
        for name in ("slurmd", "slurmctld", "munged"):  # exactly the daemons we started, by their pid
            p = c.procs.get(name)
            if p is None:
                continue
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        _remove_orphaned_shm(shm_before)


def _remove_orphaned_shm(before: set[Path]) -> None:
    """Delete the MPICH segments that appeared during the test and that no process maps any more."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line)
        except OSError:
            continue  # the process ended, or is not ours to read
    for f in set(SHM.glob("mpich_*")) - before:
        try:
            if str(f) not in mapped and time.time() - f.stat().st_mtime > 5:
                f.unlink()
        except OSError:
            pass


def _wait_for(pred, timeout_s: float, what: str, c: Cluster) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, p in c.procs.items():
            if p.poll() is not None:
                out = (c.dir / f"{name}.out").read_text(errors="replace")
                pytest.fail(f"{name} exited with {p.returncode} while waiting for {what}:\n{out}\n{c.logs()}")
        try:
            if pred():
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}\n{c.logs()}")


def _submit(c: Cluster, work: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 240,
            script: str = "train_cpu.sbatch", sbatch: tuple[str, ...] = ()) -> tuple[int, str, str, str]:
    """Submit one of the project's scripts and wait for its job to end; returns (job id, its final state, its
    exit code as Slurm records it, Slurm's output file). Polled here, not with ``sbatch --wait``, whose
    checks back off to every 10 s: a job of three seconds would cost ten."""
    r = subprocess.run(["sbatch", f"--chdir={work}", "--output=job-%j.out", *sbatch,
                        str(ROOT / "scripts" / "slurm" / script), *args],
                       capture_output=True, text=True, timeout=60, env={**c.env, **(env or {})})
    m = re.search(r"Submitted batch job (\d+)", r.stdout)
    assert r.returncode == 0 and m, f"sbatch did not submit: {r.stdout}\n{r.stderr}\n{c.logs()}"
    job = int(m.group(1))
    state = _wait_job(c, job, timeout)
    code = _job_state(c, job)[1]
    out = work / f"job-{job}.out"
    return job, state, code, out.read_text(errors="replace") if out.exists() else ""


def _job_state(c: Cluster, job: int) -> tuple[str, str]:
    text = c.run("scontrol", "show", "job", str(job)).stdout
    state = re.search(r"JobState=(\S+)", text)
    code = re.search(r"\bExitCode=(\S+)", text)
    return (state.group(1) if state else "?"), (code.group(1) if code else "?")


ARGS = ("--epochs", "1", "--limit-train", "6000", "--limit-test", "2000", "--batch-size", "64")


@pytest.mark.skipif(not FASHION.is_dir(), reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_train_cpu_sbatch_on_real_slurm(cluster: Cluster, tmp_path: Path, launcher: str) -> None:
    """With srun the options come in MPISGD_ARGS, with mpiexec from a config file (MPISGD_CONFIG)."""
    run_dir = tmp_path / "run"
    options = {"MPISGD_ARGS": "--hidden 256,128 --seed 3"}
    if launcher == "mpiexec":
        (tmp_path / "run.toml").write_text("hidden = [256, 128]\nseed = 3\nmetrics-file = 'ignored.jsonl'\n")
        options = {"MPISGD_CONFIG": str(tmp_path / "run.toml")}
    job, state, code, out = _submit(cluster, tmp_path, *ARGS,
                                    env={"RUN_DIR": str(run_dir), "MPISGD_LAUNCHER": launcher, **options})
    assert state == "COMPLETED" and code == "0:0", f"job {job} {state} exit {code}\n{out}\n{cluster.logs()}"
    assert "k=2 rank(s)" in out, out
    acc = re.search(r"final test accuracy (\d\.\d+)", out)
    assert acc, out
    assert float(acc.group(1)) > 0.6, out
    assert "final test accuracy" in (run_dir / "train.log").read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records].count("epoch") == 1, records
    assert "Linear 784x256, Linear 256x128" in out, out  # the options reached the run
    effective = (run_dir / "ckpt" / "config.toml").read_text()  # the script's own options over the file's
    assert "hidden = [256, 128]" in effective and "seed = 3" in effective
    assert f'metrics-file = "{run_dir}/metrics.jsonl"' in effective, effective


def test_failing_job_is_reported_failed(cluster: Cluster, tmp_path: Path) -> None:
    """A rank that raises ends the job promptly, and Slurm records the failure."""
    t0 = time.monotonic()
    job, state, code, out = _submit(cluster, tmp_path, "--dataset", "synthetic", "--synthetic-samples", "2048",
                                    "--hidden", "32",
                                    env={"RUN_DIR": str(tmp_path / "run"), "MPISGD_FAIL_AT_STEP": "3:1"})
    elapsed = time.monotonic() - t0
    assert state == "FAILED" and code != "0:0", f"job {job} {state} exit {code}\n{out}"
    assert "mpisgd: rank 1 of 2 failed" in out and "injected failure at step 3" in out, out
    assert elapsed < 120, f"the failed job took {elapsed:.0f} s to end"


def test_allreduce_bw_sbatch(cluster: Cluster, tmp_path: Path) -> None:
    """The benchmark script on one node, two ranks, small sizes: a verified table, JSON rows."""
    if not (ROOT / "benchmarks" / "allreduce_bw.py").exists():
        pytest.skip("benchmarks/allreduce_bw.py is not in this checkout")
    run_dir = tmp_path / "run"
    job, state, code, out = _submit(cluster, tmp_path, "--max-bytes", "64K", "--iters", "5", "--backends", "mpi",
                                    script="allreduce_bw.sbatch", sbatch=("--nodes=1", "--ntasks-per-node=2"),
                                    env={"RUN_DIR": str(run_dir), "MPISGD_HOME": str(ROOT)})
    assert state == "COMPLETED" and code == "0:0", f"job {job} {state} exit {code}\n{out}"
    rows = [json.loads(line) for line in (run_dir / "allreduce_bw.json").read_text().splitlines() if line.strip()]
    assert rows, out
    assert "allreduce_bw: exit status 0" in out


def _wait_job(c: Cluster, job: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _ = _job_state(c, job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(0.2)
    pytest.fail(f"job {job} did not end within {timeout_s} s (state {_job_state(c, job)})\n{c.logs()}")


@pytest.mark.skipif(not FASHION.is_dir(), reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_preempted_job_checkpoints_its_step_requeues_and_resumes(cluster: Cluster, tmp_path: Path) -> None:
    """SIGTERM to the job's steps, as Slurm sends at --signal=TERM@120 before the time limit and on
    preemption: the ranks stop at the next step, write a checkpoint of it and exit 75; the script
    requeues the job, and the second attempt resumes at exactly that step and finishes."""
    run_dir = tmp_path / "run"
    env = {**cluster.env, "RUN_DIR": str(run_dir)}
    r = subprocess.run(["sbatch", f"--chdir={tmp_path}", "--output=job-%j.out",
                        str(ROOT / "scripts" / "slurm" / "train_cpu.sbatch"),
                        "--epochs", "6", "--limit-train", "12000", "--limit-test", "2000", "--batch-size", "64",
                        "--hidden", "256,128"],
                       capture_output=True, text=True, timeout=60, env=env)
    m = re.search(r"Submitted batch job (\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    job = int(m.group(1))
    out, metrics = tmp_path / f"job-{job}.out", run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while (metrics.read_text().count('"kind":"step"') if metrics.exists() else 0) < 5:  # the ranks are training
        assert time.monotonic() < deadline, f"no training after 120 s\n{out.read_text() if out.exists() else ''}"
        assert _job_state(cluster, job)[0] in ("PENDING", "CONFIGURING", "RUNNING"), out.read_text()
        time.sleep(0.1)
    sig = cluster.run("scancel", "--signal=TERM", str(job))  # the job's steps, not the batch shell
    assert sig.returncode == 0, sig.stderr
    state = _wait_job(cluster, job, 240)
    text = out.read_text()
    assert state == "COMPLETED", f"{state}\n{text}"
    assert "attempt 2" in text, text
    first, second = text.split("attempt 2")
    stopped = re.search(r"stopped by SIGTERM before step (\d+)", first)
    assert stopped and "exit status 75" in first and "requeueing job" in first, first
    resumed = re.search(r"resumed from \S+ at step (\d+)", second)
    assert resumed and resumed.group(1) == stopped.group(1), text
    assert "final test accuracy" in second, text
