"""scripts/gpu_check.sh without a GPU: its dry run (GPU_CHECK_DRY_RUN=1) runs every step with --device cpu,
tiny sizes and synthetic data, and writes the results file a GPU run writes, so the script cannot rot
unseen. Also: a failing step is reported as failed, the steps after it still run and the exit status is
non-zero; a hanging step is stopped (and leaves no process behind); a run out of budget says so; without
a GPU and no dry run, exit 2. Serial tests: the script launches its own mpiexec."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ONE_THREAD, ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["env", "probe", "tests-k1", "tests-k2", "tests-k3", "train-mlp-gpu", "train-cnn-gpu", "train-mlp-gpu-k2",
         "train-mlp-nccl", "train-resnet-gpu-k2", "train-gpt-gpu", "portable-bits", "train-mlp-cpu", "train-cnn-cpu",
         "bw-nccl", "bw-staged", "bw-direct"]
TRAININGS = ["train-mlp-gpu", "train-cnn-gpu", "train-mlp-gpu-k2", "train-resnet-gpu-k2", "train-mlp-cpu",
             "train-cnn-cpu"]

pytestmark = [pytest.mark.skipif(shutil.which("mpiexec") is None or shutil.which("timeout") is None,
                                 reason="needs mpiexec and timeout(1)"),
              pytest.mark.xdist_group("gpu_check")]  # one worker makes the module's dry run


def gpu_check(tmp: Path, timeout: float = 300, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run the script (a dry run unless env says otherwise); (the process, the results file's text)."""
    results = tmp / "gpu-check.md"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "MAX_BYTES"}
    full = {**inherited, **ONE_THREAD, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "GPU_CHECK_DRY_RUN": "1",
            "GPU_CHECK_RESULTS": str(results), "GPU_CHECK_WORK": str(tmp / "work"), "MPISGD_PLAN_FILE": "off",
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **env}
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full, timeout=timeout, cwd=tmp)
    return r, results.read_text() if results.exists() else ""


def steps(text: str) -> dict[str, dict[str, str]]:
    """The Steps table: step name -> its result, time, timeout and note, in the order of the table."""
    table = text.split("## Steps", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].isdigit():
            rows[cells[1]] = {"n": cells[0], "result": cells[2], "time": cells[3], "timeout": cells[4],
                              "note": cells[5]}
    return rows


def section(text: str, heading: str) -> str:
    assert f"\n## {heading}" in text, f"no section '## {heading}' in the results file"
    return text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    r, text = gpu_check(tmp)
    return r, text, tmp


def test_dry_run_runs_every_step_and_passes(dry_run):
    r, text, _ = dry_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PASS (17 steps)" in r.stdout
    rows = steps(text)
    assert list(rows) == STEPS
    for name, row in rows.items():
        if name == "train-mlp-nccl":  # one GPU (as the dry run pretends): nothing for NCCL to train with
            assert row["result"] == "SKIP" and "NCCL needs one GPU per rank" in row["note"], row
        elif name == "bw-direct" and row["result"] == "SKIP":  # this MPI is not CUDA-aware
            assert "no CUDA-aware MPI" in row["note"], row
        else:
            assert row["result"] == "PASS", (name, row)
            assert float(row["time"]) > 0 and int(row["timeout"]) >= 30, (name, row)


def test_dry_run_results_file_has_every_section(dry_run):
    _, text, _ = dry_run
    assert text.startswith("# mpisgd GPU check")
    assert "DRY RUN on the CPU" in text and "Nothing in this file ran on a GPU" in text
    assert "result: **PASS (17 steps)**" in text
    machine = section(text, "Machine and versions")
    assert "python " in machine and "MPI library:" in machine and "MPI CUDA query:" in machine
    details = section(text, "Step details")
    for n, name in enumerate(STEPS, 1):
        assert f"### {n}. {name}: " in details, name
    # each command is there as it ran: on the CPU, tiny, at the stated k
    commands = dict(re.findall(r"### \d+\. (\S+): \S+ \([\d.]+ s\)\n\n`([^`]*)`", details))
    assert "-n 3" in commands["tests-k3"] and "--with-mpi" in commands["tests-k3"]
    for name in TRAININGS:
        assert "--device cpu" in commands[name] and "--dataset synthetic" in commands[name], name
    assert "--model cnn" in commands["train-cnn-gpu"] and "-n 2" in commands["train-mlp-gpu-k2"]
    assert "--model resnet" in commands["train-resnet-gpu-k2"] and "-n 2" in commands["train-resnet-gpu-k2"]
    assert "--model gpt" in commands["train-gpt-gpu"] and "--data README.md" in commands["train-gpt-gpu"]
    assert "--max-bytes 4K" in commands["bw-staged"] and "--cuda-aware staged" in commands["bw-staged"]
    assert "portable.sh" in commands["portable-bits"]
    assert "identical on cpu (k=1) and cpu (k=2)" in steps(text)["portable-bits"]["note"]


def test_dry_run_reports_the_tests_at_each_k(dry_run):
    _, text, _ = dry_run
    rows = steps(text)
    for k in (1, 2, 3):
        note = rows[f"tests-k{k}"]["note"]
        assert "probe test 1" in note and "staged 4/4" in note and "nccl 1/1" in note, note
        assert "collected, not run on a GPU" in note, note
        for r in range(1, k):  # the other ranks' closing lines
            assert re.search(rf"rank {r}: \d+ passed", note), note


