"""Checkpoint files, resume planning, and interrupted-then-resumed runs that end bitwise where uninterrupted
ones do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import Crash, root_makes, train_here, world

from mpisgd.checkpoint import (
    CheckpointError,
    TrainState,
    find_resume,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from mpisgd.config import Config


def state(step: int, n: int = 10, **buffers: np.ndarray) -> TrainState:
    return TrainState(params=np.arange(n, dtype=np.float32) + step,
                      buffers=buffers or {"velocity": np.ones(n, np.float32) * step}, optimizer_state={"prev_lr": 0.1},
                      global_step=step, epoch=1, step_in_epoch=3, skipped_steps=0, world_size=2,
                      effective_batch=64, config={"model": "mlp", "hidden": [8], "dtype": "float32"})


def test_round_trip_and_keep_newest(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, state(step), keep=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["ckpt-000000040.npz", "ckpt-000000030.npz"]
    loaded = load_checkpoint(tmp_path / names[0])
    assert loaded.global_step == 40 and loaded.step_in_epoch == 3 and loaded.config["hidden"] == [8]
    np.testing.assert_array_equal(loaded.params, state(40).params)
    np.testing.assert_array_equal(loaded.buffers["velocity"], state(40).buffers["velocity"])
    assert loaded.optimizer_state == {"prev_lr": 0.1} and list(loaded.buffers) == ["velocity"]
    assert not list(tmp_path.glob("*.tmp.*"))


def test_every_state_buffer_and_scalar_round_trips(tmp_path):
    """Adam's two moments and its step count (an int), the rate to the last bit."""
    m, v = np.linspace(-1, 1, 10), np.linspace(0, 1e-9, 10)
    written = state(5, exp_avg=m, exp_avg_sq=v)
    written.optimizer_state = {"step": 5, "prev_lr": 0.1 / 3}
    loaded = load_checkpoint(save_checkpoint(tmp_path, written))
    assert sorted(loaded.buffers) == ["exp_avg", "exp_avg_sq"]
    np.testing.assert_array_equal(loaded.buffers["exp_avg"], m)
    np.testing.assert_array_equal(loaded.buffers["exp_avg_sq"], v)
    assert loaded.optimizer_state == {"step": 5, "prev_lr": 0.1 / 3} and type(loaded.optimizer_state["step"]) is int
    none = state(6)
    none.buffers = {}  # SGD without momentum keeps no buffer
    assert load_checkpoint(save_checkpoint(tmp_path, none)).buffers == {}


def legacy(path, st: TrainState) -> None:
    """``st`` as mpisgd wrote checkpoints before AdamW (format 1): momentum as velocity, rate as prev_lr."""
    arrays = {"format": np.int64(1), "params": st.params,
              "scalars": np.array([st.global_step, st.epoch, st.step_in_epoch, st.skipped_steps, st.world_size,
                                   st.effective_batch], dtype=np.int64),
              "prev_lr": np.float64(st.optimizer_state["prev_lr"]), "config": np.array(json.dumps(st.config)),
              "data": np.array(json.dumps(st.data))}
    if "velocity" in st.buffers:
        arrays["velocity"] = st.buffers["velocity"]
    np.savez(path, **arrays)


def test_format_1_checkpoints_still_load(tmp_path):
    legacy(tmp_path / "ckpt-000000010.npz", state(10))
    loaded = load_checkpoint(tmp_path / "ckpt-000000010.npz")
    assert loaded.optimizer_state == {"prev_lr": 0.1} and list(loaded.buffers) == ["velocity"]
    np.testing.assert_array_equal(loaded.buffers["velocity"], state(10).buffers["velocity"])


@pytest.mark.parametrize("scalars", [{"step": float("nan")}, {"step": True}, {"prev_lr": "0.1"}, [1]])
def test_bad_optimizer_state_is_refused(tmp_path, scalars):
    bad = state(10)
    bad.optimizer_state = scalars
    with pytest.raises(CheckpointError, match="optimizer's state"):
        load_checkpoint(save_checkpoint(tmp_path, bad))


def test_a_state_buffer_of_another_size_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="exp_avg must be a 1-D float array of the parameters' size"):
        load_checkpoint(save_checkpoint(tmp_path, state(10, exp_avg=np.zeros(9))))


def test_truncated_checkpoint_is_a_clear_error_and_auto_falls_back(tmp_path):
    save_checkpoint(tmp_path, state(10))
    newest = save_checkpoint(tmp_path, state(20))
    newest.write_bytes(newest.read_bytes()[:100])  # a crash mid-copy, a full disk...
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(newest)
    found, path, warnings = find_resume("auto", str(tmp_path))
    assert found is not None and found.global_step == 10 and path.endswith("ckpt-000000010.npz")
    assert len(warnings) == 1 and warnings[0].startswith("skipping an unreadable checkpoint: ")
    assert "ckpt-000000020.npz" in warnings[0]


