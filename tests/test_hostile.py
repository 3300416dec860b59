"""What the fourth hostile probe found (issue 38), each the test that would have caught it: hand-edited
checkpoints, resuming on another k or with --global-batch, a checkpoint without the optimizer's state,
the test switches' junk, the ranks' arithmetic, evaluate under mpiexec, the watchdog's bounds, and the
signal sequences under a real launcher. Pure functions in-process; a few launches where the exit code of
every rank, a hang or a signal is the point (tiny data, a few steps). Topical cases live in their own files
(test_model_file.py, test_signals.py, test_tensorboard.py, test_config_file.py, test_preflight.py,
test_data.py, test_comm_auto_tuning.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import ONE_THREAD, ROOT, drop, mpiexec_cmd, open_mpi_launcher, rank_pids, run_mpi, serial_only, world

from mpisgd.checkpoint import CheckpointError, TrainState, load_checkpoint, save_checkpoint
from mpisgd.config import Config
from mpisgd.errors import UsageError

pytestmark = pytest.mark.alone  # times jobs or waits for them: run apart (pytest.ini)

SYNTH = ("-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "512", "--hidden", "16",
         "--progress", "off", "--batch-size", "32")


# -- resuming: another k, --global-batch -------------------------------------------------------------------
CONFIG = {**Config().to_dict(), "hidden": [8], "batch_size": 32, "epochs": 3}
DATA = {"name": "x", "n_train": 640, "n_test": 10, "fingerprint": "f", "fingerprint_version": 2}


def _resumable(**config) -> TrainState:
    """A checkpoint of a run at k = 2, b = 32, m = 1 (B = 64), 16 steps in."""
    return TrainState(params=np.zeros(10, np.float32), buffers={}, optimizer_state={"prev_lr": 0.1}, global_step=16,
                      epoch=1, step_in_epoch=6, skipped_steps=0, world_size=2, effective_batch=64,
                      config={**CONFIG, **config}, data=dict(DATA))


def _plan(st: TrainState, k: int, given: set[str] = frozenset(), **config):
    from mpisgd.app.resume import resume_point

    return resume_point(st, "ck.npz", {**CONFIG, **config}, set(given), (), k, dict(DATA))


def test_a_reproducible_resume_on_a_k_that_cannot_keep_b_is_refused():
    """B/b = 2 micro-batches of 32: k = 3 cannot keep them. It re-derived b = 16 silently and left the run's bits
    while the banner still promised them; now refused, listing the k that keep them, or with --batch-size
    given on purpose, a warning that the bits differ from here."""
    st = _resumable(reproducible=True)
    assert (_plan(st, 1, reproducible=True).batch_size, _plan(st, 1, reproducible=True).accum_steps) == (32, 2)
    with pytest.raises(CheckpointError, match=r"--reproducible: the checkpoint's run summed micro-batches of b=32 "
                                              r"samples \(B=64\).*k=3 ranks cannot keep them \(k must divide B/b = 2: "
                                              r"1, 2\)"):
        _plan(st, 3, reproducible=True)
    # k = 4: b = 16 given on purpose (4 x 16 x 1 = 64): allowed, and said
    plan = _plan(st, 4, {"batch_size"}, reproducible=True, batch_size=16)
    assert plan.batch_size == 16 and any("--reproducible's bits depend on b" in w for w in plan.warnings)
    assert _plan(_resumable(), 4).batch_size == 16  # not reproducible: b is derived, as before


def test_global_batch_given_on_resume_must_be_the_checkpoints():
    """--global-batch on resume was silently replaced by the checkpoint's B (and the written configuration then
    contradicted itself)."""
    st = _resumable()
    with pytest.raises(CheckpointError, match=r"--global-batch 128, but the checkpoint's run has effective batch B=64"):
        _plan(st, 2, {"global_batch"}, global_batch=128, accum_steps=2)
    assert _plan(st, 2, {"global_batch"}, global_batch=64).batch_size == 32


# -- hand-edited checkpoints: one line, never a traceback -------------------------------------------------
def _edited(tmp_path: Path, **arrays) -> Path:
    st = _resumable(reproducible=True)
    st.structure = {"layers": ["Linear(2, 4)", "Linear(4, 1)"], "shapes": [["0.Linear.W", [2, 4]],
                                                                             ["0.Linear.b", [4]]]}
    st.params = np.zeros(12, np.float32)
    st.grad_exponents = np.array([3, -(1 << 40)], np.int64)
    path = save_checkpoint(tmp_path, st)
    assert load_checkpoint(path).grad_exponents.tolist() == [3, -(1 << 40)]  # the unedited file loads
    with np.load(path) as z:
        saved = dict(z)
    saved.update(arrays)
    np.savez(path, **saved)
    return path


@pytest.mark.parametrize("arrays,says", [
    ({"grad_exponents": np.array([3, 4, 5], np.int64)}, "fixed-point exponents must be 2 integers, got int64 (3,)"),
    ({"grad_exponents": np.array([3.0, 4.0])}, "fixed-point exponents must be 2 integers, got float64"),
    ({"grad_exponents": np.array("x")}, "fixed-point exponents must be 2 integers"),
    ({"grad_exponents": np.array([3, 10**6], np.int64)}, "a fixed-point exponent is 1000000, outside"),
    ({"config": np.array(json.dumps({**CONFIG, "accum_steps": 0}))}, "accum_steps is 0, not an integer >= 1"),
    ({"config": np.array(json.dumps({**CONFIG, "accum_steps": "2"}))}, "accum_steps is \"2\""),
    ({"config": np.array(json.dumps({**CONFIG, "batch_size": 1.5}))}, "batch_size is 1.5"),
    ({"structure": np.array(json.dumps({"layers": 3}))}, "its model structure is not a list"),
    ({"environment": np.array("[1]")}, "environment or model record is not a JSON object"),
])
def test_a_hand_edited_checkpoint_is_one_line(tmp_path, arrays, says):
    """Exponent records of the wrong size, type or range, or an edited accumulation setting, gave a traceback at
    resume (a ZeroDivisionError, a TypeError deep in resume_point or the step)."""
    with pytest.raises(CheckpointError, match=re.escape(says)):
        load_checkpoint(_edited(tmp_path, **arrays))


def test_exponents_for_another_model_are_refused_at_resume(tmp_path):
    """An older checkpoint holds no structure: its exponents are counted against this run's model."""
    st = _resumable(reproducible=True)
    st.grad_exponents = np.array([1, 2, 3], np.int64)
    from mpisgd.app.resume import resume_point

    structure = {"layers": ["Linear(2, 4)"], "shapes": [["0.Linear.W", [2, 4]], ["0.Linear.b", [4]]]}
    with pytest.raises(CheckpointError, match="3 fixed-point exponents for a model of 2 parameter tensors"):
        resume_point(st, "ck.npz", dict(st.config), set(), (), 2, dict(DATA), structure=structure)


