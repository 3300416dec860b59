"""mpisgd.comm as a whole: the factory, the helpers strategies share, and the contract every strategy
keeps (all-reduce, non-blocking, reduce-scatter, all-gather), checked against MPI_Allreduce.

The contract tests run under mpiexec (scripts/test.sh: -n 2 and -n 3; the last test here runs the comm
suites at k = 4). Size-agnostic: rank r contributes values derived from r, every collective is
reached by all ranks, results are gathered, and only then asserted.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import DTYPES, ROOT, gathered, local_values, openmpi_env, oracle, run_mpi, run_openmpi, serial_only, world

from mpisgd.comm import STRATEGIES, create_reducer
from mpisgd.comm.base import InOrder, ScratchPool, add_in_rank_order, chunk_bounds, chunk_counts, flat_view
from mpisgd.comm.mpi import mpi_sum_type

# Under mpiexec with --with-mpi but without -m mpi, pytest-mpi runs the unmarked tests on every rank too:
# the tests that start their own processes run once, in the serial pass.
CPU_STRATEGIES = [s for s in STRATEGIES if s != "nccl"]


def self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


# -- without MPI peers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(0, 3), (1, 4), (2, 4), (7, 3), (9, 3), (1000, 7)])
def test_chunk_bounds_cover_the_buffer_in_near_equal_chunks(n, k):
    b = chunk_bounds(n, k)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == n and len(b) == k + 1
    assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1
    assert chunk_counts(n, k) == list(sizes)


def test_flat_view_refuses_a_copy():
    a = np.zeros((4, 4))
    assert np.shares_memory(flat_view(a), a)
    with pytest.raises(ValueError, match="contiguous"):
        flat_view(a[:, 1])


@pytest.mark.parametrize("own", [0, 1, 2, 3])
def test_rank_order_sum_is_right_even_summing_into_a_part(own):
    """dst may be one of the parts (a rank's own chunk): at part 2 or later the first add would
    overwrite it before it is read, so the sum must go through a spare buffer."""
    parts = [np.full(5, 10.0 ** i, dtype="float64") for i in range(4)]
    want = parts[0] + parts[1] + parts[2] + parts[3]
    add_in_rank_order(parts, parts[own], ScratchPool())
    np.testing.assert_array_equal(parts[own], want)


class Step:
    """What InOrder needs of an operation: whether its first step is done, and begin()."""

    def __init__(self, name: str, started: list[str]) -> None:
        self.name, self.started, self.done = name, started, False

    def ready(self, block: bool) -> bool:
        self.done = self.done or block  # blocking: wait for it
        return self.done

    def begin(self) -> None:
        self.started.append(self.name)


def test_second_steps_begin_in_the_order_the_operations_started():
    """Collectives must start in one order on every rank: when b's first step completes before a's
    (handles may be polled in any order), b still waits for a; waiting on c blocks until c begins."""
    started: list[str] = []
    order = InOrder()
    a, b, c = (Step(n, started) for n in "abc")
    order.queue.extend([a, b, c])
    b.done = True
    order.pump()
    assert started == []
    a.done = True
    order.pump()
    assert started == ["a", "b"]
    order.pump(until=c)
    assert started == ["a", "b", "c"] and not order.queue
    order.pump(until=c)  # already begun: nothing blocks
    assert started == ["a", "b", "c"]


@pytest.mark.parametrize("name", CPU_STRATEGIES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_one_rank_is_a_no_op_for_every_cpu_strategy(name, deterministic):
    red = create_reducer(name, self_comm(), deterministic=deterministic)
    x = np.arange(10, dtype="float32") * 0.5
    red.allreduce_(x)
    out = np.zeros_like(x)
    red.allreduce(x, out)
    h = red.start(x)
    h.wait()
    assert h.test()  # complete once waited for
    red.close()
    assert np.array_equal(x, np.arange(10, dtype="float32") * 0.5)
    assert np.array_equal(out, x)


@pytest.mark.parametrize("kwargs,match", [
    ({"name": "tree"}, "not available"),
    ({"name": "hierarchical"}, "not available"),
    ({"name": "ring", "cuda_aware": "maybe"}, "cuda_aware"),
    ({"name": "nccl"}, "needs GPU buffers"),
    ({"name": "nccl", "deterministic": True}, "no deterministic mode"),
    ({"name": "shared", "device": True}, "host buffers"),
])
def test_factory_errors_say_how_to_fix_them(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        create_reducer(name, self_comm(), **kwargs)


def test_deterministic_option_picks_the_deterministic_strategy_only_where_order_matters():
    red = create_reducer("ring", self_comm(), deterministic=True)  # one rank: any order is exact
    assert red.name == "ring"
    red.close()


@serial_only
def test_cpu_path_never_imports_cupy():
    code = ("import sys, numpy as np; from mpi4py import MPI; from mpisgd.comm import create_reducer, STRATEGIES\n"
            "for n in STRATEGIES[:-1]:\n"
            "    r = create_reducer(n, MPI.COMM_SELF, deterministic=True); r.allreduce_(np.ones(5)); r.close()\n"
            "import mpisgd.comm.cuda, mpisgd.comm.nccl, mpisgd.train\n"
            "assert 'cupy' not in sys.modules, 'cupy imported'\n")
    from mpisgd.comm.cuda import child_env

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=child_env())
    assert res.returncode == 0, res.stderr


# -- the contract, under mpiexec ----------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", CPU_STRATEGIES)
def test_every_strategy_sums_every_dtype_and_length_in_and_out_of_place(name):
    comm = world()
    red = create_reducer(name, comm)
    failures = []
    for dtype in DTYPES:
        if name in ("mpi", "shared") and mpi_sum_type(np.dtype(dtype)) is None:  # float16 outside MPICH
            with pytest.raises(TypeError, match="no predefined datatype for .*use the ring or auto"):
                red.allreduce_(local_values(3, dtype, comm.Get_rank()))  # refused before any message
            continue
        for n in (1, 2, 3, 7, 1001):
            x = local_values(n, dtype, comm.Get_rank())
            want = oracle(comm, x)
            inplace = x.copy()
            red.allreduce_(inplace)
            out = np.full_like(x, 99)
            red.allreduce(x, out)
            h = red.start(started := x.copy())
            h.wait()
            for what, got in (("in place", inplace), ("out of place", out), ("start", started)):
                if not np.array_equal(got, want):
                    failures.append((name, what, dtype, n))
            if not np.array_equal(x, local_values(n, dtype, comm.Get_rank())):
                failures.append((name, "out of place modified its input", dtype, n))
    red.close()
    assert gathered(comm, failures) == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", CPU_STRATEGIES)
def test_nonblocking_ops_in_flight_together_advance_by_test_and_finish_by_wait(name):
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = create_reducer(name, comm)
    bufs = [np.full(n, rank + 1, dtype="int64") for n in (3, 500, 20_000, 1)]
    handles = [red.start(b) for b in bufs]
    for _ in range(5):  # the way DataParallel polls after each layer
        for h in handles:
            h.test()
    for h in handles:
        h.wait()
    done = all(h.test() for h in handles)
    ok = [bool((b == k * (k + 1) // 2).all()) for b in bufs]
    red.close()
    assert all(all(o) for o in comm.allgather(ok))
    assert done


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", CPU_STRATEGIES)
@pytest.mark.parametrize("n", [1, 2, 7, 4099])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_reduce_scatter_then_allgather_give_the_allreduce(name, n, dtype):
    """Rank r receives exactly chunk r of the sum (chunk_bounds, rank order; some empty when n < k);
    the in-place all-gather of those chunks then rebuilds the whole sum on every rank."""
    if name in ("mpi", "shared") and mpi_sum_type(np.dtype(dtype)) is None:  # the same library everywhere
        pytest.skip(f"this MPI library cannot sum {dtype} (auto, ring and deterministic can)")
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    x = local_values(n, dtype, r)
    expected = oracle(comm, x)
    bounds, counts = chunk_bounds(n, k), chunk_counts(n, k)
    red = create_reducer(name, comm)
    buf = x.copy()
    out = np.full(counts[r], 99, dtype=dtype)
    h = red.start_reduce_scatter(buf, out, counts)
    while not h.test():
        pass
    h.wait()
    mine = out.copy()
    whole = np.zeros(n, dtype=dtype)
    whole[bounds[r]:bounds[r + 1]] = out  # others' chunks arrive through the all-gather
    red.start_allgather(whole, counts).wait()
    native, untouched = red.native_reduce_scatter, bool(np.array_equal(buf, x))
    with pytest.raises(ValueError, match="counts"):
        red.start_reduce_scatter(buf, out, counts[:-1])  # k - 1 chunks: refused at once, on every rank
    red.close()
    np.testing.assert_array_equal(mine, expected[bounds[r]:bounds[r + 1]])
    np.testing.assert_array_equal(whole, expected)
    assert native == (name != "ring")  # the ring runs its all-reduce and copies the chunk out
    if name in ("mpi", "deterministic"):  # (auto runs whichever it measured faster: test_comm_auto.py)
        assert untouched  # a true reduce-scatter, not an all-reduce of buf


@serial_only
def test_comm_suites_at_four_ranks():
    """The in-process MPI tests of the engines at k = 4 (oversubscribed: correctness, not speed): a third
    size, even and a power of two, where MPI's own collectives choose other algorithms than at 2 and 3. Data
    parallelism above the engines (test_parallel.py, test_sync.py) depends on k only through them: the MPI
    passes run it at k = 2 and 3. Under Debian's Open MPI where its environment is (scripts/test.sh installs
    it), else MPICH."""
    files = ["tests/test_comm.py", "tests/test_comm_ring.py", "tests/test_comm_shared.py",
             "tests/test_comm_deterministic.py", "tests/test_comm_auto.py"]
    args = ["-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "--color=no", "--with-mpi", "--only-mpi", "-x"]
    debian = openmpi_env()
    if debian is None:
        res = run_mpi(4, *args, timeout=900, cwd=ROOT)
    else:  # Open MPI yields the cores while a rank waits; MPICH's ranks spin (4 on 2 cores: 3 times longer)
        res = run_openmpi(debian, 4, *args, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout
