"""Failure cases of the training CLI under real mpiexec: every one must end the job, promptly and clearly.

Each test tags its ranks with an environment variable, so it can find their
process ids in /proc (to kill or stop one) and check that none is left behind.
docs/failures.md records what each case prints, its exit code and time to exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ONE_THREAD, ROOT, mpiexec_cmd, run_mpi

SYNTH = ("-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "2048", "--hidden", "32",
         "--progress", "off")
PROMPT_S = 30  # "within seconds": generous for a loaded CI machine, far below any collective timeout


@pytest.fixture(autouse=True)
def _serial_only(request: pytest.FixtureRequest) -> None:
    """These tests launch their own mpiexec: never once per rank under mpiexec."""
    if request.config.getoption("--with-mpi", default=False):
        pytest.skip("launches its own mpiexec: serial runs only")


@pytest.fixture
def tag() -> Iterator[str]:
    """A marker in the ranks' environment; any rank still alive at the end is killed (and fails the test)."""
    t = uuid.uuid4().hex
    yield t
    for pid in rank_pids(t).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rank_pids(tag: str) -> dict[int, int]:
    """{rank: pid} of the live training processes carrying ``tag`` (MPICH's PMI_RANK or Open MPI's)."""
    found: dict[int, int] = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            raw = environ.read_bytes()
            if f"MPISGD_TEST_TAG={tag}".encode() not in raw:
                continue
            env = dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)
            argv = Path(environ.parent, "cmdline").read_bytes().split(b"\0")
            state = Path(environ.parent, "stat").read_text().split(") ")[1][0]
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        rank = env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK"))
        if rank is not None and b"mpisgd.train" in argv and state != "Z" and b"mpiexec" not in argv[0]:
            found[int(rank)] = int(environ.parent.name)
    return found


def launch(k: int, tag: str, *args: str, timeout: float = 120, fail_at: str = "") -> tuple[
        subprocess.CompletedProcess, float]:
    """Run the CLI tagged; ``fail_at`` ("STEP:RANK") makes that rank raise at that step ($MPISGD_FAIL_AT_STEP)."""
    t0 = time.monotonic()
    r = run_mpi(k, *args, timeout=timeout, env={"MPISGD_TEST_TAG": tag, "MPISGD_FAIL_AT_STEP": fail_at})
    return r, time.monotonic() - t0


def assert_no_rank_left(tag: str) -> None:
    deadline = time.monotonic() + 5
    while rank_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rank_pids(tag), f"ranks still running after mpiexec returned: {rank_pids(tag)}"


# -- an exception on one rank ----------------------------------------------------------------
# rank 0 too: it runs the watchdog's thread (on by default), whose shutdown waits for every rank
@pytest.mark.parametrize(("k", "failing"), [(2, 1), (3, 1), (2, 0), (3, 0)])
def test_exception_on_one_rank_ends_the_job(k: int, failing: int, tag: str) -> None:
    r, elapsed = launch(k, tag, *SYNTH, timeout=90, fail_at=f"5:{failing}")
    assert r.returncode != 0
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s to end the job"
    assert f"mpisgd: rank {failing} of {k} failed" in r.stderr, r.stderr
    assert "RuntimeError: injected failure at step 5" in r.stderr, r.stderr
    assert "final test accuracy" not in r.stdout
    assert_no_rank_left(tag)


