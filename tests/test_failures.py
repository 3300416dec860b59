"""Failure cases of the training CLI: every one must end the job, promptly and clearly.

Where the launcher is part of the behaviour (an exception or a kill on one rank, aborts, signals, the
watchdog, an MPMD launch) the test starts a real ``mpiexec`` job and tags its ranks with an environment
variable, so it can find their process ids in /proc (to kill or stop one) and check that none is left
behind. Where it is not (bad input refused by a set-up stage, the checkpoint directory's rules, a full
disk), the CLI's own code runs in the test's process (``conftest.train_here``): under mpiexec on the
job's k ranks (the MPI-marked tests, at k = 2 and 3 under MPICH and Open MPI), or on one rank in the
serial pass. docs/failures.md records what each case prints, its exit code and time to exit.
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
from conftest import (
    ONE_THREAD,
    ROOT,
    TINY,
    Outcome,
    drop,
    launches,
    mpi_first,
    mpiexec_cmd,
    open_mpi_launcher,
    rank_pids,
    root_makes,
    run_mpi,
    script,
    serial_only,
    small_tmpfs,
    train_here,
    world,
)

from mpisgd.agreement import AgreedError, agree, differing_ranks, name_differences
from mpisgd.app.inject import Injected, NoHooks

pytestmark = pytest.mark.alone  # times jobs or waits for them: run apart (pytest.ini)

SYNTH = ("-m", "mpisgd.train", *TINY)
PROMPT_S = 30  # "within seconds": generous for a loaded CI machine, far below any collective timeout
# Open MPI's mpiexec (4.1) passes SIGINT and SIGTERM on to every rank as SIGTERM, SIGKILLs them 1 s later
# (odls_base_sigkill_timeout; a longer one is slept through without forwarding the ranks' output) and exits
# 1 whatever the ranks' exit codes. SIGINT and SIGTERM to a rank itself behave as with MPICH.
OMPI_SIGTERM = ("Open MPI's mpiexec forwards SIGTERM as SIGTERM and SIGKILL 1 s later, then exits 1: no stop at a "
                "step boundary with exit 75 through it (signal the ranks: srun, scancel)")


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


def refused(r: Outcome) -> str:
    """An in-process run refused before training: exit 2 on every rank, rank 0's one line (returned)."""
    line = r.error
    assert r.statuses == (2,) * len(r.statuses) and "epoch " not in r.out, (r.statuses, r.out)
    return line


# -- the agreement rules and the injected failures, as functions ------------------------------
class Gathers:
    """A stand-in communicator whose allgather returns every rank's value as given."""

    def __init__(self, values: list) -> None:
        self.values = values

    def allgather(self, mine):
        return self.values


def test_agree_raises_the_lowest_failing_ranks_message_on_every_rank():
    agree(Gathers([None, None, None]), None)  # nobody failed: nothing raised
    with pytest.raises(AgreedError, match=r"^rank 1: bad b$") as err:
        agree(Gathers([None, "bad b", "bad c"]), None, exit_code=3)
    assert err.value.exit_code == 3
    with pytest.raises(AgreedError, match=r"^bad a$"):  # every rank failed: no rank named
        agree(Gathers(["bad a", "bad b"]), ValueError("bad a"))
    # a check rank 0 makes for every rank (the checkpoint directory, the resume): its failure is no rank's own
    with pytest.raises(AgreedError, match=r"^--resume maybe: no such file$"):
        agree(Gathers(["--resume maybe: no such file", None]), None, on_root=True)
    with pytest.raises(AgreedError, match=r"^rank 1: bad b$"):  # another rank's own failure is still named
        agree(Gathers([None, "bad b"]), None, on_root=True)


def test_differing_ranks_are_those_off_the_most_common_value():
    assert differing_ranks([1, 1, 1]) == []
    assert differing_ranks([1, 2, 1, 1]) == [1]
    assert differing_ranks([2, 1, 1]) == [0]  # the majority, not rank 0, is the reference
    assert differing_ranks([1, 2]) == [1]  # a tie: rank 0's value
    assert name_differences([{"hidden": (32,), "lr": 0.1}] * 2 + [{"hidden": (64,), "lr": 0.1}], flag=True) == \
        ["--hidden is (32,) on rank(s) [0, 1] but (64,) on rank 2"]


def test_injected_failures_and_delays_come_from_the_environment():
    assert isinstance(Injected.from_environ({}), NoHooks)
    assert Injected.from_environ({"MPISGD_FAIL_AT_STEP": "7"}) == Injected(fail_at=(7, 0))
    hooks = Injected.from_environ({"MPISGD_FAIL_AT_STEP": "5:2", "MPISGD_DELAY_RANK": "1:8"})
    assert hooks == Injected(fail_at=(5, 2), delay=(1, 0.008))
    hooks.before_step(5, 1)  # another rank, or another step: nothing
    hooks.before_step(4, 2)
    with pytest.raises(RuntimeError, match=r"injected failure at step 5 \(\$MPISGD_FAIL_AT_STEP\)"):
        hooks.before_step(5, 2)
    t0 = time.monotonic()
    Injected(delay=(1, 0.05)).before_step(3, 1)
    assert time.monotonic() - t0 >= 0.05


# -- an exception on one rank ----------------------------------------------------------------
# rank 0 too: it runs the watchdog's thread (on by default), whose shutdown waits for every rank; a
# rank other than 0 at k = 3 fails in test_sharded_step_exception_ends_every_rank and the guard's test
@launches
@pytest.mark.parametrize(("k", "failing"), [(2, 1), (3, 0)])
def test_exception_on_one_rank_ends_the_job(k: int, failing: int, tag: str) -> None:
    r, elapsed = launch(k, tag, *SYNTH, timeout=90, fail_at=f"5:{failing}")
    assert r.returncode != 0
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s to end the job"
    assert f"mpisgd: rank {failing} of {k} failed" in r.stderr, r.stderr
    assert "RuntimeError: injected failure at step 5" in r.stderr, r.stderr
    assert "final test accuracy" not in r.stdout
    assert_no_rank_left(tag)


