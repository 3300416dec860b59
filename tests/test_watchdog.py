"""The stall watchdog: it names the ranks that have not reached a collective, and aborts when asked.

Serial tests launch a small MPI script where one rank sleeps before an
all-reduce; MPI tests check the quiet path (no report, the duplicate
communicator freed).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import ROOT, run_mpi

pytestmark = pytest.mark.alone  # times jobs or waits for them: run apart (pytest.ini)


@pytest.fixture(autouse=True)
def _serial_only(request: pytest.FixtureRequest) -> None:
    """Tests that launch their own mpiexec must not run once per rank under mpiexec."""
    if request.config.getoption("--with-mpi", default=False) and request.node.get_closest_marker("mpi") is None:
        pytest.skip("launches its own mpiexec: serial runs only")

SCRIPT = """
import sys, time
import numpy as np
from mpi4py import MPI
sys.path.insert(0, {root!r})
from mpisgd.watchdog import Watchdog

late_rank, sleep_s, timeout_s, abort = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
comm = MPI.COMM_WORLD
wd = Watchdog(comm, timeout_s, abort)
buf = np.ones(1000)
for step in range(6):
    if step == 3 and comm.Get_rank() == late_rank:
        time.sleep(sleep_s)
    wd.enter(f"gradient all-reduce of step {{step}}")
    comm.Allreduce(MPI.IN_PLACE, buf)
    wd.exit()
wd.close()
print(f"rank {{comm.Get_rank()}} done", flush=True)
"""


def _launch(tmp_path: Path, n: int, *, late_rank: int, sleep_s: float, timeout_s: float, abort: bool,
            limit_s: float = 120):
    script = tmp_path / "stall.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    t0 = time.monotonic()
    proc = run_mpi(n, str(script), str(late_rank), str(sleep_s), str(timeout_s), "1" if abort else "0",
                   timeout=limit_s)
    return proc, time.monotonic() - t0


def test_stall_names_the_late_rank_and_recovers(tmp_path: Path) -> None:
    proc, _ = _launch(tmp_path, 3, late_rank=1, sleep_s=5.0, timeout_s=2.0, abort=False)
    assert proc.returncode == 0, proc.stderr
    assert "stall: gradient all-reduce of step 3 waited" in proc.stderr
    assert "ranks [0, 2] reached it, ranks [1] have not" in proc.stderr
    assert "stall resolved: gradient all-reduce of step 3" in proc.stderr
    assert proc.stderr.count("mpisgd: stall:") == 1, proc.stderr  # reported once, by rank 0
    assert proc.stdout.count("done") == 3


def test_stall_of_rank_0_is_reported_by_its_thread(tmp_path: Path) -> None:
    proc, _ = _launch(tmp_path, 2, late_rank=0, sleep_s=3.0, timeout_s=1.0, abort=False)
    assert proc.returncode == 0, proc.stderr
    assert "ranks [1] reached it, ranks [0] have not" in proc.stderr


def test_stall_abort_ends_the_job_promptly(tmp_path: Path) -> None:
    # rank 2 would sleep 100 s; the watchdog must end the job after about 1 s instead
    proc, elapsed = _launch(tmp_path, 3, late_rank=2, sleep_s=100.0, timeout_s=1.0, abort=True, limit_s=90)
    assert proc.returncode != 0
    assert "ranks [0, 1] reached it, ranks [2] have not" in proc.stderr
    assert "aborts the job (--stall-abort)" in proc.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s to end the job"
    assert "done" not in proc.stdout


DP_SCRIPT = """
import sys, time
import numpy as np
from mpi4py import MPI
sys.path.insert(0, {root!r})
import mpisgd
from mpisgd.watchdog import Watchdog

comm = MPI.COMM_WORLD
model = mpisgd.nn.mlp((8,)).materialize(np, "float64", seed=0)
wd = Watchdog(comm, 1.0)
dp = mpisgd.DataParallel(model, mpisgd.SGD(model.flat), comm, watchdog=wd)
rng = np.random.default_rng(comm.Get_rank())
x, y = rng.standard_normal((4, 784)), rng.integers(0, 10, 4)
for step in range(4):
    if step == 2 and comm.Get_rank() == 1:
        time.sleep(3.0)  # between steps: the others wait in the next step's first collective
    dp.train_step([(x, y)], lr=0.1)
dp.close()
print(f"rank {{comm.Get_rank()}} done", flush=True)
"""


def test_a_rank_late_between_steps_is_named(tmp_path: Path) -> None:
    """The first collective of a step (the check-in) is watched too, not only the gradient all-reduce."""
    script = tmp_path / "late_step.py"
    script.write_text(DP_SCRIPT.format(root=str(ROOT)))
    proc = run_mpi(2, str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stall: step check-in of step 2 waited" in proc.stderr, proc.stderr
    assert "ranks [0] reached it, ranks [1] have not" in proc.stderr, proc.stderr
    assert proc.stdout.count("done") == 2


CLOSE_SCRIPT = """
import sys, time
import numpy as np
from mpi4py import MPI
sys.path.insert(0, {root!r})
from mpisgd.watchdog import Watchdog

