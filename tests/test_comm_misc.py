"""Communication engine without mpiexec: chunking, k = 1, the factory's errors, the CUDA probe on a
CPU machine, the benchmark's helpers; and, through run_mpi, the MPI suites at k = 4 and the benchmark."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from conftest import ROOT, run_mpi

from mpisgd.comm import STRATEGIES, create_reducer
from mpisgd.comm.ring import RingReducer, chunk_bounds

sys.path.insert(0, str(ROOT / "benchmarks"))
import allreduce_bw  # noqa: E402

# scripts/test.sh also runs this file on every rank under mpiexec (pytest-mpi's --with-mpi keeps
# unmarked tests): the tests that start their own processes run once, in the serial pass.
_RANKS = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
own_processes = pytest.mark.skipif(_RANKS > 1, reason="starts its own processes: run in the serial pass")


def self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


@pytest.mark.parametrize("n,k", [(0, 3), (1, 4), (2, 4), (7, 3), (9, 3), (1000, 7)])
def test_chunk_bounds_cover_the_buffer_in_near_equal_chunks(n, k):
    b = chunk_bounds(n, k)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == n and len(b) == k + 1
    assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1


@pytest.mark.parametrize("name", [s for s in STRATEGIES if s != "nccl"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("compress", ["none", "fp16"])
def test_one_rank_is_a_no_op_for_every_cpu_strategy(name, deterministic, compress):
    red = create_reducer(name, self_comm(), deterministic=deterministic, compress=compress)
    x = np.arange(10, dtype="float32") * 0.5  # exact in float16 too
    red.allreduce_(x)
    out = np.zeros_like(x)
    red.allreduce(x, out)
    h = red.start(x)
    assert h.test() or h.wait() is None
    red.close()
    assert np.array_equal(x, np.arange(10, dtype="float32") * 0.5)
    assert np.array_equal(out, x)


def test_auto_crosses_over_where_measured_in_place_and_out_of_place():
    from mpisgd.comm.auto import P2P_CROSSOVER_BYTES, P2P_OUT_OF_PLACE_CROSSOVER_BYTES, AutoReducer

    red = AutoReducer(self_comm())  # one rank: no shared window, so the point-to-point ring's crossovers
    assert red.ring.shm is None
    cross, oop = P2P_CROSSOVER_BYTES, P2P_OUT_OF_PLACE_CROSSOVER_BYTES
    just_below, at = np.empty(cross // 4 - 1, "float32"), np.empty(cross // 4, "float32")
    assert red._pick(just_below, red.crossover_bytes) is red.mpi
    assert red._pick(at, red.crossover_bytes) is red.ring
    assert red.oop_crossover_bytes == oop < cross
    assert red._pick(np.empty(oop // 4, "float32"), red.oop_crossover_bytes) is red.ring
    assert red.start_crossover_bytes == cross
    assert "1 MiB in place, 0.25 MiB out of place, 1 MiB non-blocking" in red.describe()
    red.close()
    one = AutoReducer(self_comm(), crossover_bytes=1024)  # an explicit crossover applies to every mode
    assert one.oop_crossover_bytes == one.start_crossover_bytes == 1024
    one.close()


def test_ring_rejects_a_non_contiguous_buffer_and_bad_parameters():
    red = RingReducer(self_comm())
    with pytest.raises(ValueError, match="contiguous"):
        red.allreduce_(np.zeros((4, 4))[:, 1])
    red.close()
    with pytest.raises(ValueError, match="segment_bytes"):
        RingReducer(self_comm(), segment_bytes=0)
    with pytest.raises(ValueError, match="transport must be one of"):
        RingReducer(self_comm(), transport="tcp")


@pytest.mark.parametrize("kwargs,match", [
    ({"name": "tree"}, "not available"),
    ({"name": "ring", "compress": "int8"}, "compress"),
    ({"name": "ring", "cuda_aware": "maybe"}, "cuda_aware"),
    ({"name": "nccl"}, "needs GPU buffers"),
    ({"name": "nccl", "deterministic": True}, "no deterministic mode"),
])
def test_factory_errors_say_how_to_fix_them(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        create_reducer(name, self_comm(), **kwargs)


@own_processes
def test_cpu_path_never_imports_cupy():
    code = ("import sys, numpy as np; from mpi4py import MPI; from mpisgd.comm import create_reducer\n"
            "for n in ('auto', 'mpi', 'ring', 'hierarchical'):\n"
            "    r = create_reducer(n, MPI.COMM_SELF, compress='fp16'); r.allreduce_(np.ones(5)); r.close()\n"
            "import mpisgd.comm.cuda, mpisgd.comm.nccl\n"
            "assert 'cupy' not in sys.modules, 'cupy imported'\n")
    import subprocess

    from mpisgd.comm.cuda import _child_env

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=_child_env())
    assert res.returncode == 0, res.stderr


def test_cuda_probe_on_a_machine_without_cuda_aware_mpi():
    from mpisgd.comm.cuda import library_query, probe_child, probe_cuda_aware

    said, how = library_query()
    assert said in (True, False, None) and how
    assert probe_cuda_aware(self_comm(), "direct") == (True, "forced direct")
    assert probe_cuda_aware(self_comm(), "staged") == (False, "forced staged")
    with pytest.raises(ValueError, match="auto, direct or staged"):
        probe_cuda_aware(self_comm(), "sometimes")
    try:
        import cupy  # noqa: F401
    except Exception:
        ok, why = probe_child(timeout_s=60)  # no CuPy: the child fails, and says why
        assert not ok and "probe" in why


@pytest.mark.parametrize("text,nbytes", [("4", 4), ("64K", 65536), ("256M", 256 << 20), ("1GiB", 1 << 30),
                                         ("2kb", 2048)])
def test_benchmark_sizes_parse(text, nbytes):
    assert allreduce_bw.parse_size(text) == nbytes


def test_benchmark_check_counts_wrong_elements():
    k = 3
    good = ((np.arange(100) % 13 + 1) * (k * (k + 1) // 2)).astype("float32")
    assert allreduce_bw.count_wrong(good, k) == 0
    bad = good.copy()
    bad[[3, 50]] += 1
    assert allreduce_bw.count_wrong(bad, k) == 2


@own_processes
def test_benchmark_runs_verifies_and_writes_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bw.jsonl", tmp_path / "bw.png"
    res = run_mpi(2, str(ROOT / "benchmarks" / "allreduce_bw.py"), "--max-bytes", "64K", "--step-factor", "16",
                  "--iters", "3", "--json", str(out), "--plot", str(png), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["backend"] for r in rows} == set(allreduce_bw.CPU_BACKENDS)
    assert {r["size_bytes"] for r in rows} == {4, 64, 1024, 16384}
    for r in rows:
        assert {"backend", "size_bytes", "dtype", "inplace", "time_us", "algbw_gbps", "busbw_gbps", "wrong"} <= set(r)
        assert r["wrong"] == 0 and r["time_us"] > 0
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (2 - 1) / 2, rel=1e-3)
    assert png.stat().st_size > 1000
    assert "out of bounds values: 0 OK" in res.stdout


@own_processes
def test_allgather_calls_benchmark_checks_and_times_each_way():
    res = run_mpi(3, str(ROOT / "benchmarks" / "allgather_calls.py"), "--mib", "0.01,0.003", "--repeats", "3",
                  timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "k=3, buckets 0.01,0.003 MiB" in res.stdout
    for way in ("Allgatherv (blocking)", "Iallgatherv + Wait, one by one", "Iallgatherv all, then Waitall"):
        assert way in res.stdout and "wrong" not in res.stdout


@own_processes
@pytest.mark.parametrize("op,library", [("reduce-scatter", "MPI_Ireduce_scatter"), ("allreduce", "MPI_Iallreduce")])
def test_reduce_scatter_calls_benchmark_checks_and_times_each_way(op, library):
    res = run_mpi(3, str(ROOT / "benchmarks" / "reduce_scatter_calls.py"), "--mib", "0.01,0.003", "--repeats",
                  "3", "--op", op, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "k=3, buckets 0.01,0.003 MiB" in res.stdout
    for way in (library, "direct (auto, private buffers)", "shared (auto, shared buffer)", "ring (messages)"):
        assert way in res.stdout and "wrong" not in res.stdout


@own_processes
def test_benchmark_exits_non_zero_on_a_wrong_result(tmp_path):
    """A reducer that adds 1 to element 0 must be caught by the #wrong column and the exit code."""
    script = tmp_path / "broken.py"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]\n"
        "import allreduce_bw\n"
        "real = allreduce_bw.make_reducer\n"
        "def broken(*a):\n"
        "    red = real(*a)\n"
        "    inner = red.allreduce_\n"
        "    def wrong(buf):\n"
        "        inner(buf); buf[0] += 1\n"
        "    red.allreduce_ = wrong\n"
        "    return red\n"
        "allreduce_bw.make_reducer = broken\n"
        "args = ['--max-bytes', '64', '--backends', 'ring', '--inplace', 'yes', '--iters', '2']\n"
        "sys.exit(allreduce_bw.main(args))\n")
    res = run_mpi(2, str(script), timeout=300)
    assert res.returncode != 0
    assert "ERROR" in res.stdout


@own_processes
def test_mpi_suites_at_four_ranks():
    """The in-process MPI tests at k = 4 (oversubscribed: correctness, not speed)."""
    res = run_mpi(4, "-m", "pytest", "tests/test_comm_ring.py", "tests/test_comm_shared.py",
                  "tests/test_comm_hierarchical.py", "tests/test_comm_training.py", "-q",
                  "-p", "no:cacheprovider", "--with-mpi", "--only-mpi", "-x",
                  timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout
