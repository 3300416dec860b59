"""The fixed-point codec and the k-free norms of the reproducible mode (mpisgd.exact), without MPI."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpisgd.exact import NO_EXPONENT, FixedPoint, exponent_of
from mpisgd.optim.norms import BlockNorms, block_boundaries
from mpisgd.parallel.sharded import partition

OFFSETS = [0, 3000, 3010, 9000, 9100]  # four tensors: a big one, a small one, another big one, a bias


def micro_gradients(m: int, seed: int = 0, dtype=np.float32, spread: int = 40) -> list[np.ndarray]:
    """m gradients whose elements span ``spread`` binades, signs mixed."""
    rng = np.random.default_rng(seed)
    n = OFFSETS[-1]
    return [(rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-spread, 0, n)).astype(dtype) for _ in range(m)]


def exact_sum(gs: list[np.ndarray]) -> np.ndarray:
    return np.array([math.fsum(float(g[i]) for g in gs) for i in range(gs[0].size)])


def encode_all(codec: FixedPoint, gs: list[np.ndarray]) -> np.ndarray:
    n = gs[0].size
    total, scratch = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i, g in enumerate(gs):
        codec.encode_(g, total, 0, n, i > 0, scratch)
    return total


def calibrated(gs: list[np.ndarray], terms: int) -> FixedPoint:
    codec = FixedPoint(OFFSETS, terms)
    codec.start_step()
    for g in gs:
        codec.measure(g, 0, g.size)
    codec.set_exponents(codec.needed)
    return codec


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_sum_is_exact_to_the_bound_and_beats_a_float_sum(dtype):
    """Against math.fsum: each term loses less than one unit of 2**-s, so the error is below
    terms * 2**-s per element; a float32 sum does worse wherever elements lie within ~2**35 of the
    tensor's norm (a float64 sum keeps 53 bits of each element, the fixed point ~50 below the norm)."""
    m = 12
    gs = micro_gradients(m, dtype=dtype)
    codec = calibrated(gs, m)
    out = np.empty(OFFSETS[-1], dtype)
    codec.decode(encode_all(codec, gs), out, 0, out.size)
    exact = exact_sum(gs)
    naive = gs[0].astype(dtype).copy()
    for g in gs[1:]:
        naive += g
    for t in range(len(OFFSETS) - 1):
        a, b = OFFSETS[t], OFFSETS[t + 1]
        unit = 1.0 / codec.scale(t)
        ours = np.abs(out[a:b].astype(np.float64) - exact[a:b])
        # truncation, then the one rounding to the dtype
        assert (ours <= m * unit + np.abs(exact[a:b]) * np.finfo(dtype).eps).all()
        if dtype is np.float32:
            near = np.abs(exact[a:b]) > 2.0 ** (codec.exponents[t] - 35)
            theirs = np.abs(naive[a:b].astype(np.float64) - exact[a:b])
            assert ours[near].sum() <= theirs[near].sum()


def test_any_grouping_of_the_terms_gives_the_same_integers():
    """What makes the sum k-free: integers added in any order and grouping are the same."""
    gs = micro_gradients(6, seed=1)
    codec = calibrated(gs, 6)
    whole = encode_all(codec, gs)
    parts = [encode_all(codec, gs[0:2]), encode_all(codec, gs[2:3]), encode_all(codec, gs[3:6])]
    assert np.array_equal(parts[2] + parts[0] + parts[1], whole)


def test_an_all_zero_tensor_and_an_all_zero_buffer():
    zero = [np.zeros(OFFSETS[-1], np.float32) for _ in range(3)]
    codec = calibrated(zero, 3)
    assert (codec.exponents == NO_EXPONENT).all() and not codec.overflow and not codec.nonfinite
    out = np.ones(OFFSETS[-1], np.float32)
    codec.decode(encode_all(codec, zero), out, 0, out.size)
    assert (out == 0).all()
    # a tensor zero last step and not now: it would overflow, so the step is computed again
    codec.start_step()
    codec.measure(micro_gradients(1)[0], 0, OFFSETS[-1])
    assert codec.overflow


