"""The plot CLI: the learning-rate schedule of a training command, training curves from metrics files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env, is_png

from mpisgd.app.plot import curves_figure, main, noise_points, schedule_for

pytest.importorskip("matplotlib")


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


def test_curves_from_metrics_files(tmp_path):
    paths = []
    for name, scale in (("a", 1.0), ("b", 2.0)):
        p = tmp_path / f"{name}.jsonl"
        recs = [{"kind": "step", "step": s, "epoch": 1 + s // 10, "lr": 0.1, "loss": scale / s} for s in range(1, 21)]
        recs += [{"kind": "epoch", "epoch": e, "step": 10 * e, "lr": 0.1, "train_loss": 0.5, "test_acc": 0.8 + e / 100}
                 for e in (1, 2)]
        p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        paths.append(str(p))
    out = tmp_path / "curves.png"
    assert main(["curves", *paths, "--labels", "a,b", "--out", str(out)]) == 0 and is_png(out)
    assert main(["curves", *paths, "--labels", "only-one", "--out", str(out)]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["curves", str(empty), "--out", str(out)]) == 2


def test_plot_cli_as_module(tmp_path):
    out = tmp_path / "lr.png"
    r = subprocess.run([sys.executable, "-m", "mpisgd.plot", "lr", "--out", str(out), "--epochs", "2"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert is_png(out)


def test_curves_draw_the_noise_scale_where_it_is_finite(tmp_path):
    """The noise-scale panel shows each epoch's finite estimate at its step; inf (|G|^2 estimated <= 0)
    and a missing one are left out, not drawn as a spike or a gap that looks like zero."""
    recs = [{"kind": "epoch", "epoch": e, "step": 10 * e, "lr": 0.1, "train_loss": 0.5, "test_acc": 0.8,
             **({"noise_scale": ns} if ns is not None else {})}
            for e, ns in ((1, 120.0), (2, float("inf")), (3, None), (4, 480.0))]
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert noise_points(recs) == ([10, 40], [120.0, 480.0])
    fig = curves_figure([str(p)])
    panel = next(a for a in fig.axes if "noise scale" in a.get_ylabel())
    (line,) = panel.lines
    assert list(line.get_xdata()) == [10, 40] and list(line.get_ydata()) == [120.0, 480.0]
    assert panel.get_yscale() == "log"

