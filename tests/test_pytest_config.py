"""The suite cannot pass without testing: pytest.ini requires pytest-mpi and the markers it knows.

Without pytest-mpi, pytest ignores ``@pytest.mark.mpi(min_size=2)`` and runs those tests in one
process, where a collective over one rank reduces nothing and the test passes. Each case below runs
pytest on a small file in a directory holding a copy of the repository's pytest.ini.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_env, serial_only

pytestmark = serial_only

PROBE = """
import pathlib
import pytest


@pytest.mark.mpi(min_size=2)
def test_needs_two_ranks():
    pathlib.Path("ran").write_text("at one rank")  # the evidence that it ran
"""


def pytest_in(tmp_path: Path, *args: str, ini: bool = True, env: dict[str, str] | None = None,
              probe: str = PROBE) -> tuple[subprocess.CompletedProcess, bool]:
    """Run pytest on the probe in tmp_path (with the repository's pytest.ini unless ini=False);
    returns the result and whether the probe's test body ran."""
    if ini:
        shutil.copy(ROOT / "pytest.ini", tmp_path / "pytest.ini")
    else:
        (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_probe.py").write_text(probe)
    r = subprocess.run([sys.executable, "-m", "pytest", "test_probe.py", "-q", "-p", "no:cacheprovider", *args],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**clean_env(), **(env or {})})
    return r, (tmp_path / "ran").exists()


def test_with_pytest_mpi_the_serial_pass_skips_mpi_tests(tmp_path: Path) -> None:
    r, ran = pytest_in(tmp_path)
    assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout + r.stderr
    assert not ran


@pytest.mark.parametrize("how", ["-p no:pytest_mpi", "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1"])
def test_without_pytest_mpi_pytest_refuses_to_run(tmp_path: Path, how: str) -> None:
    args, env = (how.split(), None) if how.startswith("-p") else ((), dict([how.split("=")]))
    r, ran = pytest_in(tmp_path, *args, env=env)
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, r.stdout + r.stderr
    assert "Missing required plugins: pytest-mpi" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not ran


def test_without_the_configuration_the_mpi_test_would_run_at_one_rank(tmp_path: Path) -> None:
    """The control: what pytest.ini prevents (so the probe above does detect a one-rank run)."""
    r, ran = pytest_in(tmp_path, "-p", "no:pytest_mpi", ini=False)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
    assert ran


def test_a_misspelt_marker_is_an_error(tmp_path: Path) -> None:
    r, ran = pytest_in(tmp_path, probe=PROBE.replace("mark.mpi(", "mark.mpl("))
    assert r.returncode != 0 and "'mpl' not found in `markers`" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not ran
