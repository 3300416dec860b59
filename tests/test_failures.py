"""Failure cases of the training CLI under real mpiexec: every one must end the job, promptly and clearly.

Each test tags its ranks with an environment variable, so it can find their
process ids in /proc (to kill or stop one) and check that none is left behind.
docs/failures.md records what each case prints, its exit code and time to exit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import ONE_THREAD, ROOT, mpiexec_cmd, open_mpi_launcher, run_mpi, small_tmpfs

SYNTH = ("-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "2048", "--hidden", "32",
         "--progress", "off")
PROMPT_S = 30  # "within seconds": generous for a loaded CI machine, far below any collective timeout
# Open MPI's mpiexec (4.1) passes SIGINT and SIGTERM on to every rank as SIGTERM, SIGKILLs them 1 s later
# (odls_base_sigkill_timeout; a longer one is slept through without forwarding the ranks' output) and exits
# 1 whatever the ranks' exit codes. SIGINT and SIGTERM to a rank itself behave as with MPICH.
OMPI_SIGTERM = ("Open MPI's mpiexec forwards SIGTERM as SIGTERM and SIGKILL 1 s later, then exits 1: no stop at a "
                "step boundary with exit 75 through it (signal the ranks: srun, scancel)")


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
    (("--model", "foo"), "--model must be mlp, cnn or package.module:function, got 'foo'"),
    (("--epochs", "x"), "invalid int value: 'x'"),
    (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
    (("--dataset", "fashion-mnist", "--data-dir", "/nonexistent"), "/nonexistent"),
    (("--limit-train", "10", "--batch-size", "64"), "fewer than one global batch"),
    (("--resume", "/nonexistent/ckpt.npz"), "--resume /nonexistent/ckpt.npz: no such file"),
    (("--data", ""), "--data is empty: give a path (an unset shell variable?)"),
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
    assert "--hidden is (32,) on rank(s) [0, 1] but (64,) on rank 2" in r.stderr, r.stderr
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


# -- interrupts and preemption ---------------------------------------------------------------
def _mpiexec_pid(p: subprocess.Popen) -> int:
    return p.pid  # mpiexec itself: the launcher forwards SIGINT and SIGTERM to every rank


def test_ctrl_c_to_mpiexec_ends_every_rank_with_130_and_one_line(tag: str, tmp_path: Path) -> None:
    p = _start_long_run(2, tag, tmp_path)
    os.kill(_mpiexec_pid(p), signal.SIGINT)
    out, err, elapsed = _wait_end(p, tag, limit_s=30)
    if open_mpi_launcher():  # the ranks get SIGTERM (and SIGKILL 1 s later), mpiexec exits 1: see OMPI_SIGTERM
        assert p.returncode == 1 and "Traceback" not in err and elapsed < 10, (p.returncode, err[-2000:])
        assert_no_rank_left(tag)
        return
    assert p.returncode == 130, (p.returncode, err[-2000:])
    ours = [line for line in err.splitlines() if line.startswith("mpisgd:")]
    assert len(ours) == 1 and "interrupted (SIGINT)" in ours[0], err[-2000:]
    assert "Traceback" not in err and elapsed < 10, f"{elapsed:.1f} s"
    assert_no_rank_left(tag)


@pytest.mark.parametrize("k,rank", [(2, 1), (3, 1), (3, 0)])
def test_sigint_to_one_rank_ends_the_job_promptly(k: int, rank: int, tag: str, tmp_path: Path) -> None:
    """Before: that rank went into MPI_Finalize while its peers waited in the all-reduce, for ever."""
    p = _start_long_run(k, tag, tmp_path)
    os.kill(rank_pids(tag)[rank], signal.SIGINT)
    out, err, elapsed = _wait_end(p, tag, limit_s=30)
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert f"mpisgd: interrupted (SIGINT) on rank {rank}" in err and "Traceback" not in err, err[-2000:]
    assert elapsed < 10, f"{elapsed:.1f} s"
    assert_no_rank_left(tag)


def _final_params(k: int, tag: str, tmp_path: Path, name: str, *args: str) -> tuple[subprocess.CompletedProcess,
                                                                                    Path]:
    out = tmp_path / f"{name}.npz"
    r, _ = launch(k, tag, *SYNTH, "--epochs", "2", "--dtype", "float64", "--save-model", str(out), *args,
                  timeout=180)
    return r, out


@pytest.mark.parametrize("target", ["mpiexec", "one rank"])
def test_sigterm_mid_epoch_checkpoints_that_step_and_the_resumed_run_is_bitwise_equal(
        target: str, tag: str, tmp_path: Path) -> None:
    if target == "mpiexec" and open_mpi_launcher():
        pytest.skip(OMPI_SIGTERM)
    ck = tmp_path / "ck"
    metrics = tmp_path / "metrics.jsonl"
    # a constant rate: the schedule does not depend on the run's length, so a shorter run can be compared
    p = _start_long_run(2, tag, tmp_path, "--checkpoint-dir", str(ck), "--dtype", "float64", "--decay", "none")
    victim = _mpiexec_pid(p) if target == "mpiexec" else rank_pids(tag)[1]
    os.kill(victim, signal.SIGTERM)
    out, err, elapsed = _wait_end(p, tag, limit_s=40)
    assert p.returncode == 75, (p.returncode, err[-2000:])
    stop = re.search(r"stopped by SIGTERM before step (\d+) .*checkpoint (\S+) written", err)
    assert stop, err[-2000:]
    step, path = int(stop.group(1)), Path(stop.group(2))
    assert path.exists() and path.name == f"ckpt-{step:09d}.npz" and elapsed < 30
    assert step == metrics.read_text().count('"kind":"step"')  # the steps done before the stop, no more
    assert_no_rank_left(tag)
    # the same run, uninterrupted, against the stopped one resumed: the same bits (float64, k = 2)
    total = step + 25
    r, resumed = _final_params(2, tag, tmp_path, "resumed", "--checkpoint-dir", str(ck), "--resume", "auto",
                               "--epochs", "10000", "--decay", "none", "--max-steps", str(total),
                               "--resume-allow", "max_steps")
    assert r.returncode == 0 and f"at step {step}" in r.stdout, r.stderr
    r, full = _final_params(2, tag, tmp_path, "full", "--epochs", "10000", "--decay", "none", "--max-steps",
                            str(total))
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(resumed)["flat"], np.load(full)["flat"])


def test_sigusr1_to_the_launcher_stops_like_sigterm(tag: str, tmp_path: Path) -> None:
    """SIGUSR1 is the stop request that Open MPI's mpirun passes on without killing the ranks (it SIGKILLs
    them a second after forwarding a SIGTERM); with either launcher the job stops with its checkpoint."""
    ck = tmp_path / "ck"
    p = _start_long_run(2, tag, tmp_path, "--checkpoint-dir", str(ck))
    os.kill(_mpiexec_pid(p), signal.SIGUSR1)
    out, err, _ = _wait_end(p, tag, limit_s=40)
    assert p.returncode == 75 and "stopped by SIGUSR1 before step" in err, (p.returncode, err[-2000:])
    assert list(ck.glob("ckpt-*.npz"))
    assert_no_rank_left(tag)


def test_sigterm_without_a_checkpoint_dir_says_the_work_is_lost(tag: str, tmp_path: Path) -> None:
    """75 promises a checkpoint of the interrupted step (the Slurm scripts requeue on it): without one, 143."""
    if open_mpi_launcher():
        pytest.skip(OMPI_SIGTERM)
    p = _start_long_run(2, tag, tmp_path)
    os.kill(_mpiexec_pid(p), signal.SIGTERM)
    out, err, _ = _wait_end(p, tag, limit_s=40)
    assert p.returncode == 143 and "no checkpoint of this step" in err and "(exit 143)" in err, err[-2000:]
    assert_no_rank_left(tag)


def test_sigterm_when_the_checkpoint_cannot_be_written_is_not_75(tag: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    p = _start_long_run(2, tag, tmp_path, "--checkpoint-dir", str(ck))
    ck.rename(tmp_path / "ck-moved")  # not rmtree: a checkpoint may be written into it meanwhile
    # the directory's name becomes a file: the next checkpoint cannot be written there
    ck.write_text("not a directory any more")
    os.kill(rank_pids(tag)[1], signal.SIGTERM)  # to a rank: Open MPI's mpiexec would SIGKILL them a second later
    out, err, _ = _wait_end(p, tag, limit_s=40)
    assert p.returncode == 143 and "not written" in out + err, (p.returncode, (out + err)[-2000:])
    assert_no_rank_left(tag)


def test_a_second_sigterm_ends_the_job_with_143(tag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second SIGTERM arrives while the first is still waiting for the next step (rank 1's steps are made
    slow): the job ends with 143, and no later clean stop turns that into 75."""
    monkeypatch.setenv("MPISGD_DELAY_RANK", "1:800")
    p = _start_long_run(2, tag, tmp_path, "--checkpoint-dir", str(tmp_path / "ck"))
    target = rank_pids(tag)[1]
    os.kill(target, signal.SIGTERM)
    time.sleep(0.2)
    os.kill(target, signal.SIGTERM)
    out, err, _ = _wait_end(p, tag, limit_s=40)
    assert p.returncode == 143 and "a second SIGTERM" in err, (p.returncode, err[-2000:])
    assert_no_rank_left(tag)


