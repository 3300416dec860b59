"""The pinned level (mpisgd.pinning): which command lines ask for it, the variables it sets for each NumPy,
the machines it refuses; through the CLI: the process pins itself before NumPy and MPI load (from the
command line or a --config file), the checkpoint records what was pinned, an unpinned process and a
rank pinned otherwise are refused naming the rank and the setting, and a resume under other
libraries warns naming them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, clean_env, openmpi_env, run_mpi, run_openmpi, serial_only

from mpisgd import pinning
from mpisgd.app import preflight
from mpisgd.app.options import parse_config
from mpisgd.backend import numpy_simd
from mpisgd.errors import UsageError

JOB = ("-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "384", "--limit-test", "64",
       "--batch-size", "16", "--global-batch", "32", "--max-steps", "2", "--hidden", "16", "--progress", "off")


@pytest.mark.parametrize("argv,pinned", [
    (["--reproducible"], True), (["--reproducible", "pinned"], True), (["--reproducible=pinned"], True),
    (["--reproducible", "portable"], False), (["--reproducible=portable"], False), ([], False),
    (["--reproducible", "--hidden", "8"], True), (["--reproducible", "--no-reproducible"], False),
    (["--reproducible-level", "portable", "--reproducible"], False),
    (["--reproducible", "--reproducible-level", "portable"], False),
    (["--reproducible-level=pinned", "--reproducible"], True),
])
def test_which_command_lines_ask_for_the_pinned_level(argv, pinned):
    assert pinning.asks_pinned(argv) is pinned
    cfg = parse_config(argv)
    assert (cfg.reproducible and cfg.reproducible_level == "pinned") is pinned  # the real parser agrees


def test_a_config_file_asks_too_and_the_command_line_overrides_it(tmp_path):
    on = tmp_path / "on.toml"
    on.write_text("reproducible = true\n")
    portable = tmp_path / "portable.toml"
    portable.write_text('reproducible = true\nreproducible-level = "portable"\n')
    assert pinning.asks_pinned(["--config", str(on)])
    assert not pinning.asks_pinned(["--config", str(portable)])
    assert pinning.asks_pinned(["--config", str(portable), "--reproducible", "pinned"])
    assert not pinning.asks_pinned(["--config", str(on), "--no-reproducible"])
    assert not pinning.asks_pinned(["--config", str(tmp_path / "missing.toml")])  # the parser reports it


def test_the_variables_for_either_naming_of_numpy_s_targets():
    new = pinning.pinned_variables(["X86_V3", "X86_V4", "AVX512_ICL", "AVX512_SPR"])
    assert new["NPY_DISABLE_CPU_FEATURES"] == "X86_V4 AVX512_ICL AVX512_SPR"
    old = pinning.pinned_variables(["SSSE3", "AVX2", "AVX512F", "AVX512CD", "AVX512_SKX", "AVX512_ICL"])
    assert old["NPY_DISABLE_CPU_FEATURES"] == "AVX512F AVX512CD AVX512_SKX AVX512_ICL"
    assert new["OPENBLAS_CORETYPE"] == "Haswell" and new["OPENBLAS_NUM_THREADS"] == "1"
    assert new["MKL_CBWR"].startswith("AVX2") and new["ATEN_CPU_CAPABILITY"] == "avx2"
    here = pinning.pinned_variables(pinning.numpy_dispatch())
    assert here == pinning.pinned_variables(numpy_simd(enabled=False))  # the child's probe, this process's list


def test_the_dispatch_probe_runs_once_per_numpy_install(tmp_path, monkeypatch):
    """The first call asks a child and keeps the answer under NumPy's compiled core; the next reads it
    without a child; a core that changed (another size or time) is asked again; an unreadable cache file
    is asked around; "off" keeps nothing."""
    cache = tmp_path / "c" / "dispatch.json"
    probes = []
    real = pinning.subprocess.run

    def counted(*args, **kwargs):
        probes.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(pinning.subprocess, "run", counted)
    first = pinning.numpy_dispatch(cache=str(cache))
    assert first == numpy_simd(enabled=False) and len(probes) == 1
    key = pinning._numpy_core_key()
    assert key is not None and json.loads(cache.read_text()) == {key: first}
    assert pinning.numpy_dispatch(cache=str(cache)) == first and len(probes) == 1  # from the cache
    cache.write_text(json.dumps({key: ["X86_V3"]}))  # what the cache says is what is used: no child asked
    assert pinning.numpy_dispatch(cache=str(cache)) == ["X86_V3"] and len(probes) == 1
    path, size, mtime = key.rsplit(" ", 2)
    cache.write_text(json.dumps({f"{path} {size} {int(mtime) - 1}": ["X86_V3"]}))  # another build at that path
    assert pinning.numpy_dispatch(cache=str(cache)) == first and len(probes) == 2
    cache.write_text("{not json")
    assert pinning.numpy_dispatch(cache=str(cache)) == first and len(probes) == 3
    assert json.loads(cache.read_text()) == {key: first}  # rewritten whole
    assert pinning.numpy_dispatch(cache=None) == first and len(probes) == 4
    assert pinning.numpy_dispatch(env=dict(os.environ), cache=str(cache)) == first and len(probes) == 5
    assert [p.name for p in cache.parent.iterdir()] == ["dispatch.json"]  # no temporary file left


def test_machines_the_level_cannot_hold_on():
    assert pinning.unavailable("x86_64", {"avx2", "fma", "sse2"}) == ""
    assert "lacks FMA" in pinning.unavailable("x86_64", {"avx2"})
    assert "lacks AVX2 and FMA" in pinning.unavailable("x86_64", {"sse2"})
    assert "aarch64" in pinning.unavailable("aarch64", set())
    facts = {"pinned": "", "numpy_simd": "X86_V3", "blas": "openblas 0.3 (Haswell)", "blas_threads": "1"}
    assert "use --reproducible portable" in pinning.problem(facts, {}, machine_problem="no AVX2")


def test_what_a_process_that_is_not_pinned_alike_is_told():
    want = pinning.pinned_variables(["X86_V3", "X86_V4"])
    ok = {"pinned": json.dumps(want), "numpy_simd": "X86_V3", "blas": "openblas 0.3.31 (Haswell)", "blas_threads": "1"}
    assert pinning.problem(ok, want, machine_problem="") == ""
    cases = {"not pinned before NumPy loaded": dict(ok, pinned=""),
             "pinned otherwise: OPENBLAS_CORETYPE='SkylakeX'": dict(ok, pinned=json.dumps(
                 dict(want, OPENBLAS_CORETYPE="SkylakeX"))),
             "still dispatches to X86_V4": dict(ok, numpy_simd="X86_V3 X86_V4"),
             "other kernels than Haswell's": dict(ok, blas="openblas 0.3.31 (SkylakeX)"),
             "runs 2 threads": dict(ok, blas_threads="2"),
             "on a GPU": dict(ok, device="H200")}
    for phrase, facts in cases.items():
        assert phrase in pinning.problem(facts, want, machine_problem=""), phrase


class Ranks:
    """A communicator stand-in whose allgather returns the given ranks' values (this rank is rank 0)."""

    def __init__(self, *others: dict) -> None:
        self.others = others

    def allgather(self, mine):
        return [mine, *[dict(mine, **o) if isinstance(mine, dict) else o for o in self.others]]


