"""The examples run as their docstrings say (examples/: the library, a NumPy model of one's own; the PyTorch
examples: tests/test_torch_examples.py)."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_mpi

EXAMPLES = ROOT / "examples"


def test_library_example_runs_under_mpiexec():
    r = run_mpi(2, str(EXAMPLES / "train_library.py"), "--steps", "60", "--synthetic", timeout=180)
    assert r.returncode == 0, r.stderr
    acc = float(r.stdout.split("test accuracy")[1].split()[0])
    assert acc > 0.5 and "k=2 ranks" in r.stdout


@pytest.mark.parametrize("k", [2, 3])
def test_hand_written_numpy_model_trains_data_parallel(k):
    r = run_mpi(k, str(EXAMPLES / "numpy_model.py"), "--steps", "150", "--synthetic", timeout=180)
    assert r.returncode == 0, r.stderr
    assert f"with k={k}; replicas identical" in r.stdout
    assert float(r.stdout.split("training accuracy on 2,000 samples ")[1].split()[0]) > 0.8
