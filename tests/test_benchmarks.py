"""The benchmarks users run (benchmarks/): each one's helpers, and a quick real run that checks what it
prints and writes (training throughput with its baselines, all-reduce bandwidth). The experiments behind
the docs are tested in test_experiments.py."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, clean_env, run_mpi, script, serial_only

allreduce_bw = script("benchmarks", "allreduce_bw")

# under mpiexec without -m mpi every rank would collect these: what starts its own processes runs once
pytestmark = serial_only


def test_throughput_ratios_are_paired_within_a_repeat():
    tt = script("benchmarks", "train_throughput")

    def run(impl, rep, sps, step):
        return {"impl": impl, "repeat": rep, "samples_per_s": sps, "step_ms": step}

    runs = {"mpisgd k=1": [run("mpisgd k=1", 0, 100, 10.0), run("mpisgd k=1", 1, 50, 20.0)],
            "mpisgd k=2": [run("mpisgd k=2", 0, 170, 12.0), run("mpisgd k=2", 1, 90, 22.0)],
            "numpy-loop-1t": [run("numpy-loop-1t", 1, 55, 19.0)],  # repeat 0 failed: left out
            "torch-ddp-gloo": [run("torch-ddp-gloo", 0, 100, 30.0), run("torch-ddp-gloo", 1, 60, 40.0)]}
    ratios = tt.paired_ratios(runs, 2)
    assert ratios["efficiency k=2 (>= 0.93)"] == pytest.approx([0.85, 0.9])
    assert ratios["k=1 step / numpy-loop-1t step (<= 1.05)"] == pytest.approx([20.0 / 19.0])
    assert ratios["k=2 / PyTorch DDP gloo k=2 (>= 1.6)"] == pytest.approx([1.7, 1.5])
    assert not any("2 BLAS threads" in label or "replicated" in label for label in ratios)  # no such runs
    runs["mpisgd k=2 replicated"] = [run("mpisgd k=2 replicated", 0, 120, 0), run("mpisgd k=2 replicated", 1, 126, 0)]
    ratios = tt.paired_ratios(runs, 2)
    assert ratios["efficiency k=2 replicated"] == pytest.approx([0.6, 1.26])
    assert ratios["k=2 / k=2 replicated"] == pytest.approx([170 / 120, 90 / 126])
    assert not any("apart" in label for label in ratios)
    runs["mpisgd k=2 apart"] = [run("mpisgd k=2 apart", 1, 88, 0)]  # repeat 0 missing: paired on repeat 1 only
    ratios = tt.paired_ratios(runs, 2)
    assert ratios["ceiling: k=2 apart / (2 x k=1)"] == pytest.approx([0.88])
    assert ratios["k=2 / k=2 apart"] == pytest.approx([90 / 88])
    assert ratios["k=2 replicated / k=2 apart"] == pytest.approx([126 / 88])
    # --variant launches: each against plain mpisgd, or the replicated one when its options do not shard
    runs["mpisgd k=2 private"] = [dict(run("mpisgd k=2 private", 1, 100, 0), options="--no-shared-grads")]
    runs["mpisgd k=2 private sh"] = [dict(run("mpisgd k=2 private sh", 0, 60, 0),
                                          options="--no-shared-grads --no-shard-optimizer")]
    ratios = tt.paired_ratios(runs, 2)
    assert ratios["k=2 private / k=2"] == pytest.approx([100 / 90])
    assert ratios["k=2 private sh / k=2 replicated"] == pytest.approx([60 / 120])
    # on a GPU: the CuPy loop and DDP over NCCL are the comparisons
    gpu = {"mpisgd k=1": runs["mpisgd k=1"], "mpisgd k=2": runs["mpisgd k=2"],
           "cupy-loop": [run("cupy-loop", 0, 120, 8.0)], "torch-ddp-nccl": [run("torch-ddp-nccl", 0, 85, 9.0)]}
    ratios = tt.paired_ratios(gpu, 2)
    assert ratios["k=1 step / cupy-loop step (<= 1.05)"] == pytest.approx([10.0 / 8.0])
    assert ratios["k=2 / PyTorch DDP nccl k=2 (>= 1.6)"] == pytest.approx([2.0])


def test_median_interval_covers_the_median_and_narrows_with_repeats():
    tt = script("benchmarks", "train_throughput")
    assert tt.median_ci([0.8] * 5) == (0.8, 0.8)
    rng = np.random.default_rng(1)
    few, many = list(rng.normal(0.85, 0.05, 6)), list(rng.normal(0.85, 0.05, 60))
    lo6, hi6 = tt.median_ci(few)
    lo60, hi60 = tt.median_ci(many)
    assert lo6 <= float(np.median(few)) <= hi6 and lo60 <= float(np.median(many)) <= hi60
    assert min(few) <= lo6 < hi6 <= max(few)
    assert hi60 - lo60 < hi6 - lo6  # ten times the repeats: a narrower interval
    assert lo60 < 0.85 < hi60


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="dataset-fashion-mnist absent")
def test_throughput_benchmark_smoke_run(tmp_path):
    """The comparison script end to end, small: interleaved launches, the table, the paired ratios."""
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--repeats", "2", "--compare",
                        "--baselines", "numpy-1t", "--replicated", "--apart", "--variant", "private=--no-shared-grads",
                        "--json", str(out), "--", "--hidden", "32", "--limit-train", "8192", "--limit-test", "1000"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr + r.stdout
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"mpisgd k=1", "mpisgd k=2", "mpisgd k=2 replicated", "mpisgd k=2 apart",
                                    "mpisgd k=2 private", "numpy-loop-1t"}
    assert len(data["ratios"]["k=2 private / k=2"]) == 2
    # the ceiling pairs each apart launch (two ranks' samples/s summed) with the k=1 launch of its repeat; no
    # bound on the value itself: epochs this small last a fraction of a second, so timing noise rules them
    apart = data["runs"]["mpisgd k=2 apart"]
    one = {x["repeat"]: x["samples_per_s"] for x in data["runs"]["mpisgd k=1"]}
    assert [x["repeat"] for x in apart] == [0, 1] and all(x["samples_per_s"] > 0 for x in apart)
    assert data["ratios"]["ceiling: k=2 apart / (2 x k=1)"] == pytest.approx(
        [x["samples_per_s"] / (2 * one[x["repeat"]]) for x in apart])
    lo, hi = data["ratio_ci95"]["k=2 / k=2 apart"]
    assert lo <= statistics.median(data["ratios"]["k=2 / k=2 apart"]) <= hi
    assert len(data["ratios"]["k=2 / k=2 replicated"]) == 2
    assert [x["repeat"] for x in data["runs"]["mpisgd k=2"]] == [0, 1]
    assert len(data["ratios"]["efficiency k=2 (>= 0.93)"]) == 2
    assert all(v > 0 for v in data["ratios"]["k=1 step / numpy-loop-1t step (<= 1.05)"])
    assert "the speed issue's ratios" in r.stdout and "torch" not in r.stdout  # DDP not asked for
    assert [x["steps"] for x in data["runs"]["numpy-loop-1t"]] == [8192 // 128] * 2  # mpisgd's --limit-train


@pytest.mark.parametrize("text,nbytes", [("4", 4), ("64K", 65536), ("256M", 256 << 20), ("1GiB", 1 << 30),
                                         ("2kb", 2048)])
def test_allreduce_bw_sizes_parse(text, nbytes):
    assert allreduce_bw.parse_size(text) == nbytes


def test_allreduce_bw_counts_wrong_elements():
    k = 3
    good = ((np.arange(100) % 13 + 1) * (k * (k + 1) // 2)).astype("float32")
    assert allreduce_bw.count_wrong(good, k) == 0
    bad = good.copy()
    bad[[3, 50]] += 1
    assert allreduce_bw.count_wrong(bad, k) == 2


def test_allreduce_bw_runs_verifies_and_writes_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bw.jsonl", tmp_path / "bw.png"
    res = run_mpi(2, str(ROOT / "benchmarks" / "allreduce_bw.py"), "--max-bytes", "64K", "--step-factor", "16",
                  "--iters", "3", "--json", str(out), "--plot", str(png), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["backend"] for r in rows} == set(allreduce_bw.CPU_BACKENDS)
    assert {r["size_bytes"] for r in rows} == {4, 64, 1024, 16384}
    for r in rows:
        assert {"backend", "size_bytes", "dtype", "inplace", "time_us", "algbw_gbps", "busbw_gbps", "wrong"} <= set(r)
        assert r["wrong"] == 0 and r["time_us"] > 0
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (2 - 1) / 2, rel=1e-3)
    assert png.stat().st_size > 1000
    assert "out of bounds values: 0 OK" in res.stdout


def test_allreduce_bw_exits_non_zero_on_a_wrong_result(tmp_path):
    """A reducer that adds 1 to element 0 must be caught by the #wrong column and the exit code."""
    script = tmp_path / "broken.py"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]\n"
        "import allreduce_bw\n"
        "real = allreduce_bw.make_reducer\n"
        "def broken(*a):\n"
        "    red = real(*a)\n"
        "    inner = red.allreduce_\n"
        "    def wrong(buf):\n"
        "        inner(buf); buf[0] += 1\n"
        "    red.allreduce_ = wrong\n"
        "    return red\n"
        "allreduce_bw.make_reducer = broken\n"
        "args = ['--max-bytes', '64', '--backends', 'ring', '--inplace', 'yes', '--iters', '2']\n"
        "sys.exit(allreduce_bw.main(args))\n")
    res = run_mpi(2, str(script), timeout=300)
    assert res.returncode != 0
    assert "ERROR" in res.stdout




