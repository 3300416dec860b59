"""Hierarchical all-reduce with faked nodes (a color split of one machine), under mpiexec."""

from __future__ import annotations

import numpy as np
import pytest

from mpisgd.comm import HierarchicalReducer

pytestmark = pytest.mark.mpi(min_size=2)


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.mark.parametrize("layout", ["round-robin", "blocks", "one-node", "node-per-rank"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_hierarchical_equals_mpi_with_faked_nodes(layout, deterministic):
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    color = {"round-robin": rank % 2, "blocks": rank // 2, "one-node": 0, "node-per-rank": rank}[layout]
    red = HierarchicalReducer(comm, color=color, deterministic=deterministic)
    want_nodes = {"round-robin": 2, "blocks": (k + 1) // 2, "one-node": 1, "node-per-rank": k}[layout]
    failures = []
    if red.nodes != want_nodes:
        failures.append(("nodes", red.nodes, want_nodes))
    for dtype in ("int32", "int64", "float32", "float64", "float16"):
        for n in (1, 2, 3, 17, 5000):
            x = ((np.arange(n) + 5 * rank) % 9).astype(dtype)
            want = np.sum(comm.allgather(x), axis=0, dtype=np.int64).astype(dtype)  # exact: small integers
            h = red.start(x)
            h.test()
            h.wait()
            if not np.array_equal(x, want):
                failures.append((dtype, n))
    red.close()
    assert [f for per in comm.allgather(failures) for f in per] == []


def test_hierarchical_deterministic_is_bitwise_equal_across_buckets():
    comm = world()
    rank = comm.Get_rank()
    x = np.random.default_rng(11 + rank).standard_normal(9000).astype("float32")
    red = HierarchicalReducer(comm, color=rank % 2, deterministic=True)
    whole = x.copy()
    red.allreduce_(whole)
    pieces = x.copy()
    for a in range(0, x.size, 1234):
        red.allreduce_(pieces[a:a + 1234])
    red.close()
    digests = comm.allgather(whole.tobytes() == pieces.tobytes())
    assert all(digests)


def test_injected_node_comm_and_default_shared_memory_split():
    comm = world()
    rank = comm.Get_rank()
    node = comm.Split(rank % 2, rank)
    injected = HierarchicalReducer(comm, node_comm=node)
    shared = HierarchicalReducer(comm)  # one machine: one node
    a = np.full(10, rank, dtype="int64")
    b = a.copy()
    injected.allreduce_(a)
    shared.allreduce_(b)
    nodes = (injected.nodes, shared.nodes)
    injected.close()
    shared.close()
    node.Free()
    k = comm.Get_size()
    everyone = comm.allgather((bool((a == k * (k - 1) // 2).all()), bool((b == a).all()), nodes))
    assert all(x and y for x, y, _ in everyone)
    assert all(n == (2, 1) for _, _, n in everyone)


def test_color_and_node_comm_together_is_an_error():
    comm = world()
    with pytest.raises(ValueError, match="either color or node_comm"):
        HierarchicalReducer(comm, color=0, node_comm=comm)