# -- bad input: one line from rank 0, exit 2 everywhere ----------------------------------------
# End to end under mpiexec for an option argparse refuses and for one a set-up stage refuses; every other
# bad option is refused by parse_config (tests/test_config.py) or by a set-up stage in process (below).
@launches
@pytest.mark.parametrize(("args", "says"), [
    (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
    (("--resume", "/nonexistent/ckpt.npz"), "--resume /nonexistent/ckpt.npz: no such file"),
])
def test_bad_input_is_one_line_and_exit_2_on_every_rank(args: tuple[str, ...], says: str, tag: str) -> None:
    r, elapsed = launch(3, tag, *SYNTH, "--max-steps", "3", *args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in (r.stderr + r.stdout).splitlines() if "mpisgd: error" in line]
    assert len(lines) == 1 and says in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert elapsed < PROMPT_S
    assert_no_rank_left(tag)


@pytest.mark.mpi
@pytest.mark.parametrize(("args", "says"), [
    (("--dataset", "fashion-mnist", "--synthetic-samples", "8192", "--data-dir", "/nonexistent"),  # TINY's size
     "/nonexistent"),  # back to the default, which Fashion-MNIST does not read
    (("--limit-train", "10", "--batch-size", "64"), "fewer than one global batch"),
    (("--resume", "/nonexistent/ckpt.npz"), "--resume /nonexistent/ckpt.npz: no such file"),
    (("--resume", "/tmp"), "--resume /tmp is a directory: give one of its checkpoints (ckpt-<step>.npz), or "
                           "--checkpoint-dir /tmp --resume auto for its newest"),  # "not a regular file" before
    (("--epochs", "x"), "invalid int value: 'x'"),  # argparse's refusal, agreed before set-up
    (("--lr", "1e308", "--batch-size", "512", "--base-batch", "1"), "learning rates must be finite"),
    (("--allreduce", "nccl"), "needs GPU buffers"),
    (("--hidden", "200000,200000"), "the run needs at least"),
])
def test_a_set_up_stage_refuses_bad_input_on_every_rank(args: tuple[str, ...], says: str) -> None:
    assert says in refused(train_here([*TINY, "--max-steps", "3", *args]))


@pytest.mark.mpi
def test_configuration_mismatch_names_the_odd_rank() -> None:
    """The last rank was given another model (as an MPMD launch would): every rank refuses to start."""
    k = world().Get_size()
    odd = "64" if world().Get_rank() == k - 1 else "32"
    line = refused(train_here([*TINY, "--max-steps", "3", "--hidden", odd]))
    assert f"--hidden is (32,) on rank(s) {list(range(k - 1))} but (64,) on rank {k - 1}" in line, line


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


# the replicated step's all-reduce at k = 2; the sharded step's collectives at k = 3 below
@launches
def test_killed_rank_ends_the_job(tag: str, tmp_path: Path) -> None:
    p = _start_long_run(2, tag, tmp_path)
    os.kill(rank_pids(tag)[1], signal.SIGKILL)
    out, err, elapsed = _wait_end(p, tag)
    assert p.returncode != 0
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s to end the job"
    if "BAD TERMINATION" in out + err:  # MPICH's hydra: names the pid and the signal, exits with its number
        assert "Killed (signal 9)" in out + err
    assert_no_rank_left(tag)


# -- the sharded step's extra collectives (reduce-scatter, finite vote, all-gathers) ---------------
@launches
def test_sharded_step_exception_ends_every_rank(tag: str) -> None:
    r, elapsed = launch(3, tag, *SYNTH, "--shard-optimizer", timeout=90, fail_at="5:2")
    assert r.returncode != 0, r.stdout
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s to end the job"
    assert "final test accuracy" not in r.stdout
    assert "mpisgd: rank 2 of 3 failed" in r.stderr, r.stderr
    assert_no_rank_left(tag)


@pytest.mark.mpi
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_sharded_step_non_finite_gradient_stops_every_rank_with_one_line() -> None:
    """Every rank learns it from the finite vote: one error line, exit 1 everywhere, no abort of a lone rank."""
    r = train_here([*TINY, "--shard-optimizer", "--max-steps", "20", "--lr", "1e30"])
    assert r.statuses == (1,) * len(r.statuses) and "non-finite gradient" in r.error, r
    assert "final test accuracy" not in r.out


@launches
def test_killed_rank_ends_the_sharded_job(tag: str, tmp_path: Path) -> None:
    p = _start_long_run(3, tag, tmp_path, "--shard-optimizer")
    os.kill(rank_pids(tag)[2], signal.SIGKILL)
    _, _, elapsed = _wait_end(p, tag)
    assert p.returncode != 0
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s to end the job"
    assert_no_rank_left(tag)


@launches
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
@launches
def test_non_finite_gradient_stops_every_rank(tag: str) -> None:
    """End to end: an error every rank detects together is one line and exit 1 on every rank, no abort."""
    r, elapsed = launch(2, tag, *SYNTH, "--max-steps", "20", "--lr", "1e30", "--on-nan", "stop")
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("mpisgd: error")]
    assert len(errors) == 1 and "non-finite gradient" in errors[0] and "--on-nan skip" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert elapsed < PROMPT_S
    assert_no_rank_left(tag)


@pytest.mark.mpi
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_non_finite_gradient_skip_counts_the_skipped_steps_and_gives_up_when_diverged(shared_tmp: Path) -> None:
    """--lr 1e30 makes the parameters huge after the first step: every later step is non-finite. Ten steps
    are skipped and counted (exit 0); forty give up at the twentieth skipped in a row, exit 1 on every rank."""
    metrics = shared_tmp / "m.jsonl"
    run = [*TINY, "--lr", "1e30", "--on-nan", "skip"]
    r = train_here([*run, "--max-steps", "10", "--metrics-file", str(metrics)])
    assert r.statuses == (0,) * len(r.statuses), r
    assert "warning: non-finite gradient at step" in r.out and "step skipped (--on-nan skip;" in r.out, r.out
    epochs = [rec for rec in map(json.loads, metrics.read_text().splitlines()) if rec["kind"] == "epoch"]
    assert epochs and epochs[-1]["skipped_steps"] > 0, epochs
    r = train_here([*run, "--max-steps", "40"])
    assert r.statuses == (1,) * len(r.statuses), r
    assert "non-finite gradients at 20 steps in a row" in r.err and "the run has diverged; lower --lr" in r.err, r


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