# bad input: one line on stderr, exit status 2, before any measurement or launch
SMALL = ["--max-bytes", "64", "--iters", "1", "--warmup", "0", "--backends", "mpi"]  # fast, were it measured


def bw_refuses(capsys, *argv: str) -> str:
    """allreduce_bw's one error line for ``argv`` (in this process, k=1), checking that nothing was measured."""
    assert allreduce_bw.main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert "# allreduce_bw" not in out  # refused before the measurement
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("allreduce_bw: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv,says", [(["--plot", "x.txt"], "cannot write .txt"),
                                       (["--json", "same.out", "--plot", "same.out"], "also the --json file")])
def test_allreduce_bw_refuses_a_plot_it_cannot_write_before_measuring(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    assert says in bw_refuses(capsys, *SMALL, *argv)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("backends", [",", "", "mpi,"])
def test_allreduce_bw_refuses_an_empty_backend_list(capsys, backends):
    assert "--backends" in bw_refuses(capsys, *SMALL, "--backends", backends)


def test_allreduce_bw_keeps_a_file_it_did_not_write(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    line = bw_refuses(capsys, *SMALL, "--json", str(notes))
    assert f"--json {notes} exists and is not allreduce_bw output" in line
    assert notes.read_text() == "my notes\n"
    args = allreduce_bw.parse_args([*SMALL, "--json", str(notes)])
    for mine in ("", json.dumps({"backend": "mpi", "size_bytes": 4, "inplace": True, "time_us": 1.0,
                                 "busbw_gbps": 0.1}) + "\n"):  # empty, or an earlier run's: replaced
        notes.write_text(mine)
        assert allreduce_bw.output_problem(args) is None


def test_allreduce_bw_names_the_output_it_cannot_write_without_a_rank(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "x.json"  # its directory is a regular file: no one can write there, root included
    line = bw_refuses(capsys, *SMALL, "--json", str(out))
    assert line.startswith("allreduce_bw: error: --json ") and f"so {out} cannot be written" in line
    assert "rank 0" not in line


def _rows(backends=("mpi", "ring", "auto"), sizes=(4, 64)):
    return "".join(json.dumps({"backend": b, "size_bytes": s, "count": s // 4, "dtype": "float32", "inplace": inplace,
                               "time_us": 10.0 + s, "algbw_gbps": 0.1, "busbw_gbps": 0.1, "wrong": 0}) + "\n"
                   for s in sizes for inplace in (False, True) for b in backends)


@pytest.mark.parametrize("name,content,says", [
    ("nope.json", None, ": no such file"),
    ("somedir", "dir", " is a directory"),
    ("metrics.jsonl", '{"kind": "epoch", "samples_per_s": 1}\n', ": line 1 is not an allreduce_bw --json row"),
    ("notjson.json", "\nhello\n", ": line 2 is not an allreduce_bw --json row"),
    ("empty.json", "", ": no in-place rows"),
])
def test_allreduce_bw_summarize_says_what_is_wrong_with_a_file(tmp_path, capsys, name, content, says):
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    assert f"--summarize {path}{says}" in bw_refuses(capsys, "--summarize", str(path))


def test_allreduce_bw_summarize_refuses_a_file_twice_and_a_run_without_auto(tmp_path, capsys):
    """Several files compare auto with mpi and ring: a run compared with itself, or one without auto, was a table
    of NaN; a size one run lacks is left out."""
    a, b, no_auto = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(_rows())
    b.write_text(_rows(sizes=(64, 1024)))
    no_auto.write_text(_rows(("mpi", "ring")))
    assert f"--summarize names {a} twice" in bw_refuses(capsys, "--summarize", str(a), str(a))
    assert f"{no_auto}: no in-place rows of auto" in bw_refuses(capsys, "--summarize", str(a), str(no_auto))
    assert allreduce_bw.main(["--summarize", str(a), str(b)]) == 0
    table = capsys.readouterr().out
    assert "nan" not in table and "| 64B |" in table and "| 4B |" not in table and "| 1K |" not in table


def tt_refuses(capsys, monkeypatch, *argv: str) -> str:
    """train_throughput's one error line for ``argv``, checking that it launched nothing."""
    tt = script("benchmarks", "train_throughput")

    def launch(*a, **kw):
        raise AssertionError(f"launched {a}")

    monkeypatch.setattr(subprocess, "run", launch)
    monkeypatch.setattr(subprocess, "Popen", launch)
    monkeypatch.setattr(sys, "argv", ["train_throughput.py", *argv])
    with pytest.raises(SystemExit) as exc:
        tt.main()
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_throughput.py: error: "), lines
    return lines[0]


@pytest.mark.parametrize("argv,says", [
    (["--ks", ""], "--ks"), (["--ks", "a"], "--ks"), (["--ks", "0"], "--ks"), (["--ks", "-1"], "--ks"),
    (["--ks", "2,2"], "twice"), (["--repeats", "0"], "--repeats"),
    (["--", "--metrics-file", "user.jsonl"], "--metrics-file is the benchmark's own"),
    (["--variant", "x=--metrics-file=user.jsonl"], "--metrics-file is the benchmark's own"),
    (["--", "--model", "resnet"], "mlp and cnn only"), (["--", "--model=gpt"], "mlp and cnn only"),
    (["--model", "cnn", "--", "--model=mlp"], "differ"), (["--", "--no-such-option"], "train options:"),
    (["--max-others", "-1"], "--max-others must be a number of cores >= 0"),  # reran every launch 4 times
    (["--max-others", "nan"], "--max-others must be a number of cores >= 0"),
])
def test_throughput_refuses_bad_options_before_any_launch(capsys, monkeypatch, argv, says):
    assert says in tt_refuses(capsys, monkeypatch, *argv)


def test_throughput_checks_its_json_before_any_launch(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert f"--json {tmp_path} exists and is not a regular file" in \
        tt_refuses(capsys, monkeypatch, "--json", str(tmp_path))
    assert f"so {tmp_path / 'file' / 'x.json'} cannot be written" in \
        tt_refuses(capsys, monkeypatch, "--json", str(tmp_path / "file" / "x.json"))
    assert "is not train_throughput output" in tt_refuses(capsys, monkeypatch, "--json", str(notes))
    assert notes.read_text() == "my notes\n"
    tt = script("benchmarks", "train_throughput")
    notes.write_text(json.dumps({"summary": {}, "runs": {}, "ratios": {}}))  # an earlier run's: replaced
    tt.check_json(str(notes))


def test_throughput_reads_train_options_as_mpisgd_does(capsys, monkeypatch):
    """``-- --model=cnn --threads=2`` trains LeNet-5 on two threads: no --model mlp or --threads 1 added after."""
    tt = script("benchmarks", "train_throughput")
    seen = []

    def run_mpisgd(k, train_args, tmp, replicated=False, variant=""):
        seen.append(train_args)
        return {"impl": f"mpisgd k={k}", "k": k, "samples_per_s": 100.0, **dict.fromkeys(tt.SPLIT, 1.0),
                **dict.fromkeys(tt.MEMORY, 1.0), "options": ""}

    monkeypatch.setattr(tt, "run_mpisgd", run_mpisgd)
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: subprocess.CompletedProcess(a, 1))  # no torch
    monkeypatch.setattr(sys, "argv", ["train_throughput.py", "--ks", "1", "--repeats", "1", "--",
                                      "--model=cnn", "--threads=2"])
    tt.main()
    assert seen and all("mlp" not in args and "1" not in args for args in seen), seen
    assert "workload: LeNet-5" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["benchmarks/gpt_speed.py", "compare", "--repeats", "0"],  # was statistics' "no median for empty data"
    ["benchmarks/baselines.py", "side-by-side", "--model", "resnet", "--steps", "0"],  # "min() arg is an empty ..."
    ["benchmarks/baselines.py", "numpy", "--batch-size", "-4"],
    ["experiments/profile_step.py", "--model", "cnn", "--batch-size", "0"],  # profiled b = 128 instead
    ["benchmarks/train_throughput.py", "--repeats", "two"],
    ["benchmarks/gpt_torch.py", "speed", "--steps", "0"],  # an AssertionError's traceback
    ["benchmarks/gpt_torch.py", "speed", "--threads", "0"],  # torch's RuntimeError
    ["benchmarks/baselines.py", "side-by-side", "--profile", "-1"],  # profiled nothing, silently
])
def test_the_scripts_counts_are_checked_before_anything_runs(argv):
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=clean_env())
    name = Path(argv[0]).name
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"{name}: error: argument "), r.stderr
    assert "expected a whole number >= " in r.stderr and "Traceback" not in r.stderr, r.stderr
