"""Our ring all-reduce against MPI_Allreduce, under mpiexec (scripts/test.sh runs -n 2 and -n 3;
test_comm_misc.py runs these at k = 4).

Size-agnostic: rank r contributes values derived from r, the expected sum is
computed on every rank, every collective is reached by all ranks, results are
gathered, and only then asserted.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import rank_order_sum

from mpisgd.comm import AutoReducer, MpiReducer, RingReducer, create_reducer

pytestmark = pytest.mark.mpi(min_size=2)

DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint64"]
LENGTHS = [1, 2, 3, 5, 7, 64, 1001, 4099]  # odd, below k, one element per rank, several slices


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def local_values(n: int, dtype: str, rank: int) -> np.ndarray:
    """Small integers: sums are exact in every dtype, so any difference is a bug, not rounding."""
    return ((np.arange(n) * 7 + 3 * rank + 1) % 11).astype(dtype)


def oracle(comm, x: np.ndarray) -> np.ndarray:
    """MPI_Allreduce's answer; where the library has no SUM for the dtype (float16 outside MPICH),
    the exact sum of the gathered inputs (they are small integers)."""
    y = x.copy()
    try:
        MpiReducer(comm).allreduce_(y)
    except TypeError:
        y = np.sum(comm.allgather(x), axis=0, dtype=np.int64).astype(x.dtype)
    return y


def all_ok(comm, failures: list) -> list:
    """Every rank's failures (collective), so each rank asserts on the whole picture."""
    return [f for per_rank in comm.allgather(failures) for f in per_rank]


# (transport, segment or shared-memory chunk bytes, window): p2p messages with large, tiny and odd segments;
# the shared window (one node: always so under mpiexec here) with large, tiny and odd chunks
TRANSPORTS = [("p2p", 1 << 20, 4), ("p2p", 8, 2), ("p2p", 24, 1), ("shm", 1 << 20, 0), ("shm", 8, 0), ("shm", 100, 0)]


def ring(comm, transport: str, nbytes: int, window: int = 2, **kw):
    if transport == "shm":
        red = RingReducer(comm, transport="shm", shm_chunk_bytes=nbytes, **kw)
        assert red.shm is not None, "every rank is on one node here: the shared window must be in use"
        return red
    return RingReducer(comm, transport="p2p", segment_bytes=nbytes, window=window, **kw)


@pytest.mark.parametrize("transport,nbytes,window", TRANSPORTS)
def test_ring_equals_mpi_allreduce_bitwise_every_dtype_and_length(transport, nbytes, window):
    comm = world()
    red = ring(comm, transport, nbytes, window)
    failures = []
    lengths = LENGTHS if nbytes > 1024 else LENGTHS[:-1]  # tiny segments: thousands of messages
    for dtype in DTYPES:
        for n in lengths:
            x = local_values(n, dtype, comm.Get_rank())
            want = oracle(comm, x)
            inplace = x.copy()
            red.allreduce_(inplace)
            out = np.full_like(x, 99)
            red.allreduce(x, out)
            if not np.array_equal(inplace, want):
                failures.append(("in-place", dtype, n))
            if not np.array_equal(out, want):
                failures.append(("out-of-place", dtype, n))
            if not np.array_equal(x, local_values(n, dtype, comm.Get_rank())):
                failures.append(("out-of-place modified its input", dtype, n))
    red.close()
    assert all_ok(comm, failures) == []


@pytest.mark.parametrize("transport", ["p2p", "shm"])
def test_ring_random_floats_within_rounding_of_the_exact_sum(transport):
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = ring(comm, transport, 256)
    everyone = np.random.default_rng(1).standard_normal((k, 10_007))
    exact = everyone.sum(axis=0)
    errors = {}
    for dtype, tol in (("float32", 1e-5), ("float64", 1e-13)):
        x = everyone[rank].astype(dtype)
        red.allreduce_(x)
        errors[dtype] = float(np.max(np.abs(x - exact)) / np.max(np.abs(exact))) / tol
    red.close()
    worst = max(max(e.values()) for e in comm.allgather(errors))
    assert worst <= 1.0, f"relative error / tolerance = {worst}"