comm = MPI.COMM_WORLD
wd = Watchdog(comm, 1.0, sys.argv[1] == "1")
wd.enter("gradient all-reduce of step 0")
comm.Allreduce(MPI.IN_PLACE, np.ones(4))
wd.exit()
if comm.Get_rank() == 1:
    time.sleep(float(sys.argv[2]))  # after the last collective: rank 0 waits for it in close()
wd.close()
print(f"rank {{comm.Get_rank()}} done", flush=True)
"""


@pytest.mark.parametrize("abort", [False, True])
def test_a_rank_late_to_close_is_named(tmp_path: Path, abort: bool) -> None:
    """Rank 0's close() waits for every rank: a rank that stops after the last collective is named too,
    and with abort the job ends instead of hanging in close()."""
    script = tmp_path / "late_close.py"
    script.write_text(CLOSE_SCRIPT.format(root=str(ROOT)))
    t0 = time.monotonic()
    proc = run_mpi(2, str(script), "1" if abort else "0", "100" if abort else "3", timeout=90)
    assert "stall: shutdown (every rank closing the watchdog) waited" in proc.stderr, proc.stderr
    assert "ranks [0] reached it, ranks [1] have not" in proc.stderr, proc.stderr
    if abort:
        assert proc.returncode != 0 and "aborts the job (--stall-abort)" in proc.stderr
        assert time.monotonic() - t0 < 30
    else:
        assert proc.returncode == 0, proc.stderr
        assert "stall resolved: shutdown" in proc.stderr
        assert proc.stdout.count("done") == 2


def test_bounds_must_be_non_negative_numbers() -> None:
    """0 is "no report" (--stall-timeout-s 0) or "never abort" (--stall-abort-s 0); below 0 or NaN is refused
    before anything is made."""
    from mpisgd.watchdog import Watchdog

    for timeout_s, abort_after_s in ((-1.0, 0.0), (float("nan"), 0.0), (1.0, -5.0)):
        with pytest.raises(ValueError, match=">= 0"):
            Watchdog(object(), timeout_s, abort_after_s=abort_after_s)


@pytest.mark.mpi(min_size=2)
def test_no_report_without_stall_and_the_duplicate_freed(capfd: pytest.CaptureFixture[str]) -> None:
    import numpy as np
    from mpi4py import MPI

    from mpisgd.watchdog import Watchdog

    comm = MPI.COMM_WORLD
    wd = Watchdog(comm, timeout_s=30.0)
    assert wd.comm != comm  # a duplicate
    summed = 0.0
    for i in range(200):
        buf = np.ones(10)
        wd.enter(f"all-reduce {i}")
        comm.Allreduce(MPI.IN_PLACE, buf)
        wd.exit()
        summed += buf.sum()
    wd.close()
    assert wd.comm == MPI.COMM_NULL  # freed
    assert "stall" not in capfd.readouterr().err
    assert summed == 200 * 10 * comm.Get_size()  # every all-reduce completed


@pytest.mark.mpi(min_size=2)
def test_close_does_not_wait_out_the_threads_poll() -> None:
    """close() wakes the thread: with a poll of 5 s, the old sleep made every close wait up to two polls
    (rank 0 hears the others' "close" one poll after they send it)."""
    import time

    from mpi4py import MPI

    from mpisgd.watchdog import Watchdog

    wd = Watchdog(MPI.COMM_WORLD, timeout_s=300.0)
    wd._poll_s = 5.0  # as if configured so; the thread reads it at its next sleep
    time.sleep(0.3)  # the thread is in that sleep now
    MPI.COMM_WORLD.Barrier()
    t0 = time.monotonic()
    wd.close()
    took = time.monotonic() - t0
    assert took < 2.5, f"close took {took:.2f} s"


SKIP_SCRIPT = """
import sys
import numpy as np
from mpi4py import MPI
sys.path.insert(0, {root!r})
import mpisgd

comm = MPI.COMM_WORLD
avg = mpisgd.GradientAverager(comm, stall_timeout_s=1.0, stall_abort_s=4.0)  # the defaults are 300 and 1800
avg.average_([np.ones(10)])
if comm.Get_rank() == 0:
    avg.average_([np.ones(10)])  # rank 1 skips this call: without the watchdog rank 0 would wait for ever
print(f"rank {{comm.Get_rank()}} past", flush=True)
import time; time.sleep(60)
"""


def test_the_library_names_a_rank_that_skips_a_call_and_ends_the_job(tmp_path: Path) -> None:
    """GradientAverager watches its collectives by default: rank 1 never comes to the second call, rank 0
    names it after stall_timeout_s and the job ends after stall_abort_s instead of hanging."""
    script = tmp_path / "skip.py"
    script.write_text(SKIP_SCRIPT.format(root=str(ROOT)))
    t0 = time.monotonic()
    proc = run_mpi(2, str(script), timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "ranks [1] have not" in proc.stderr and "--stall-abort-s" in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 40, f"{elapsed:.0f} s"