# -- bad input: one line from rank 0, exit 2 everywhere ----------------------------------------
@pytest.mark.parametrize(("args", "says"), [
    (("--batch-size", "0"), "--batch-size must be >= 1, got 0"),
    (("--lr", "-1"), "--lr must be > 0"),
    (("--model", "foo"), "invalid choice: 'foo'"),
    (("--epochs", "x"), "invalid int value: 'x'"),
    (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
    (("--dataset", "fashion-mnist", "--data-dir", "/nonexistent"), "/nonexistent"),
    (("--limit-train", "10", "--batch-size", "64"), "fewer than one global batch"),
    (("--resume", "/nonexistent/ckpt.npz"), "not a usable checkpoint"),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], says: str, tag: str) -> None:
    r, elapsed = launch(3, tag, *SYNTH, "--max-steps", "3", *args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in (r.stderr + r.stdout).splitlines() if "mpisgd: error" in line]
    assert len(lines) == 1 and says in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert elapsed < PROMPT_S
    assert_no_rank_left(tag)


def test_configuration_mismatch_names_the_odd_rank(tag: str) -> None:
    """MPMD launch: rank 2 was given another model; every rank refuses to start."""
    cmd = mpiexec_cmd(2, *SYNTH, "--max-steps", "3")
    odd = mpiexec_cmd(1, *SYNTH, "--max-steps", "3", "--hidden", "64")[1:]  # "-n 1 python ..."
    env = {**os.environ, **ONE_THREAD, "MPISGD_TEST_TAG": tag}
    r = subprocess.run([*cmd, ":", *odd], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("mpisgd: error") == 1, r.stderr
    assert "--hidden is (32,) on rank 0 but (64,) on rank 2" in r.stderr, r.stderr
    assert_no_rank_left(tag)


# -- a rank that disappears or stops ---------------------------------------------------------
def _start_long_run(k: int, tag: str, tmp_path: Path, *args: str) -> subprocess.Popen:
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, **ONE_THREAD, "MPISGD_TEST_TAG": tag}
    p = subprocess.Popen(mpiexec_cmd(k, *SYNTH, "--epochs", "10000", "--metrics-file", str(metrics), *args),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.read_text().count('"step"') >= 3 and len(rank_pids(tag)) == k):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            out, err = p.communicate(timeout=30)
            pytest.fail(f"training did not get going (exit {p.returncode}):\n{out}\n{err}")
        time.sleep(0.1)
    return p


def _wait_end(p: subprocess.Popen, tag: str, limit_s: float = 90) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        where = _describe_ranks(tag)  # before the kill: what each rank and thread was doing
        p.kill()
        out, err = p.communicate(timeout=30)
        pytest.fail(f"the job hung: still running {limit_s} s after the rank went away\n{where}\n{err[-2000:]}")
    return out, err, time.monotonic() - t0


def _describe_ranks(tag: str) -> str:
    """Each live rank's threads with their state and kernel wait channel, for a hang's post-mortem."""
    lines = []
    for rank, pid in sorted(rank_pids(tag).items()):
        for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
            try:
                stat = (task / "stat").read_text()
                name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
                wchan = (task / "wchan").read_text() or "-"
            except (OSError, ValueError):
                continue
            lines.append(f"rank {rank} pid {pid} thread {task.name} ({name}): state {state}, waiting in {wchan}")
    return "\n".join(lines) or "no rank alive"


@pytest.mark.parametrize("k", [2, 3])
def test_killed_rank_ends_the_job(k: int, tag: str, tmp_path: Path) -> None:
    p = _start_long_run(k, tag, tmp_path)
    os.kill(rank_pids(tag)[1], signal.SIGKILL)
    out, err, elapsed = _wait_end(p, tag)
    assert p.returncode != 0
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s to end the job"
    if "BAD TERMINATION" in out + err:  # MPICH's hydra: names the pid and the signal, exits with its number
        assert "Killed (signal 9)" in out + err
    assert_no_rank_left(tag)


# -- the sharded step's extra collectives (reduce-scatter, finite vote, all-gathers) ---------------
@pytest.mark.parametrize("args,fail_at", [((), "5:2"), (("--max-steps", "20", "--lr", "1e30"), "")],
                         ids=["exception", "non-finite"])
def test_sharded_step_failures_end_every_rank(args: tuple[str, ...], fail_at: str, tag: str) -> None:
    r, elapsed = launch(3, tag, *SYNTH, "--shard-optimizer", *args, timeout=90, fail_at=fail_at)
    assert r.returncode != 0, r.stdout
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s to end the job"
    assert "final test accuracy" not in r.stdout
    if "1e30" in args:  # every rank learns it from the vote: one error line, no abort of a lone rank
        errors = [line for line in r.stderr.splitlines() if line.startswith("mpisgd: error")]
        assert len(errors) == 1 and "non-finite gradient" in errors[0], r.stderr
    else:
        assert "mpisgd: rank 2 of 3 failed" in r.stderr, r.stderr
    assert_no_rank_left(tag)


def test_killed_rank_ends_the_sharded_job(tag: str, tmp_path: Path) -> None:
    p = _start_long_run(3, tag, tmp_path, "--shard-optimizer")
    os.kill(rank_pids(tag)[2], signal.SIGKILL)
    _, _, elapsed = _wait_end(p, tag)
    assert p.returncode != 0
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s to end the job"
    assert_no_rank_left(tag)


def test_stopped_rank_is_reported_and_aborted_by_the_watchdog(tag: str, tmp_path: Path) -> None:
    """SIGSTOP leaves the rank alive but silent: without the watchdog the others would wait forever."""
    p = _start_long_run(3, tag, tmp_path, "--stall-timeout", "2", "--stall-abort")
    stopped = rank_pids(tag)[1]
    os.kill(stopped, signal.SIGSTOP)
    try:
        out, err, elapsed = _wait_end(p, tag)
    finally:
        try:
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert p.returncode != 0
    assert "mpisgd: stall:" in err and "waited" in err, err[-2000:]
    assert "aborts the job (--stall-abort)" in err, err[-2000:]
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s to end the job"
    assert_no_rank_left(tag)


# -- the abort itself stuck -------------------------------------------------------------------
STUCK_ABORT = """
import sys, time
sys.path.insert(0, {root!r})
from mpisgd.abort import abort_job

class StuckComm:
    def Abort(self, code):  # an MPI_Abort that never returns (a library lock held forever)
        time.sleep(600)

print("aborting", flush=True)
abort_job(StuckComm(), 1, grace_s=0.1, deadline_s=0.5)
print("abort returned", flush=True)
"""


def test_a_stuck_mpi_abort_still_ends_the_rank() -> None:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", STUCK_ABORT.format(root=str(ROOT))], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    assert "aborting" in r.stdout and "abort returned" not in r.stdout
    assert "MPI_Abort did not end this rank within 0.5 s; killing it (SIGKILL)" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 20


# -- non-finite gradients --------------------------------------------------------------------
def test_non_finite_gradient_stops_every_rank(tag: str) -> None:
    r, elapsed = launch(2, tag, *SYNTH, "--max-steps", "20", "--lr", "1e30", "--on-nan", "stop")
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("mpisgd: error")]
    assert len(errors) == 1 and "non-finite gradient" in errors[0] and "--on-nan skip" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert elapsed < PROMPT_S
    assert_no_rank_left(tag)


