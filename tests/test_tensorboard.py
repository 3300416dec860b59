"""--tensorboard DIR: event files on rank 0, read back with TensorBoard's own reader; nothing imported without
the option; a missing library is one line at set-up. Step records carry step_ms (and grad_norm when the
step has one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env, run_mpi, serial_only

from mpisgd.app.records import EpochRecord, StepRecord, TestRecord
from mpisgd.app.tensorboard import TensorBoardWriter, open_writer

SYNTH = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "1024", "--hidden", "16",
         "--progress", "off", "--batch-size", "32", "--epochs", "2"]


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under logdir, as TensorBoard reads them."""
    pytest.importorskip("tensorboard", reason="reading events back needs tensorboard (pip install 'mpisgd[test]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@serial_only
def test_a_run_writes_what_tensorboard_reads_on_rank_0_only(tmp_path):
    pytest.importorskip("tensorboardX", reason="--tensorboard needs tensorboardX (pip install 'mpisgd[tensorboard]')")
    logdir, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    r = run_mpi(2, *SYNTH, "--val-split", "0.25", "--tensorboard", str(logdir), "--metrics-file", str(metrics))
    assert r.returncode == 0, r.stderr + r.stdout
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1  # rank 0's only
    got = scalars(logdir)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [x for x in records if x["kind"] == "step"]
    epochs = [x for x in records if x["kind"] == "epoch"]
    test = next(x for x in records if x["kind"] == "test")
    assert len(steps) == 24 and all(s["step_ms"] > 0 for s in steps)
    assert [s for s, _ in got["step/loss"]] == [s["step"] for s in steps]
    assert [v for _, v in got["step/lr"]] == pytest.approx([s["lr"] for s in steps], rel=1e-6)  # float32 there
    assert [v for _, v in got["step/step_ms"]] == pytest.approx([s["step_ms"] for s in steps], rel=1e-6)
    for key in ("train_loss", "val_loss", "val_acc", "samples_per_s", "comm_frac", "lr"):
        assert [s for s, _ in got[f"epoch/{key}"]] == [e["step"] for e in epochs], key
        assert [v for _, v in got[f"epoch/{key}"]] == pytest.approx([e[key] for e in epochs], rel=1e-6), key
    assert got["test/acc"][0][0] == test["step"] and got["test/acc"][0][1] == pytest.approx(test["test_acc"])
    assert "epoch/test_acc" not in got  # with --val-split the test set is scored once, at the end
    # --tensorboard asks DataParallel for the averaged gradient's norm every step (measure_grad_norm)
    assert [v for _, v in got["step/grad_norm"]] == pytest.approx([s["grad_norm"] for s in steps], rel=1e-6)
    assert all(s["grad_norm"] > 0 for s in steps)


def epoch_record(**over) -> EpochRecord:
    values = dict(epoch=1, step=1, lr=0.1, train_loss=2.0, samples_per_s=100.0, comm_frac=0.1, comm_exposed_ms=0.1,
                  comm_total_ms=0.2, forward_ms=1.0, backward_ms=2.0, optimizer_ms=0.5, step_ms=4.0, epoch_time_s=0.4,
                  skipped_steps=0, world_size=1, effective_batch=32, local_batch=32, accum_steps=1, grad_nbytes=400,
                  bucket_algbw_gbps=0.0, bucket_busbw_gbps=0.0, peak_rss_mib=90.0, rss_start_mib=50.0, state_mib=2.0)
    values.update(over)
    return EpochRecord(**values)


def test_scalars_of_each_kind_of_record(tmp_path):
    """The writer reads the typed records by field name: each kind's scalars, NaN and None left out."""
    pytest.importorskip("tensorboardX", reason="--tensorboard needs tensorboardX (pip install 'mpisgd[tensorboard]')")
    w = TensorBoardWriter(str(tmp_path))
    w.write(StepRecord(step=1, epoch=1, loss=2.5, lr=0.1, step_ms=3.0, grad_norm=7.0))
    w.write(StepRecord(step=2, epoch=1, loss=2.4, lr=0.1, step_ms=3.0))  # no grad_norm: no point
    w.write(epoch_record(test_acc=0.5, noise_scale=900.0, comm_frac=float("nan")))
    w.write(TestRecord(step=2, test_acc=0.75, test_loss=0.6))
    w.close()
    got = scalars(tmp_path)
    assert got["step/grad_norm"] == [(1, 7.0)] and got["epoch/noise_scale"] == [(1, 900.0)]
    assert [s for s, _ in got["step/loss"]] == [1, 2]
    assert got["epoch/test_acc"] == [(1, 0.5)] and "epoch/comm_frac" not in got  # NaN: not a point
    assert got["test/acc"] == [(2, 0.75)] and got["test/loss"] == [(2, pytest.approx(0.6))]
    assert not any("allreduce" in t or "skipped" in t or "val_" in t for t in got)  # None (no --val-split): none


def test_nothing_is_written_or_imported_without_the_option():
    w = open_writer(None)
    w.write(StepRecord(step=1, epoch=1, lr=0.1, loss=1.0, step_ms=1.0))
    w.close()
    code = ("import sys; import mpisgd.app.trainer, mpisgd.app.run; from mpisgd.app.tensorboard import open_writer; "
            "open_writer(None).close(); print('tensorboardX' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**clean_env(), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stdout + r.stderr


@serial_only
def test_a_missing_library_is_one_line_at_set_up(tmp_path):
    fake = tmp_path / "site" / "tensorboardX"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named tensorboardX')\n")
    r = run_mpi(2, *SYNTH, "--tensorboard", str(tmp_path / "tb"), timeout=120,
                env={"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"})
    assert r.returncode == 2 and r.stderr.count("mpisgd: error") == 1, r.stderr
    assert "--tensorboard needs the tensorboardX package: pip install 'mpisgd[tensorboard]'" in r.stderr
    assert "Traceback" not in r.stderr and "epoch" not in r.stdout


def _promptly(fn, timeout_s: float = 20.0):
    """fn() in a daemon thread joined with a bound: a writer that blocks fails the test instead of hanging it."""
    import threading

    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "the TensorBoard writer blocked (rank 0 would wait for ever inside it)"
    return out.get("value")


def test_a_disk_that_fills_mid_run_warns_once_and_never_blocks(tmp_path, capsys):
    """tensorboardX's writer thread died of ENOSPC and the next writes waited for ever on its queue: rank 0 hung
    until --stall-abort-s. Now the writes fail in the loop's own thread, one warning, and the events written
    before stay readable."""
    pytest.importorskip("tensorboardX", reason="--tensorboard needs tensorboardX (pip install 'mpisgd[tensorboard]')")
    from conftest import small_tmpfs

    with small_tmpfs(tmp_path / "small", "64k") as d:
        w = _promptly(lambda: TensorBoardWriter(str(d / "tb")))
        records = [StepRecord(step=i, epoch=1, loss=1.0 / i, lr=0.1, step_ms=2.0) for i in range(1, 20_000)]

        def write_all():
            for i, r in enumerate(records):
                w.write(r)
                if i % 500 == 0:
                    w.write(epoch_record(step=i, train_loss=1.0))  # flushed at an epoch's end
            w.close()

        _promptly(write_all, timeout_s=60)
        err = capsys.readouterr().out
        assert w.failed == "No space left on device" and err.count("--tensorboard") == 1, err
        assert "write failed (No space left on device); no more TensorBoard events are written" in err
        got = scalars(d / "tb")
        assert got["step/loss"][:3] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]


def test_a_disk_full_at_start_warns_and_training_goes_on(tmp_path, capsys):
    """A full disk at start gave a traceback (the writer's first event): now one warning, and writes are no-ops."""
    pytest.importorskip("tensorboardX", reason="--tensorboard needs tensorboardX (pip install 'mpisgd[tensorboard]')")
    from conftest import small_tmpfs

    with small_tmpfs(tmp_path / "small", "16k") as d:
        try:
            (d / "filler").write_bytes(b"\0" * (1 << 20))
        except OSError:
            pass  # full now
        w = _promptly(lambda: TensorBoardWriter(str(d)))
        _promptly(lambda: (w.write(epoch_record(step=1, train_loss=1.0)), w.close()))
    assert w.failed == "No space left on device"
    assert "write failed (No space left on device)" in capsys.readouterr().out


def test_two_runs_sharing_one_directory_keep_both_event_files(tmp_path):
    """tensorboardX named the file by the second and the host, and opened it for writing: a second run started
    in the same second truncated the first's events. Each run's file now has a name of its own."""
    pytest.importorskip("tensorboardX", reason="--tensorboard needs tensorboardX (pip install 'mpisgd[tensorboard]')")
    pytest.importorskip("tensorboard", reason="reading events back needs tensorboard (pip install 'mpisgd[test]')")
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    a, b = TensorBoardWriter(str(tmp_path)), TensorBoardWriter(str(tmp_path))
    a.write(epoch_record(step=1, train_loss=1.0))
    b.write(epoch_record(step=1, train_loss=2.0))
    a.close()
    b.close()
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 2 and a.path != b.path

    def losses(path):
        return [v.simple_value for e in LegacyEventFileLoader(str(path)).Load() for v in e.summary.value
                if v.tag == "epoch/train_loss"]

    assert sorted(losses(a.path) + losses(b.path)) == [1.0, 2.0]