def test_failed_write_keeps_the_good_checkpoint(tmp_path, monkeypatch):
    good = save_checkpoint(tmp_path, state(10))
    before = good.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("mpisgd.checkpoint.write_npz", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, state(20))
    assert good.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [good.name]  # no temporary left behind


class Planted:
    """Unpickling this creates a file: the proof that a loader ran code from the checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_checkpoints_never_unpickle(tmp_path):
    """A checkpoint whose config is a pickled object that would run code when loaded: refused, and the
    code never runs (with allow_pickle=True the file would appear and this test fail)."""
    planted = tmp_path / "code-ran"
    good = save_checkpoint(tmp_path, state(10))
    with np.load(good) as z:
        arrays = dict(z)
    arrays["config"] = np.array([Planted(str(planted))], dtype=object)
    evil = tmp_path / "ckpt-000000020.npz"
    np.savez(evil, **arrays)
    with pytest.raises(CheckpointError, match="not a usable checkpoint"):
        load_checkpoint(evil)
    assert not planted.exists()


def test_a_failed_write_leaves_no_temporary_and_stale_ones_are_removed(tmp_path, monkeypatch):
    from mpisgd.files import remove_stale_temporaries

    (tmp_path / "ckpt-000000005.npz.tmp.999999999").write_bytes(b"x" * 100)  # a writer long dead
    removed = remove_stale_temporaries(tmp_path, r"ckpt-\d{9}\.npz")
    assert [p.name for p in removed] == ["ckpt-000000005.npz.tmp.999999999"] and not list(tmp_path.iterdir())


# -- interrupted runs, resumed in process on this job's k ranks (k = 2 and 3 under MPICH and Open MPI) -------
# B = 48: 21 steps an epoch, 2 epochs. A run that stops at step 35 (every rank, before the step: what its last
# checkpoint holds is what a job killed there leaves) and is resumed ends bitwise where the uninterrupted
# run ends. End to end, with the launcher and a real signal, tests/test_failures.py resumes a SIGTERM's
# checkpoint.
ARGS = ("--dataset", "synthetic", "--synthetic-samples", "1024", "--hidden", "32,16", "--epochs", "2",
        "--progress", "off", "--nesterov", "--warmup-epochs", "1")


def final(tmp: Path, name: str, *extra: str, expect: int = 0, crash_at: int | None = None, base=ARGS, comm=None):
    """Train in process (conftest.train_here) with --save-model; (the final parameters, the outcome)."""
    out = tmp / f"{name}.npz"
    r = train_here([*base, "--save-model", str(out), *extra], comm=comm,
                   hooks=Crash(crash_at) if crash_at is not None else None)
    assert r.statuses == (expect,) * len(r.statuses), r
    return (np.load(out)["flat"] if expect == 0 else None), r


def batch(k: int | None = None) -> tuple[str, str]:
    """--batch-size for B = 48 at this job's k (2 or 3)."""
    return "--batch-size", str(48 // (k or world().Get_size()))


@pytest.mark.mpi
def test_interrupted_and_resumed_run_is_bitwise_equal(shared_tmp):
    full, _ = final(shared_tmp, "full", *batch())
    ck = str(shared_tmp / "ck")
    # stops mid-epoch 2 (a step not on a checkpoint boundary): the last checkpoint is at step 30
    every = ("--checkpoint-dir", ck, "--checkpoint-every", "15")
    final(shared_tmp, "crash", *batch(), *every, expect=1, crash_at=35)
    assert [p.name for p in list_checkpoints(ck)][0] == "ckpt-000000030.npz"
    resumed, r = final(shared_tmp, "resumed", *batch(), *every, "--resume", "auto")
    assert "resumed from" in r.out and "at step 30" in r.out, r.out
    np.testing.assert_array_equal(resumed, full)
    assert not np.array_equal(resumed, load_checkpoint(Path(ck) / "ckpt-000000030.npz").params)  # it trained on


@pytest.mark.mpi
def test_sharded_run_checkpoints_whole_momentum_and_resumes_bitwise(shared_tmp):
    """With --shard-optimizer each rank updates only its chunks of the momentum; the checkpoint must hold
    all of it (gathered first), or the resumed run would continue from stale momentum and drift."""
    sharded = ("--shard-optimizer", "--bucket-mb", "0.002")
    full, _ = final(shared_tmp, "full", *batch(), *sharded)
    ck = str(shared_tmp / "ck")
    final(shared_tmp, "crash", *batch(), "--checkpoint-dir", ck, "--checkpoint-every", "15", *sharded, expect=1,
          crash_at=35)
    velocity = load_checkpoint(list_checkpoints(ck)[0]).buffers["velocity"]
    assert np.count_nonzero(velocity) > 0.9 * velocity.size  # every rank's chunks, gathered
    resumed, r = final(shared_tmp, "resumed", *batch(), "--checkpoint-dir", ck, "--resume", "auto", *sharded)
    assert "at step 30" in r.out
    np.testing.assert_array_equal(resumed, full)


@pytest.mark.mpi
def test_lars_run_resumes_bitwise(shared_tmp):
    """LARS keeps SGD's state (momentum, previous rate): a sharded LARS run resumes where it stopped."""
    lars = ("--optimizer", "lars", "--trust-coef", "0.02", "--lr", "2", "--shard-optimizer", "--bucket-mb", "0.002",
            "--momentum-correction")
    full, _ = final(shared_tmp, "full", *batch(), *lars)
    ck = str(shared_tmp / "ck")
    final(shared_tmp, "crash", *batch(), "--checkpoint-dir", ck, "--checkpoint-every", "10", *lars, expect=1,
          crash_at=25)
    resumed, r = final(shared_tmp, "resumed", *batch(), "--checkpoint-dir", ck, "--resume", "auto", *lars)
    assert "at step 20" in r.out and "LARS, trust coefficient 0.02" in r.out
    np.testing.assert_array_equal(resumed, full)


ADAM_ARGS = tuple(a for a in ARGS if a != "--nesterov")  # Nesterov is SGD's


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer,shard", [("adamw", False), ("lamb", True)])
def test_adam_runs_resume_bitwise(shared_tmp, optimizer, shard):
    """AdamW and LAMB keep two moments and a step count (and clipping no state): a run interrupted and
    resumed ends bitwise where an uninterrupted one does; sharded, the checkpoint holds the moments
    gathered whole (the two moments are the same buffers for both rules; LAMB's ratios need the chunks'
    norms added across ranks, tests/test_train.py's k-equivalence runs every rule both ways)."""
    opts = ("--optimizer", optimizer, "--lr", "0.01", "--weight-decay", "0.01", "--clip-grad-norm", "0.5", *batch(),
            *(("--shard-optimizer", "--bucket-mb", "0.002") if shard else ("--no-shard-optimizer",)))
    full, _ = final(shared_tmp, "full", *opts, base=ADAM_ARGS)
    ck = str(shared_tmp / "ck")
    final(shared_tmp, "crash", "--checkpoint-dir", ck, "--checkpoint-every", "10", *opts, expect=1, crash_at=25,
          base=ADAM_ARGS)
    saved = load_checkpoint(list_checkpoints(ck)[0])
    assert saved.global_step == 20 and saved.optimizer_state == {"step": 20}
    assert sorted(saved.buffers) == ["exp_avg", "exp_avg_sq"] and saved.buffers["exp_avg_sq"].min() >= 0
    assert np.count_nonzero(saved.buffers["exp_avg"]) > 0.9 * saved.params.size  # every rank's chunks, gathered
    resumed, r = final(shared_tmp, "resumed", "--checkpoint-dir", ck, "--resume", "auto", *opts, base=ADAM_ARGS)
    assert "at step 20" in r.out and f"optimizer: {'AdamW' if optimizer == 'adamw' else 'LAMB'}, " in r.out
    np.testing.assert_array_equal(resumed, full)


@pytest.mark.mpi
def test_a_checkpoint_of_format_1_resumes_bitwise(shared_tmp):
    """A checkpoint as mpisgd wrote them before AdamW (velocity, prev_lr; none of the new options in its
    configuration) continues exactly as this version's own would."""
    extra = (*batch(), "--momentum-correction")
    full, _ = final(shared_tmp, "full", *extra)
    ck = shared_tmp / "ck"
    final(shared_tmp, "crash", "--checkpoint-dir", str(ck), "--checkpoint-every", "20", *extra, expect=1,
          crash_at=25)  # one checkpoint, step 20: it becomes an older mpisgd's, which names no run

    def rewrite() -> Path:
        path = list_checkpoints(ck)[0]
        st = load_checkpoint(path)
        for name in ("beta1", "beta2", "eps", "clip_grad_norm"):
            del st.config[name]
        legacy(path, st)
        return path

    path = root_makes(rewrite)
    assert int(np.load(path)["format"]) == 1 and "velocity" in np.load(path).files
    resumed, r = final(shared_tmp, "resumed", "--checkpoint-dir", str(ck), "--resume", "auto", *extra)
    assert "at step 20" in r.out
    np.testing.assert_array_equal(resumed, full)


@pytest.mark.mpi
def test_resume_with_another_optimizer_is_refused_unread_options_may_change(shared_tmp):
    ck = str(shared_tmp / "ck")
    one = ("--epochs", "1", *batch())
    final(shared_tmp, "a", "--checkpoint-dir", ck, *one, base=ADAM_ARGS)
    _, r = final(shared_tmp, "b", "--checkpoint-dir", ck, *one, "--resume", "auto", "--optimizer", "adamw", expect=2,
                 base=ADAM_ARGS)
    assert "--optimizer sgd -> adamw" in r.error and "--resume-allow optimizer" in r.error, r
    ck2 = str(shared_tmp / "ck2")
    adamw = ("--optimizer", "adamw", "--lr", "0.01", *one)
    final(shared_tmp, "c", "--checkpoint-dir", ck2, *adamw, base=ADAM_ARGS)
    _, r = final(shared_tmp, "d", "--checkpoint-dir", ck2, "--resume", "auto", *adamw, "--momentum", "0.5",
                 "--trust-coef", "1", expect=2, base=ADAM_ARGS)  # neither is AdamW's: refused as doing nothing
    assert "--momentum 0.5 (for --optimizer sgd or lars, not adamw) and --trust-coef 1.0" in r.error, r
    _, r = final(shared_tmp, "e", "--checkpoint-dir", ck2, "--resume", "auto", *adamw, "--beta2", "0.99",
                 expect=2, base=ADAM_ARGS)
    assert "--beta2 0.999 -> 0.99" in r.error, r


@pytest.mark.mpi
def test_resume_with_one_rank_and_the_same_effective_batch(shared_tmp):
    """k ranks stop, rank 0 alone (B = 48 as one batch) continues: the same trajectory as one rank's
    uninterrupted run, up to the summation order (float32)."""
    from mpi4py import MPI

    k, ck = world().Get_size(), str(shared_tmp / "ck")
    final(shared_tmp, "part", *batch(), "--checkpoint-dir", ck, "--checkpoint-every", "20", expect=1, crash_at=25)

    def alone() -> tuple:
        full, _ = final(shared_tmp, "full", *batch(1), comm=MPI.COMM_SELF)
        return full, *final(shared_tmp, "resumed", *batch(1), "--checkpoint-dir", ck, "--resume", "auto",
                            comm=MPI.COMM_SELF)

    full, resumed, r = root_makes(alone)
    assert f"written by k={k} ranks, now k=1" in r.out, r.out
    np.testing.assert_allclose(resumed, full, rtol=1e-5, atol=1e-6)  # float32: summation order differs


@pytest.mark.mpi
def test_resume_with_other_effective_batch_is_refused(shared_tmp):
    ck = str(shared_tmp / "ck")
    final(shared_tmp, "a", *batch(), "--checkpoint-dir", ck, "--checkpoint-every", "20", "--epochs", "1")
    _, r = final(shared_tmp, "b", "--batch-size", "8", "--accum-steps", "1", "--checkpoint-dir", ck,
                 "--resume", "auto", "--epochs", "1", expect=2)
    assert "effective batch B=48" in r.error, r


@pytest.mark.mpi
def test_resume_with_another_batch_size_alone_keeps_the_effective_batch(shared_tmp):
    """--batch-size without --accum-steps: m follows from the checkpoint's B and this run's k."""
    k, ck = world().Get_size(), str(shared_tmp / "ck")
    final(shared_tmp, "a", *batch(), "--checkpoint-dir", ck, "--checkpoint-every", "10", "--epochs", "1", expect=1,
          crash_at=15)
    _, r = final(shared_tmp, "b", "--batch-size", str(24 // k), "--checkpoint-dir", ck, "--resume", "auto",
                 "--epochs", "1")
    assert "m=2 derived to keep B=48" in r.out and "B=48 |" in r.out, r.out


@pytest.mark.mpi
def test_resume_auto_with_empty_dir_starts_fresh(shared_tmp):
    _, r = final(shared_tmp, "a", *batch(), "--checkpoint-dir", str(shared_tmp / "none"), "--resume", "auto",
                 "--epochs", "1")
    assert "no usable checkpoint" in r.out


# -- a run's identity: pruning, another run's directory, rolling back -----------------------------------
def _st(step: int, run: str, n: int = 10) -> TrainState:
    s = state(step, n)
    s.run_id = run
    s.epoch, s.step_in_epoch = divmod(step, 8)
    return s


def _names(d) -> list[str]:
    return sorted(p.name for p in d.glob("ckpt-*.npz"))


def test_pruning_deletes_only_this_runs_superseded_checkpoints(tmp_path):
    for step in (40, 48, 56):
        save_checkpoint(tmp_path, _st(step, "other"), keep=3)
    (tmp_path / "ckpt-000000064.npz").write_bytes(b"unreadable")  # not provably anyone's: never pruned
    for step in (8, 16, 24, 32):
        save_checkpoint(tmp_path, _st(step, "mine"), keep=2)
    assert _names(tmp_path) == ["ckpt-000000024.npz", "ckpt-000000032.npz", "ckpt-000000040.npz",
                                "ckpt-000000048.npz", "ckpt-000000056.npz", "ckpt-000000064.npz"]


def test_resuming_into_another_runs_directory_is_refused_and_nothing_is_touched(tmp_path):
    from mpisgd.app.run_dir import RunDirectory
    from mpisgd.checkpoint import run_id_of

    theirs, elsewhere = tmp_path / "theirs", tmp_path / "elsewhere"
    for step in (8, 16):
        save_checkpoint(theirs, _st(step, "theirs"))
    mine = save_checkpoint(elsewhere, _st(8, "mine"))
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    rd = RunDirectory(str(theirs), str(mine), overwrite=False)
    try:
        with pytest.raises(CheckpointError, match=r"holds another run's checkpoints \(ckpt-000000016.npz, 2 in all\), "
                                                  r"not those of the run .* continues: give the resumed run its own"):
            rd.find_resume(str(mine))
    finally:
        rd.close()
    assert {p.name: p.read_bytes() for p in theirs.iterdir() if p.name != ".mpisgd.lock"} == \
        {k: v for k, v in before.items() if k != ".mpisgd.lock"}
    # --overwrite-checkpoints: said so, and done only when the run writes its first checkpoint
    rd = RunDirectory(str(theirs), str(mine), overwrite=True)
    try:
        state_, _, notes = rd.find_resume(str(mine))
        assert any("another run's 2 checkpoint(s)" in n for n in notes) and len(_names(theirs)) == 2
        assert f"run {state_.run_id}" in (theirs / ".mpisgd.lock").read_text()
        s = _st(9, "ignored")
        rd.save(s)
    finally:
        rd.close()
    assert _names(theirs) == ["ckpt-000000009.npz"] and run_id_of(theirs / "ckpt-000000009.npz") == "mine"


def test_rolling_back_moves_the_abandoned_checkpoints_aside_so_auto_continues_the_new_line(tmp_path):
    from mpisgd.app.run_dir import RunDirectory

    for step in (32, 40, 48):
        save_checkpoint(tmp_path, _st(step, "a"))
    rd = RunDirectory(str(tmp_path), str(tmp_path / "ckpt-000000032.npz"), overwrite=False)
    try:
        st, _, notes = rd.find_resume(str(tmp_path / "ckpt-000000032.npz"))
        assert st.global_step == 32 and len(_names(tmp_path)) == 3  # nothing moved during set-up
        assert any("rolling back to step 32" in n and "ckpt-000000040.npz, ckpt-000000048.npz" in n and
                   "nothing is deleted" in n for n in notes), notes
        rd.save(_st(36, "a"))  # the rolled-back run's first checkpoint (a SIGTERM, say)
    finally:
        rd.close()
    assert _names(tmp_path) == ["ckpt-000000032.npz", "ckpt-000000036.npz"]
    assert sorted(p.name for p in (tmp_path / "abandoned").iterdir()) == ["ckpt-000000040.npz",
                                                                         "ckpt-000000048.npz"]
    found, path, _ = find_resume("auto", str(tmp_path))
    assert found.global_step == 36 and path.endswith("ckpt-000000036.npz")


def test_a_file_of_the_same_name_that_is_not_this_runs_is_moved_not_replaced(tmp_path):
    from mpisgd.app.run_dir import RunDirectory

    save_checkpoint(tmp_path, _st(8, "a"))
    (tmp_path / "ckpt-000000016.npz").write_bytes(b"a newer mpisgd's checkpoint")
    rd = RunDirectory(str(tmp_path), "auto", overwrite=False)
    try:
        st, _, warnings = rd.find_resume("auto")
        assert st.global_step == 8 and "skipping" in warnings[0]
        rd.save(_st(16, "x"))
    finally:
        rd.close()
    assert (tmp_path / "abandoned" / "ckpt-000000016.npz").read_bytes() == b"a newer mpisgd's checkpoint"


def test_resume_auto_refuses_when_no_checkpoint_reads_unless_told_to_overwrite(tmp_path):
    from mpisgd.app.run_dir import RunDirectory

    for step in (8, 16):
        save_checkpoint(tmp_path, _st(step, "a"))
    (tmp_path / "ckpt-000000008.npz").write_bytes(b"x")
    newest = tmp_path / "ckpt-000000016.npz"
    with np.load(newest) as z:
        arrays = dict(z)
    np.savez(newest, **{**arrays, "format": np.int64(3)})  # a newer mpisgd's format: a downgrade
    before = {p: p.read_bytes() for p in tmp_path.glob("ckpt-*")}
    with pytest.raises(CheckpointError, match=r"--resume auto: none of the 2 checkpoint\(s\) in .* can be read \(.*"
                                              r"checkpoint format 3, this mpisgd reads 1, 2; \.\.\.\); they are kept"):
        find_resume("auto", str(tmp_path))
    assert {p: p.read_bytes() for p in tmp_path.glob("ckpt-*")} == before
    rd = RunDirectory(str(tmp_path), "auto", overwrite=True)
    try:
        st, _, warnings = rd.find_resume("auto")
        assert st is None and "they are deleted when this run writes its first checkpoint" in warnings[-1]
        assert len(_names(tmp_path)) == 2
        rd.save(_st(4, "b"))
    finally:
        rd.close()
    assert _names(tmp_path) == ["ckpt-000000004.npz"]


def test_a_released_directory_is_as_it_was_found(tmp_path):
    """release(): the lock file goes if this run made it, then the directories it made while empty; another
    run's lock file and checkpoints stay. A refusal in the constructor releases too."""
    from mpisgd.app.run_dir import RunDirectory
    from mpisgd.checkpoint import LOCK
    from mpisgd.errors import UsageError

    RunDirectory(str(tmp_path / "a" / "b"), "no", overwrite=False).release()
    assert not list(tmp_path.iterdir())
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("mine")
    RunDirectory(str(tmp_path / "a" / "b" / "c"), "no", overwrite=False).release()
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["notes.txt"]
    save_checkpoint(tmp_path / "used", _st(8, "theirs"))
    (tmp_path / "used" / LOCK).write_text("pid 1 on elsewhere, job -, run theirs\n")
    with pytest.raises(UsageError, match="holds another run's checkpoints"):
        RunDirectory(str(tmp_path / "used"), "no", overwrite=False)
    rd = RunDirectory(str(tmp_path / "used"), "auto", overwrite=False)
    rd.release()
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == [LOCK, "ckpt-000000008.npz"]
    (tmp_path / "used" / LOCK).unlink()
    with pytest.raises(UsageError, match="holds another run's checkpoints"):
        RunDirectory(str(tmp_path / "used"), "no", overwrite=False)
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["ckpt-000000008.npz"]


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_that_is_not_a_file_is_one_line(tmp_path, kind):
    import os

    from mpisgd.app.run_dir import RunDirectory
    from mpisgd.checkpoint import LOCK
    from mpisgd.errors import UsageError

    (tmp_path / LOCK).mkdir() if kind == "directory" else os.mkfifo(tmp_path / LOCK)
    with pytest.raises(UsageError, match="its lock file .* exists and is not a regular file; remove it"):
        RunDirectory(str(tmp_path), "no", overwrite=False)


# -- hand-edited checkpoints, and what must match the run --------------------------------------------------
@pytest.mark.parametrize("edit,says", [
    ({"params": np.full(10, np.nan, np.float32)}, "params hold 10 non-finite values"),
    ({"state.velocity": np.r_[np.ones(9), np.inf].astype(np.float32)}, "velocity hold 1 non-finite values"),
    ({"scalars": np.array([16, 2, 0, 0, 0, 64], np.int64)}, "world size 0 and effective batch 64 must be >= 1"),
    ({"scalars": np.array([16, 2, 0, 0, 3, 64], np.int64)}, "effective batch 64 is not its k x b x m = 3 x 32 x 1"),
    ({"scalars": np.array([16, 2, 0, 20, 2, 64], np.int64)}, "step 16 with 20 skipped"),
    ({"scalars": np.array([16, -1, 0, 0, 2, 64], np.int64)}, "epoch is -1"),
    ({"scalars": np.array([16, 2], np.int64)}, "scalars must be 6 integers"),
    ({"optimizer": np.array('{"prev_lr": NaN}')}, "the optimizer's state must be a JSON object of finite numbers"),
    ({"optimizer": np.array('{"prev_lr": -0.5}')}, "previous learning rate -0.5"),
    ({"optimizer": np.array('{"step": -3}')}, "optimizer step count -3"),
])
def test_every_scalar_and_every_parameter_is_checked(tmp_path, edit, says):
    path = save_checkpoint(tmp_path, TrainState(**{**state(16).__dict__, "config": {"batch_size": 32}}))
    with np.load(path) as z:
        arrays = dict(z)
    np.savez(path, **{**arrays, **edit})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert says in str(err.value) and str(path) in str(err.value), err.value


CONFIG = {**Config().to_dict(), "hidden": [8], "batch_size": 32, "epochs": 3}
DATA = {"name": "x", "n_train": 640, "n_test": 10, "fingerprint": "f", "fingerprint_version": 2}


def _plan(st: TrainState, **kw):
    from mpisgd.app.resume import resume_point

    args = {"config": dict(CONFIG), "given": set(), "allowed": (), "k": 2, "data": dict(DATA), **kw}
    return resume_point(st, "ck.npz", args["config"], args["given"], args["allowed"], args["k"], args["data"],
                       structure=kw.get("structure"))


def _resumable(**kw) -> TrainState:
    st = state(16)
    st.config, st.data, st.epoch, st.step_in_epoch = dict(CONFIG), dict(DATA), 1, 6  # 10 steps per epoch
    for k, v in kw.items():
        setattr(st, k, v)
    return st


def test_a_position_past_the_end_with_steps_to_do_is_refused():
    assert _plan(_resumable()).global_step == 16
    with pytest.raises(CheckpointError, match=r"epoch 8, is past this run's last epoch \(3\) although only 16 of its "
                                              r"30 steps are done"):
        _plan(_resumable(epoch=7, step_in_epoch=0))
    with pytest.raises(CheckpointError, match="step 12 of epoch 2, lies past the end of an epoch of this run"):
        _plan(_resumable(step_in_epoch=12))
    finished = _resumable(global_step=30, epoch=3, step_in_epoch=0)  # a finished run says so and exits 0
    assert _plan(finished).global_step == 30


def test_resuming_on_another_k_derives_b_and_m_or_says_which_k_work():
    """The checkpoint's B = 64 (k = 2, b = 32): at k = 4, b = 16 is derived; at k = 3 no b fits and the k that
    divide B are listed; a --batch-size that contradicts B is refused, saying what would fit."""
    four = _plan(_resumable(), k=4)
    assert (four.world_size, four.batch_size, four.accum_steps) == (2, 16, 1)
    assert four.derived == "b=16, m=1 derived to keep B=64 (the checkpoint's run: k=2, b=32, m=1)"
    with pytest.raises(CheckpointError, match=r"B=64 cannot be split over k=3 ranks: k must divide B "
                                              r"\(1, 2, 4, 8, 16, 32, 64\)"):
        _plan(_resumable(), k=3)
    with pytest.raises(CheckpointError, match=r"pass --batch-size and --accum-steps with 4 x b x m = 64 \(e.g. "
                                              r"--batch-size 16 --accum-steps 1\), or neither"):
        _plan(_resumable(), k=4, given={"batch_size"})  # b = 32 given: 4 x 32 > 64
    with pytest.raises(CheckpointError, match=r"B=64 cannot be split over k=3 ranks"):  # no b and m fit at k = 3:
        _plan(_resumable(), k=3, given={"batch_size", "accum_steps"})  # the old line asked for 3 x b x m = 64
    alone = _plan(_resumable(), k=4, config={**CONFIG, "batch_size": 8}, given={"batch_size"})
    assert (alone.batch_size, alone.accum_steps) == (8, 2) and alone.derived.startswith("m=2 derived to keep B=64")


def test_a_huge_odd_effective_batch_is_refused_at_once_listing_a_few_divisors():
    big = 2**61 - 1  # prime: the old loop up to B would never end
    st = _resumable(effective_batch=big, world_size=1, config={**CONFIG, "batch_size": big})
    with pytest.raises(CheckpointError, match=r"B=2305843009213693951 cannot be split over k=2 ranks: k must divide B "
                                              r"\(1, 2305843009213693951, \.\.\.\)"):
        _plan(st, data={**DATA, "n_train": 2**62})
    with pytest.raises(CheckpointError, match="is larger than this run's training set"):
        _plan(st)
    from mpisgd.app.resume import divisors

    assert divisors(64) == ([1, 2, 4, 8, 16, 32, 64], True)


def test_another_optimizer_or_trust_coefficient_is_a_difference_named():
    with pytest.raises(CheckpointError, match=r"--optimizer sgd -> lars; --trust-coef 0.1 -> 0.02; .*--resume-allow "
                                              r"optimizer,trust_coef"):
        _plan(_resumable(), config={**CONFIG, "optimizer": "lars", "trust_coef": 0.02})
    assert _plan(_resumable(), config={**CONFIG, "trust_coef": 0.5}).changes == []  # SGD has no trust coefficient
    old = _resumable(config={k: v for k, v in CONFIG.items() if k not in ("optimizer", "trust_coef")})
    assert _plan(old).changes == []  # an older checkpoint without the keys: their defaults


def test_another_layer_structure_is_refused_naming_the_layer_and_older_checkpoints_still_load(tmp_path):
    from mpisgd.model_file import model_structure
    from mpisgd.nn import Flatten, Linear, ReLU, Sequential

    a = Sequential(Flatten(), Linear(5, 4), ReLU(), Linear(4, 3))
    b = Sequential(Flatten(), Linear(5, 4), Linear(4, 3), ReLU())  # the same parameter count
    st = _resumable(structure=model_structure(a))
    path = save_checkpoint(tmp_path, st)
    assert load_checkpoint(path).structure == model_structure(a)
    assert _plan(load_checkpoint(path), structure=model_structure(a)).global_step == 16
    with pytest.raises(CheckpointError, match=r"model differs from the checkpoint's \(ck.npz\): layer 2 is "
                                              r"Linear\(4, 3\) in this run, ReLU\(\) in the checkpoint"):
        _plan(load_checkpoint(path), structure=model_structure(b))
    with np.load(path) as z:
        arrays = {k: v for k, v in z.items() if k not in ("structure", "run")}
    np.savez(path, **arrays)  # as an older mpisgd wrote it
    old = load_checkpoint(path)
    assert old.structure == {} and old.run_id == "" and _plan(old, structure=model_structure(b)).global_step == 16


def test_an_older_fingerprint_compares_the_name_and_sizes_only():
    old = _resumable(data={"name": "x", "n_train": 640, "n_test": 10, "fingerprint": "v1hash"})
    assert _plan(old).changes == []
    with pytest.raises(CheckpointError, match="--data x"):
        _plan(old, data={**DATA, "n_test": 11})


# -- the final model: never lost silently ------------------------------------------------------------
def test_the_final_model_falls_back_and_says_where_or_raises_naming_every_place(tmp_path):
    from mpisgd.checkpoint import SaveError
    from mpisgd.model_file import save_params
    from mpisgd.nn import mlp

    model = mlp((4,), n_in=3, n_classes=2).materialize(np, "float32")
    assert save_params(str(tmp_path / "m.npz"), model) == str(tmp_path / "m.npz")
    (tmp_path / "fb").mkdir()
    (tmp_path / "fb" / "m.npz").write_bytes(b"someone's")
    where = save_params("/proc/mpisgd-nope/m.npz", model, [tmp_path / "fb"])
    assert where == str(tmp_path / "fb" / "m-1.npz") and (tmp_path / "fb" / "m.npz").read_bytes() == b"someone's"
    np.testing.assert_array_equal(np.load(where)["flat"], model.flat.params)
    with pytest.raises(SaveError, match=r"the final model was not written: /proc/mpisgd-nope/m.npz \(.*\); "
                                        r"/proc/also-nope/m.npz \("):
        save_params("/proc/mpisgd-nope/m.npz", model, ["/proc/also-nope"])


def test_another_model_is_refused_by_name_before_its_layers(tmp_path):
    """--resume of an MLP's checkpoint with --model cnn names the two models (it named a Permute against a
    Flatten)."""
    from mpisgd.model_file import model_structure
    from mpisgd.nn import Flatten, Linear, Sequential

    st = _resumable(structure=model_structure(Sequential(Flatten(), Linear(5, 3))))
    with pytest.raises(CheckpointError, match=r"^--model cnn, but the checkpoint \(ck.npz\) is of --model mlp: a "
                                              r"resumed run must build the same model$"):
        _plan(st, config={**CONFIG, "model": "cnn"}, structure=model_structure(Sequential(Linear(5, 3))))


def test_a_save_model_file_given_to_resume_is_named_as_such(tmp_path):
    path = tmp_path / "model.npz"
    np.savez(path, flat=np.zeros(3, np.float32), meta=np.array("{}"))
    with pytest.raises(CheckpointError, match=r"model.npz is a --save-model file \(the final parameters\), not a "
                                              r"checkpoint: it holds no optimizer state"):
        load_checkpoint(path)