def test_growth_beyond_the_headroom_is_an_overflow_and_within_it_is_not():
    g = micro_gradients(1, seed=2)[0]
    codec = calibrated([g], 2)
    for factor, overflow in ((2.0 ** (codec.headroom_bits - 1), False), (2.0 ** (codec.headroom_bits + 1), True)):
        codec.start_step()
        codec.measure(g * factor, 0, g.size)
        assert codec.overflow is overflow, factor


def test_nan_and_huge_finite_values():
    g = micro_gradients(1)[0]
    codec = calibrated([g], 1)
    bad = g.copy()
    bad[5] = np.nan
    codec.start_step()
    codec.measure(bad, 0, bad.size)
    assert codec.nonfinite
    huge = np.full(OFFSETS[-1], np.finfo(np.float32).max / 4, np.float32)  # finite; its squares are not
    codec.start_step()
    codec.measure(huge, 0, huge.size)
    assert not codec.nonfinite and codec.overflow  # far beyond the last step's exponents


def test_a_vanishing_gradient_is_scaled_in_float64():
    """A norm so small that 2**s leaves float32's range: the conversion goes through float64."""
    g = micro_gradients(1, spread=4)[0] * np.float32(2.0 ** -120)
    codec = calibrated([g], 1)
    assert codec.scale(0) > float(np.finfo(np.float32).max)
    out = np.empty_like(g)
    codec.decode(encode_all(codec, [g]), out, 0, g.size)
    np.testing.assert_allclose(out, g, rtol=1e-6)


def test_buckets_hold_whole_tensors_and_the_codec_says_so():
    codec = FixedPoint(OFFSETS, 1)
    assert list(codec.tensors_in(3000, 9000)) == [1, 2]
    with pytest.raises(ValueError):
        codec.tensors_in(100, 9000)


def test_exponent_bounds_the_norm():
    for x in (1e-30, 0.3, 1.0, 7.9, 1e20):
        assert 2.0 ** (exponent_of(x) - 1) <= x < 2.0 ** exponent_of(x)
    assert exponent_of(0.0) == NO_EXPONENT


# -- norms that do not depend on how tensors are cut among ranks ---------------------------------
def test_block_norms_are_the_same_bits_however_the_tensors_are_cut():
    rng = np.random.default_rng(3)
    big = [0, 10_000, 10_007, 30_001]  # tensors of 10000, 7 and 19994 elements
    g = rng.standard_normal(big[-1]).astype(np.float32)
    whole = BlockNorms(big, [(0, big[-1])]).squared([g])
    for k in (2, 3, 5):
        bounds = partition(0, big[-1], k, block_boundaries(big))
        ranges = [(int(a), int(b)) for a, b in zip(bounds, bounds[1:])]
        pieces = [[g[a:b].copy()] for a, b in ranges]  # each "rank" holds its chunk in a buffer of its own
        every = [BlockNorms(big, [r])._blocks(p) for r, p in zip(ranges, pieces)]
        gathered = BlockNorms(big, [ranges[0]], gather=lambda mine, every=every: [[e] for e in every])
        assert np.array_equal(gathered.squared([pieces[0][0]]), whole), k
    np.testing.assert_allclose(whole[0], [np.sum(g[a:b].astype(np.float64) ** 2) for a, b in zip(big, big[1:])],
                               rtol=1e-12)


def test_the_sharded_parts_end_only_on_block_boundaries():
    offsets = [0, 5000, 5003, 20_000]
    valid = {a + j for a, b in zip(offsets, offsets[1:]) for j in range(0, b - a, 1024)} | {20_000}
    assert set(block_boundaries(offsets, block=1024)) == valid
    for k in (1, 2, 3, 4, 7):
        bounds = partition(0, 20_000, k, block_boundaries(offsets, block=1024))
        parts = np.diff(bounds)
        assert len(parts) == k and bounds[0] == 0 and bounds[-1] == 20_000 and (parts >= 0).all()
        assert set(bounds) <= valid | {0}
        if k <= 4:  # near-equal where the blocks allow
            assert parts.max() - parts.min() <= 2 * 1024 + 3
