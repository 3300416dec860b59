"""The auto policy under mpiexec (-n 2 and -n 3; test_comm.py runs it at k = 4): each size class is
decided once, on every rank alike; the tuning file records where each choice came from and is trusted,
re-checked or re-measured by rule; it is saved at tune() and close() only and never damages what is at
its path; deterministic keeps the node-shared buffer. The timings are injected wherever a test asserts a
choice, so no assert depends on this machine's speed. Every collective is reached by all ranks before
any assert. The tuning file's rules without MPI: test_comm_auto_tuning.py."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from conftest import world

from mpisgd.comm import AutoReducer, DeterministicReducer, create_reducer
from mpisgd.comm import auto as auto_module
from mpisgd.comm import tuning as tuning_module
from mpisgd.comm.auto import RECHECK_TRIALS, trials_for
from mpisgd.comm.base import chunk_counts
from mpisgd.comm.shared import SharedOp
from mpisgd.comm.tuning import FORMAT, stamp

pytestmark = pytest.mark.mpi(min_size=2)
DAY = 86400.0


class FakeTimer:
    """Stands in for AutoReducer._time_calls: no call is made; each comparison returns the medians
    ``medians(buffer timed)`` gives (seconds, (mpi, ring)), with no spread, and is recorded as
    (bytes of the buffer timed, trials)."""

    def __init__(self, medians, overload: float | None = 0.0) -> None:
        self.medians = medians if callable(medians) else (lambda buf: medians)
        self.overload = overload
        self.calls: list[tuple[int, int]] = []

    def __call__(self, run, sync_on, trials):
        self.calls.append((sync_on.nbytes, trials))
        mpi, ring = self.medians(sync_on)
        return np.array([[mpi] * trials, [ring] * trials]), self.overload


MPI_FASTER, RING_FASTER = (1e-5, 3e-5), (3e-5, 1e-5)  # clear margins (3x)


def shared_dir(comm, tmp_path):
    return comm.bcast(tmp_path if comm.Get_rank() == 0 else None)


def tuning_key(comm) -> str:
    probe = AutoReducer(comm, tuning_file="off")
    key = probe.tuning_key
    probe.close()
    return key


def write_tuning(comm, path, entries: dict, doc=None) -> None:
    """Rank 0 writes a tuning file holding ``entries`` for this configuration (or ``doc`` as it is)."""
    key = tuning_key(comm)
    if comm.Get_rank() == 0:
        doc = doc if doc is not None else {"format": FORMAT, "configurations": {key: entries}}
        path.write_text(json.dumps(doc))
    comm.Barrier()


def entry(choice: str, age_days: float = 0.0, ratio: float = 3.0, spread: float = 0.0,
          overload: float | None = 0.0) -> dict:
    return {"choice": choice, "measured": stamp(time.time() - age_days * DAY), "ratio": ratio,
            "spread": spread, "overload": overload, "median_us": {"mpi": 10.0, "ring": 10.0 * ratio}, "trials": 11}


def saved(comm, path) -> dict:
    """This configuration's entries in the tuning file, as rank 0 reads them (broadcast)."""
    key = tuning_key(comm)
    doc = json.loads(path.read_text()) if comm.Get_rank() == 0 else None
    return comm.bcast(doc, root=0)["configurations"][key]


# -- deciding -------------------------------------------------------------------------------------
def test_each_size_class_is_decided_once_by_the_measured_figures_on_every_rank(monkeypatch):
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm, tuning_file="off")
    # the ring for 4 B, the reverse of any real machine: only the timings can have chosen it
    timer = FakeTimer(lambda buf: RING_FASTER if buf.nbytes == 4 else MPI_FASTER)
    monkeypatch.setattr(red, "_time_calls", timer)
    results = []
    for n in (1, 1, 3, 2, 300, 257, 300, 5):  # classes: 4 B; 8-15 B twice (3 and 2); 1-2 KiB twice (300, 257)
        x = np.full(n, r + 1, dtype="float32")
        red.allreduce_(x)
        results.append(bool((x == k * (k + 1) / 2).all()))
    y = np.full(300, r, dtype="float32")
    red.allreduce(np.full(300, r, dtype="float32"), y)  # out of place: the same class, no new measurement
    choices, origin, summary = dict(red.choices), dict(red.origin), red.choices_summary()
    red.close()
    assert all(results) and bool((y == k * (k - 1) / 2).all())
    assert timer.calls == [(4, 11), (12, 11), (1200, 11), (20, 11)]
    assert choices == {"allreduce float32:3": "ring", "allreduce float32:4": "mpi", "allreduce float32:11": "mpi",
                    "allreduce float32:5": "mpi"}
    assert set(origin.values()) == {"measured"}
    assert len({json.dumps(p, sort_keys=True) for p in comm.allgather(choices)}) == 1
    assert summary == "float32 ring 4 B-8 B, mpi 8 B-32 B, mpi 1 KiB-2 KiB"


