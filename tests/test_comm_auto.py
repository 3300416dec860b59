"""The auto policy under mpiexec (-n 2 and -n 3; test_comm.py runs it at k = 4): each size class is
measured once, on every rank alike, then fixed; the plan file makes later runs choose the same; the
node-shared buffer is offered on one node."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import world

from mpisgd.comm import AutoReducer
from mpisgd.comm.shared import SharedOp

pytestmark = pytest.mark.mpi(min_size=2)


def test_each_size_class_is_measured_once_and_every_rank_chooses_alike(monkeypatch):
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm, plan_file="off")
    measured = []
    real = red._measure
    monkeypatch.setattr(red, "_measure", lambda src, dst: measured.append(dst.nbytes) or real(src, dst))
    results = []
    for n in (1, 1, 3, 2, 300, 257, 300, 5):  # classes: 4 B; 8-15 B twice (3 and 2); 1-2 KiB twice (300, 257)
        x = np.full(n, r + 1, dtype="float32")
        red.allreduce_(x)
        results.append(bool((x == k * (k + 1) / 2).all()))
    y = np.full(300, r, dtype="float32")
    red.allreduce(np.full(300, r, dtype="float32"), y)  # out of place: the same class, no new measurement
    plan, summary = dict(red.plan), red.plan_summary()
    red.close()
    assert all(results) and bool((y == k * (k - 1) / 2).all())
    assert measured == [4, 12, 1200, 20]
    assert set(plan) == {"float32:3", "float32:4", "float32:11", "float32:5"}
    assert len({json.dumps(p, sort_keys=True) for p in comm.allgather(plan)}) == 1  # the slower rank decided
    assert summary.startswith("float32 ")
    assert plan["float32:3"] == "mpi"  # 4 bytes: one library call, against 2(k-1) Python message rounds


def test_the_plan_file_makes_the_next_run_choose_the_same_without_measuring(tmp_path, monkeypatch):
    comm = world()
    path = str(comm.bcast(tmp_path if comm.Get_rank() == 0 else None) / "plans.json")
    first = AutoReducer(comm, plan_file=path)
    first.allreduce_(np.ones(1000, dtype="float64"))
    first.allreduce_(np.ones(1 << 16, dtype="float64"))
    plan = dict(first.plan)
    first.close()
    comm.Barrier()  # rank 0 has written the file
    second = AutoReducer(comm, plan_file=path)
    monkeypatch.setattr(second, "_measure", lambda *a: pytest.fail("measured a class the plan file holds"))
    x = np.full(1000, 2.0)
    second.allreduce_(x)
    second.allreduce_(np.ones(1 << 16, dtype="float64"))
    again = dict(second.plan)
    second.close()
    assert again == plan and bool((x == 2.0 * comm.Get_size()).all())
    if comm.Get_rank() == 0:
        saved = json.loads(open(path).read())
        assert list(saved.values()) == [plan] and f"k={comm.Get_size()}" in next(iter(saved))


def test_tune_decides_for_nonblocking_buffers_before_they_start(monkeypatch):
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm, plan_file="off")
    bufs = [np.full(n, r + 1, dtype="float32") for n in (100, 70_000)]
    red.tune(bufs)
    decided = dict(red.plan)
    monkeypatch.setattr(red, "_measure", lambda *a: pytest.fail("measured in the middle of a step"))
    handles = [red.start(b) for b in bufs]
    for h in handles:
        h.wait()
    red.close()
    assert len(decided) == 2
    assert all(bool((b == k * (k + 1) / 2).all()) for b in bufs)  # tune() left the data as it was


def test_on_one_node_it_offers_the_shared_buffer_and_reduces_its_pieces_in_place():
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm, plan_file="off")
    buf = red.shared_buffer(1000, "float32")
    buf[...] = r + 1
    h = red.start(buf[:600])
    h.wait()
    red.tune([buf[600:]])  # a piece of the window: no measurement, nothing to decide
    desc, plan, result = red.describe(), dict(red.plan), buf.copy()
    red.close()
    assert isinstance(h, SharedOp) and plan == {}
    assert desc.startswith("node-shared buffer on this node")
    assert np.all(result[:600] == k * (k + 1) / 2) and np.all(result[600:] == r + 1)