def test_ranks_with_other_arithmetic_are_named_with_the_setting():
    env = {"level": "pinned", "array": "numpy 2.4.6", "blas": "openblas (Haswell)", "numpy_simd": "X86_V3"}
    preflight.same_arithmetic(env, ("array", "blas"), Ranks({}, {}), "the bits")
    with pytest.raises(UsageError, match=r"array is 'numpy 2.4.6' on rank\(s\) \[0, 1\] but 'numpy 1.24.2' on rank 2"):
        preflight.same_arithmetic(env, ("array", "blas"), Ranks({}, {"array": "numpy 1.24.2"}), "the bits")


def test_threads_other_than_one_are_refused_at_the_pinned_level():
    with pytest.raises(UsageError, match="one BLAS thread per rank"):
        parse_config(["--reproducible", "--threads", "2"])
    assert parse_config(["--reproducible", "portable", "--threads", "2"]).threads == 2


# -- through the CLI ---------------------------------------------------------------------------------
def checkpoint_environment(directory: Path) -> dict:
    with np.load(sorted(directory.glob("ckpt-*.npz"))[-1]) as z:
        return json.loads(str(z["environment"]))


@serial_only
def test_the_cli_pins_itself_and_the_checkpoint_records_it(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("reproducible = true\n")
    for tag, extra in (("flag", ("--reproducible",)), ("file", ("--config", str(config)))):
        r = run_mpi(2, *JOB, *extra, "--checkpoint-dir", str(tmp_path / tag), env={"OPENBLAS_CORETYPE": "Prescott"})
        assert r.returncode == 0, r.stderr[-2000:]
        env = checkpoint_environment(tmp_path / tag)
        assert env["level"] == "pinned" and json.loads(env["pinned"]) == pinning.pinned_variables(
            numpy_simd(enabled=False))
        assert "(Haswell)" in env["blas"] and env["blas_threads"] == "1"
        assert not pinning.avx512_targets(env["numpy_simd"].split())
        assert "pinned level: on any x86-64 CPU with AVX2 and FMA" in " ".join(r.stdout.split())
    r = run_mpi(1, *JOB, "--reproducible", "portable", "--checkpoint-dir", str(tmp_path / "portable"))
    assert r.returncode == 0, r.stderr[-2000:]
    env = checkpoint_environment(tmp_path / "portable")
    assert env["level"] == "portable" and env["pinned"] == ""  # nothing to pin: no re-exec
    assert "portable level: on any BLAS, CPU, thread count, NumPy version or GPU" in " ".join(r.stdout.split())


@serial_only
def test_the_console_script_pins_itself_as_python_m_does(tmp_path):
    """``mpisgd-train``, as setup.py declares it (read from there: an installed script may be older), starts
    the pinned level as ``python -m mpisgd.train`` does; a target that does not pin is refused at set-up."""
    declared = re.search(r'"mpisgd-train=([\w.]+):(\w+)"', (ROOT / "setup.py").read_text())
    assert declared, "setup.py declares the mpisgd-train console script"
    module, function = declared.groups()
    code = f"import sys; from {module} import {function}; sys.exit({function}())"
    r = subprocess.run([sys.executable, "-c", code, *JOB[2:], "--reproducible", "--checkpoint-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env={**clean_env(), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    env = checkpoint_environment(tmp_path)
    assert env["level"] == "pinned" and json.loads(env["pinned"]) == pinning.pinned_variables(
        numpy_simd(enabled=False))


@serial_only
def test_a_process_that_loaded_numpy_first_is_refused():
    code = ("import sys, numpy; from mpisgd.app.train import main; "
            f"sys.exit(main({list(JOB[2:]) + ['--reproducible']!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**clean_env(), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rank 0: this process was not pinned before NumPy loaded: start it with python -m mpisgd.train" \
        in r.stderr


@serial_only
def test_a_rank_pinned_otherwise_is_refused_naming_it_and_the_setting(tmp_path):
    """MPMD: rank 1 pinned by hand with AVX2's loops off too (a machine set up differently)."""
    want = pinning.pinned_variables(numpy_simd(enabled=False))
    odd = dict(want, NPY_DISABLE_CPU_FEATURES=want["NPY_DISABLE_CPU_FEATURES"] + " X86_V3")
    from conftest import mpiexec_cmd

    cmd = mpiexec_cmd(1, *JOB, "--reproducible")
    env_args = [f"{k}={v}" for k, v in odd.items()] + [f"{pinning.MARKER}={json.dumps(odd)}"]
    cmd += [":", "-n", "1", "env", *env_args, sys.executable, *JOB, "--reproducible"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**clean_env(), "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1",
                            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--reproducible (pinned level): rank 1: this process was pinned otherwise: NPY_DISABLE_CPU_FEATURES=" \
        in r.stderr


@serial_only
def test_a_resume_under_other_libraries_warns_naming_them(tmp_path):
    debian = openmpi_env()
    if debian is None:
        pytest.skip("no Open MPI environment (bash scripts/install.sh openmpi)")
    ck = tmp_path / "ck"
    r = run_mpi(1, *JOB, "--reproducible", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
                env={"MPISGD_FAIL_AT_STEP": "1"})
    assert r.returncode == 1 and list(ck.glob("ckpt-*.npz")), r.stderr[-2000:]
    r = run_openmpi(debian, 1, *JOB, "--reproducible", "--checkpoint-dir", str(ck), "--resume", "auto")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "warning: resume: the checkpoint was written with other arithmetic (" in out
    assert "array 'numpy " in out and "promises the same bits only where these are the same" in out


@serial_only
def test_a_script_pins_itself_with_pin(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text("from mpisgd import pinning\npinning.pin()\nimport json, numpy\n"
                      "from mpisgd.backend import numpy_simd\n"
                      "print(json.dumps([numpy_simd(), pinning.is_pinned()]))\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**clean_env(), "PYTHONPATH": str(ROOT), "OPENBLAS_CORETYPE": "Sandybridge"})
    assert r.returncode == 0, r.stderr[-2000:]
    simd, pinned = json.loads(r.stdout.splitlines()[-1])
    assert not pinning.avx512_targets(simd) and pinned["OPENBLAS_CORETYPE"] == "Haswell"
    late = subprocess.run([sys.executable, "-c", "import numpy\nfrom mpisgd import pinning\npinning.pin()"],
                          capture_output=True, text=True, timeout=300, env={**clean_env(), "PYTHONPATH": str(ROOT)})
    assert late.returncode != 0 and "NumPy is loaded already: call pin() before importing it" in late.stderr
