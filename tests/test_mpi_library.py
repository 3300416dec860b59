"""Which MPI library the suite runs on. scripts/test.sh's Open MPI passes set MPISGD_TEST_MPI_LIBRARY to
"Open MPI": a pass that silently ran another library (an mpi4py or an mpiexec from another environment)
fails here instead of testing MPICH twice. Without the variable any one library will do."""

from __future__ import annotations

import os

import pytest
from conftest import run_mpi, serial_only

EXPECTED = os.environ.get("MPISGD_TEST_MPI_LIBRARY", "")
PROBE = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
         "libs = c.gather(MPI.Get_library_version().replace(chr(0), '').splitlines()[0]); "
         "c.Get_rank() == 0 and print(c.Get_size(), *sorted(set(libs)), sep=chr(10))")


@pytest.mark.mpi(min_size=1)
def test_every_rank_runs_the_expected_mpi_library():
    from mpi4py import MPI

    libs = MPI.COMM_WORLD.allgather(MPI.Get_library_version().replace("\0", "").splitlines()[0])
    assert len(set(libs)) == 1, libs
    assert libs[0].startswith(EXPECTED), f"this pass expects {EXPECTED!r}; the ranks run {libs[0]!r}"


@serial_only
def test_the_tests_own_jobs_run_the_expected_mpi_library():
    """The mpiexec and the interpreter the tests launch (conftest.mpiexec_cmd) belong together and to the
    expected library: a launcher of another library would start two singletons of size 1."""
    r = run_mpi(2, "-c", PROBE, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    size, *libs = r.stdout.splitlines()  # one world of 2 prints "2" and its one library, once
    assert size == "2" and len(libs) == 1, r.stdout
    assert libs[0].startswith(EXPECTED), f"this pass expects {EXPECTED!r}; the launched ranks run {libs[0]!r}"