@pytest.mark.parametrize("transport", ["p2p", "shm"])
def test_nonblocking_ops_in_flight_together_advance_by_test_and_finish_by_wait(transport):
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = ring(comm, transport, 64)
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


@pytest.mark.parametrize("transport", ["p2p", "shm"])
def test_test_alone_completes_an_operation(transport):
    """Polling test() (as DataParallel does during backward) must finish the work without wait()."""
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = ring(comm, transport, 1024, det_gather_bytes=0)
    for det in ((False, True) if transport == "p2p" else (False,)):  # deterministic (k >= 3) uses messages
        red.deterministic = det
        x = np.full(50_000, rank + 1, dtype="float64")
        h = red.start(x)
        polls = 0
        while not h.test() and polls < 10_000_000:
            polls += 1
        finished = h.test()
        h.wait()
        ok = finished and bool((x == k * (k + 1) / 2).all())
        assert all(comm.allgather(ok)), f"deterministic={det}: test() did not complete the operation"
    red.close()


def test_scratch_cap_limits_slices_in_flight_without_changing_results(monkeypatch):
    from mpisgd.comm import ring

    monkeypatch.setattr(ring, "SCRATCH_CAP_BYTES", 1)  # one slice in flight at a time
    comm = world()
    failures = []
    for det in (False, True):
        red = RingReducer(comm, deterministic=det, segment_bytes=256, det_gather_bytes=0, transport="p2p")
        for n in (5, 999, 4000):
            x = local_values(n, "int64", comm.Get_rank())
            want = oracle(comm, x)
            red.allreduce_(x)
            if not np.array_equal(x, want):
                failures.append((det, n))
        red.close()
    assert all_ok(comm, failures) == []


@pytest.mark.parametrize("transport", ["p2p", "shm"])
def test_many_random_lengths_against_mpi(transport):
    comm = world()
    red = ring(comm, transport, 40, window=3)
    lengths = np.random.default_rng(7).integers(0, 3000, size=25)  # same on every rank
    failures = []
    for n in lengths:
        x = local_values(int(n), "int32", comm.Get_rank())
        want = oracle(comm, x)
        red.allreduce_(x)
        if not np.array_equal(x, want):
            failures.append(int(n))
    red.close()
    assert all_ok(comm, failures) == []


def test_both_transports_give_the_same_bits_on_random_floats():
    """Same ring, same summation order (chunk c summed from rank c on): only the transport differs."""
    comm = world()
    x = np.random.default_rng(11 + comm.Get_rank()).standard_normal(30_011).astype("float32")
    results = []
    for transport, nbytes in (("p2p", 1 << 20), ("p2p", 4096), ("shm", 4096), ("shm", 1 << 20)):
        red = ring(comm, transport, nbytes)
        y = x.copy()
        red.allreduce_(y)
        red.close()
        results.append(y.tobytes())
    # chunk boundaries differ between slicings, so compare like with like: same slice geometry
    assert all(comm.allgather(results[1] == results[2])), "p2p and shm disagree at the same chunking"
    assert all(comm.allgather(results[0] == results[3])), "p2p and shm disagree at the same chunking"