def test_resume_auto_with_keep_1_never_prunes_a_checkpoint_it_could_not_read(tmp_path):
    """The newest checkpoint damaged (its run id still readable, its parameters not finite), --resume auto falls
    back to the one before and --checkpoint-keep 1 prunes as the run goes: the damaged file is moved to
    abandoned/ at the first checkpoint, never deleted."""
    from mpisgd.app.run_dir import RunDirectory

    first = RunDirectory(str(tmp_path), "no", False)
    for step in (8, 16):
        st = _resumable()
        st.global_step, st.run_id = step, first.run_id
        first.save(st, keep=3)
    first.close()
    damaged = tmp_path / "ckpt-000000016.npz"
    with np.load(damaged) as z:
        arrays = dict(z)
    arrays["params"] = arrays["params"] * np.nan
    np.savez(damaged, **arrays)
    again = RunDirectory(str(tmp_path), "auto", False)
    state, path, warnings = again.find_resume("auto")
    assert path.endswith("ckpt-000000008.npz") and any("skipping" in w for w in warnings)
    for step in (12, 16, 20):
        state.global_step = step
        again.save(state, keep=1)
    again.close()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.npz")) == ["ckpt-000000020.npz"]
    assert [p.name for p in (tmp_path / "abandoned").iterdir()] == ["ckpt-000000016.npz"]


# -- the test suite's switches -------------------------------------------------------------------------------
@pytest.mark.parametrize("env,says", [
    ({"MPISGD_FAIL_AT_STEP": "x"}, "MPISGD_FAIL_AT_STEP='x': expected STEP or STEP:RANK"),
    ({"MPISGD_FAIL_AT_STEP": "3:one"}, "MPISGD_FAIL_AT_STEP='3:one'"),
    ({"MPISGD_DELAY_RANK": "1:nan"}, "MPISGD_DELAY_RANK='1:nan': expected RANK:MS"),
    ({"MPISGD_DELAY_RANK": "1"}, "MPISGD_DELAY_RANK='1'"),
])
def test_junk_in_the_fault_injection_variables_is_one_line(env, says):
    from mpisgd.app.inject import Injected

    with pytest.raises(UsageError, match=re.escape(says)):
        Injected.from_environ(env)
    assert Injected.from_environ({"MPISGD_FAIL_AT_STEP": "3:1"}).fail_at == (3, 1)


# -- the watchdog's bounds -------------------------------------------------------------------------------------
def test_a_watchdog_with_no_report_still_bounds_every_wait(monkeypatch):
    """--stall-timeout-s 0 --stall-abort-s 5 made no watchdog at all, so the explicit bound was dropped: now the
    bound holds (no report), and 0 and 0 make one that neither reports nor aborts."""
    from mpi4py import MPI

    from mpisgd.watchdog import Watchdog

    w = Watchdog(MPI.COMM_SELF, 300.0)
    aborted: list[str] = []
    monkeypatch.setattr(w, "_abort", lambda why="--stall-abort": aborted.append(why))
    w.configure(0, False, 5.0)
    w.enter("gradient all-reduce of step 3")
    w._t_enter -= 6.0  # it has waited six seconds
    w._check(time.monotonic())
    assert aborted == ["--stall-abort-s"]
    w.configure(0, False, 0)
    w._check(time.monotonic())
    assert aborted == ["--stall-abort-s"]
    w.exit()
    w.close()
    with pytest.raises(ValueError, match="stall bounds must be >= 0"):
        w.configure(float("nan"), False, 1.0)


# -- the ranks' arithmetic -------------------------------------------------------------------------------------
@serial_only
def test_what_decides_the_arithmetic_is_seen(tmp_path):
    """The record the ranks compare changes with the BLAS kernel (OPENBLAS_CORETYPE), NumPy's SIMD targets
    (NPY_DISABLE_CPU_FEATURES) and the level-1 switch (MPISGD_BLAS_LEVEL1), each set in the environment as a
    heterogeneous node, or a user, would."""
    code = ("import json, numpy as np; from mpisgd.backend import arithmetic; from mpisgd.optim import SGD; "
            "from mpisgd.nn import mlp; m = mlp((4,), 8, 2).materialize(np, 'float32'); "
            "print(json.dumps(arithmetic(m.flat.params, SGD(m.flat).blas is not None)))")

    def record(**env: str) -> dict[str, str]:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT), **env})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    base = record()
    assert base["level-1 BLAS update"] == "on" and base["blas threads"] == "1" and base["dtype"] == "float32"
    assert record(MPISGD_BLAS_LEVEL1="0")["level-1 BLAS update"] == "off"
    assert record(OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2")["blas threads"] == "2"
    if "openblas" in base["blas"] and "Haswell" in base["blas"]:
        assert "Sandybridge" in record(OPENBLAS_CORETYPE="SandyBridge")["blas"]
    found = base["simd"].split(" + ")[-1].split()
    if "+" in base["simd"] and found:
        assert found[-1] not in record(NPY_DISABLE_CPU_FEATURES=found[-1])["simd"]


@pytest.mark.mpi(min_size=2)
def test_data_parallel_refuses_ranks_that_would_round_differently(monkeypatch):
    """A heterogeneous partition (old and new nodes: another BLAS kernel) let the replicas drift apart with exit
    0. DataParallel now compares the ranks' arithmetic at start-up and names the odd rank and the difference,
    on every rank."""
    from mpisgd.nn import mlp
    from mpisgd.optim import SGD
    from mpisgd.parallel import data_parallel

    comm = world()
    odd = comm.Get_size() - 1
    if comm.Get_rank() == odd:
        real = data_parallel.arithmetic
        monkeypatch.setattr(data_parallel, "arithmetic",
                            lambda p, level1: {**real(p, level1), "blas": "openblas 0.3.31 (SkylakeX)"})
    model = mlp((8,), 6, 3).materialize(np, "float64")
    with pytest.raises(data_parallel.ReplicaError,
                       match=rf"the ranks would round differently \(blas is .* on rank {odd}\).*OPENBLAS_CORETYPE"):
        data_parallel.DataParallel(model, SGD(model.flat), comm, stall_timeout_s=0, stall_abort_s=0)


def _mpmd(args: tuple[str, ...], env_last: dict[str, str], k: int = 2) -> list[str]:
    """An MPMD command line: ranks 0..k-2 plain, the last rank with ``env_last`` in its environment."""
    first, last = mpiexec_cmd(k - 1, *args), mpiexec_cmd(1, *args)[1:]
    flags = [f for name, value in env_last.items()
             for f in (["-x", f"{name}={value}"] if open_mpi_launcher() else ["-env", name, value])]
    return [*first, ":", *last[:2], *flags, *last[2:]]


@serial_only
def test_the_cli_refuses_ranks_that_would_round_differently_one_line_exit_2(tmp_path):
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(_mpmd((*SYNTH, "--max-steps", "2"), {"MPISGD_BLAS_LEVEL1": "0"}), capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stderr.count("mpisgd: error") == 1, r.stderr
    assert "level-1 BLAS update is 'on' on rank(s) [0] but 'off' on rank 1" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout


# -- evaluate under mpiexec ----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_evaluate_refuses_ranks_that_would_score_different_things(tmp_path, capsys):
    """evaluate under mpiexec summed whatever each rank scored (another --limit-test on one rank here): now every
    rank compares the model and the test set first, and every rank exits 2."""
    from mpisgd.app.evaluate import _main
    from mpisgd.model_file import save_params
    from mpisgd.nn import build_model

    comm = world()
    model = build_model("mlp", (1, 28, 28), 10, (8,)).materialize(np, "float32", seed=0)
    path = tmp_path / "m.npz"  # each rank's own copy of the same model
    save_params(str(path), model, meta={"format": "mpisgd-model", "version": 1, "model": "mlp",
                                         "in_shape": [1, 28, 28], "classes": 10, "hidden": [8], "seed": 0})
    limit = "300" if comm.Get_rank() == comm.Get_size() - 1 else "200"
    codes = comm.allgather(_main([str(path), "--dataset", "synthetic", "--limit-test", limit], comm))
    assert codes == [2] * comm.Get_size()
    if comm.Get_rank() == 0:
        err = capsys.readouterr().err
        assert "the ranks would score different things (test set is 'synthetic, 200 samples" in err, err
    same = comm.allgather(_main([str(path), "--dataset", "synthetic", "--limit-test", "200"], comm))
    assert same == [0] * comm.Get_size()


# -- launches: a checkpoint without the optimizer's state, the stall bound, signals ------------------------------
@serial_only
@pytest.mark.parametrize("optimizer,buffer,owner", [("sgd", "velocity", "SGD"), ("adamw", "exp_avg_sq", "AdamW")])
def test_a_checkpoint_missing_an_optimizer_buffer_is_refused(tmp_path, optimizer, buffer, owner):
    """SGD's velocity or Adam's second moment deleted from a checkpoint: the run resumed with zeros in its
    place (exit 0)."""
    ck, opt = tmp_path / "ck", ("--optimizer", optimizer, "--lr", "0.01" if optimizer == "sgd" else "0.001")
    r = run_mpi(2, *SYNTH, *opt, "--max-steps", "4", "--epochs", "2", "--checkpoint-dir", str(ck), timeout=120)
    assert r.returncode == 0, r.stderr
    (path,) = ck.glob("ckpt-*.npz")
    with np.load(path) as z:
        assert f"state.{buffer}" in z.files
        arrays = {k: v for k, v in z.items() if k != f"state.{buffer}"}
    np.savez(path, **arrays)
    again = run_mpi(2, *SYNTH, *opt, "--max-steps", "8", "--resume-allow", "max_steps", "--epochs", "2",
                    "--checkpoint-dir", str(ck), "--resume", "auto", timeout=120)
    assert again.returncode == 2 and again.stderr.count("mpisgd: error") == 1, again.stderr
    assert f"lacks the optimizer's state {buffer} ({owner} keeps it): resuming would restart it at zero" in again.stderr


FACTORY = textwrap.dedent("""
    import os, time
    from mpisgd.nn import mlp

    def build(in_shape, n_classes):
        rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        time.sleep(float(os.environ["SLOW_S"]) if rank == int(os.environ["SLOW_RANK"]) else 0)
        return mlp((16,), 784, n_classes)
""")


def _factory(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "slowmodel.py").write_text(FACTORY)
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}


@serial_only
def test_the_stall_abort_bound_holds_without_a_report(tmp_path):
    """--stall-timeout-s 0 --stall-abort-s 3, and one rank blocked in set-up: the job ends with the bound. Before,
    no watchdog existed and the job hung."""
    t0 = time.monotonic()
    r = run_mpi(2, *drop(SYNTH, "--hidden"), "--model", "slowmodel:build", "--stall-timeout-s", "0",
                "--stall-abort-s", "3", timeout=90, env={**_factory(tmp_path), "SLOW_S": "600", "SLOW_RANK": "1"})
    assert r.returncode != 0 and time.monotonic() - t0 < 60, r.stderr
    assert "longer than the bound of 3 s (--stall-abort-s)" in r.stderr, r.stderr


def _rank_pid(tag: str, rank: int, limit_s: float = 60) -> int:
    """The pid of the training process of ``rank`` whose environment carries MPISGD_TEST_TAG=tag."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        pid = rank_pids(tag).get(rank)
        if pid is not None:
            return pid
        time.sleep(0.05)
    pytest.fail(f"no rank {rank} of the job appeared")


def _blocks(pid: int, sig: int) -> bool:
    """Whether process ``pid``'s main thread blocks ``sig`` (/proc's SigBlk mask)."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigBlk:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)


def _launch(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    tag = uuid.uuid4().hex
    base = drop(SYNTH, "--hidden") if any(":" in a for a in args) else SYNTH  # a model of one's own: no widths
    p = subprocess.Popen(mpiexec_cmd(2, *base, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **ONE_THREAD, "MPISGD_TEST_TAG": tag, **(env or {})})
    return p, tag


def _end(p: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate(timeout=30)
        pytest.fail(f"the job hung:\n{err[-2000:]}")
    return p.returncode, err


def _steps_done(metrics: Path, n: int, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not (metrics.exists() and metrics.read_text().count('"step"') >= n):
        assert time.monotonic() < deadline, "training did not get going"
        time.sleep(0.05)


@serial_only
@pytest.mark.parametrize("delay_s", [0.0, 0.02])
def test_sigusr1_twice_to_one_rank_ends_every_rank_with_one_code(tmp_path, delay_s):
    """SIGUSR1 to one rank is reported as SIGUSR1 (it said "stopped by SIGTERM", rank 0's default), and a second
    one moments later never mixes 143 on that rank with 75 on the others (MPICH ORs them: exit 207, which the
    Slurm scripts do not requeue): 75 with the checkpoint when the stop was agreed first, else 143 without."""
    metrics = tmp_path / "m.jsonl"
    p, tag = _launch(tmp_path, "--epochs", "100000", "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-file",
                     str(metrics))
    _steps_done(metrics, 3)
    victim = _rank_pid(tag, 1)
    os.kill(victim, signal.SIGUSR1)
    time.sleep(delay_s)
    try:
        os.kill(victim, signal.SIGUSR1)
    except ProcessLookupError:
        pass  # it had stopped already
    code, err = _end(p)
    assert code in (75, 143), (code, err[-2000:])
    if code == 75:
        assert re.search(r"stopped by SIGUSR1 before step \d+ .*: checkpoint \S+ written", err), err[-2000:]
    else:
        assert "stopped by a second SIGUSR1 before step" in err and "no checkpoint of this step" in err, err[-2000:]
    assert "SIGTERM" not in err, err[-2000:]


@serial_only
def test_sigterm_during_a_long_set_up_stage_stops_at_the_first_step_with_its_checkpoint(tmp_path):
    """The signal arrives while rank 1 is still building its model (a slow factory): set-up goes on, and the job
    stops at its first step with the checkpoint of that state, 75. The grace now counts from the end of set-up:
    a set-up stage longer than its 25 s ended the job with 143 and no checkpoint."""
    ck = tmp_path / "ck"
    p, tag = _launch(tmp_path, "--model", "slowmodel:build", "--epochs", "100000", "--checkpoint-dir", str(ck),
                     env={**_factory(tmp_path), "SLOW_S": "2", "SLOW_RANK": "1"})
    pid = _rank_pid(tag, 1)
    deadline = time.monotonic() + 60
    while not _blocks(pid, signal.SIGTERM):  # mpisgd's signal thread is waiting for it: set-up has begun
        assert time.monotonic() < deadline, "rank 1 never blocked SIGTERM"
        time.sleep(0.02)
    os.kill(pid, signal.SIGTERM)
    code, err = _end(p)
    assert code == 75 and "stopped by SIGTERM before step 0 (epoch 1, step 0 of 8): checkpoint" in err, err[-2000:]
    assert [x.name for x in ck.glob("ckpt-*.npz")] == ["ckpt-000000000.npz"]