def test_the_slowest_rank_decides_so_every_rank_picks_alike(monkeypatch):
    """Rank 0 alone sees the ring faster; on every other rank mpi is faster by more: the maximum of the
    medians over ranks makes mpi the choice everywhere."""
    comm = world()
    red = AutoReducer(comm, tuning_file="off")
    monkeypatch.setattr(red, "_time_calls", FakeTimer((2e-5, 1e-5) if comm.Get_rank() == 0 else (1e-5, 4e-5)))
    red.tune([np.ones(100)])  # decides only: ranks that chose apart would fail here, not hang in a call
    every = comm.allgather(dict(red.choices))
    red.close()
    assert all(p == {"allreduce float64:10": "mpi"} for p in every)


def test_tune_decides_for_nonblocking_buffers_before_they_start(monkeypatch):
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm, tuning_file="off")
    timer = FakeTimer(lambda buf: RING_FASTER if buf.nbytes > 1000 else MPI_FASTER)
    monkeypatch.setattr(red, "_time_calls", timer)
    bufs = [np.full(n, r + 1, dtype="float32") for n in (100, 70_000)]
    red.tune(bufs)
    decided, calls = dict(red.choices), list(timer.calls)
    monkeypatch.setattr(red, "_time_calls", lambda *a: pytest.fail("measured in the middle of a step"))
    handles = [red.start(b) for b in bufs]
    for h in handles:
        h.wait()
    red.close()
    assert decided == {"allreduce float32:9": "mpi", "allreduce float32:19": "ring"}
    assert calls == [(400, trials_for(400)), (280_000, trials_for(280_000))]
    assert all(bool((b == k * (k + 1) / 2).all()) for b in bufs)  # tune() left the data as it was


def test_reduce_scatter_follows_its_own_measured_choices(monkeypatch):
    """tune(reduce_scatter=True) decides reduce-scatter classes apart from all-reduce ones; each call then
    goes to the strategy its class chose (the ring's is an all-reduce and a copy) and gives this rank's
    chunk of the sum; a class not tuned is decided at its first call."""
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm, tuning_file="off")
    timer = FakeTimer(lambda buf: RING_FASTER if buf.dtype == np.float32 else MPI_FASTER)
    monkeypatch.setattr(red, "_time_calls", timer)
    ran = []
    for name in ("mpi", "ring"):
        inner = getattr(red, name)
        real = inner.start_reduce_scatter
        monkeypatch.setattr(inner, "start_reduce_scatter",
                            lambda b, o, c, name=name, real=real: ran.append(name) or real(b, o, c))
    bufs = [np.full(n, r + 1, dtype=d) for n, d in ((5000, "float32"), (3000, "float64"))]
    red.tune(bufs, reduce_scatter=True)
    tuned, calls = dict(red.choices), len(timer.calls)
    ran.clear()
    outs = []
    for b in bufs + [np.full(40, r + 1, dtype="float64")]:  # the last one not tuned
        counts = chunk_counts(b.size, k)
        out = np.zeros(counts[r], dtype=b.dtype)
        red.start_reduce_scatter(b, out, counts).wait()
        outs.append(out)
    choices, origin, summary = dict(red.choices), dict(red.origin), red.choices_summary()
    red.close()
    assert tuned == {"reduce_scatter float32:15": "ring", "reduce_scatter float64:15": "mpi"} and calls == 2
    assert ran == ["ring", "mpi", "mpi"] and len(timer.calls) == 3
    assert choices["reduce_scatter float64:9"] == "mpi" and origin["reduce_scatter float64:9"] == "measured"
    assert all(bool((o == k * (k + 1) / 2).all()) for o in outs)
    assert summary.startswith("reduce-scatter float32 ring") and "allreduce" not in summary