def test_a_stopped_and_continued_rank_is_not_blamed_on_rank_0(tag: str, tmp_path: Path) -> None:
    """SIGSTOP, then SIGCONT: rank 0 names the stopped rank while it is stopped; once it runs again, the job
    goes on, and the resumed rank does not report rank 0's silence (the time it was stopped is not waiting)."""
    p = _start_long_run(3, tag, tmp_path, "--stall-timeout-s", "2", "--max-steps", "1500")
    victim = rank_pids(tag)[1]
    os.kill(victim, signal.SIGSTOP)
    time.sleep(7)
    os.kill(victim, signal.SIGCONT)
    out, err, _ = _wait_end(p, tag, limit_s=120)
    assert p.returncode == 0, err[-2000:]
    assert "mpisgd: stall:" in err, err[-2000:]
    assert "rank 0 has not reported" not in err, err[-2000:]
    assert_no_rank_left(tag)


# -- outputs checked before any work ------------------------------------------------------------
@pytest.mark.parametrize("option,path,says", [
    ("--checkpoint-dir", "{file}", "exists and is not a directory"),
    ("--checkpoint-dir", "/proc/mpisgd-nope", "cannot create the directory"),
    ("--save-model", "/proc/mpisgd-nope/model.npz", "cannot"),
    ("--save-model", "/dev/null", "exists and is not a regular file"),
    ("--metrics-file", "{file}/m.jsonl", "cannot"),
    ("--timeline", "/proc/mpisgd-nope/trace", "cannot"),
])
def test_an_output_that_cannot_be_written_fails_before_training(option: str, path: str, says: str, tag: str,
                                                                tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    r, elapsed = launch(2, tag, *SYNTH, "--max-steps", "3", option, path.format(file=file))
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "mpisgd: error" in line]
    assert len(errors) == 1 and option in errors[0] and says in errors[0], r.stderr
    assert "epoch" not in r.stdout and "Traceback" not in r.stderr
    assert file.read_text() == "x"
    assert_no_rank_left(tag)