def test_shm_transport_is_chosen_on_one_node_and_refuses_nonsense():
    from mpisgd.comm.ring import RingOp
    from mpisgd.comm.shm import ShmRingOp

    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = RingReducer(comm)
    chosen = red.shm is not None
    desc = red.describe()
    overlapped_only = red.start(np.zeros(4))
    overlapped_only.wait()
    unmapped = red.shm.win is None  # training (non-blocking only) never allocates the window
    red.shm_max_bytes = 1024
    small, large = np.full(100, rank + 1, "float64"), np.full(1000, rank + 1, "float64")
    picks = [red.uses_shm(small, blocking=True), red.uses_shm(large, blocking=True),
             red.uses_shm(small, blocking=False)]
    red.allreduce_(small)  # blocking below the limit: the window
    red.allreduce_(large)  # above it: messages
    overlapped = red.start(y := np.full(10, rank, "int32"))  # non-blocking: messages, even when small
    kind = type(overlapped)
    overlapped.wait()
    forced = RingReducer(comm, transport="shm")
    forced_kind = type(h := forced.start(z := np.full(10, rank, "int32")))
    h.wait()
    forced.close()
    red.close()
    ok = bool((small == k * (k + 1) / 2).all() and (large == k * (k + 1) / 2).all()
              and (y == k * (k - 1) // 2).all() and (z == k * (k - 1) // 2).all())
    assert all(comm.allgather(chosen)), "auto transport on one node should be the shared window"
    assert "shared-memory window" in desc and "messages in segments" in desc
    assert picks == [True, False, False]
    assert unmapped
    assert kind is RingOp and forced_kind is ShmRingOp
    assert all(comm.allgather(ok))
    with pytest.raises(ValueError, match="transport must be one of auto, shm, p2p"):
        RingReducer(comm, transport="tcp")


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_deterministic_bitwise_equal_across_bucket_and_segment_sizes(dtype):
    comm = world()
    rank = comm.Get_rank()
    rng = np.random.default_rng(100 + rank)
    x = (rng.standard_normal(6007) * 10.0 ** rng.integers(-3, 3, size=6007)).astype(dtype)
    want = rank_order_sum(comm, x)
    results = []
    for segment_bytes, window, bucket in ((1 << 20, 4, None), (64, 2, 997), (256, 3, 4096), (40, 1, 13),
                                          (1 << 20, 4, 5)):
        red = RingReducer(comm, deterministic=True, segment_bytes=segment_bytes, window=window,
                          det_gather_bytes=16 << 10)  # buckets of 13 and 997 gather, the others exchange
        y = x.copy()
        cuts = [0, y.size] if bucket is None else list(range(0, y.size, bucket)) + [y.size]
        for a, b in zip(cuts[:-1], cuts[1:]):
            red.allreduce_(y[a:b])
        red.close()
        results.append(y)
    digests = [r.tobytes() for r in results]
    same_as_def = [np.array_equal(r.view(np.uint8), want.view(np.uint8)) for r in results]
    everyone = comm.allgather((len(set(digests)), same_as_def, hashlib.sha256(digests[0]).hexdigest()))
    assert all(n == 1 for n, _, _ in everyone), "results differ between bucketings"
    assert all(all(s) for _, s, _ in everyone), "not the rank-order sum"
    assert len({h for _, _, h in everyone}) == 1, "ranks disagree"


def test_deterministic_small_and_large_paths_give_the_same_bits():
    """Below det_gather_bytes one Allgather, above it the exchange: the order, hence the bits, agree."""
    comm = world()
    x = np.random.default_rng(5 + comm.Get_rank()).standard_normal(20_000).astype("float32")
    red = RingReducer(comm, deterministic=True, det_gather_bytes=16 << 10)
    whole = x.copy()
    red.allreduce_(whole)
    tiny = x.copy()
    for a in range(0, x.size, 50):  # 200-byte buckets: the Allgather path
        red.allreduce_(tiny[a:a + 50])
    red.close()
    same = comm.allgather(bool(np.array_equal(whole.view(np.uint32), tiny.view(np.uint32))))
    assert all(same)


def test_fp16_compression_error_is_bounded_and_nonzero():
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    everyone = np.random.default_rng(3).standard_normal((k, 50_000)).astype("float32")
    exact = everyone.astype("float64").sum(axis=0)
    bound = 2.0 ** -11 * (2 * k) * np.abs(everyone).astype("float64").sum(axis=0) + 1e-7
    stats = {}
    for name in ("ring", "mpi", "auto"):
        red = create_reducer(name, comm, compress="fp16")
        x = everyone[rank].copy()
        red.allreduce_(x)
        red.close()
        err = np.abs(x.astype("float64") - exact)
        stats[name] = (x.dtype == np.float32, float(np.max(err / bound)), float(np.max(err)))
    everywhere = comm.allgather(stats)
    for s in everywhere:
        for name, (kept_dtype, worst, max_err) in s.items():
            assert kept_dtype, name
            assert worst <= 1.0, f"{name}: fp16 error {worst:.2f} x the bound"
            assert max_err > 1e-6, f"{name}: no rounding at all, so nothing was compressed"


def test_auto_is_right_on_both_sides_of_its_crossover():
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm, crossover_bytes=1024)
    ok = []
    for n in (1, 255, 256, 10_000):
        x = np.full(n, rank + 1, dtype="float32")
        red.allreduce_(x)
        h = red.start(y := np.full(n, rank, dtype="int32"))
        h.wait()
        ok.append(bool((x == k * (k + 1) / 2).all() and (y == k * (k - 1) // 2).all()))
    red.close()
    assert all(all(o) for o in comm.allgather(ok))


def test_auto_uses_the_crossovers_measured_for_the_shared_window_on_one_node():
    from mpisgd.comm.auto import CROSSOVER_BYTES, OUT_OF_PLACE_CROSSOVER_BYTES, P2P_CROSSOVER_BYTES

    comm = world()
    red = AutoReducer(comm)
    got = (red.ring.shm is not None, red.crossover_bytes, red.oop_crossover_bytes, red.start_crossover_bytes)
    red.close()
    want = (True, CROSSOVER_BYTES, OUT_OF_PLACE_CROSSOVER_BYTES, P2P_CROSSOVER_BYTES)  # start(): messages
    assert all(g == want for g in comm.allgather(got)), got


@pytest.mark.parametrize("name", ["auto", "mpi", "ring", "hierarchical"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_every_cpu_strategy_by_name(name, deterministic):
    comm = world()
    k, rank = comm.Get_size(), comm.Get_rank()
    red = create_reducer(name, comm, deterministic=deterministic)
    desc = red.describe()
    x = np.arange(3001, dtype="float64") + rank
    red.allreduce_(x)
    red.close()
    want = k * np.arange(3001) + k * (k - 1) / 2
    assert all(comm.allgather(bool(np.array_equal(x, want)))), desc


# -- reduce-scatter and all-gather (the sharded optimizer step) -----------------------------------
@pytest.mark.parametrize("name", ["mpi", "auto", "ring", "ring-tiny-segments", "ring-deterministic", "hierarchical"])
@pytest.mark.parametrize("n", [1, 2, 7, 4099])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_reduce_scatter_then_allgather_give_the_allreduce(name, n, dtype):
    """Rank r receives exactly chunk r of the sum (chunk_bounds, rank order; some empty when n < k);
    the in-place all-gather of those chunks then rebuilds the whole sum on every rank."""
    from mpisgd.comm.base import chunk_bounds
    from mpisgd.comm.mpi import mpi_sum_type

    if name == "mpi" and mpi_sum_type(np.dtype(dtype)) is None:  # the same library on every rank: all skip
        pytest.skip(f"this MPI library cannot sum {dtype} (auto and ring can)")
    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    x = local_values(n, dtype, r)
    expected = oracle(comm, x)
    bounds = chunk_bounds(n, k)
    counts = [bounds[c + 1] - bounds[c] for c in range(k)]
    if name == "ring-tiny-segments":  # many slices, several in flight, segments of uneven length
        red = RingReducer(comm, transport="p2p", segment_bytes=8, window=2)
    elif name == "ring-deterministic":  # no reduce-scatter of its own: the full all-reduce, then a copy
        red = RingReducer(comm, deterministic=True)
    else:
        red = create_reducer(name, comm)
    native = red.native_reduce_scatter
    buf = x.copy()
    out = np.full(counts[r], 99, dtype=dtype)
    h = red.start_reduce_scatter(buf, out, counts)
    while not h.test():
        pass
    h.wait()
    mine = out.copy()
    whole = np.zeros(n, dtype=dtype)
    whole[bounds[r]:bounds[r + 1]] = out  # others' chunks arrive through the all-gather
    red.allgather_(whole, counts)
    untouched = bool(np.array_equal(buf, x))
    reduced_in_buf = bool(np.array_equal(buf, expected))
    red.close()
    np.testing.assert_array_equal(mine, expected[bounds[r]:bounds[r + 1]])
    np.testing.assert_array_equal(whole, expected)
    if name in ("mpi", "auto"):
        assert untouched  # a true reduce-scatter (MPI_Ireduce_scatter, or auto's direct one), not an all-reduce
    if name == "auto":  # every rank of these tests is on one node: auto's direct reduce-scatter ran
        from mpisgd.comm.direct import DirectOp

        assert isinstance(h, DirectOp)
    assert native == (name in ("mpi", "auto", "ring", "ring-tiny-segments"))
    if name.startswith("ring") and native:
        assert not reduced_in_buf  # the ring's own reduce-scatter ran, not an all-reduce of buf


def test_direct_reduce_scatter_sums_in_rank_order_with_two_buckets_in_flight():
    """auto's direct reduce-scatter on one node: two buffers in flight at once (as the training buckets
    are) each get their own receive buffer, and every chunk is the rank-order float32 sum, bit for bit,
    whichever rank owns it (rounded values: at k >= 3 another order gives other bits)."""
    from mpisgd.comm.base import chunk_bounds

    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm)
    sizes = (1000, 999)
    xs = [np.random.default_rng(100 * r + i).standard_normal(n).astype("float32") for i, n in enumerate(sizes)]
    everyone = [comm.allgather(x) for x in xs]
    handles, outs = [], []
    for x, n in zip(xs, sizes):
        b = chunk_bounds(n, k)
        counts = [b[c + 1] - b[c] for c in range(k)]
        outs.append(np.empty(counts[r], dtype="float32"))
        handles.append(red.start_reduce_scatter(x, outs[-1], counts))
    for h in reversed(handles):
        h.wait()
    with pytest.raises(ValueError, match="counts"):
        red.start_reduce_scatter(xs[0], outs[0], [sizes[0]] + [0] * (k - 2))  # k - 1 chunks: refused at once
    red.close()
    for parts, out, n in zip(everyone, outs, sizes):
        b = chunk_bounds(n, k)
        want = parts[0][b[r]:b[r + 1]].copy()
        for p in parts[1:]:
            want += p[b[r]:b[r + 1]]
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_direct_allreduce_in_place_finishes_in_any_order_on_each_rank(dtype):
    """auto's non-blocking all-reduce of large buffers on one node: three in flight, tested in a
    different order on each rank (so their second phases start in different orders: their messages
    must not meet), some with n < k (empty chunks); each ends as the rank-order sum on every rank,
    bit for bit (rank r >= 2 sums into a spare row, not over its own part)."""
    from mpisgd.comm.direct import DirectOp

    comm = world()
    k, r = comm.Get_size(), comm.Get_rank()
    red = AutoReducer(comm)
    sizes = (4099, 1, 2 * k + 1)
    xs = [np.random.default_rng(10 * r + i).standard_normal(n).astype(dtype) for i, n in enumerate(sizes)]
    everyone = [comm.allgather(x.copy()) for x in xs]
    handles = [red.direct.allreduce(x) for x in xs]
    comm.Barrier()  # the first halves (small, eager) arrive here, so the sweeps below start the second
    order = [(i + r) % len(handles) for i in range(len(handles))]  # halves in this rank-dependent order
    while not all([handles[i].test() for i in order]):
        pass
    big = np.ones((red.start_crossover_bytes // 4) + 1, dtype="float32") * (r + 1)
    h = red.start(big)  # above the crossover: auto picks the direct all-reduce
    h.wait()
    desc = red.describe()
    red.close()
    assert "the direct operations" in desc  # the banner says so
    assert isinstance(h, DirectOp)
    assert np.all(big == k * (k + 1) / 2)
    for parts, x in zip(everyone, xs):
        want = parts[0].copy()
        for p in parts[1:]:
            want += p
        np.testing.assert_array_equal(x, want)
    digests = comm.allgather(hashlib.sha1(np.concatenate(xs).tobytes()).hexdigest())
    assert len(set(digests)) == 1  # identical replicas
