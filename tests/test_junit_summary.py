"""scripts/junit_summary.py's closing line: real skips counted, the serial run's skips of MPI tests (which
the runs under mpiexec run) said apart."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0"
skipped="3" tests="5"><testcase name="a"/><testcase name="b"/>
<testcase name="c"><skipped type="pytest.skip" message="need --with-mpi option to run">x</skipped></testcase>
<testcase name="d"><skipped type="pytest.skip" message="need --with-mpi option to run">x</skipped></testcase>
<testcase name="e"><skipped type="pytest.skip" message="no GPU: CuPy is not installed">x</skipped></testcase>
</testsuite></testsuites>"""


def test_skips_left_to_mpiexec_are_not_counted_as_skipped(tmp_path):
    (tmp_path / "serial.xml").write_text(REPORT)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "junit_summary.py"), str(tmp_path / "serial.xml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "2 passed, 0 failed, 1 skipped"
    assert lines[-2].startswith("(2 MPI tests skipped by the serial run are left to mpiexec")