def test_a_full_disk_while_checkpointing_warns_and_training_goes_on(tag: str, tmp_path: Path) -> None:
    """A real full file system: the checkpoint directory on a 256 KiB tmpfs, each checkpoint 400 KB. The
    writes fail with a warning naming the free space, training finishes, no temporary file is left."""
    ck = tmp_path / "ck"
    with small_tmpfs(ck, "256k"):
        r, _ = launch(2, tag, *SYNTH, "--max-steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                      "--hidden", "64")
        left = sorted(p.name for p in ck.iterdir())
    assert r.returncode == 0, r.stderr[-2000:]
    warned = [line for line in r.stdout.splitlines() if line.startswith("warning: checkpoint of step")]
    assert len(warned) == 3 and "MiB free in" in warned[0] and "training goes on" in warned[0], r.stdout
    assert "final test accuracy" in r.stdout
    assert left == [".mpisgd.lock", "config.toml"]  # no checkpoint, no temporary (the effective configuration fit)


# -- a checkpoint directory belongs to one run ----------------------------------------------------
def test_a_reused_checkpoint_dir_is_refused_unless_resumed_or_overwritten(tag: str, tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "10", "--checkpoint-dir", ck)
    assert r.returncode == 0, r.stderr
    again, _ = launch(2, tag, *SYNTH, "--max-steps", "5", "--checkpoint-dir", ck, "--seed", "7")
    assert again.returncode == 2 and "holds another run's checkpoints" in again.stderr, again.stderr
    # an epoch is 8 steps: its end, and the last step whatever --checkpoint-every says; nothing pruned
    assert sorted(p.name for p in Path(ck).glob("ckpt-*")) == ["ckpt-000000008.npz", "ckpt-000000010.npz"]
    over, _ = launch(2, tag, *SYNTH, "--max-steps", "5", "--checkpoint-dir", ck, "--seed", "7",
                     "--overwrite-checkpoints")
    assert over.returncode == 0 and [p.name for p in Path(ck).glob("ckpt-*")] == ["ckpt-000000005.npz"]
    done, _ = launch(2, tag, *SYNTH, "--max-steps", "5", "--checkpoint-dir", ck, "--seed", "7", "--resume", "auto")
    assert done.returncode == 0 and "the run is finished (step 5 of 5)" in done.stdout, done.stdout
    assert "nan" not in done.stdout + done.stderr


def test_two_runs_never_share_a_checkpoint_dir(tag: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    p = _start_long_run(2, tag, tmp_path, "--checkpoint-dir", str(ck))
    try:
        other, _ = launch(2, tag + "-2", *SYNTH, "--max-steps", "3", "--checkpoint-dir", str(ck), "--resume",
                          "auto")
    finally:
        os.kill(_mpiexec_pid(p), signal.SIGINT)
        _wait_end(p, tag, limit_s=30)
    assert other.returncode == 2 and "is in use by another run (pid" in other.stderr, other.stderr


def test_resume_checks_the_run_identity_and_names_every_difference(tag: str, tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "10", "--checkpoint-dir", ck, "--epochs", "5")
    assert r.returncode == 0, r.stderr
    other, _ = launch(2, tag, *SYNTH, "--max-steps", "20", "--checkpoint-dir", ck, "--epochs", "5", "--resume", "auto",
                      "--lr", "0.05", "--seed", "3")
    errors = [line for line in other.stderr.splitlines() if "mpisgd: error" in line]
    assert other.returncode == 2 and len(errors) == 1, other.stderr
    for needle in ("--lr 0.1 -> 0.05", "--seed 0 -> 3", "--max-steps 10 -> 20", "--data synthetic (2048 train",
                   "--resume-allow data,seed,lr,max_steps"):  # the synthetic data follow the seed
        assert needle in errors[0], errors[0]
    allowed, _ = launch(2, tag, *SYNTH, "--max-steps", "20", "--checkpoint-dir", ck, "--epochs", "5", "--resume",
                        "auto", "--lr", "0.05", "--resume-allow", "lr,max_steps")
    assert allowed.returncode == 0, allowed.stderr
    assert "resume: changed --lr 0.1 -> 0.05 on purpose" in allowed.stdout, allowed.stdout


def test_resume_on_other_k_derives_the_batch_or_lists_the_k_that_work(tag: str, tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "10", "--checkpoint-dir", ck, "--batch-size", "32")
    assert r.returncode == 0, r.stderr
    four, _ = launch(4, tag, *SYNTH, "--max-steps", "12", "--checkpoint-dir", ck, "--resume", "auto",
                     "--resume-allow", "max_steps")
    assert four.returncode == 0, four.stderr
    assert "written by k=2 ranks, now k=4 with the same B=64; b=16, m=1 derived" in four.stdout, four.stdout
    three, _ = launch(3, tag, *SYNTH, "--max-steps", "14", "--checkpoint-dir", ck, "--resume", "auto",
                      "--resume-allow", "max_steps")
    assert three.returncode == 2 and "B=64 cannot be split over k=3 ranks" in three.stderr, three.stderr
    assert "(1, 2, 4, 8, 16, 32, 64)" in three.stderr
    given, _ = launch(4, tag, *SYNTH, "--max-steps", "14", "--checkpoint-dir", ck, "--resume", "auto",
                      "--batch-size", "32", "--resume-allow", "max_steps")
    assert given.returncode == 2 and "pass --batch-size and --accum-steps with 4 x b x m = 64" in given.stderr


# -- data the ranks disagree on, data the models cannot learn from -------------------------------------
def _idx_dir(directory: Path, labels_train, n_test: int = 50, seed: int = 0) -> Path:
    from test_data import write_idx

    rng = np.random.default_rng(seed)
    directory.mkdir()
    n = len(labels_train)
    write_idx(directory / "train-images-idx3-ubyte", rng.integers(0, 255, (n, 28, 28), dtype=np.uint8))
    write_idx(directory / "train-labels-idx1-ubyte", np.asarray(labels_train, dtype=np.uint8))
    write_idx(directory / "t10k-images-idx3-ubyte", rng.integers(0, 255, (n_test, 28, 28), dtype=np.uint8))
    write_idx(directory / "t10k-labels-idx1-ubyte", rng.integers(0, 10, n_test, dtype=np.uint8))
    return directory


def _two_ranks_two_data_sets(a: Path, b: Path, tag: str) -> subprocess.CompletedProcess:
    """A k = 2 training whose rank 0 reads the data set in ``a`` and rank 1 the one in ``b``."""
    train = ("-m", "mpisgd.train", "--hidden", "16", "--progress", "off", "--max-steps", "3")
    one = mpiexec_cmd(1, *train)
    py = one.index(sys.executable)  # env(1) sets each rank's variable: MPICH's -env and Open MPI's -x differ
    first = [*one[:py], "env", f"MPISGD_DATA={a}", *one[py:]]
    second = [*one[1:py], "env", f"MPISGD_DATA={b}", *one[py:]]
    env = {**os.environ, **ONE_THREAD, "MPISGD_TEST_TAG": tag}
    return subprocess.run([*first, ":", *second], capture_output=True, text=True, timeout=120, env=env)


def test_ranks_with_different_data_are_refused(tag: str, tmp_path: Path) -> None:
    a = _idx_dir(tmp_path / "a", np.arange(512) % 10)
    b = _idx_dir(tmp_path / "b", np.arange(512) % 10, seed=1)
    r = _two_ranks_two_data_sets(a, b, tag)
    assert r.returncode == 2 and "ranks loaded different data (fingerprint is" in r.stderr, r.stderr
    assert "on rank(s) [0] but" in r.stderr and "on rank 1" in r.stderr, r.stderr
    assert r.stderr.count("mpisgd: error") == 1
    assert_no_rank_left(tag)


@pytest.mark.parametrize("labels,n_test,says", [([*range(10)] * 1, 50, "fewer than one global batch B = 16"),
                                                ([*range(10)] * 20, 0, "the test set is empty")])
def test_data_the_models_cannot_learn_from_is_refused_at_load(labels, n_test, says, tag: str, tmp_path: Path):
    d = _idx_dir(tmp_path / "d", labels, n_test=n_test)
    r, _ = launch(2, tag, "-m", "mpisgd.train", "--data-dir", str(d), "--hidden", "16", "--progress", "off",
                  "--batch-size", "8")
    assert r.returncode == 2 and says in r.stderr and "epoch" not in r.stdout, r.stderr


# -- every bad number: one line, exit 2 ------------------------------------------------------------
@pytest.mark.parametrize("args,says", [
    (("--lr", "inf"), "--lr must be a finite number"),
    (("--lr", "1e308", "--batch-size", "512", "--base-batch", "1"), "learning rates must be finite"),
    (("--warmup-epochs", "nan"), "--warmup-epochs must be a finite number"),
    (("--weight-decay", "nan"), "--weight-decay must be a finite number"),
    (("--weight-decay", "inf"), "--weight-decay must be a finite number"),
    (("--bucket-cap-mb", "nan"), "--bucket-cap-mb must be a finite number"),
    (("--bucket-mb", "nan"), "--bucket-cap-mb must be a finite number"),  # the earlier spelling
    (("--stall-timeout-s", "nan"), "--stall-timeout-s must be a finite number"),
    (("--seed", "-1"), "--seed must be >= 0"),
    (("--allreduce", "nccl"), "needs GPU buffers"),
    (("--hidden", "200000,200000"), "the run needs at least"),
    (("--resume-allow", "model"), "not an option a resumed run can change"),
])
def test_every_bad_number_is_one_line_and_exit_2(args: tuple[str, ...], says: str, tag: str) -> None:
    r, elapsed = launch(2, tag, *SYNTH, "--max-steps", "3", *args)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "mpisgd: error" in line]
    assert len(errors) == 1 and says in errors[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout and elapsed < PROMPT_S
    assert_no_rank_left(tag)


@pytest.mark.parametrize("kind", ["npy", "edited"])
def test_resume_from_something_that_is_not_a_checkpoint_is_one_line(kind: str, tag: str, tmp_path: Path) -> None:
    bad = tmp_path / ("x.npy" if kind == "npy" else "x.npz")
    if kind == "npy":
        np.save(bad, np.zeros(3))
    else:  # a checkpoint whose parameters someone replaced by integers
        np.savez(bad, format=np.int64(1), params=np.arange(5), scalars=np.zeros(6, np.int64),
                 prev_lr=np.float64(0.1), config=np.array("{}"))
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "3", "--resume", str(bad))
    errors = [line for line in r.stderr.splitlines() if "mpisgd: error" in line]
    assert r.returncode == 2 and len(errors) == 1 and str(bad) in errors[0], r.stderr
    assert "Traceback" not in r.stderr


# -- the library: a rank that fails alone inside mpisgd.guard ends the job -------------------------
GUARDED = """
import sys
import numpy as np
from mpi4py import MPI
sys.path.insert(0, {root!r})
import mpisgd
comm = MPI.COMM_WORLD
with mpisgd.guard(comm):
    model = mpisgd.nn.mlp((8,), n_in=4, n_classes=3).materialize(np, "float64")
    dp = mpisgd.DataParallel(model, mpisgd.SGD(model.flat), comm)
    x = np.ones((2, 4))
    y = np.array([0, 7 if comm.Get_rank() == 1 else 1])  # rank 1's label is out of range
    for _ in range(3):
        dp.train_step([(x, y)], lr=0.1)
    dp.close()
"""


def test_guard_ends_the_job_with_the_failing_ranks_message(tag: str, tmp_path: Path) -> None:
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED.format(root=str(ROOT)))
    r, elapsed = launch(2, tag, str(script), timeout=60)
    assert r.returncode != 0 and elapsed < PROMPT_S
    assert "mpisgd: rank 1 of 2 failed" in r.stderr and "IndexError" in r.stderr, r.stderr
    assert_no_rank_left(tag)