def test_a_dtype_mpi_cannot_sum_goes_to_the_ring_unmeasured(monkeypatch):
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm, tuning_file="off")
    monkeypatch.setattr(auto_module, "mpi_sum_type", lambda dtype: None)
    monkeypatch.setattr(red, "_time_calls", lambda *a: pytest.fail("measured a dtype with one candidate"))
    x = np.full(100, r + 1, dtype="float32")
    red.tune([x])
    red.allreduce_(x)
    choices, origin, desc = dict(red.choices), dict(red.origin), red.describe()
    red.close()
    assert choices == {"allreduce float32:9": "ring"} and origin["allreduce float32:9"].startswith("fixed")
    assert bool((x == k * (k + 1) / 2).all())
    assert "not measured: MPI cannot sum float32" in desc


# -- the tuning file: when it is written, what it says --------------------------------------------------
def test_the_tuning_file_is_saved_at_tune_and_close_and_never_inside_an_allreduce(tmp_path, monkeypatch):
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    writes = []
    real = tuning_module.atomic_write
    monkeypatch.setattr(tuning_module, "atomic_write", lambda p, w: writes.append(str(p)) or real(p, w))
    red = AutoReducer(comm, tuning_file=str(path))
    monkeypatch.setattr(red, "_time_calls", FakeTimer(MPI_FASTER))
    red.allreduce_(np.ones(10))  # a new class, outside tune(): decided, not saved
    pending = np.ones(1000)  # a handle does not keep its buffer alive: keep a reference until wait()
    red.start(pending).wait()
    after_calls = (len(writes), path.exists())
    red.tune([np.ones(10), np.ones(5000)])  # one more new class: tune() saves
    after_tune = len(writes)
    red.tune([np.ones(10)])  # nothing new: nothing to save
    red.allreduce_(np.ones(70_000))
    after_more = len(writes)
    red.close()
    comm.Barrier()
    entries = saved(comm, path)
    expected = 1 if comm.Get_rank() == 0 else 0  # only rank 0 writes
    assert after_calls == (0, False)
    assert after_tune == after_more == expected and len(writes) == 2 * expected
    assert set(entries) == {"allreduce float64:7", "allreduce float64:13", "allreduce float64:16",
                            "allreduce float64:20"}


def test_entries_record_when_and_how_clear_and_the_next_run_trusts_them(tmp_path, monkeypatch):
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    first = AutoReducer(comm, tuning_file=str(path))
    monkeypatch.setattr(first, "_time_calls", FakeTimer((1e-5, 2.5e-5), overload=0.2))
    before = time.time()
    first.tune([np.ones(1000), np.ones(1 << 16)])
    first_desc = first.describe()
    first.close()
    after = time.time()
    comm.Barrier()
    entries = saved(comm, path)
    second = AutoReducer(comm, tuning_file=str(path))
    monkeypatch.setattr(second, "_time_calls", lambda *a: pytest.fail("measured a class the tuning file holds"))
    x = np.full(1000, 2.0)
    second.tune([x, np.ones(1 << 16)])
    second.allreduce_(x)
    choices, origin, desc = dict(second.choices), set(second.origin.values()), second.describe()
    second.close()
    assert bool((x == 2.0 * comm.Get_size()).all())
    assert choices == {"allreduce float64:13": "mpi", "allreduce float64:20": "mpi"} and origin == {"tuned"}
    e = entries["allreduce float64:13"]
    assert e["choice"] == "mpi" and e["ratio"] == 2.5 and e["spread"] == 0.0 and e["overload"] == 0.2
    assert e["median_us"] == {"mpi": 10.0, "ring": 25.0} and e["trials"] == trials_for(8000)
    assert before - 1 <= tuning_module.parse_stamp(e["measured"]) <= after + 1
    assert first_desc.endswith("(measured now)")
    assert desc == f"auto: float64 mpi 4 KiB-8 KiB, mpi 512 KiB-1 MiB (tuned {e['measured'][:10]})"


