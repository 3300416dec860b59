"""Shared fixtures. MPI tests carry @pytest.mark.mpi and run under mpiexec with --with-mpi;
tests that launch their own mpiexec are ordinary serial tests."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import io
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Debian's Open MPI with its mpi4py and NumPy (scripts/install.sh openmpi): the checkout's .openmpi-env unless
# $MPISGD_OPENMPI_ENV names another; scripts/test.sh installs it first and sets the variable, and then the
# tests that launch jobs in it fail where it is missing instead of leaving its machines out
OPENMPI_ENV = Path(os.environ.get("MPISGD_OPENMPI_ENV") or ROOT / ".openmpi-env")


def openmpi_env() -> Path | None:
    """The Open MPI environment, or None where it is not installed (and not required)."""
    if (OPENMPI_ENV / "bin" / "mpiexec").exists():
        return OPENMPI_ENV
    if os.environ.get("MPISGD_OPENMPI_ENV"):
        pytest.fail(f"MPISGD_OPENMPI_ENV={OPENMPI_ENV} has no bin/mpiexec: bash scripts/install.sh openmpi")
    return None


def run_openmpi(debian: Path, n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``mpiexec -n n python args...`` in the Open MPI environment ``debian`` (:func:`openmpi_env`): its
    launcher and its Python, this checkout's mpisgd, one BLAS thread per rank."""
    bin_dir = debian / "bin"
    env = {**clean_env(), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return subprocess.run([str(bin_dir / "mpiexec"), "--oversubscribe", "-n", str(n), str(bin_dir / "python"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
# under mpiexec (pytest-mpi), the job's size; a test that starts its own processes runs once, serially
RANKS = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
serial_only = pytest.mark.skipif(RANKS > 1, reason="starts its own processes: run in the serial pass")
LAUNCHER_MARK = ("a serial test whose job the MPI launcher is part of (an abort, a signal, the watchdog, an MPMD "
                 "launch, the exit code mpiexec returns): scripts/test_openmpi.sh runs it again under Open MPI's")


def launches(test: Callable) -> Callable:
    """Mark a test that starts its own mpiexec job and checks what the launcher does with it: serial only,
    and run again under Open MPI's launcher (the ``launcher`` marker)."""
    return pytest.mark.launcher(serial_only(test))
_SESSION_START = time.time()
T = TypeVar("T")


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


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (the test modules, NumPy, PyTorch: some 240,000 objects) lives as long as the
    session: frozen out of the garbage collector's reach, so that each full collection (an automatic one,
    or train_here's after a failed set-up) scans only what the tests made, 0.01 s, not 0.14 s."""
    gc.freeze()


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



@dataclass(frozen=True)
class Outcome:
    """How an in-process run of the training CLI ended (:func:`train_here`), the same on every rank."""

    status: int  # what ``python -m mpisgd.train`` would have exited with (0, 1, 2, 75)
    out: str  # rank 0's stdout
    err: str  # rank 0's stderr
    statuses: tuple[int, ...]  # every rank's status, in rank order
    outs: tuple[str, ...] = ()  # every rank's stdout, in rank order (only rank 0 should print)

    @property
    def error(self) -> str:
        """The one error line (asserting there is exactly one and no traceback, and that every rank
        returned the same status)."""
        lines = [x for x in (self.out + self.err).splitlines() if "mpisgd: error" in x]
        assert len(lines) == 1 and "Traceback" not in self.out + self.err, (self.statuses, self.out, self.err)
        assert len(set(self.statuses)) == 1, self.statuses
        return lines[0]


class Crash:
    """Hooks for :func:`train_here`: every rank stops at global step ``step`` (before its compute), as a
    job killed there would; the run's state is what a checkpoint before that step holds."""

    def __init__(self, step: int) -> None:
        self.step = step

    def before_step(self, step: int, rank: int) -> None:
        if step == self.step:
            from mpisgd.agreement import AgreedError

            raise AgreedError(f"crashed on purpose at step {step}", exit_code=1)


@functools.cache
def _synthetic(*args, **kwargs):
    """mpisgd.data.synthetic's set, made once per arguments in this process, read-only (a run that wrote into
    it would fail, not spoil the next run's data)."""
    from mpisgd.data import synthetic

    made = synthetic(*args, **kwargs)
    made.images.setflags(write=False)
    made.labels.setflags(write=False)
    return made


@contextlib.contextmanager
def _made_once(target: str):
    """In-process runs share their synthetic data sets (drawing them is a third of a short run's time)."""
    from unittest import mock

    with mock.patch(target, _synthetic):
        yield


def mpi_first(cases: list) -> list:
    """Cases for ``pytest.mark.parametrize`` of a refusal whose message does not depend on k: the first runs
    in the MPI passes (every rank's exit code at k = 2 and 3), the others in the
    serial pass, in this process at k = 1 (the test must be written collectively: shared_tmp, root_makes)."""
    args = [c if isinstance(c, tuple) else (c,) for c in cases]
    return [pytest.param(*a, marks=pytest.mark.mpi) if i == 0 else pytest.param(*a) for i, a in enumerate(args)]


def root_makes(make: Callable[[], T]) -> T:
    """``make()`` on rank 0 only (inputs written into ``shared_tmp``), its result on every rank (collective:
    the others wait until it is made; an exception on rank 0 is raised on every rank)."""
    comm = world()
    result, error = None, None
    if comm.Get_rank() == 0:
        try:
            result = make()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    result, error = comm.bcast((result, error), root=0)
    if error is not None:
        raise error
    return result


def train_here(argv: list[str] | tuple[str, ...], comm=None, hooks=None) -> Outcome:
    """``python -m mpisgd.train ARGV`` in this process, on ``comm`` (default: this job's ranks; one in the
    serial pass), through the CLI's own code: the options parsed and agreed, ``mpisgd.app.train.run``
    (set-up, the loop, the shutdown), an error every rank raises reported as the CLI reports it (rank 0's
    one line, the exit code). Collective. ``hooks`` replace the environment's injected failures
    (e.g. :class:`Crash`). An error on one rank alone propagates (the CLI would MPI_Abort)."""
    from mpisgd.agreement import agree
    from mpisgd.app import train as cli
    from mpisgd.app.options import parse_config
    from mpisgd.errors import UsageError

    comm = comm if comm is not None else world()
    rank = comm.Get_rank()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _made_once("mpisgd.app.run.synthetic"):
        cfg, error, status = None, None, None
        try:
            cfg = parse_config(list(argv), quiet=rank != 0)
        except UsageError as exc:
            error = exc
        except SystemExit as exc:  # --help: printed by rank 0, every rank leaves
            status = int(exc.code or 0)
        if status is None:
            try:
                agree(comm, error)
                status = cli.run(cfg, comm, None, hooks=hooks)
            except cli._errors_every_rank_raises() as exc:
                status = cli._report(exc, comm)
    statuses = tuple(comm.allgather(status))
    outs = tuple(comm.allgather(out.getvalue()))
    err_0 = comm.bcast(err.getvalue(), root=0)
    return Outcome(status, outs[0], err_0, statuses, outs)


def rank_pids(tag: str, program: str = "mpisgd.train") -> dict[int, int]:
    """{rank: pid} of the live ``program`` processes (python -m PROGRAM) whose environment carries
    MPISGD_TEST_TAG=tag, by MPICH's PMI_RANK or Open MPI's rank (the launcher itself and zombies left out)."""
    found: dict[int, int] = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            raw = environ.read_bytes()
            if f"MPISGD_TEST_TAG={tag}".encode() not in raw:
                continue
            env = dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)
            argv = Path(environ.parent, "cmdline").read_bytes().split(b"\0")
            state = Path(environ.parent, "stat").read_text().split(") ")[1][0]
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        rank = env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK"))
        if rank is not None and program.encode() in argv and state != "Z" and b"mpiexec" not in argv[0]:
            found[int(rank)] = int(environ.parent.name)
    return found


def drop(args: tuple[str, ...] | list[str], *flags: str) -> list[str]:
    """``args`` without ``flags`` and their values (``--hidden 32`` for a model of one's own, which does not
    read it: mpisgd.train refuses an option the run would not read)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


# python -m mpisgd.train's options for a small, quick run on synthetic data (add --max-steps or --epochs)
TINY = ("--dataset", "synthetic", "--synthetic-samples", "2048", "--hidden", "32", "--progress", "off")


def clean_env() -> dict[str, str]:
    """This environment without the MPI launcher's variables: when pytest itself runs under mpiexec,
    a child that imports mpisgd (hence mpi4py.MPI) would otherwise try the parent's PMI connection."""
    launcher = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD", "MPIR_CVAR_")
    return {k: v for k, v in os.environ.items() if not k.startswith(launcher)} | ONE_THREAD


def is_png(path: Path) -> bool:
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def torch_one_thread():
    """PyTorch on one thread for the test (ranks share the cores), its thread count put back after."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def shared_tmp(tmp_path: Path) -> Path:
    """A directory every rank of the job names alike (rank 0's tmp_path): the options of a run must be the
    same on every rank, paths included. Only rank 0 should write into it before a run (then ``barrier``)."""
    return Path(world().bcast(str(tmp_path), root=0)) if RANKS > 1 else tmp_path


@pytest.fixture
def own_module(shared_tmp: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a module of one's own into shared_tmp (rank 0), importable as the CLI's working directory
    would make it; forgotten afterwards, so that the next test's module of that name is imported anew."""

    def write(name: str, source: str) -> None:
        root_makes(lambda: (shared_tmp / f"{name}.py").write_text(source))
        monkeypatch.syspath_prepend(str(shared_tmp))
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.invalidate_caches()
        names.append(name)

    names: list[str] = []
    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def mpirun():
    return run_mpi


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under mpiexec, ranks > 0 write their report to a log and their own junit file.

    Rank 0's console stays readable; a failure on another rank still fails that
    rank's pytest, hence mpiexec's exit code, and scripts/junit_summary.py shows its log.
    """
    config.addinivalue_line("markers", f"launcher: {LAUNCHER_MARK}")
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

        # lives as long as the session, written line by line: it is never closed, and the collector may not
        # finalize it at exit (pytest_collection_finish freezes what the session made before its tests)
        reporter._tw = TerminalWriter(open(log, "w", buffering=1))  # noqa: SIM115


# The serial pass's longest tests (10 to 40 s each, from its --durations): run first. pytest-xdist hands the
# tests to its workers in collection order, and these, collected late, left one worker idle at the end.
LONGEST_FIRST = ("tests/test_machines.py::test_the_portable_level_gives_one_state_on_every_machine",
                 "tests/test_torch_cli.py::", "tests/test_gpu_check.py::", "tests/test_torch_examples.py::",
                 "tests/test_comm.py::test_comm_suites_at_four_ranks", "tests/test_slurm.py::",
                 "tests/test_benchmarks.py::test_throughput_benchmark_smoke_run", "tests/test_experiments.py::")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first (LONGEST_FIRST; a stable sort, the same on every worker). The check that the
    tests' own jobs run the expected MPI library (tests/test_mpi_library.py's serial test) is a launcher
    test too: the Open MPI pass selects it with the others (``-m launcher``)."""
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))
    for item in items:
        if item.nodeid.startswith("tests/test_mpi_library.py::") and item.get_closest_marker("mpi") is None:
            item.add_marker(pytest.mark.launcher)


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