# -- inputs that are not what they seem: refused in one line, never opened if they could block ----------
def _one_error(r: subprocess.CompletedProcess) -> str:
    """The run's one error line (asserting exit 2, one line, no traceback, no training)."""
    errors = [line for line in (r.stderr + r.stdout).splitlines() if "mpisgd: error" in line]
    assert r.returncode == 2 and len(errors) == 1, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr + r.stdout and "epoch " not in r.stdout, r.stderr[-3000:]
    return errors[0]


def _npz(path: Path, n_train: int = 512, n_test: int = 64, **change) -> Path:
    rng = np.random.default_rng(0)
    a = {"x_train": rng.normal(size=(n_train, 6)).astype("float32"), "y_train": rng.integers(0, 3, n_train),
         "x_test": rng.normal(size=(n_test, 6)).astype("float32"), "y_test": rng.integers(0, 3, n_test)}
    np.savez(path, **{**a, **change})
    return path


DATA_RUN = ("-m", "mpisgd.train", "--hidden", "8", "--progress", "off", "--batch-size", "16", "--max-steps", "3")


@pytest.mark.parametrize("case,says", [
    ("fifo", "is not a regular file or a directory (a FIFO or a device is never opened)"),
    ("npy", "is a single .npy array; mpisgd reads an .npz holding x_train"),
    ("csv", "is not an .npz (a zip of .npy arrays); mpisgd reads"),
    ("idx without test files", "it lacks t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]"),
    ("float64 overflows float32", "training inputs hold 1e+39 (sample 300), which overflows float32"),
    ("label 10**9", "training label 1000000000 (sample 7) makes 1,000,000,001 classes"),
])
def test_data_that_is_not_a_data_set_is_one_line_and_exit_2(case: str, says: str, tag: str, tmp_path: Path) -> None:
    path = tmp_path / "data"
    if case == "fifo":
        os.mkfifo(path)
    elif case == "npy":
        path = tmp_path / "x.npy"
        np.save(path, np.zeros((4, 3)))
    elif case == "csv":
        path.write_text("0.1,0.2,1\n0.3,0.4,0\n")
    elif case == "idx without test files":
        path = _idx_dir(tmp_path / "idx", np.arange(512) % 10)
        for stem in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
            (path / stem).unlink()
    elif case.startswith("float64"):
        x = np.random.default_rng(0).normal(size=(512, 6))
        x[300, 2] = 1e39
        path = _npz(tmp_path / "big.npz", x_train=x)
    else:
        y = np.arange(512) % 3
        y[7] = 10**9
        path = _npz(tmp_path / "labels.npz", y_train=y)
    r, elapsed = launch(2, tag, *DATA_RUN, "--data", str(path))
    line = _one_error(r)
    assert says in line and "allow_pickle" not in line and "apt-get" not in line, line
    assert elapsed < PROMPT_S
    assert_no_rank_left(tag)