@pytest.mark.parametrize("why", ["old", "busy", "format 1", "future"])
def test_an_old_busy_or_undated_choice_is_rechecked_with_a_few_calls_and_kept(tmp_path, monkeypatch, why):
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    stored = {"old": entry("ring", age_days=30), "busy": entry("ring", overload=3.0), "format 1": "ring",
              "future": entry("ring", age_days=-5)}[why]
    stored = comm.bcast(stored)  # rank 0's clock: each rank's own may have passed a second since rank 0 stamped it
    if why == "format 1":
        write_tuning(comm, path, {}, doc={tuning_key(comm): {"float64:13": "ring"}})
    else:
        write_tuning(comm, path, {"allreduce float64:13": stored})
    red = AutoReducer(comm, tuning_file=str(path))
    timer = FakeTimer((1.02e-5, 1e-5))  # the ring still ahead, narrowly: not clearly slower, so kept
    monkeypatch.setattr(red, "_time_calls", timer)
    red.tune([np.ones(1000)])
    choices, origin, desc = dict(red.choices), dict(red.origin), red.describe()
    red.close()
    comm.Barrier()
    doc = json.loads(path.read_text()) if comm.Get_rank() == 0 else None
    doc = comm.bcast(doc)
    e = doc["configurations"][tuning_key(comm)]["allreduce float64:13"]
    assert timer.calls == [(8000, RECHECK_TRIALS)]
    assert choices == {"allreduce float64:13": "ring"} and origin["allreduce float64:13"] == "re-checked"
    assert doc["format"] == FORMAT and e["choice"] == "ring"
    assert abs(tuning_module.parse_stamp(e["checked"]) - time.time()) < 600 and e["overload"] == 0.0
    if why == "format 1":
        assert e["measured"] is None and "tuned by an older version, re-checked" in desc
    else:
        assert e["measured"] == stored["measured"] and f"tuned {stored['measured'][:10]}, re-checked" in desc


def test_a_recheck_that_finds_the_choice_clearly_slower_measures_again(tmp_path, monkeypatch):
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    write_tuning(comm, path, {"allreduce float64:13": entry("ring", age_days=30)})
    red = AutoReducer(comm, tuning_file=str(path))
    timer = FakeTimer(MPI_FASTER)
    monkeypatch.setattr(red, "_time_calls", timer)
    red.tune([np.ones(1000)])
    choices, origin = dict(red.choices), dict(red.origin)
    red.close()
    comm.Barrier()
    e = saved(comm, path)["allreduce float64:13"]
    assert timer.calls == [(8000, RECHECK_TRIALS), (8000, trials_for(8000))]
    assert choices == {"allreduce float64:13": "mpi"} and origin["allreduce float64:13"] == "re-measured"
    assert e["choice"] == "mpi" and e["ratio"] == 3.0 and "checked" not in e


@pytest.mark.parametrize("now_clear", [True, False])
def test_a_choice_made_inside_the_noise_is_remeasured(tmp_path, monkeypatch, now_clear):
    """Stored: ring ahead by 2 %, inside the noise. Re-measured in full: a clear winner now takes the class;
    another toss-up keeps the file's choice (the bits stay those of the last run)."""
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    write_tuning(comm, path, {"allreduce float64:13": entry("ring", ratio=1.02, spread=0.01)})
    red = AutoReducer(comm, tuning_file=str(path))
    timer = FakeTimer(MPI_FASTER if now_clear else (1e-5, 1.01e-5))
    monkeypatch.setattr(red, "_time_calls", timer)
    red.tune([np.ones(1000)])
    choices, desc = dict(red.choices), red.describe()
    red.close()
    assert timer.calls == [(8000, trials_for(8000))]
    assert choices == {"allreduce float64:13": "mpi" if now_clear else "ring"}
    assert "re-measured" in desc


def test_a_busy_machine_is_seen_and_said(tmp_path, monkeypatch):
    """Timed with more runnable tasks than CPUs: the entry keeps that, the banner says so, and the next run
    re-checks it."""
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    red = AutoReducer(comm, tuning_file=str(path))
    monkeypatch.setattr(red, "_time_calls", FakeTimer(MPI_FASTER, overload=2.0 if comm.Get_rank() == 0 else 0.0))
    red.tune([np.ones(1000)])
    desc = red.describe()
    red.close()
    comm.Barrier()
    again = AutoReducer(comm, tuning_file=str(path))
    status = again.loaded["allreduce float64:13"][1]
    again.close()
    overload = saved(comm, path)["allreduce float64:13"]["overload"]
    assert desc == "auto: float64 mpi 4 KiB-8 KiB (measured now, timed on a busy machine)"
    assert overload == 2.0 and status == "recheck"