def test_clean_shm_never_reaches_outside_its_directory(tmp_path):
    """A --pattern with a '/' ('../*' removed the parent's unheld files with --delete) or an empty one (a
    traceback), and a --dir that is no directory (0 files, as if clean): one line, exit 2, nothing removed."""
    shm = tmp_path / "shm"
    shm.mkdir()
    outside = tmp_path / "mpich_shm_outside"
    outside.write_bytes(b"x")
    script = [sys.executable, str(ROOT / "scripts" / "clean_shm.py"), "--delete"]
    for args, says in ((["--dir", str(shm), "--pattern", "../*"], "--pattern must be a file-name pattern"),
                       (["--dir", str(shm), "--pattern", "../mpich_shm_*"], "--pattern must be a file-name pattern"),
                       (["--dir", str(shm), "--pattern", ""], "--pattern must be a file-name pattern"),
                       (["--dir", str(tmp_path / "none")], "is not a directory"),
                       (["--dir", str(outside)], "is not a directory")):
        r = subprocess.run([*script, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("clean_shm.py: error: ") \
            and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert outside.exists()


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


@launches
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


# a rank other than 0 (whose peers wait in the all-reduce), and rank 0 (the watchdog's, at k = 3)
@launches
@pytest.mark.parametrize("k,rank", [(2, 1), (3, 0)])
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


# the signal through the launcher or to one rank: the same stop; the resumed run compared once (to a rank,
# as Open MPI's launcher allows too)
@launches
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
    if target == "mpiexec":
        return
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


@launches
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


@launches
def test_sigterm_without_a_checkpoint_dir_says_the_work_is_lost(tag: str, tmp_path: Path) -> None:
    """75 promises a checkpoint of the interrupted step (the Slurm scripts requeue on it): without one, 143."""
    if open_mpi_launcher():
        pytest.skip(OMPI_SIGTERM)
    p = _start_long_run(2, tag, tmp_path)
    os.kill(_mpiexec_pid(p), signal.SIGTERM)
    out, err, _ = _wait_end(p, tag, limit_s=40)
    assert p.returncode == 143 and "no checkpoint of this step" in err and "(exit 143)" in err, err[-2000:]
    assert_no_rank_left(tag)


@launches
def test_sigterm_when_the_checkpoint_cannot_be_written_is_not_75(tag: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    p = _start_long_run(2, tag, tmp_path, "--checkpoint-dir", str(ck))
    # the directory's name becomes a file: the next checkpoint cannot be written there. Moved away, not
    # removed (a checkpoint may be written into it meanwhile); the run may make it again before the file
    # takes its name, so move it again until the file does
    for attempt in range(50):
        try:
            ck.rename(tmp_path / f"ck-moved-{attempt}")
        except FileNotFoundError:
            pass
        try:
            with open(ck, "x") as f:
                f.write("not a directory any more")
            break
        except (FileExistsError, IsADirectoryError):
            continue
    assert ck.is_file()
    os.kill(rank_pids(tag)[1], signal.SIGTERM)  # to a rank: Open MPI's mpiexec would SIGKILL them a second later
    out, err, _ = _wait_end(p, tag, limit_s=40)
    assert p.returncode == 143 and "not written" in out + err, (p.returncode, (out + err)[-2000:])
    assert_no_rank_left(tag)


@launches
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


@launches
def test_a_stopped_and_continued_rank_is_not_blamed_on_rank_0(tag: str, tmp_path: Path) -> None:
    """SIGSTOP, then SIGCONT: rank 0 names the stopped rank while it is stopped; once it runs again, the job
    goes on, and the resumed rank does not report rank 0's silence (the time it was stopped is not waiting)."""
    p = _start_long_run(3, tag, tmp_path, "--stall-timeout-s", "2", "--max-steps", "400")
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
@pytest.mark.parametrize("option,path,says", mpi_first([
    ("--checkpoint-dir", "{file}", "exists and is not a directory"),
    ("--checkpoint-dir", "/proc/mpisgd-nope", "cannot create the directory"),
    ("--save-model", "/proc/mpisgd-nope/model.npz", "cannot"),
    ("--save-model", "/dev/null", "exists and is not a regular file"),
    ("--metrics-file", "{file}/m.jsonl", "cannot"),
    ("--timeline", "/proc/mpisgd-nope/trace", "cannot"),
]))
def test_an_output_that_cannot_be_written_fails_before_training(option: str, path: str, says: str,
                                                                shared_tmp: Path) -> None:
    file = root_makes(lambda: _written(shared_tmp / "a-file", "x"))
    line = refused(train_here([*TINY, "--max-steps", "3", option, path.format(file=file)]))
    assert option in line and says in line, line
    assert file.read_text() == "x"


@pytest.mark.mpi
def test_save_model_keeps_a_file_it_did_not_write_and_replaces_a_model(shared_tmp: Path) -> None:
    """--save-model onto someone's file (notes, a data .npz) is refused before training and the file kept; onto
    an empty file or an earlier run's model, the run writes its model there (a rerun of one command)."""
    notes = root_makes(lambda: _written(shared_tmp / "notes.txt", "x"))
    line = refused(train_here([*TINY, "--max-steps", "2", "--save-model", str(notes)]))
    assert "--save-model" in line and "is not a model mpisgd saved" in line, line
    assert notes.read_text() == "x"
    data = root_makes(lambda: _saved_npz(shared_tmp / "d.npz"))
    refused(train_here([*TINY, "--max-steps", "2", "--save-model", str(data)]))
    assert set(np.load(data).files) == {"x"}
    model = root_makes(lambda: _written(shared_tmp / "model.npz", ""))
    for steps in ("1", "2"):  # empty, then the first run's model: each replaced
        r = train_here([*TINY, "--max-steps", steps, "--save-model", str(model)])
        assert r.statuses == (0,) * len(r.statuses), r
        assert "flat" in np.load(model).files


@serial_only  # one rank's run, in this process (the refusals are rank 0's set-up checks, agreed like the others)
def test_a_users_files_beside_the_runs_outputs_are_kept(tmp_path: Path) -> None:
    """A metrics file that is not one (notes.txt): refused, not appended to. A config.toml of one's own in the
    checkpoint directory or beside the metrics file: refused, not replaced. An earlier run's metrics file and
    configuration copies: continued and replaced (a rerun of one command)."""
    notes = _written(tmp_path / "notes.txt", "my notes\n")
    line = refused(train_here([*TINY, "--max-steps", "2", "--metrics-file", str(notes)]))
    assert "--metrics-file" in line and "is not a metrics file" in line, line
    ck = tmp_path / "ck"
    ck.mkdir()
    mine = _written(ck / "config.toml", "lr = 0.5  # my own\n")
    line = refused(train_here([*TINY, "--max-steps", "2", "--checkpoint-dir", str(ck)]))
    assert f"{mine} exists and is not a configuration mpisgd wrote" in line and "--checkpoint-dir" in line, line
    beside = _written(tmp_path / "m.jsonl.config.toml", "lr = 0.5\n")
    line = refused(train_here([*TINY, "--max-steps", "2", "--metrics-file", str(tmp_path / "m.jsonl")]))
    assert f"{beside} exists and is not a configuration mpisgd wrote" in line and "--metrics-file" in line, line
    assert notes.read_text() == "my notes\n" and mine.read_text() == "lr = 0.5  # my own\n"
    mine.unlink()
    beside.unlink()
    run = [*TINY, "--max-steps", "2", "--metrics-file", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(ck)]
    for again in ([], ["--resume", "auto"]):  # the second run continues the first's files
        r = train_here([*run, *again])
        assert r.status == 0, r
    assert (ck / "config.toml").read_text().startswith("# the effective configuration of a run on k=")


def _saved_npz(path: Path) -> Path:
    np.savez(path, x=np.arange(3))
    return path


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@serial_only  # one rank's run, in this process
def test_a_full_disk_while_checkpointing_warns_and_the_lost_last_checkpoint_fails_the_run(tmp_path: Path) -> None:
    """A real full file system: the checkpoint directory on a small tmpfs, each checkpoint 400 KB. The writes
    fail with a warning naming the free space and training finishes, no temporary file is left; but a run
    whose last step has no checkpoint exits 1, its last line saying which checkpoint a resume would start
    from (none; or the one that fit, when the disk filled up later)."""
    ck = tmp_path / "ck"
    run = [*TINY, "--max-steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--hidden", "64"]
    with small_tmpfs(ck, "256k"):
        r = train_here(run)
        left = sorted(p.name for p in ck.iterdir())
    assert r.status == 1, r
    warned = [line for line in r.out.splitlines() if line.startswith("warning: checkpoint of step")]
    assert len(warned) == 3 and "MiB free in" in warned[0] and "training goes on" in warned[0], r.out
    assert "final test accuracy" in r.out
    assert r.err.splitlines()[-1] == (f"mpisgd: error: the checkpoint of the last step (6) was not written in {ck} "
                                      "(the warning above says why); there is no checkpoint"), r.err
    assert left == [".mpisgd.lock", "config.toml"]  # no checkpoint, no temporary (the effective configuration fit)
    with small_tmpfs(ck, "640k"):  # room for one checkpoint, not for its successor beside it
        r = train_here([*run, "--checkpoint-keep", "1"])
        left = sorted(p.name for p in ck.iterdir())
    assert r.status == 1 and r.err.splitlines()[-1].endswith(
        "the newest checkpoint is of step 2, so a resume repeats steps 3 to 6"), r
    assert left == [".mpisgd.lock", "ckpt-000000002.npz", "config.toml"]


# -- a checkpoint directory belongs to one run (rank 0's: one rank shows it) ------------------------
@serial_only  # one rank's run, in this process
def test_a_reused_checkpoint_dir_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    run = (*TINY, "--batch-size", "256", "--checkpoint-dir", ck)  # 8 steps an epoch
    r = train_here([*run, "--max-steps", "10"])
    assert r.status == 0, r
    again = train_here([*run, "--max-steps", "5", "--seed", "7"])
    assert "holds another run's checkpoints" in refused(again)
    # an epoch is 8 steps: its end, and the last step whatever --checkpoint-every says; nothing pruned
    assert sorted(p.name for p in Path(ck).glob("ckpt-*")) == ["ckpt-000000008.npz", "ckpt-000000010.npz"]
    # refused at set-up (a model that cannot be built): --overwrite-checkpoints deleted them all the same
    typo = train_here([*drop(run, "--hidden"), "--max-steps", "5", "--overwrite-checkpoints", "--model",
                       "no_such_module:build"])
    assert "cannot import no_such_module" in refused(typo)
    assert sorted(p.name for p in Path(ck).glob("ckpt-*")) == ["ckpt-000000008.npz", "ckpt-000000010.npz"]
    over = train_here([*run, "--max-steps", "5", "--seed", "7", "--overwrite-checkpoints"])
    assert over.status == 0 and [p.name for p in Path(ck).glob("ckpt-*")] == ["ckpt-000000005.npz"]
    done = train_here([*run, "--max-steps", "5", "--seed", "7", "--resume", "auto"])
    assert done.status == 0 and "the run is finished (step 5 of 5)" in done.out, done.out
    assert "nan" not in done.out + done.err


@serial_only  # one rank's run, in this process
def test_two_runs_never_share_a_checkpoint_dir(tmp_path: Path) -> None:
    """Another run holds the directory's lock (here: this process, through another open file)."""
    from mpisgd.app.run_dir import RunDirectory

    ck = tmp_path / "ck"
    holder = RunDirectory(str(ck), "no", overwrite=False)
    try:
        other = train_here([*TINY, "--max-steps", "3", "--checkpoint-dir", str(ck), "--resume", "auto"])
    finally:
        holder.close()
    assert "is in use by another run (pid" in refused(other)


@serial_only  # one rank's run, in this process
def test_resume_checks_the_run_identity_and_names_every_difference(tmp_path: Path) -> None:
    run = (*TINY, "--batch-size", "256", "--checkpoint-dir", str(tmp_path / "ck"), "--epochs", "5")
    assert train_here([*run, "--max-steps", "10"]).status == 0
    line = refused(train_here([*run, "--max-steps", "20", "--resume", "auto", "--lr", "0.05", "--seed", "3"]))
    for needle in ("--lr 0.1 -> 0.05", "--seed 0 -> 3", "--max-steps 10 -> 20", "--data synthetic (2048 train",
                   "--resume-allow data,seed,lr,max_steps"):  # the synthetic data follow the seed
        assert needle in line, line
    allowed = train_here([*run, "--max-steps", "20", "--resume", "auto", "--lr", "0.05", "--resume-allow",
                          "lr,max_steps"])
    assert allowed.status == 0, allowed
    assert "resume: changed --lr 0.1 -> 0.05 on purpose" in allowed.out, allowed.out
    # the model's structure cannot change: said so, and --resume-allow offered for the others only
    line = refused(train_here([*run, "--dtype", "float64", "--lr", "0.05", "--max-steps", "30", "--resume", "auto"]))
    assert line.endswith("--dtype cannot change on a resume (the model's structure): give the checkpoint's value; "
                         "to continue with the other changes on purpose pass --resume-allow max_steps"), line
    line = refused(train_here([*run, "--dtype", "float64", "--lr", "0.05", "--max-steps", "20", "--resume", "auto"]))
    assert line.endswith("--dtype float32 -> float64; --dtype cannot change on a resume (the model's structure): "
                         "give the checkpoint's value"), line


@pytest.mark.mpi
def test_resume_on_other_k_derives_the_batch(shared_tmp: Path) -> None:
    """A checkpoint written by one rank (B = 48) resumed by this job's k ranks: b = 48 / k derived.
    (The refusals, B not divisible by k and a --batch-size that contradicts B, are resume_point's:
    tests/test_checkpoint.py.)"""
    from mpi4py import MPI

    k, ck = world().Get_size(), str(shared_tmp / "ck")
    one = root_makes(lambda: train_here([*TINY, "--max-steps", "10", "--checkpoint-dir", ck, "--batch-size", "48"],
                                        comm=MPI.COMM_SELF))
    assert one.status == 0, one
    r = train_here([*TINY, "--max-steps", "12", "--checkpoint-dir", ck, "--resume", "auto", "--resume-allow",
                    "max_steps"])
    assert r.status == 0, r
    assert f"written by k=1 ranks, now k={k} with the same B=48; b={48 // k}, m=1 derived" in r.out, r.out


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


@launches
def test_ranks_with_different_data_are_refused(tag: str, tmp_path: Path) -> None:
    """End to end, an MPMD launch whose ranks read different data sets: one line, exit 2, no rank left."""
    a = _idx_dir(tmp_path / "a", np.arange(512) % 10)
    b = _idx_dir(tmp_path / "b", np.arange(512) % 10, seed=1)
    r = _two_ranks_two_data_sets(a, b, tag)
    assert r.returncode == 2 and "ranks loaded different data (fingerprint is" in r.stderr, r.stderr
    assert "on rank(s) [0] but" in r.stderr and "on rank 1" in r.stderr, r.stderr
    assert r.stderr.count("mpisgd: error") == 1
    assert_no_rank_left(tag)


@pytest.mark.mpi
def test_ranks_with_another_test_set_are_refused(shared_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fingerprint covers the test set too: the last rank's blank test images are found (each rank's
    $MPISGD_DATA names its set, so the options agree)."""
    from test_data import write_idx

    def make() -> tuple[Path, Path]:
        a = _idx_dir(shared_tmp / "a", np.arange(512) % 10)
        b = shared_tmp / "b"
        b.mkdir()
        for f in a.iterdir():
            (b / f.name).write_bytes(f.read_bytes())
        write_idx(b / "t10k-images-idx3-ubyte", np.zeros((50, 28, 28), np.uint8))
        return a, b

    a, b = root_makes(make)
    last = world().Get_rank() == world().Get_size() - 1
    monkeypatch.setenv("MPISGD_DATA", str(b if last else a))
    line = refused(train_here(["--hidden", "16", "--progress", "off", "--max-steps", "3"]))
    assert "data" in line and "fingerprint" in line and "give every rank the same data set" in line, line


@pytest.mark.parametrize("labels,n_test,says", mpi_first([([*range(10)] * 1, 50, "fewer than one global batch B = {B}"),
                                                ([*range(10)] * 20, 0, "the test set is empty")]))
def test_data_the_models_cannot_learn_from_is_refused_at_load(labels, n_test, says, shared_tmp: Path):
    d = root_makes(lambda: _idx_dir(shared_tmp / "d", labels, n_test=n_test))
    r = train_here(["--data-dir", str(d), "--hidden", "16", "--progress", "off", "--batch-size", "8"])
    assert says.format(B=8 * world().Get_size()) in refused(r)


@pytest.mark.parametrize("kind", mpi_first(["npy", "edited"]))
def test_resume_from_something_that_is_not_a_checkpoint_is_one_line(kind: str, shared_tmp: Path) -> None:
    def make() -> Path:
        bad = shared_tmp / ("x.npy" if kind == "npy" else "x.npz")
        if kind == "npy":
            np.save(bad, np.zeros(3))
        else:  # a checkpoint whose parameters someone replaced by integers
            np.savez(bad, format=np.int64(1), params=np.arange(5), scalars=np.zeros(6, np.int64),
                     prev_lr=np.float64(0.1), config=np.array("{}"))
        return bad

    bad = root_makes(make)
    assert str(bad) in refused(train_here([*TINY, "--max-steps", "3", "--resume", str(bad)]))


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


@launches
def test_guard_ends_the_job_with_the_failing_ranks_message(tag: str, tmp_path: Path) -> None:
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED.format(root=str(ROOT)))
    r, elapsed = launch(2, tag, str(script), timeout=60)
    assert r.returncode != 0 and elapsed < PROMPT_S
    assert "mpisgd: rank 1 of 2 failed" in r.stderr, r.stderr
    assert "ValueError: train_step: rank 1 passed labels outside 0..2" in r.stderr, r.stderr  # at the first forward
    assert_no_rank_left(tag)


# -- inputs that are not what they seem: refused in one line, never opened if they could block ----------
def _npz(path: Path, n_train: int = 512, n_test: int = 64, **change) -> Path:
    rng = np.random.default_rng(0)
    a = {"x_train": rng.normal(size=(n_train, 6)).astype("float32"), "y_train": rng.integers(0, 3, n_train),
         "x_test": rng.normal(size=(n_test, 6)).astype("float32"), "y_test": rng.integers(0, 3, n_test)}
    np.savez(path, **{**a, **change})
    return path


DATA_RUN = ("--hidden", "8", "--progress", "off", "--batch-size", "16", "--max-steps", "3")


def _not_a_data_set(case: str, tmp: Path) -> Path:
    path = tmp / "data"
    if case == "fifo":
        os.mkfifo(path)
    elif case == "npy":
        path = tmp / "x.npy"
        np.save(path, np.zeros((4, 3)))
    elif case == "csv":
        path.write_text("0.1,0.2,1\n0.3,0.4,0\n")
    elif case == "idx without test files":
        path = _idx_dir(tmp / "idx", np.arange(512) % 10)
        for stem in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
            (path / stem).unlink()
    elif case.startswith("float64"):
        x = np.random.default_rng(0).normal(size=(512, 6))
        x[300, 2] = 1e39
        path = _npz(tmp / "big.npz", x_train=x)
    else:
        y = np.arange(512) % 3
        y[7] = 10**9
        path = _npz(tmp / "labels.npz", y_train=y)
    return path


@pytest.mark.parametrize("case,says", mpi_first([
    ("fifo", "is not a regular file or a directory (a FIFO or a device is never opened)"),
    ("npy", "is a single .npy array; mpisgd reads an .npz holding x_train"),
    ("csv", "is not an .npz (a zip of .npy arrays); mpisgd reads"),
    ("idx without test files", "it lacks t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]"),
    ("float64 overflows float32", "training inputs hold 1e+39 (sample 300), which overflows float32"),
    ("label 10**9", "training label 1000000000 (sample 7) makes 1,000,000,001 classes"),
]))
def test_data_that_is_not_a_data_set_is_one_line_and_exit_2(case: str, says: str, shared_tmp: Path) -> None:
    path = root_makes(lambda: _not_a_data_set(case, shared_tmp))
    line = refused(train_here([*DATA_RUN, "--data", str(path)]))
    assert says in line and "allow_pickle" not in line and "apt-get" not in line, line


@serial_only  # one rank's run, in this process
def test_a_context_on_image_data_is_refused_as_doing_nothing() -> None:
    """--context sizes windows of text or tokens; on images it passed silently."""
    line = refused(train_here([*TINY, "--max-steps", "1", "--context", "32"]))
    assert line == "mpisgd: error: --context 32 would do nothing in this run: it is the window of sequence data " \
        "(--data a text file or an .npz of tokens), and this data is images or features", line


@pytest.mark.mpi
def test_one_stray_label_is_refused_naming_it(shared_tmp: Path) -> None:
    """A label 200 among 0..2 trained a 201-class model, 197 classes empty: now refused, naming the sample."""
    y = np.arange(512) % 3
    y[7] = 200
    r = train_here([*DATA_RUN, "--data", str(root_makes(lambda: _npz(shared_tmp / "s.npz", y_train=y)))])
    line = r.error
    assert r.statuses == (2,) * len(r.statuses), r
    assert "training label 200 (sample 7) makes 201 classes" in line and "a stray label?" in line, line


# -- a model module of one's own that fails: one line, exit 2 ---------------------------------------------
@pytest.mark.parametrize("source,says", mpi_first([
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
]))
def test_a_model_module_that_fails_is_one_line_and_exit_2(source: str, says: str, shared_tmp: Path,
                                                          own_module) -> None:
    own_module("mymodel", source)
    data = root_makes(lambda: _npz(shared_tmp / "d.npz"))
    assert says in refused(train_here([*drop(DATA_RUN, "--hidden"), "--data", str(data), "--model", "mymodel:f"]))


# -- outputs never replace inputs or each other -------------------------------------------------------
@pytest.mark.parametrize("outs,says", mpi_first([
    (("--save-model", "{data}"), "--save-model {data} is the file --data reads"),
    (("--metrics-file", "{data}"), "--metrics-file {data} is the file --data reads"),
    (("--metrics-file", "{out}", "--save-model", "{out}"), "--save-model and --metrics-file name the same file"),
    (("--checkpoint-dir", "{ck}", "--save-model", "{ck}/ckpt-000000003.npz"), "lies in --checkpoint-dir"),
]))
def test_an_output_colliding_with_an_input_or_another_output_is_refused(outs, says, shared_tmp: Path) -> None:
    data = root_makes(lambda: _npz(shared_tmp / "d.npz"))
    out = root_makes(lambda: _written(shared_tmp / "out", "earlier metrics\n"))
    before = data.read_bytes()
    fill = {"data": str(data), "out": str(out), "ck": str(shared_tmp / "ck")}
    line = refused(train_here([*DATA_RUN, "--data", str(data), *(o.format(**fill) for o in outs)]))
    assert says.format(**fill) in line, line
    assert data.read_bytes() == before and out.read_text() == "earlier metrics\n"


@pytest.mark.mpi
def test_a_run_refused_at_set_up_leaves_its_output_places_as_it_found_them(shared_tmp: Path) -> None:
    """Refused after the checkpoint directory is locked (the model cannot be built): the directories the
    output checks and the lock made are gone again, new ones and an empty one alike; an earlier run's
    directory keeps its lock file and checkpoints."""
    new = shared_tmp / "new"
    empty, used = shared_tmp / "empty", shared_tmp / "used"
    outs = ("--checkpoint-dir", str(new / "ck"), "--metrics-file", str(new / "m" / "m.jsonl"),
            "--save-model", str(new / "s" / "model.npz"), "--timeline", str(new / "t" / "tl"))
    typo = (*drop(TINY, "--hidden"), "--max-steps", "2", "--model", "no_such_module:build")
    root_makes(empty.mkdir)
    for ck in (str(empty), str(used)):
        if ck == str(used):
            assert train_here([*TINY, "--max-steps", "2", "--checkpoint-dir", ck]).status == 0
        before = root_makes(lambda ck=ck: sorted(p.name for p in Path(ck).iterdir()))
        line = refused(train_here([*typo, *outs, "--checkpoint-dir", ck, "--resume", "auto"]))
        assert "cannot import no_such_module" in line, line
        assert root_makes(lambda ck=ck: sorted(p.name for p in Path(ck).iterdir())) == before
    assert before[0] == ".mpisgd.lock" and "ckpt-000000002.npz" in before, before
    assert "cannot import no_such_module" in refused(train_here([*typo, *outs]))
    assert not root_makes(new.exists)


@pytest.mark.mpi
def test_a_lock_file_that_is_a_directory_is_one_line(shared_tmp: Path) -> None:
    ck = shared_tmp / "ck"
    root_makes(lambda: (ck / ".mpisgd.lock").mkdir(parents=True))
    assert "its lock file" in refused(train_here([*TINY, "--max-steps", "3", "--checkpoint-dir", str(ck)]))
    assert (ck / ".mpisgd.lock").is_dir()


# -- a full disk: the metrics stop with a warning, the model goes elsewhere and says where ----------------
@serial_only  # one rank's run, in this process
def test_a_full_disk_for_metrics_model_and_timeline_loses_nothing_silently(tmp_path: Path) -> None:
    small, ck = tmp_path / "small", tmp_path / "ck"
    with small_tmpfs(small, "8k"):
        r = train_here([*TINY, "--max-steps", "60", "--metrics-file", str(small / "m.jsonl"),
                        "--save-model", str(small / "model.npz"), "--timeline", str(small / "t"),
                        "--checkpoint-dir", str(ck)])
        left = sorted(p.name for p in small.iterdir())
    assert r.status == 0, r
    out = r.out.splitlines()
    assert sum("warning: --metrics-file" in x and "No space left on device" in x and "training goes on" in x
               for x in out) == 1, r.out
    assert any("warning: rank 0: --timeline" in x and "not written (No space left on device)" in x for x in out)
    assert out[-1] == f"warning: --save-model {small}/model.npz could not be written; the final model is in " \
                      f"{ck}/model.npz", r.out
    assert "final test accuracy" in r.out and "Traceback" not in r.err
    assert np.load(ck / "model.npz")["flat"].size > 0
    assert not [x for x in left if ".tmp." in x], left  # no temporary file left behind


# -- checkpoints: every resume path keeps what was on disk (rank 0's directory: one rank shows it) ---------
EPOCH8 = (*TINY, "--batch-size", "256")  # 8 steps an epoch


def _names(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.glob("ckpt-*.npz"))


@serial_only  # one rank's run, in this process
def test_resuming_into_another_runs_directory_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for ck, seed in ((a, "0"), (b, "7")):
        r = train_here([*EPOCH8, "--max-steps", "10", "--checkpoint-dir", str(ck), "--seed", seed])
        assert r.status == 0, r
    before = {p.name: p.read_bytes() for p in b.glob("ckpt-*")}
    r = train_here([*EPOCH8, "--max-steps", "20", "--checkpoint-dir", str(b), "--resume",
                    str(a / "ckpt-000000010.npz"), "--resume-allow", "max_steps"])
    assert "holds another run's checkpoints (ckpt-000000010.npz, 2 in all), not those of the run" in refused(r)
    assert {p.name: p.read_bytes() for p in b.glob("ckpt-*")} == before
    # another --optimizer or --trust-coef is a difference too (it was accepted without a word)
    r = train_here([*EPOCH8, "--max-steps", "20", "--checkpoint-dir", str(a), "--resume", "auto",
                    "--resume-allow", "max_steps", "--optimizer", "lars", "--trust-coef", "0.02"])
    assert "--optimizer sgd -> lars; --trust-coef 0.1 -> 0.02" in refused(r)


@serial_only  # one rank's run, in this process
def test_rolling_back_moves_the_abandoned_checkpoints_and_auto_continues_the_new_line(tmp_path: Path):
    ck = tmp_path / "ck"
    r = train_here([*EPOCH8, "--max-steps", "24", "--checkpoint-dir", str(ck)])
    assert r.status == 0 and _names(ck) == ["ckpt-000000008.npz", "ckpt-000000016.npz", "ckpt-000000024.npz"]
    back = train_here([*EPOCH8, "--max-steps", "12", "--checkpoint-dir", str(ck), "--resume",
                       str(ck / "ckpt-000000008.npz"), "--resume-allow", "max_steps"])
    assert back.status == 0, back
    assert "rolling back to step 8: this run's later checkpoints (ckpt-000000016.npz, ckpt-000000024.npz) move " \
           f"to {ck}/abandoned/" in back.out, back.out
    assert _names(ck) == ["ckpt-000000008.npz", "ckpt-000000012.npz"]
    assert sorted(p.name for p in (ck / "abandoned").iterdir()) == ["ckpt-000000016.npz", "ckpt-000000024.npz"]
    on = train_here([*EPOCH8, "--max-steps", "14", "--checkpoint-dir", str(ck), "--resume", "auto",
                     "--resume-allow", "max_steps"])
    assert on.status == 0 and "at step 12" in on.out, on


@serial_only  # one rank's run, in this process
def test_resume_auto_with_no_readable_checkpoint_refuses_unless_told_to_overwrite(tmp_path: Path):
    ck = tmp_path / "ck"
    ck.mkdir()
    for step in (8, 16):
        (ck / f"ckpt-{step:09d}.npz").write_bytes(b"a damaged copy")
    r = train_here([*EPOCH8, "--max-steps", "3", "--checkpoint-dir", str(ck), "--resume", "auto"])
    assert "--resume auto: none of the 2 checkpoint(s)" in refused(r)
    assert [(ck / n).read_bytes() for n in _names(ck)] == [b"a damaged copy"] * 2
    r = train_here([*EPOCH8, "--max-steps", "3", "--checkpoint-dir", str(ck), "--resume", "auto",
                    "--overwrite-checkpoints"])
    assert r.status == 0 and _names(ck) == ["ckpt-000000003.npz"], r


FACTORY = """
from mpisgd.nn import Flatten, Linear, ReLU, Sequential
def f(input_shape, n_classes):
    return Sequential(Flatten(), Linear(784, 16), {middle}, Linear(16, n_classes){last})
"""


@serial_only  # one rank's run, in this process
def test_resuming_an_edited_model_factory_is_refused_naming_the_layer(tmp_path: Path, own_module) -> None:
    """The parameter count is unchanged: before, the checkpoint's parameters were poured into the new layers."""
    run = (*drop(EPOCH8, "--hidden"), "--model", "net:f", "--checkpoint-dir", str(tmp_path / "ck"))
    own_module("net", FACTORY.format(middle="ReLU()", last=""))
    r = train_here([*run, "--max-steps", "4"])
    assert r.status == 0, r
    own_module("net", FACTORY.format(middle="ReLU()", last=", ReLU()"))
    r = train_here([*run, "--max-steps", "8", "--resume", "auto", "--resume-allow", "max_steps"])
    assert "model differs from the checkpoint's" in refused(r) and "5 layers in this run, 4 in the checkpoint " \
        "(layer 4 is ReLU() in this run)" in r.err, r.err


@serial_only  # one rank's run, in this process
def test_a_hand_edited_checkpoint_past_the_last_epoch_is_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    r = train_here([*EPOCH8, "--max-steps", "10", "--epochs", "3", "--checkpoint-dir", str(ck)])
    assert r.status == 0, r
    path = ck / "ckpt-000000010.npz"
    with np.load(path) as z:
        arrays = dict(z)
    arrays["scalars"][1] = 99  # the epoch, with a valid zip CRC
    np.savez(path, **arrays)
    r = train_here([*EPOCH8, "--max-steps", "20", "--epochs", "3", "--checkpoint-dir", str(ck), "--resume",
                    "auto", "--resume-allow", "max_steps"])
    assert "epoch 100, is past this run's last epoch (3) although only 10 of its 20 steps are done" in refused(r)


# -- the all-reduce benchmark: bad input is one line and exit 2 on every rank, before any collective ---------
@launches
def test_allreduce_benchmark_bad_input_is_one_line_and_exit_2_on_every_rank() -> None:
    r = run_mpi(2, str(ROOT / "benchmarks" / "allreduce_bw.py"), "--max-bytes", "64", "--backends", "mpi,nope",
                timeout=120)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if "error" in line]
    assert r.returncode == 2 and len(errors) == 1 and errors[0].startswith("allreduce_bw: error: "), r.stderr
    assert "--backends: unknown nope; choose from" in errors[0] and "time_us" not in r.stdout, errors


@pytest.mark.parametrize("args,says", mpi_first([
    (("--iters", "-1"), "--iters and --warmup must be >= 0, got -1"),
    (("--backends", "mpi,nope"), "--backends: unknown nope; choose from"),
    (("--max-bytes", "100000G"), "needs "),
    (("--json", "/proc/mpisgd-nope/bw.json"), "--json /proc/mpisgd-nope: cannot create the directory"),
    (("--dtype", "complex128"), "--dtype must be a number type"),
    (("--step-factor", "x"), "invalid int value"),
]))
def test_allreduce_benchmark_refuses_bad_input_on_every_rank(args: tuple[str, ...], says: str, capsys) -> None:
    status = script("benchmarks", "allreduce_bw").main(["--max-bytes", "64", *args])
    out, err = capsys.readouterr()
    comm = world()
    statuses, (out, err) = comm.allgather(status), comm.bcast((out, err), root=0)
    errors = [line for line in (out + err).splitlines() if "error" in line]
    assert statuses == [2] * comm.Get_size() and len(errors) == 1, (statuses, out, err)
    assert errors[0].startswith("allreduce_bw: error: ") and says in errors[0], errors
    assert "Traceback" not in err and "time_us" not in out


# -- start-up under the watchdog -------------------------------------------------------------------
BLOCKING_FACTORY = """
import os, time
from mpisgd.nn import mlp

def build(in_shape, n_classes):
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
        time.sleep(600)  # a factory that blocks on one rank (a lock, a download, input())
    return mlp((16,), 784, n_classes)
"""


@launches
@pytest.mark.parametrize("abort", ["--stall-abort", "--stall-abort-s=4"])
def test_a_set_up_stage_blocking_on_one_rank_is_named_and_the_job_ends(abort: str, tag: str, tmp_path: Path) -> None:
    """Set-up runs under the watchdog: rank 1's model factory never returns, the others wait in the stage's
    agreement; rank 0 names rank 1 and the job ends (at once with --stall-abort, at --stall-abort-s else)."""
    (tmp_path / "blocking_model.py").write_text(BLOCKING_FACTORY)
    t0 = time.monotonic()
    path = f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"
    r = run_mpi(2, *drop(SYNTH, "--hidden"), "--model", "blocking_model:build", "--stall-timeout-s", "2", abort,
                "--max-steps", "3", timeout=120, env={"MPISGD_TEST_TAG": tag, "PYTHONPATH": path}, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "set-up: building the model" in r.stderr and "ranks [1] have not" in r.stderr, r.stderr[-2000:]
    assert elapsed < 60, f"{elapsed:.0f} s"
    assert_no_rank_left(tag)