def test_one_stray_label_trains_with_a_warning_naming_it(tag: str, tmp_path: Path) -> None:
    y = np.arange(512) % 3
    y[7] = 200
    r, _ = launch(2, tag, *DATA_RUN, "--data", str(_npz(tmp_path / "s.npz", y_train=y)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning: labels 0..200 make 201 classes, but 197 of them have no training sample (3, 4, 5, 6, 7, ...)" \
        in r.stdout and "200, is training sample 7" in r.stdout, r.stdout


def test_ranks_with_another_test_set_are_refused(tag: str, tmp_path: Path) -> None:
    """The fingerprint covers the test set too: rank 1's blank test images are found."""
    from test_data import write_idx

    a = _idx_dir(tmp_path / "a", np.arange(512) % 10)
    b = tmp_path / "b"
    b.mkdir()
    for f in a.iterdir():
        (b / f.name).write_bytes(f.read_bytes())
    write_idx(b / "t10k-images-idx3-ubyte", np.zeros((50, 28, 28), np.uint8))
    r = _two_ranks_two_data_sets(a, b, tag)
    line = _one_error(r)
    assert "data" in line and "fingerprint" in line and "give every rank the same data set" in line, line
    assert_no_rank_left(tag)


# -- a model module of one's own that fails: one line, exit 2 ---------------------------------------------
@pytest.mark.parametrize("source,says", [
    ("def f(input_shape, n_classes)\n    pass\n", "mymodel.py, line 1: SyntaxError: expected ':'"),
    ("raise KeyError('CUDA_HOME')\n", "importing mymodel raised KeyError: 'CUDA_HOME' (at "),
    ("import sys\nsys.exit(0)\n", "importing mymodel called sys.exit(0)"),
    ("from mpisgd.nn import Flatten, Linear, Sequential\n"
     "class Odd(Linear):\n"
     "    def backward(self, dy, need_dx=True):\n"
     "        raise NotImplementedError('backward of Odd')\n"
     "def f(input_shape, n_classes):\n"
     "    return Sequential(Flatten(), Odd(6, n_classes))\n",
     "the model's backward fails (NotImplementedError: backward of Odd)"),
])
def test_a_model_module_that_fails_is_one_line_and_exit_2(source: str, says: str, tag: str, tmp_path: Path) -> None:
    (tmp_path / "mymodel.py").write_text(source)
    r = run_mpi(2, *DATA_RUN, "--data", str(_npz(tmp_path / "d.npz")), "--model", "mymodel:f", cwd=tmp_path,
                env={"MPISGD_TEST_TAG": tag, "PYTHONPATH": str(ROOT)})
    assert says in _one_error(r)
    assert_no_rank_left(tag)


# -- outputs never replace inputs or each other -------------------------------------------------------
@pytest.mark.parametrize("outs,says", [
    (("--save-model", "{data}"), "--save-model {data} is the file --data reads"),
    (("--metrics-file", "{data}"), "--metrics-file {data} is the file --data reads"),
    (("--metrics-file", "{out}", "--save-model", "{out}"), "--save-model and --metrics-file name the same file"),
    (("--checkpoint-dir", "{ck}", "--save-model", "{ck}/ckpt-000000003.npz"), "lies in --checkpoint-dir"),
])
def test_an_output_colliding_with_an_input_or_another_output_is_refused(outs, says, tag: str, tmp_path: Path) -> None:
    data = _npz(tmp_path / "d.npz")
    out = tmp_path / "out"
    out.write_text("earlier metrics\n")
    before = data.read_bytes()
    fill = {"data": str(data), "out": str(out), "ck": str(tmp_path / "ck")}
    r, _ = launch(2, tag, *DATA_RUN, "--data", str(data), *(o.format(**fill) for o in outs))
    assert says.format(**fill) in _one_error(r)
    assert data.read_bytes() == before and out.read_text() == "earlier metrics\n"
    assert_no_rank_left(tag)


def test_a_lock_file_that_is_a_directory_is_one_line(tag: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    (ck / ".mpisgd.lock").mkdir(parents=True)
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "3", "--checkpoint-dir", str(ck))
    assert "its lock file" in _one_error(r) and (ck / ".mpisgd.lock").is_dir()


# -- a full disk: the metrics stop with a warning, the model goes elsewhere and says where ----------------
def test_a_full_disk_for_metrics_model_and_timeline_loses_nothing_silently(tag: str, tmp_path: Path) -> None:
    small, ck = tmp_path / "small", tmp_path / "ck"
    with small_tmpfs(small, "8k"):
        r, _ = launch(2, tag, *SYNTH, "--max-steps", "60", "--metrics-file", str(small / "m.jsonl"),
                      "--save-model", str(small / "model.npz"), "--timeline", str(small / "t"),
                      "--checkpoint-dir", str(ck))
        left = sorted(p.name for p in small.iterdir())
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert sum("warning: --metrics-file" in x and "No space left on device" in x and "training goes on" in x
               for x in out) == 1, r.stdout
    assert any("warning: rank 0: --timeline" in x and "not written (No space left on device)" in x for x in out)
    assert out[-1] == f"warning: --save-model {small}/model.npz could not be written; the final model is in " \
                      f"{ck}/model.npz", r.stdout
    assert "final test accuracy" in r.stdout and "Traceback" not in r.stderr
    assert np.load(ck / "model.npz")["flat"].size > 0
    assert not [x for x in left if ".tmp." in x], left  # no temporary file left behind


# -- checkpoints: every resume path keeps what was on disk ------------------------------------------------
def _names(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.glob("ckpt-*.npz"))


def test_resuming_into_another_runs_directory_is_refused_and_deletes_nothing(tag: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for ck, seed in ((a, "0"), (b, "7")):
        r, _ = launch(2, tag, *SYNTH, "--max-steps", "10", "--checkpoint-dir", str(ck), "--seed", seed)
        assert r.returncode == 0, r.stderr[-2000:]
    before = {p.name: p.read_bytes() for p in b.glob("ckpt-*")}
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "20", "--checkpoint-dir", str(b), "--resume",
                  str(a / "ckpt-000000010.npz"), "--resume-allow", "max_steps")
    assert "holds another run's checkpoints (ckpt-000000010.npz, 2 in all), not those of the run" in _one_error(r)
    assert {p.name: p.read_bytes() for p in b.glob("ckpt-*")} == before
    # another --optimizer or --trust-coef is a difference too (it was accepted without a word)
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "20", "--checkpoint-dir", str(a), "--resume", "auto",
                  "--resume-allow", "max_steps", "--optimizer", "lars", "--trust-coef", "0.02")
    assert "--optimizer sgd -> lars; --trust-coef 0.1 -> 0.02" in _one_error(r)


def test_rolling_back_moves_the_abandoned_checkpoints_and_auto_continues_the_new_line(tag: str, tmp_path: Path):
    ck = tmp_path / "ck"
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "24", "--checkpoint-dir", str(ck))  # 8 steps per epoch
    assert r.returncode == 0 and _names(ck) == ["ckpt-000000008.npz", "ckpt-000000016.npz", "ckpt-000000024.npz"]
    back, _ = launch(2, tag, *SYNTH, "--max-steps", "12", "--checkpoint-dir", str(ck), "--resume",
                     str(ck / "ckpt-000000008.npz"), "--resume-allow", "max_steps")
    assert back.returncode == 0, back.stderr[-2000:]
    assert "rolling back to step 8: this run's later checkpoints (ckpt-000000016.npz, ckpt-000000024.npz) move " \
           f"to {ck}/abandoned/" in back.stdout, back.stdout
    assert _names(ck) == ["ckpt-000000008.npz", "ckpt-000000012.npz"]
    assert sorted(p.name for p in (ck / "abandoned").iterdir()) == ["ckpt-000000016.npz", "ckpt-000000024.npz"]
    on, _ = launch(2, tag, *SYNTH, "--max-steps", "14", "--checkpoint-dir", str(ck), "--resume", "auto",
                   "--resume-allow", "max_steps")
    assert on.returncode == 0 and "at step 12" in on.stdout, on.stdout + on.stderr[-2000:]