def test_other_configurations_entries_are_kept_when_saving(tmp_path, monkeypatch):
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    other = {"MPICH Version: 0 | k=99 | elsewhere": {"allreduce float32:3": "mpi"}}
    write_tuning(comm, path, {}, doc={"format": FORMAT, "configurations": other})
    red = AutoReducer(comm, tuning_file=str(path))
    monkeypatch.setattr(red, "_time_calls", FakeTimer(MPI_FASTER))
    red.tune([np.ones(1000)])
    red.close()
    comm.Barrier()
    doc, key = comm.bcast(json.loads(path.read_text()) if comm.Get_rank() == 0 else None), tuning_key(comm)
    assert doc["configurations"]["MPICH Version: 0 | k=99 | elsewhere"] == other["MPICH Version: 0 | k=99 | elsewhere"]
    assert doc["configurations"][key]["allreduce float64:13"]["choice"] == "mpi"


# -- the tuning file never damages or hangs anything ---------------------------------------------------
def _exercise(comm, path, monkeypatch):
    red = AutoReducer(comm, tuning_file=str(path))
    monkeypatch.setattr(red, "_time_calls", FakeTimer(MPI_FASTER))
    x = np.ones(1000)
    red.tune([x])
    red.allreduce_(x)
    red.allreduce_(np.ones(50))
    desc = red.describe()
    red.close()
    comm.Barrier()
    return desc, bool((x == comm.Get_size()).all())


@pytest.mark.parametrize("kind", ["fifo", "directory", "link to /dev/null"])
def test_a_tuning_path_that_is_not_a_regular_file_is_not_used_and_left_as_it_is(tmp_path, monkeypatch, kind):
    """A FIFO would block a reader forever, and renaming over a device node (MPISGD_TUNING_FILE=/dev/null, as
    root) would replace it: such a path is "no tuning file", said once. (A symbolic link to /dev/null stands
    in for /dev/null itself: a wrong rename then replaces the link, not the device.)"""
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    make = {"fifo": os.mkfifo, "directory": os.mkdir, "link to /dev/null": lambda p: os.symlink("/dev/null", p)}
    if comm.Get_rank() == 0:
        make[kind](path)
    comm.Barrier()
    desc, right = _exercise(comm, path, monkeypatch)
    if comm.Get_rank() == 0:
        still = {"fifo": path.is_fifo, "directory": path.is_dir,
                 "link to /dev/null": lambda: path.is_symlink() and os.readlink(path) == "/dev/null"}[kind]()
        assert still and sorted(os.listdir(path.parent)) == ["tuning.json"]  # no temporary file left either
    assert right
    assert desc.count(f"tuning file {path} not used: not a regular file") == 1


@pytest.mark.parametrize("content", [b"\x00\xff garbage", b"[1, 2, 3]", b'{"format": "mpisgd allreduce plans 9"}',
                                     b'{"name": {"a": "b"}}', b'{"format": "mpisgd allreduce plans 2", "plans": 7}'])
def test_a_file_that_is_not_a_tuning_file_is_ignored_and_never_overwritten(tmp_path, monkeypatch, content):
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    if comm.Get_rank() == 0:
        path.write_bytes(content)
    comm.Barrier()
    desc, right = _exercise(comm, path, monkeypatch)
    unchanged = comm.bcast(path.read_bytes() == content if comm.Get_rank() == 0 else None)
    assert right and unchanged
    assert f"tuning file {path} ignored" in desc


def test_a_tuning_file_that_cannot_be_written_is_not_an_error(tmp_path, monkeypatch):
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"

    def full_disk(p, write):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tuning_module, "atomic_write", full_disk)
    desc, right = _exercise(comm, path, monkeypatch)
    exists = comm.bcast(path.exists() if comm.Get_rank() == 0 else None)
    assert right and not exists
    assert f"tuning file not saved to {path} (No space left on device)" in desc


