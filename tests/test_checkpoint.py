"""Checkpoint files, and interrupted-then-resumed runs that end bitwise where uninterrupted ones do."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_mpi

from mpisgd.checkpoint import (
    CheckpointError,
    TrainState,
    find_resume,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


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
    assert len(warnings) == 1 and "ckpt-000000020.npz" in warnings[0]


def test_failed_write_keeps_the_good_checkpoint(tmp_path, monkeypatch):
    good = save_checkpoint(tmp_path, state(10))
    before = good.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
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


ARGS = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "2048", "--hidden", "32,16",
        "--epochs", "3", "--batch-size", "16", "--progress", "off", "--nesterov", "--warmup-epochs", "1"]


def final(tmp_path, name: str, k: int, *extra: str, expect: int = 0, fail_at: str = "", base=ARGS):
    out = tmp_path / f"{name}.npz"
    r = run_mpi(k, *base, "--save-model", str(out), *extra, timeout=180, env={"MPISGD_FAIL_AT_STEP": fail_at})
    assert r.returncode == expect, r.stderr[-3000:]
    return (np.load(out)["flat"] if expect == 0 else None), r


@pytest.mark.parametrize("k", [2, 3])
def test_interrupted_and_resumed_run_is_bitwise_equal(tmp_path, k):
    b = 48 // k
    full, _ = final(tmp_path, "full", k, "--batch-size", str(b))
    ck = str(tmp_path / "ck")
    # dies mid-epoch 2 (a step not on a checkpoint boundary): the last checkpoint is at step 60
    final(tmp_path, "crash", k, "--batch-size", str(b), "--checkpoint-dir", ck, "--checkpoint-every", "30",
          expect=1, fail_at=f"70:{k - 1}")
    assert [p.name for p in list_checkpoints(ck)][0] == "ckpt-000000060.npz"
    resumed, r = final(tmp_path, "resumed", k, "--batch-size", str(b), "--checkpoint-dir", ck,
                       "--checkpoint-every", "30", "--resume", "auto")
    assert "resumed from" in r.stdout and "at step 60" in r.stdout
    np.testing.assert_array_equal(resumed, full)


def test_sharded_run_checkpoints_whole_momentum_and_resumes_bitwise(tmp_path):
    """With --shard-optimizer each rank updates only its chunks of the momentum; the checkpoint must hold
    all of it (gathered first), or the resumed run would continue from stale momentum and drift."""
    k, b, sharded = 3, 16, ("--shard-optimizer", "--bucket-mb", "0.002")
    full, _ = final(tmp_path, "full", k, "--batch-size", str(b), *sharded)
    ck = str(tmp_path / "ck")
    final(tmp_path, "crash", k, "--batch-size", str(b), "--checkpoint-dir", ck, "--checkpoint-every", "30",
          *sharded, expect=1, fail_at="70:1")
    resumed, r = final(tmp_path, "resumed", k, "--batch-size", str(b), "--checkpoint-dir", ck, "--resume", "auto",
                       *sharded)
    assert "at step 60" in r.stdout
    np.testing.assert_array_equal(resumed, full)


def test_lars_run_resumes_bitwise(tmp_path):
    """LARS keeps SGD's state (momentum, previous rate): a sharded LARS run resumes where it stopped."""
    k, b, lars = 2, 24, ("--optimizer", "lars", "--trust-coef", "0.02", "--lr", "2", "--shard-optimizer",
                         "--bucket-mb", "0.002", "--momentum-correction")
    full, _ = final(tmp_path, "full", k, "--batch-size", str(b), *lars)
    ck = str(tmp_path / "ck")
    final(tmp_path, "crash", k, "--batch-size", str(b), "--checkpoint-dir", ck, "--checkpoint-every", "30",
          *lars, expect=1, fail_at="50:1")
    resumed, r = final(tmp_path, "resumed", k, "--batch-size", str(b), "--checkpoint-dir", ck, "--resume", "auto",
                       *lars)
    assert "at step 30" in r.stdout and "LARS, trust coefficient 0.02" in r.stdout
    np.testing.assert_array_equal(resumed, full)


ADAM_ARGS = [a for a in ARGS if a != "--nesterov"]  # Nesterov is SGD's


@pytest.mark.parametrize("k,optimizer,shard", [(2, "adamw", False), (3, "adamw", True), (2, "lamb", True),
                                               (3, "lamb", False)])