def test_resume_auto_with_no_readable_checkpoint_refuses_unless_told_to_overwrite(tag: str, tmp_path: Path):
    ck = tmp_path / "ck"
    ck.mkdir()
    for step in (8, 16):
        (ck / f"ckpt-{step:09d}.npz").write_bytes(b"a damaged copy")
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "3", "--checkpoint-dir", str(ck), "--resume", "auto")
    assert "--resume auto: none of the 2 checkpoint(s)" in _one_error(r)
    assert [(ck / n).read_bytes() for n in _names(ck)] == [b"a damaged copy"] * 2
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "3", "--checkpoint-dir", str(ck), "--resume", "auto",
                  "--overwrite-checkpoints")
    assert r.returncode == 0 and _names(ck) == ["ckpt-000000003.npz"], r.stdout + r.stderr[-2000:]


FACTORY = """
from mpisgd.nn import Flatten, Linear, ReLU, Sequential
def f(input_shape, n_classes):
    return Sequential(Flatten(), Linear(784, 16), {middle}, Linear(16, n_classes){last})
"""


def test_resuming_an_edited_model_factory_is_refused_naming_the_layer(tag: str, tmp_path: Path) -> None:
    """The parameter count is unchanged: before, the checkpoint's parameters were poured into the new layers."""
    ck = tmp_path / "ck"
    run = (*SYNTH, "--model", "net:f", "--checkpoint-dir", str(ck))
    env = {"MPISGD_TEST_TAG": tag, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    (tmp_path / "net.py").write_text(FACTORY.format(middle="ReLU()", last=""))
    r = run_mpi(2, *run, "--max-steps", "4", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    (tmp_path / "net.py").write_text(FACTORY.format(middle="ReLU()", last=", ReLU()"))
    r = run_mpi(2, *run, "--max-steps", "8", "--resume", "auto", "--resume-allow", "max_steps", cwd=tmp_path, env=env)
    assert "model differs from the checkpoint's" in _one_error(r) and "the model has 5 layers, the checkpoint's 4" \
        in r.stderr, r.stderr


def test_a_hand_edited_checkpoint_past_the_last_epoch_is_refused(tag: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "10", "--epochs", "3", "--checkpoint-dir", str(ck))
    assert r.returncode == 0
    path = ck / "ckpt-000000010.npz"
    with np.load(path) as z:
        arrays = dict(z)
    arrays["scalars"][1] = 99  # the epoch, with a valid zip CRC
    np.savez(path, **arrays)
    r, _ = launch(2, tag, *SYNTH, "--max-steps", "20", "--epochs", "3", "--checkpoint-dir", str(ck), "--resume",
                  "auto", "--resume-allow", "max_steps")
    assert "epoch 100, is past this run's last epoch (3) although only 10 of its 20 steps are done" in _one_error(r)


# -- the all-reduce benchmark: bad input is one line and exit 2 on every rank, before any collective ---------
@pytest.mark.parametrize("args,says", [
    (("--iters", "-1"), "--iters and --warmup must be >= 0, got -1"),
    (("--backends", "mpi,nope"), "--backends: unknown nope; choose from"),
    (("--max-bytes", "100000G"), "needs "),
    (("--json", "/proc/mpisgd-nope/bw.json"), "--json /proc/mpisgd-nope: cannot create the directory"),
    (("--dtype", "complex128"), "--dtype must be a number type"),
    (("--step-factor", "x"), "invalid int value"),
])
def test_allreduce_benchmark_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], says: str) -> None:
    r = run_mpi(2, str(ROOT / "benchmarks" / "allreduce_bw.py"), "--max-bytes", "64", *args, timeout=120)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if "error" in line]
    assert r.returncode == 2 and len(errors) == 1 and errors[0].startswith("allreduce_bw: error: "), r.stderr
    assert says in errors[0] and "Traceback" not in r.stderr and "time_us" not in r.stdout, errors