def test_wrong_entries_in_a_tuning_file_are_ignored(tmp_path, monkeypatch):
    comm = world()
    path = shared_dir(comm, tmp_path) / "tuning.json"
    write_tuning(comm, path, {"allreduce float64:13": {"choice": "carrier pigeon"}, "allreduce float64:7": [1],
                            "allreduce float64:9": {"choice": "mpi", "ratio": "fast", "measured": 12}})
    red = AutoReducer(comm, tuning_file=str(path))
    timer = FakeTimer(RING_FASTER)
    monkeypatch.setattr(red, "_time_calls", timer)
    red.tune([np.ones(1000), np.ones(40)])
    statuses, choices = {n: s for n, (_, s) in red.loaded.items()}, dict(red.choices)
    red.close()
    assert statuses == {"allreduce float64:9": "recheck"}  # a usable choice with no usable date or margin
    assert choices == {"allreduce float64:13": "ring", "allreduce float64:9": "ring"}
    assert timer.calls == [(8000, trials_for(8000)), (320, RECHECK_TRIALS), (320, trials_for(320))]


# -- node-shared memory, deterministic -----------------------------------------------------------------
def test_on_one_node_it_offers_the_shared_buffer_and_reduces_its_pieces_in_place():
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm, tuning_file="off")
    buf = red.shared_buffer(1000, "float32")
    buf[...] = r + 1
    h = red.start(buf[:600])
    h.wait()
    red.tune([buf[600:]])  # a piece of the window: no measurement, nothing to decide
    desc, choices, result = red.describe(), dict(red.choices), buf.copy()
    red.close()
    assert isinstance(h, SharedOp) and choices == {}
    assert desc == "node-shared buffer on this node"
    assert np.all(result[:600] == k * (k + 1) / 2) and np.all(result[600:] == r + 1)


def random_floats(rank: int, n: int) -> np.ndarray:
    """Values of many magnitudes: at k >= 3 another summation order gives other bits."""
    rng = np.random.default_rng(7 + rank)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, size=n)).astype("float32")


def test_deterministic_keeps_the_node_shared_buffer_with_the_deterministic_bits(monkeypatch):
    """--deterministic with auto on one node: the gradients' window stays (its sums are in rank order),
    every other buffer goes to the deterministic strategy; all-reduce and reduce-scatter give the same
    bits as the deterministic strategy's, nothing is measured and no choices file is read."""
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    timed = []
    monkeypatch.setattr(AutoReducer, "_time_calls", lambda self, *a: timed.append(a) or FakeTimer(MPI_FASTER)(*a))
    x = random_floats(r, 3001)
    counts = chunk_counts(x.size, k)
    det = DeterministicReducer(comm)
    want = x.copy()
    det.allreduce_(want)
    want_chunk = np.zeros(counts[r], "float32")
    det.start_reduce_scatter(x.copy(), want_chunk, counts).wait()
    det.close()
    red = create_reducer("auto", comm, deterministic=True)
    buf = red.shared_buffer(x.size, x.dtype)
    buf[...] = x
    red.start(buf).wait()
    in_window = buf.copy()
    buf[...] = x
    chunk = np.zeros(counts[r], "float32")
    red.start_reduce_scatter(buf, chunk, counts).wait()
    private = x.copy()
    red.allreduce_(private)
    name, desc, has_det = red.name, red.describe(), red.det is not None
    red.close()
    assert name == "auto" and buf is not None
    for got, expected in ((in_window, want), (private, want), (chunk, want_chunk)):
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert has_det == (k > 2)  # at k = 2 any order of a + b gives the same bits: nothing changes
    if k > 2:
        assert desc == "node-shared buffer on this node, deterministic elsewhere" and timed == []


def test_shared_with_deterministic_sums_its_other_buffers_in_rank_order():
    comm = world()
    x = random_floats(comm.Get_rank(), 2001)
    det = DeterministicReducer(comm)
    want = x.copy()
    det.allreduce_(want)
    det.close()
    red = create_reducer("shared", comm, deterministic=True)
    got = x.copy()
    red.allreduce_(got)  # not in the window
    other = red.other.name
    red.close()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert other == ("deterministic" if comm.Get_size() > 2 else "mpi")