def test_adam_runs_resume_bitwise(tmp_path, k, optimizer, shard):
    """AdamW and LAMB keep two moments and a step count (and clipping no state): a run interrupted and
    resumed ends bitwise where an uninterrupted one does; sharded, the checkpoint holds the moments
    gathered whole."""
    opts = ("--optimizer", optimizer, "--lr", "0.01", "--weight-decay", "0.01", "--clip-grad-norm", "0.5",
            "--batch-size", str(48 // k), *(("--shard-optimizer", "--bucket-mb", "0.002") if shard else ()))
    full, _ = final(tmp_path, "full", k, *opts, base=ADAM_ARGS)
    ck = str(tmp_path / "ck")
    final(tmp_path, "crash", k, "--checkpoint-dir", ck, "--checkpoint-every", "30", *opts, expect=1, fail_at="50:1",
          base=ADAM_ARGS)
    saved = load_checkpoint(list_checkpoints(ck)[0])
    assert saved.global_step == 30 and saved.optimizer_state == {"step": 30}
    assert sorted(saved.buffers) == ["exp_avg", "exp_avg_sq"] and saved.buffers["exp_avg_sq"].min() >= 0
    assert np.count_nonzero(saved.buffers["exp_avg"]) > 0.9 * saved.params.size  # every rank's chunks, gathered
    resumed, r = final(tmp_path, "resumed", k, "--checkpoint-dir", ck, "--resume", "auto", *opts, base=ADAM_ARGS)
    assert "at step 30" in r.stdout and f"optimizer: {'AdamW' if optimizer == 'adamw' else 'LAMB'}, " in r.stdout
    np.testing.assert_array_equal(resumed, full)


def test_a_checkpoint_of_format_1_resumes_bitwise(tmp_path):
    """A checkpoint as mpisgd wrote them before AdamW (velocity, prev_lr; none of the new options in its
    configuration) continues exactly as this version's own would."""
    k, extra = 2, ("--batch-size", "24", "--momentum-correction")
    full, _ = final(tmp_path, "full", k, *extra)
    ck = tmp_path / "ck"
    final(tmp_path, "crash", k, "--checkpoint-dir", str(ck), "--checkpoint-every", "30", *extra, expect=1,
          fail_at="50:1")
    path = list_checkpoints(ck)[0]
    st = load_checkpoint(path)
    for name in ("beta1", "beta2", "eps", "clip_grad_norm"):
        del st.config[name]
    legacy(path, st)
    assert int(np.load(path)["format"]) == 1 and "velocity" in np.load(path).files
    resumed, r = final(tmp_path, "resumed", k, "--checkpoint-dir", str(ck), "--resume", "auto", *extra)
    assert "at step 30" in r.stdout
    np.testing.assert_array_equal(resumed, full)


def test_resume_with_another_optimizer_is_refused_unread_options_may_change(tmp_path):
    ck = str(tmp_path / "ck")
    final(tmp_path, "a", 2, "--checkpoint-dir", ck, "--epochs", "1", base=ADAM_ARGS)
    _, r = final(tmp_path, "b", 2, "--checkpoint-dir", ck, "--epochs", "1", "--resume", "auto", "--optimizer",
                 "adamw", expect=2, base=ADAM_ARGS)
    assert r.stderr.count("mpisgd: error") == 1 and "--optimizer sgd -> adamw" in r.stderr, r.stderr
    assert "--resume-allow optimizer" in r.stderr
    ck2 = str(tmp_path / "ck2")
    adamw = ("--optimizer", "adamw", "--lr", "0.01", "--epochs", "1")
    final(tmp_path, "c", 2, "--checkpoint-dir", ck2, *adamw, base=ADAM_ARGS)
    _, r = final(tmp_path, "d", 2, "--checkpoint-dir", ck2, "--resume", "auto", *adamw, "--momentum", "0.5",
                 "--trust-coef", "1", base=ADAM_ARGS)  # neither is AdamW's: nothing changes
    assert "the run is finished" in r.stdout and "changed" not in r.stdout, r.stdout
    _, r = final(tmp_path, "e", 2, "--checkpoint-dir", ck2, "--resume", "auto", *adamw, "--beta2", "0.99",
                 expect=2, base=ADAM_ARGS)
    assert "--beta2 0.999 -> 0.99" in r.stderr, r.stderr


def test_resume_with_other_k_and_same_effective_batch(tmp_path):
    ck = str(tmp_path / "ck")
    full, _ = final(tmp_path, "full", 1, "--batch-size", "32")
    final(tmp_path, "part", 2, "--batch-size", "16", "--checkpoint-dir", ck, "--checkpoint-every", "40",
          expect=1, fail_at="50")
    resumed, r = final(tmp_path, "resumed", 1, "--batch-size", "32", "--checkpoint-dir", ck, "--resume", "auto")
    assert "written by k=2 ranks, now k=1" in r.stdout
    np.testing.assert_allclose(resumed, full, rtol=1e-5, atol=1e-6)  # float32: summation order differs


def test_resume_with_other_effective_batch_is_refused(tmp_path):
    ck = str(tmp_path / "ck")
    final(tmp_path, "a", 2, "--checkpoint-dir", ck, "--checkpoint-every", "20", "--epochs", "1")
    _, r = final(tmp_path, "b", 2, "--batch-size", "8", "--checkpoint-dir", ck, "--resume", "auto", expect=2)
    assert r.stderr.count("mpisgd: error") == 1 and "effective batch B=32" in r.stderr and "Traceback" not in r.stderr


def test_resume_auto_with_empty_dir_starts_fresh(tmp_path):
    _, r = final(tmp_path, "a", 2, "--checkpoint-dir", str(tmp_path / "none"), "--resume", "auto", "--epochs", "1")
    assert "no usable checkpoint" in r.stdout
