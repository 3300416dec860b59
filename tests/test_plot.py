"""The plot CLI: the learning-rate schedule of a training command, training curves from metrics files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env, is_png

from mpisgd.app.plot import curves_figure, main, noise_points, schedule_for
from mpisgd.app.records import EpochRecord, StepRecord, to_json

pytest.importorskip("matplotlib")


def epoch_record(epoch: int, step: int, **over) -> EpochRecord:
    values = dict(lr=0.1, train_loss=0.5, samples_per_s=100.0, comm_frac=0.0, comm_exposed_ms=0.0, comm_total_ms=0.0,
                  forward_ms=1.0, backward_ms=2.0, optimizer_ms=0.5, step_ms=4.0, epoch_time_s=0.4, skipped_steps=0,
                  world_size=1, effective_batch=32, local_batch=32, accum_steps=1, grad_nbytes=400,
                  bucket_algbw_gbps=0.0, bucket_busbw_gbps=0.0, peak_rss_mib=90.0, rss_start_mib=50.0, state_mib=2.0)
    values.update(over)
    return EpochRecord(epoch=epoch, step=step, **values)


def write(path, records) -> str:
    path.write_text("\n".join(json.dumps(to_json(r)) for r in records) + "\n")
    return str(path)


def test_lr_plot_of_a_training_command(tmp_path):
    out = tmp_path / "lr.png"
    argv = ["lr", "--ranks", "2", "--out", str(out), "--batch-size", "512", "--accum-steps", "4",
            "--warmup-epochs", "1", "--epochs", "5"]
    assert main(argv) == 0 and is_png(out)


def test_lr_schedule_is_the_trainers():
    from mpisgd.app.options import parse_config

    cfg = parse_config(["--batch-size", "512", "--accum-steps", "4", "--warmup-epochs", "1", "--epochs", "5"])
    sched, spe = schedule_for(cfg, ranks=2)
    assert spe == 60000 // 4096 and sched.total_steps == 5 * spe
    assert sched.peak_lr == pytest.approx(0.1 * 4096 / 256) and sched.warmup_steps == spe


@pytest.mark.parametrize("argv", [["lr", "--warmup-epochs", "9", "--epochs", "2"], ["lr", "--base-batch", "0"],
                                  ["lr", "--ranks", "0"], ["lr", "--no-such-flag"]])
def test_lr_plot_bad_input_exits_2(tmp_path, argv, capsys):
    assert main([*argv, "--out", str(tmp_path / "x.png")]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["lr", "curves"])
def test_out_takes_a_figure_type_writes_it_whole_and_refuses_the_rest_in_one_line(tmp_path, capsys, what):
    """--out by its name's type: .svg and .pdf are written as such, whole (into a new directory too); another
    type or none, a directory, a place it cannot write: one line, exit 2, nothing written. Before, a name
    without a type wrote NAME.png and said "wrote NAME", and a type matplotlib lacks was a traceback."""
    src = [write(tmp_path / "m.jsonl", [epoch_record(e, 10 * e, test_acc=0.8) for e in (1, 2)])] if what == "curves" \
        else []
    svg = tmp_path / "deeper" / "f.svg"
    assert main([what, *src, "--out", str(svg)]) == 0 and svg.read_text().lstrip().startswith(("<?xml", "<svg"))
    pdf = tmp_path / "f.pdf"
    assert main([what, *src, "--out", str(pdf)]) == 0 and pdf.read_bytes().startswith(b"%PDF")
    capsys.readouterr()
    blocked = tmp_path / "file"
    blocked.write_text("")
    for out, says in ((tmp_path / "f.txt", "the file type '.txt' is not one of .png, .pdf, .svg"),
                      (tmp_path / "noext", "the file type '(none)' is not one of"),
                      (tmp_path / "dir.png", "is a directory: give a file name"),
                      (blocked / "f.png", "not written (")):
        if out.name == "dir.png":
            out.mkdir()
        assert main([what, *src, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"mpisgd.plot: error: --out {out}") and says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["deeper", "f.pdf", "file", "dir.png",
                                                                 *(["m.jsonl"] if src else [])])


def test_curves_from_metrics_files(tmp_path):
    paths = []
    for name, scale in (("a", 1.0), ("b", 2.0)):
        recs: list = [StepRecord(step=s, epoch=1 + s // 10, lr=0.1, loss=scale / s, step_ms=1.0) for s in range(1, 21)]
        recs += [epoch_record(e, 10 * e, test_acc=0.8 + e / 100) for e in (1, 2)]
        paths.append(write(tmp_path / f"{name}.jsonl", recs))
    out = tmp_path / "curves.png"
    assert main(["curves", *paths, "--labels", "a,b", "--out", str(out)]) == 0 and is_png(out)
    assert main(["curves", *paths, "--labels", "only-one", "--out", str(out)]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["curves", str(empty), "--out", str(out)]) == 2


def test_curves_of_a_file_two_runs_appended_to_draw_the_last(tmp_path, capsys):
    """Two runs appended to one file (schema 0: no run records; the second run's steps start again at 1):
    the curve is the last run's, not both runs' steps joined."""
    first = [StepRecord(step=s, epoch=1, lr=0.1, loss=9.0, step_ms=1.0) for s in range(1, 11)]
    second = [StepRecord(step=s, epoch=1, lr=0.2, loss=1.0, step_ms=1.0) for s in range(1, 6)]
    path = write(tmp_path / "m.jsonl", [*first, epoch_record(1, 10), *second, epoch_record(1, 5)])
    fig = curves_figure([path])
    loss = next(a for a in fig.axes if "training loss" in a.get_ylabel())
    assert list(loss.lines[0].get_xdata()) == [1, 2, 3, 4, 5] and set(loss.lines[0].get_ydata()) == {1.0}


def test_curves_refuse_what_is_no_metrics_file(tmp_path, capsys):
    npz = tmp_path / "model.npz"
    npz.write_bytes(b"PK\x03\x04\x00\xff\xfe binary")
    assert main(["curves", str(npz), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not text" in err, err


def test_plot_cli_as_module(tmp_path):
    out = tmp_path / "lr.png"
    r = subprocess.run([sys.executable, "-m", "mpisgd.plot", "lr", "--out", str(out), "--epochs", "2"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert is_png(out)


def test_curves_draw_the_noise_scale_where_it_is_finite(tmp_path):
    """The noise-scale panel shows each epoch's finite estimate at its step; inf (|G|^2 estimated <= 0,
    null in the file) and a missing one are left out, not drawn as a spike or a gap that looks like zero."""
    recs = [epoch_record(e, 10 * e, test_acc=0.8, noise_scale=ns)
            for e, ns in ((1, 120.0), (2, float("inf")), (3, None), (4, 480.0))]
    p = tmp_path / "m.jsonl"
    from mpisgd.app.metrics import MetricsWriter, read_metrics

    w = MetricsWriter(str(p))
    for r in recs:
        w.write(r)
    w.close()
    epochs = read_metrics(str(p))[-1].epochs
    assert [r.noise_scale for r in epochs] == [120.0, None, None, 480.0]  # inf is written as null
    assert noise_points(recs) == ([10, 40], [120.0, 480.0]) == noise_points(epochs)
    fig = curves_figure([str(p)])
    panel = next(a for a in fig.axes if "noise scale" in a.get_ylabel())
    (line,) = panel.lines
    assert list(line.get_xdata()) == [10, 40] and list(line.get_ydata()) == [120.0, 480.0]
    assert panel.get_yscale() == "log"