def test_dry_run_tables_of_training_and_bandwidth(dry_run):
    _, text, _ = dry_run
    training = section(text, "Training")
    for name in TRAININGS:
        row = re.search(rf"^\| {name} \| cpu \| (\d) \| 1 of 1 \| (0\.\d+|1\.0+) \| ([\d,]+) \|", training, re.M)
        assert row, f"no finished run {name} in\n{training}"
        assert int(row.group(3).replace(",", "")) > 0
    assert re.search(r"MLP: train-mlp-gpu / train-mlp-cpu samples/s = \*\*\d+\.\d\d\*\*", training)
    assert re.search(r"CNN: train-cnn-gpu / train-cnn-cpu samples/s = \*\*\d+\.\d\d\*\*", training)
    for name, k, backends in (("bw-nccl", 1, 1), ("bw-staged", 2, 3)):
        table = section(text, f"{name}: all-reduce at k={k}")
        sizes = re.findall(r"^\| (\d+) \|(.*)\|$", table, re.M)
        assert [int(s) for s, _ in sizes] == [4 << i for i in range(11)], table
        for _, cells in sizes:
            values = [c.strip() for c in cells.split("|")]
            assert len(values) == 3 * backends and all(w == "0" for w in values[2::3]), cells


def test_a_failing_step_is_reported_and_the_rest_still_run(tmp_path):
    r, text = gpu_check(tmp_path, GPU_CHECK_STEPS="env,train-mlp-cpu,train-cnn-cpu",
                        GPU_CHECK_INJECT="train-mlp-cpu=fail")
    assert r.returncode == 1, r.stdout[-3000:]
    rows = steps(text)
    assert [(n, row["result"]) for n, row in rows.items()] == [
        ("env", "PASS"), ("train-mlp-cpu", "FAIL"), ("train-cnn-cpu", "PASS")]
    assert "exit 3" in rows["train-mlp-cpu"]["note"]
    assert "result: **FAIL (1 of 3 steps failed" in text
    assert "injected failure (GPU_CHECK_INJECT)" in section(text, "Step details")
    assert re.search(r"^\| train-cnn-cpu \| cpu \| 1 \| 1 of 1 \|", section(text, "Training"), re.M)


def test_a_training_below_the_accuracy_bar_fails(tmp_path):
    """On a GPU each training must reach 0.6 (chance: 0.1); the dry run's 8 steps are held to a bar raised
    to 0.99 here, to see the check fail a run whose command succeeded."""
    r, text = gpu_check(tmp_path, GPU_CHECK_STEPS="train-mlp-cpu", GPU_CHECK_MIN_ACC="0.99")
    assert r.returncode == 1
    row = steps(text)["train-mlp-cpu"]
    assert row["result"] == "FAIL" and re.search(r"test accuracy 0\.\d+ < 0\.99", row["note"]), row


def test_a_hanging_step_is_stopped_and_leaves_nothing_behind(tmp_path):
    r, text = gpu_check(tmp_path, timeout=120, GPU_CHECK_STEPS="env,probe", GPU_CHECK_INJECT="env=hang",
                        GPU_CHECK_HANG_S="3")
    assert r.returncode == 1, r.stdout[-3000:]
    rows = steps(text)
    assert rows["env"]["result"] == "TIMEOUT" and "stopped after 3 s" in rows["env"]["note"], rows
    assert 3 <= float(rows["env"]["time"]) < 20, rows
    assert rows["probe"]["result"] == "PASS", rows
    marker = str(tmp_path / "work" / "injected-hang")
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                left.append(proc.name)
        except OSError:
            continue
    assert left == [], f"processes of the stopped step still running: {left}"


def test_no_time_left_means_not_run_and_a_failure(tmp_path):
    r, text = gpu_check(tmp_path, GPU_CHECK_STEPS="env,probe", GPU_CHECK_BUDGET_S="0")
    assert r.returncode == 1
    rows = steps(text)
    assert [row["result"] for row in rows.values()] == ["NOT RUN", "NOT RUN"]
    assert "out of time" in rows["probe"]["note"]


def test_unknown_step_is_refused(tmp_path):
    r, _ = gpu_check(tmp_path, GPU_CHECK_STEPS="env,bw-everything")
    assert r.returncode == 2 and "unknown step 'bw-everything'" in r.stderr


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    probe = subprocess.run([sys.executable, "-c", "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0"],
                           capture_output=True)
    if probe.returncode == 0:
        pytest.skip("this machine has a GPU: the check would run for real")
    r, text = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="0")
    assert r.returncode == 2
    assert "no CuPy or no CUDA device" in r.stderr
    assert "result: **NOT RUN (see the setup step)**" in text and "Nothing ran:" in text
    rows = steps(text)
    assert rows["setup"]["result"] == "FAIL" and rows["env"]["result"] == "PASS"


def test_an_argument_says_how_it_runs_instead_of_running(tmp_path):
    """It takes no arguments: --help prints how it is run (exit 0), anything else too and exit 2; neither
    starts a step nor writes a results file (an argument was ignored and the whole check ran)."""
    for args, status in ((["--help"], 0), (["--steps", "env"], 2)):
        r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, cwd=tmp_path,
                           env={**os.environ, "GPU_CHECK_RESULTS": str(tmp_path / "r.md")})
        assert r.returncode == status and "bash scripts/gpu_check.sh" in r.stdout, r.stdout + r.stderr
        assert "[env]" not in r.stdout + r.stderr and not (tmp_path / "r.md").exists()
    assert "unknown argument(s) '--steps env': it takes none" in r.stderr


def test_install_refuses_an_argument_it_does_not_know_before_installing():
    """scripts/install.sh test | openmpi | nothing: a typo ('tset') installed the package without the test
    tools, silently; now one line and exit 2, before anything is installed."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "tset"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert r.stderr.startswith("install.sh: unknown argument(s) 'tset': give none (the package), test")
