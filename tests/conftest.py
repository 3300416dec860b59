"""Shared fixtures. MPI tests carry @pytest.mark.mpi and run under mpiexec with --with-mpi;
tests that launch their own mpiexec are ordinary serial tests."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# under mpiexec (pytest-mpi), the job's size; a test that starts its own processes runs once, serially
RANKS = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
serial_only = pytest.mark.skipif(RANKS > 1, reason="starts its own processes: run in the serial pass")
_SESSION_START = time.time()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite aborts MPI jobs on purpose, and MPICH then leaves a file in /dev/shm (about a dozen,
    30 MiB, per run of scripts/test.sh): remove those made during this session that no process holds
    (scripts/clean_shm.py), so that test runs do not fill a node's tmpfs."""
    for path in script("scripts", "clean_shm").leftovers(Path("/dev/shm"), "mpich_shm_*"):
        try:
            if path.stat().st_mtime >= _SESSION_START:
                path.unlink()
        except OSError:  # another rank's session removed it first
            continue


os.environ.setdefault("MPISGD_TUNING_FILE", "off")  # auto measures afresh in tests: no choice from earlier runs
DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint64"]


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def local_values(n: int, dtype: str, rank: int):
    """Small integers: sums are exact in every dtype, so any difference is a bug, not rounding."""
    import numpy as np

    return ((np.arange(n) * 7 + 3 * rank + 1) % 11).astype(dtype)


def oracle(comm, x):
    """MPI_Allreduce's answer; where the library has no SUM for the dtype (float16 outside MPICH), the
    exact sum of the gathered inputs (they are small integers)."""
    import numpy as np

    from mpisgd.comm import MpiReducer
    from mpisgd.comm.mpi import mpi_sum_type

    if mpi_sum_type(x.dtype) is None:
        return np.sum(comm.allgather(x), axis=0, dtype=np.int64).astype(x.dtype)
    y = x.copy()
    red = MpiReducer(comm)
    red.allreduce_(y)
    red.close()
    return y


def gathered(comm, failures: list) -> list:
    """Every rank's failures (collective), so each rank asserts on the whole picture."""
    return [f for per_rank in comm.allgather(failures) for f in per_rank]


def rank_order_sum(comm, x):
    """x0 + x1 + ... + x(k-1), elementwise, in x's dtype (collective): the deterministic order, which
    the direct and shared-memory reductions use too."""
    parts = comm.allgather(x)
    acc = parts[0].copy()
    for p in parts[1:]:
        acc += p
    return acc


@functools.cache
def _launcher_is_open_mpi(exe: str) -> bool:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return "Open MPI" in out or "OpenRTE" in out


def open_mpi_launcher() -> bool:
    """Whether the mpiexec on PATH, the one the tests launch, is Open MPI's (scripts/test_openmpi.sh)."""
    exe = shutil.which("mpiexec")
    return exe is not None and _launcher_is_open_mpi(exe)


def mpiexec_cmd(n: int, *args: str) -> list[str]:
    """An mpiexec command line for n ranks running `python args...` (MPICH or Open MPI), this interpreter."""
    exe = shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpiexec on PATH")
    cmd = [exe, "-n", str(n)]
    if _launcher_is_open_mpi(exe):
        cmd += ["--oversubscribe"]  # Open MPI counts cores as slots: k = 3 on two cores needs it
    return cmd + [sys.executable, *args]


def run_mpi(n: int, *args: str, timeout: float = 300, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run `mpiexec -n n python args...`, one BLAS thread per rank, with a hard timeout."""
    full_env = {**os.environ, **ONE_THREAD, "OMPI_ALLOW_RUN_AS_ROOT": "1",
                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(env or {})}
    return subprocess.run(mpiexec_cmd(n, *args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd)



def clean_env() -> dict[str, str]:
    """This environment without the MPI launcher's variables: when pytest itself runs under mpiexec,
    a child that imports mpisgd (hence mpi4py.MPI) would otherwise try the parent's PMI connection."""
    launcher = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD", "MPIR_CVAR_")
    return {k: v for k, v in os.environ.items() if not k.startswith(launcher)} | ONE_THREAD


def is_png(path: Path) -> bool:
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def mpirun():
    return run_mpi


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under mpiexec, ranks > 0 write their report to a log and their own junit file.

    Rank 0's console stays readable; a failure on another rank still fails that
    rank's pytest, hence mpiexec's exit code, and scripts/junit_summary.py shows its log.
    """
    if not config.getoption("--with-mpi", default=False):
        return
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        return
    xml = getattr(config.option, "xmlpath", None)
    if xml:
        config.option.xmlpath = f"{xml}.rank{rank}"
        junit = config.stash.get(_junit_key(), None)
        if junit is not None:
            junit.logfile = config.option.xmlpath
    log = f"{xml or 'results/tmp/pytest'}.rank{rank}.log"
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        from _pytest.terminal import TerminalWriter

        reporter._tw = TerminalWriter(open(log, "w"))  # noqa: SIM115 - lives as long as the session


def _junit_key():
    from _pytest.junitxml import xml_key

    return xml_key


def step_peak_bytes(opt, flat, lrs=(0.1, 0.2)) -> int:
    """The peak bytes Python allocated over ``opt.step(lr)`` for each of ``lrs`` (a first step, with its
    one-time allocations, runs before the measurement); the gradient is 0.5 everywhere."""
    flat.grads[...] = 0.5
    opt.step(lrs[0])
    tracemalloc.start()
    try:
        for lr in lrs:
            flat.grads[...] = 0.5
            opt.step(lr)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A real file system that fills up: a tmpfs of ``size`` (e.g. "8k") mounted on ``path`` (made here),
    unmounted afterwards; the test is skipped where it cannot be mounted (root is needed)."""
    path.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (root needed): {mounted.stderr.strip()}")
    try:
        yield path
    finally:  # lazily where a file is still open (a thread the test gave up on): never leave it mounted
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def script(folder: str, name: str):
    """The module ``name`` of the repository's ``folder`` (benchmarks/, experiments/, scripts/: not packages)."""
    sys.path.insert(0, str(ROOT / folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
