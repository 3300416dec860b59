"""The documented library example runs as documented."""

from __future__ import annotations

from conftest import ROOT, run_mpi


def test_library_example_runs_under_mpiexec():
    r = run_mpi(2, str(ROOT / "examples" / "train_library.py"), "--steps", "60", "--synthetic", timeout=180)
    assert r.returncode == 0, r.stderr
    acc = float(r.stdout.split("test accuracy")[1].split()[0])
    assert acc > 0.5 and "k=2 ranks" in r.stdout