def test_non_finite_gradient_skip_counts_the_skipped_steps(tag: str, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "20", "--lr", "1e30", "--on-nan", "skip",
                  "--metrics-file", str(metrics))
    assert r.returncode == 0, r.stderr
    epochs = [rec for rec in map(json.loads, metrics.read_text().splitlines()) if rec["kind"] == "epoch"]
    assert epochs and epochs[-1]["skipped_steps"] > 0, epochs


def test_clean_shm_removes_only_leftovers_no_process_holds(tmp_path):
    """scripts/clean_shm.py: aborted MPICH jobs leave files in /dev/shm. A file this process has open
    and one it has mapped stay; an unheld one is listed, and removed only with --delete."""
    import mmap

    held, mapped, left = (tmp_path / f"mpich_shm_{name}" for name in ("held", "mapped", "left"))
    for p in (held, mapped, left):
        p.write_bytes(b"x" * 4096)
    (tmp_path / "other").write_bytes(b"x")  # not matching the pattern
    script = [sys.executable, str(ROOT / "scripts" / "clean_shm.py"), "--dir", str(tmp_path)]
    with open(held, "rb"), open(mapped, "r+b") as f:
        view = mmap.mmap(f.fileno(), 4096)
    try:
        with open(held, "rb"):
            dry = subprocess.run(script, capture_output=True, text=True, timeout=60)
            wet = subprocess.run([*script, "--delete"], capture_output=True, text=True, timeout=60)
    finally:
        view.close()
    assert dry.returncode == 0 and "1 file(s)" in dry.stdout and "held by no process" in dry.stdout, dry
    assert wet.returncode == 0 and "1 file(s)" in wet.stdout and "removed" in wet.stdout, wet
    assert held.exists() and mapped.exists() and (tmp_path / "other").exists() and not left.exists()


def test_fresh_debian_check_refuses_before_touching_anything(tmp_path):
    """scripts/fresh_debian_check.sh builds a whole system; bad input must stop it with one clear line and
    exit 2 before debootstrap starts: a target that exists, or no debootstrap, or not root."""
    target = tmp_path / "exists"
    target.mkdir()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "fresh_debian_check.sh"), str(target)],
                       capture_output=True, text=True, timeout=30)
    reasons = ("exists; remove it or name another", "apt-get install debootstrap first", "needs root")
    assert r.returncode == 2 and any(x in r.stderr for x in reasons), r.stdout + r.stderr
    assert "[fresh]" not in r.stdout and list(target.iterdir()) == []
