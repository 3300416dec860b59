"""auto's tuning file (mpisgd.comm.tuning) without mpiexec: what a run does with each entry (trust, re-check,
re-measure) as a pure function of the entry and the time, what is read from each kind of path, where it is,
how it is written (through a symbolic link), and one rank, where there is nothing to choose and no tuning
file is touched. The same rules under mpiexec: test_comm_auto.py."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from mpisgd.comm.auto import AutoReducer
from mpisgd.comm.tuning import (
    BUSY_TASKS,
    CLOSE_MARGIN,
    FORMAT,
    MAX_AGE_DAYS,
    MAX_BYTES,
    TUNING_FILE,
    TuningFile,
    is_clear,
    parse_stamp,
    read_tuning,
    stamp,
    status_of,
    tuning_path,
)

NOW = parse_stamp("2026-12-01T12:00:00Z")
DAY = 86400.0


def entry(**fields):
    base = {"choice": "ring", "measured": stamp(NOW - 3600), "ratio": 1.5, "spread": 0.02, "overload": 0.0,
            "median_us": {"mpi": 15.0, "ring": 10.0}, "trials": 21}
    return {**base, **fields}


def test_stamps_are_utc_and_read_back():
    assert stamp(NOW) == "2026-12-01T12:00:00Z" and parse_stamp(stamp(NOW + 1.0)) == NOW + 1.0
    for bad in (None, 12, "yesterday", "2026-12-01"):
        assert parse_stamp(bad) is None


def test_a_margin_is_clear_only_outside_the_spread_and_the_floor():
    assert is_clear(1.5, 0.02)
    assert not is_clear(1.0 + 0.9 * CLOSE_MARGIN, 0.0)  # under the floor: a toss-up
    assert not is_clear(1.3, 0.4)  # the calls themselves varied more than the two differ
    assert is_clear(1.0 + CLOSE_MARGIN + 0.01, 0.0)


@pytest.mark.parametrize("fields,status", [
    ({}, "trust"),  # recent, clear, quiet
    ({"measured": stamp(NOW - (MAX_AGE_DAYS + 1) * DAY)}, "recheck"),  # too old
    ({"measured": stamp(NOW - (MAX_AGE_DAYS + 1) * DAY), "checked": stamp(NOW - DAY)}, "trust"),  # re-checked since
    ({"measured": stamp(NOW + 2 * DAY)}, "recheck"),  # dated in the future: a clock was wrong
    ({"overload": BUSY_TASKS + 0.5}, "recheck"),  # timed on a busy machine
    ({"overload": None}, "trust"),  # the system did not say how busy it was
    ({"ratio": 1.02}, "remeasure"),  # inside the floor
    ({"ratio": 1.2, "spread": 0.3}, "remeasure"),  # inside the calls' spread
    ({"ratio": 1.02, "measured": stamp(NOW - 30 * DAY)}, "remeasure"),  # close wins over old: measured in full
    ({"measured": "last week"}, "recheck"), ({"ratio": "fast"}, "recheck"), ({"spread": None}, "recheck"),
    ({"choice": "carrier pigeon"}, None), ({"choice": None}, None),
])
def test_what_a_run_does_with_each_entry(fields, status):
    assert status_of(entry(**fields), NOW) == status


def test_format_1_entries_are_rechecked_and_other_things_ignored():
    assert status_of("mpi", NOW) == status_of("ring", NOW) == "recheck"
    for junk in ("nccl", 3, None, [1, 2], {"a": 1}):
        assert status_of(junk, NOW) is None


def read_in_a_thread(path):
    """read_tuning(path) in a thread joined with a bound, so that a reader that blocks fails the test
    instead of hanging the suite."""
    out = []
    t = threading.Thread(target=lambda: out.append(read_tuning(path)), daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), f"reading {path} blocked"
    return out[0]


def test_read_tuning_of_each_kind_of_path(tmp_path):
    missing = read_in_a_thread(tmp_path / "none.json")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    link = tmp_path / "null.json"
    link.symlink_to("/dev/null")
    (tmp_path / "dir.json").mkdir()
    assert missing == ({}, "")
    for p in (fifo, link, tmp_path / "dir.json"):
        entries, note = read_in_a_thread(p)
        assert entries is None and note == f"tuning file {p} not used: not a regular file"
    assert fifo.is_fifo() and os.readlink(link) == "/dev/null"


@pytest.mark.parametrize("content", [b"", b"{}", b"\n"])
def test_an_empty_file_is_an_empty_tuning_file(tmp_path, content):
    p = tmp_path / "tuning.json"
    p.write_bytes(content)
    assert read_tuning(p) == ({}, "")


@pytest.mark.parametrize("content", [
    b"\x00\xff\xfe not json", b"[]", b"42", b'"mpi"', b"[" * 100_000 + b"]" * 100_000,
    b'{"format": "mpisgd allreduce plans 3", "plans": {}}', b'{"format": "mpisgd allreduce plans 2"}',
    b'{"format": "mpisgd allreduce tuning 3", "plans": {}}', b'{"format": ["mpisgd allreduce tuning 3"]}',
    b'{"format": "mpisgd allreduce plans 2", "plans": {"key": 3}}',
    b'{"name": {"a": "b"}}', b'{"MPICH | k=2 | h": {"float32:3": "tuba"}}', b'{"MPICH | k=2 | h": ["mpi"]}',
])
def test_what_is_not_a_tuning_file_is_ignored_with_a_note(tmp_path, content):
    p = tmp_path / "tuning.json"
    p.write_bytes(content)
    entries, note = read_tuning(p)
    assert entries is None and note.startswith(f"tuning file {p} ignored") and p.read_bytes() == content


def test_a_file_too_large_for_a_tuning_file_is_not_read(tmp_path):
    p = tmp_path / "tuning.json"
    p.write_bytes(b" " * (MAX_BYTES + 1))
    assert read_tuning(p) == (None, f"tuning file {p} ignored: too large for a tuning file (left as it is)")


def test_every_format_reads_to_one_shape(tmp_path):
    old, plans2, new = tmp_path / "old.json", tmp_path / "plans2.json", tmp_path / "new.json"
    old.write_text(json.dumps({"MPICH Version: 5 | k=2 | vm": {"float32:23": "ring", "float64:3": "mpi"}}))
    two = {"MPICH Version: 5 | k=2 | vm": {"allreduce float32:23": entry(), "reduce_scatter float32:23": entry()}}
    plans2.write_text(json.dumps({"format": "mpisgd allreduce plans 2", "plans": two}))  # before the rename
    new.write_text(json.dumps({"format": FORMAT, "configurations": two}))
    assert read_tuning(old) == ({"MPICH Version: 5 | k=2 | vm": {"allreduce float32:23": "ring",
                                                                 "allreduce float64:3": "mpi"}}, "")
    assert read_tuning(plans2) == read_tuning(new) == (two, "")


def test_where_the_tuning_file_is(monkeypatch):
    """$MPISGD_TUNING_FILE, else its older name $MPISGD_PLAN_FILE, else the default; an explicit path first."""
    monkeypatch.delenv("MPISGD_TUNING_FILE", raising=False)
    monkeypatch.delenv("MPISGD_PLAN_FILE", raising=False)
    assert tuning_path() == TUNING_FILE == "~/.cache/mpisgd/allreduce-tuning.json"
    monkeypatch.setenv("MPISGD_PLAN_FILE", "/old/name.json")
    assert tuning_path() == "/old/name.json"
    monkeypatch.setenv("MPISGD_TUNING_FILE", "/new/name.json")
    assert tuning_path() == "/new/name.json" and tuning_path("off") == "off"


def test_a_symbolic_link_is_written_through_and_stays_a_link(tmp_path):
    """The tuning file behind a symbolic link (dotfiles kept elsewhere): saving replaces the file the link
    names, all or nothing, and the link stays; before, the rename replaced the link by a file."""
    real = tmp_path / "dotfiles" / "tuning.json"
    real.parent.mkdir()
    other = {"MPICH Version: 0 | k=9 | elsewhere": {"allreduce float32:3": entry()}}
    real.write_text(json.dumps({"format": FORMAT, "configurations": other}))
    link = tmp_path / "tuning.json"
    link.symlink_to(real)
    f, loaded, note = TuningFile.load(str(link), "MPICH Version: 5 | k=2 | vm")
    assert f is not None and loaded == {} and note == ""
    assert f.save({"allreduce float64:13": entry(choice="mpi")}) == ""
    assert link.is_symlink() and os.readlink(link) == str(real)
    doc = json.loads(real.read_text())
    assert doc["configurations"]["MPICH Version: 5 | k=2 | vm"]["allreduce float64:13"]["choice"] == "mpi"
    assert doc["configurations"]["MPICH Version: 0 | k=9 | elsewhere"] == other["MPICH Version: 0 | k=9 | elsewhere"]
    assert sorted(os.listdir(real.parent)) == ["tuning.json"]  # no temporary file left behind


def test_one_rank_routes_without_measuring_and_touches_no_tuning_file(tmp_path, monkeypatch):
    """k = 1: nothing to sum, so mpi, with no measurement; the tuning file is neither read nor written."""
    from mpi4py import MPI

    path = tmp_path / "tuning.json"
    path.write_text("not json, and not to be touched")
    red = AutoReducer(MPI.COMM_SELF, tuning_file=str(path))
    monkeypatch.setattr(red, "_time_calls", lambda *a: pytest.fail("measured at one rank"))
    x = np.arange(5.0)
    red.tune([x])
    red.allreduce_(x)
    out = np.zeros(5)
    red.start_reduce_scatter(x.copy(), out, [5]).wait()
    choices, desc, note = dict(red.choices), red.describe(), red.note
    red.close()
    assert choices == {"allreduce float64:6": "mpi", "reduce_scatter float64:6": "mpi"}
    assert np.array_equal(x, np.arange(5.0)) and np.array_equal(out, x)
    assert desc == "auto: float64 mpi 32 B-64 B; reduce-scatter float64 mpi 32 B-64 B (not measured: one rank)"
    assert note == "" and path.read_text() == "not json, and not to be touched"
