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
from conftest import ONE_THREAD, ROOT, mpiexec_cmd, open_mpi_launcher, run_mpi

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


def test_sigterm_without_a_checkpoint_dir_says_the_work_is_lost(tag: str, tmp_path: Path) -> None:
    if open_mpi_launcher():
        pytest.skip(OMPI_SIGTERM)
    p = _start_long_run(2, tag, tmp_path)
    os.kill(_mpiexec_pid(p), signal.SIGTERM)
    out, err, _ = _wait_end(p, tag, limit_s=40)
    assert p.returncode == 75 and "no checkpoint" in err, err[-2000:]
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
    ck.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(ck)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (root needed): {mounted.stderr.strip()}")
    try:
        r, _ = launch(2, tag, *SYNTH, "--max-steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                      "--hidden", "64")
        left = sorted(p.name for p in ck.iterdir())
    finally:
        subprocess.run(["umount", str(ck)], capture_output=True)
    assert r.returncode == 0, r.stderr[-2000:]
    warned = [line for line in r.stdout.splitlines() if line.startswith("warning: checkpoint of step")]
    assert len(warned) == 3 and "MiB free in" in warned[0] and "training goes on" in warned[0], r.stdout
    assert "final test accuracy" in r.stdout
    assert left == [".mpisgd.lock"]  # no checkpoint, no temporary


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


def test_ranks_with_different_data_are_refused(tag: str, tmp_path: Path) -> None:
    a = _idx_dir(tmp_path / "a", np.arange(512) % 10)
    b = _idx_dir(tmp_path / "b", np.arange(512) % 10, seed=1)
    train = ("-m", "mpisgd.train", "--hidden", "16", "--progress", "off", "--max-steps", "3")
    one = mpiexec_cmd(1, *train)
    py = one.index(sys.executable)  # env(1) sets each rank's variable: MPICH's -env and Open MPI's -x differ
    first = [*one[:py], "env", f"MPISGD_DATA={a}", *one[py:]]
    second = [*one[1:py], "env", f"MPISGD_DATA={b}", *one[py:]]
    env = {**os.environ, **ONE_THREAD, "MPISGD_TEST_TAG": tag}
    r = subprocess.run([*first, ":", *second], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "ranks [1] loaded other data than rank 0" in r.stderr, r.stderr
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
    (("--bucket-mb", "nan"), "--bucket-mb must be a finite number"),
    (("--stall-timeout", "nan"), "--stall-timeout must be a finite number"),
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