# -- start-up under the watchdog -------------------------------------------------------------------
BLOCKING_FACTORY = """
import os, time
from mpisgd.nn import mlp

def build(in_shape, n_classes):
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
        time.sleep(600)  # a factory that blocks on one rank (a lock, a download, input())
    return mlp((16,), 784, n_classes)
"""


@pytest.mark.parametrize("abort", ["--stall-abort", "--stall-abort-s=4"])
def test_a_set_up_stage_blocking_on_one_rank_is_named_and_the_job_ends(abort: str, tag: str, tmp_path: Path) -> None:
    """Set-up runs under the watchdog: rank 1's model factory never returns, the others wait in the stage's
    agreement; rank 0 names rank 1 and the job ends (at once with --stall-abort, at --stall-abort-s else)."""
    (tmp_path / "blocking_model.py").write_text(BLOCKING_FACTORY)
    t0 = time.monotonic()
    path = f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"
    r = run_mpi(2, *SYNTH, "--model", "blocking_model:build", "--stall-timeout-s", "2", abort, "--max-steps", "3",
                timeout=120, env={"MPISGD_TEST_TAG": tag, "PYTHONPATH": path}, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "set-up: building the model" in r.stderr and "ranks [1] have not" in r.stderr, r.stderr[-2000:]
    assert elapsed < 60, f"{elapsed:.0f} s"
    assert_no_rank_left(tag)
