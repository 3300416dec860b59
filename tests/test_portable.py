"""The portable kernels (mpisgd.portable, mpisgd.kernels): their GEMMs are exact integer sums, so any
BLAS kernel, thread count and NumPy build gives the same bits (checked in child processes under
emulated machines, with the float32 GEMM as the negative control); their sums follow one fixed
order; exp, log, tanh and erf come within a few float64 ulps of the C library's from IEEE operations
only; every layer's backward passes the float64 gradient check at the portable level; their error
against a float64 reference is no larger than the fast kernels'."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, clean_env, openmpi_env, serial_only, train_here

from mpisgd import pinning
from mpisgd.kernels import FAST, PortableKernels, kernels_for
from mpisgd.nn import (
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool2d,
    Linear,
    MaxPool2d,
    Module,
    Permute,
    ReLU,
    Residual,
    Sequential,
    SoftmaxCrossEntropy,
)
from mpisgd.nn.gradcheck import check_gradients
from mpisgd.portable import elementwise, gemm, reduce, scalar, weight
from mpisgd.schedule import Schedule


def operands(rng: np.random.Generator, m: int, k: int, n: int, dtype: str = "float32") -> tuple:
    """A with rows of very different magnitudes, B heavy-tailed: what scaling per row and column is for."""
    a = rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1)) * 3)
    b = rng.standard_t(3, (k, n))
    return a.astype(dtype), b.astype(dtype)


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


# -- the GEMM --------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,k,n", [(5, 7, 3), (64, 257, 33), (128, 784, 40), (3, 1000, 5)])
def test_the_slices_multiply_to_exact_integers(m, k, n):
    """Every product of slices is a sum of integers below 2^53 (float32 operands' slices hold them with
    their powers of two applied): BLAS's float64 result equals NumPy's exact int64 matmul (which no BLAS
    computes) with those powers of two, whatever the chunking."""
    a, b = operands(np.random.default_rng(k), m, k, n)
    ws = gemm.Workspace()
    sa, sb = gemm.split(a, "left", ws), gemm.split(b, "right", ws)
    qa, qb = sa.integers(), sb.integers()
    assert np.array_equal(qa, np.rint(qa)) and np.array_equal(qb, np.rint(qb))
    exact = np.matmul(qa.astype(np.int64), qb.astype(np.int64))
    assert np.abs(exact).max() < 2**53
    assert sa.applied and sb.applied
    scale = sa.slices[0][1] * sb.slices[0][1]  # (nc, m, 1) x (nc, 1, n): powers of two
    assert np.array_equal(np.matmul(sa.slices[0][0], sb.slices[0][0]) * scale, exact)
    # the norms the scales come from bound the integers as the exactness argument needs
    assert np.sqrt((qa * qa).sum(axis=-1)).max() <= 2**gemm.GAMMA + math.sqrt(sa.kc) / 2
    assert np.sqrt((qb * qb).sum(axis=-2)).max() <= 2**gemm.GAMMA + math.sqrt(sb.kc) / 2


def test_transposed_batched_and_broadcast_operands_give_the_plain_product():
    rng = np.random.default_rng(1)
    a, b = operands(rng, 40, 300, 20)
    want = a.astype(np.float64) @ b.astype(np.float64)
    plain = gemm.matmul(a, b)
    assert rel_error(plain, want) < 1e-6
    # the same values through transposed views: the same bits (the split reads them as their transposes)
    assert np.array_equal(gemm.matmul(np.asfortranarray(a), np.asfortranarray(b)), plain)
    w, cols = rng.standard_normal((6, 25)).astype(np.float32), rng.standard_normal((25, 50, 16)).astype(np.float32)
    y = np.empty((6, 50, 16), np.float32)
    gemm.matmul(w, cols.transpose(1, 0, 2), out=y.transpose(1, 0, 2))  # Conv2d's per-position products
    ref = np.einsum("ck,kpn->cpn", w.astype(np.float64), cols.astype(np.float64))
    assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max()
    # a split made once, used for several products (Conv2d's input gradient)
    ws = gemm.Workspace()
    right = gemm.split(cols.transpose(1, 0, 2)[:, :6], "right", ws, tag="once")
    for _ in range(3):
        wi = rng.standard_normal((4, 6)).astype(np.float32)
        assert np.array_equal(gemm.matmul(wi, right, ws=ws), gemm.matmul(wi, cols.transpose(1, 0, 2)[:, :6]))


def test_a_shared_workspace_gives_the_bits_of_a_fresh_one():
    """Inner dimensions 1000 and 999 cut alike (4 chunks of 250): the second's short last chunk must not
    keep the first's padding (it did: a wrong product)."""
    rng = np.random.default_rng(12)
    ws = gemm.Workspace()
    for k in (1000, 999, 1000):
        a, b = rng.standard_normal((8, k)).astype(np.float32), rng.standard_normal((k, 5)).astype(np.float32)
        assert np.array_equal(gemm.matmul(a, b, ws=ws), gemm.matmul(a, b))


def test_the_convolutions_share_one_set_of_samples_per_shape_and_keep_their_bits():
    """Each convolution kept its own samples for forward, the weight gradient and dx (scratch used by the
    product that follows): a ResNet-20 held 1.7 GiB of them. Four layers of one shape now hold what one
    does, and train to the bits of a model whose layers each have their own."""
    from mpisgd.portable.samples import Samples

    def trained(layers: int, own: bool, kernels: str = "portable") -> tuple[np.ndarray, int]:
        convs = [m for _ in range(layers) for m in (Conv2d(3, 3, 3, padding=1), ReLU())]
        model = Sequential(*convs, Flatten(), Linear(3 * 6 * 6, 4)).materialize(np, "float32", seed=1)
        model.ctx.kernels = kernels_for(kernels)
        if own:  # the old way: a workspace per Samples
            model.ctx.kernels.sample_space = None
        rng = np.random.default_rng(3)
        loss = SoftmaxCrossEntropy(model.ctx.kernels)
        for _ in range(2):
            loss.forward_array(model.forward(rng.standard_normal((5, 3, 6, 6)).astype(np.float32)),
                               rng.integers(0, 4, 5))
            model.backward(loss.backward())
        found = {id(s.ws): s.ws for m in model._modules for s in vars(m).values() if isinstance(s, Samples)}
        return model.flat.grads.copy(), sum(ws.nbytes() for ws in found.values())

    one = trained(1, own=False)[1]
    grads, four = trained(4, own=False)
    own_grads, own_four = trained(4, own=True)
    assert four == one and own_four > 3 * one, (one, four, own_four)
    assert np.array_equal(grads, own_grads)
    assert not np.array_equal(grads, trained(4, own=False, kernels="fast")[0])  # the comparison can fail


def test_float64_operands_use_two_slices_to_float64_accuracy():
    a, b = operands(np.random.default_rng(2), 30, 600, 20, "float64")
    assert rel_error(gemm.matmul(a, b), a @ b) < 1e-13


def test_non_finite_and_zero_inputs_and_empty_inner_dimension():
    a = np.zeros((3, 4), np.float32)
    b = np.ones((4, 2), np.float32)
    assert np.array_equal(gemm.matmul(a, b), np.zeros((3, 2), np.float32))
    a[1, 2] = np.nan
    got = gemm.matmul(a, b)
    assert np.isnan(got[1]).all() and np.array_equal(got[[0, 2]], np.zeros((2, 2)))
    assert gemm.matmul(np.ones((2, 0), np.float32), np.ones((0, 3), np.float32)).tolist() == [[0] * 3] * 2
    with pytest.raises(ValueError, match="do not chain"):
        gemm.matmul(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="float32 or float64"):
        gemm.matmul(np.ones((2, 3), np.float16), np.ones((3, 3), np.float16))


def test_rows_far_below_and_above_float32_s_squares_stay_accurate():
    """Squares of float32 values flush below 2^-75 and overflow from 2^64: such rows take their scale from
    their largest element (exact) instead, and keep their accuracy."""
    a = np.ones((5, 300), np.float32)
    a[0, :5], a[1], a[2], a[3, :7], a[4, 3] = 3e19, 1e-30, 1e-45, 1e-20, np.inf
    b = np.random.default_rng(10).standard_normal((300, 4)).astype(np.float32)
    got, want = gemm.matmul(a, b), a.astype(np.float64) @ b.astype(np.float64)
    size = np.abs(a[:4]).astype(np.float64) @ np.abs(b).astype(np.float64)  # |a| |b|: what the error is relative to
    assert (np.abs(got[:4] - want[:4]) <= 1e-6 * size + 1e-44).all() and not np.isfinite(got[4]).any()


@pytest.mark.parametrize("spread", [1.2, 3.0, 10.0])
def test_a_weight_split_once_serves_both_products(spread):
    """Linear's W: x @ W and dy @ W.T exactly (int64 agrees) and at least as accurately as float32 BLAS,
    from tiles scaled once where its columns' norms spread little (a trained MLP's spread 2.2 to 2.5),
    split per product where they spread 10x (tiles would cost their weak columns bits)."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((784, 300)) * np.exp(rng.uniform(0, np.log(spread), 300))).astype(np.float32)
    x, dy = rng.standard_normal((64, 784)).astype(np.float32), rng.standard_normal((64, 300)).astype(np.float32)
    prepared = weight.Weight().prepare(w)
    assert (prepared.right.slices[0][0].base is prepared.T.slices[0][0].base) == (spread < weight.SPREAD)
    for q in (prepared.right.integers(), prepared.T.integers()):
        assert np.array_equal(q, np.rint(q)) and np.sqrt((q * q).sum(axis=-2)).max() <= 2**gemm.GAMMA + 8
    for a, b, wt in ((x, w, prepared.right), (dy, w.T, prepared.T)):
        want = a.astype(np.float64) @ b.astype(np.float64)
        assert rel_error(gemm.matmul(a, wt), want) <= rel_error(a @ b, want)
    sx = gemm.split(x, "left", gemm.Workspace())
    qa, qb = sx.integers(), prepared.right.integers()
    scale = sx.slices[0][1] * prepared.right.slices[0][1]
    assert np.array_equal(np.matmul(sx.slices[0][0], prepared.right.slices[0][0]) * scale,
                          np.matmul(qa.astype(np.int64), qb.astype(np.int64)))


@pytest.mark.parametrize("shape", [(784, 300), (1000, 999), (300, 10), (5, 7)])
def test_a_weight_split_per_product_is_what_split_makes(shape):
    """Where tiles would cost bits, Weight makes W's integers for each product in one sweep of its own
    (blocks of rows, from the norms it folded for the tiles): they, their scales and the products are
    those of split(W) and split(W.T) (shapes with padded chunks on either side; one that overflows
    float32's squares, which takes the largest elements instead)."""
    rng = np.random.default_rng(12)
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(0, np.log(50.0), shape[1]))).astype(np.float32)
    w[0, :3] = 3e19  # squares overflow float32: these columns and rows take the largest-element bound
    prepared = weight.Weight().prepare(w)
    assert prepared.right.slices[0][0].base is not prepared.T.slices[0][0].base  # per product, not tiles
    for got, want in ((prepared.right, gemm.split(w, "right", gemm.Workspace())),
                      (prepared.T, gemm.split(w.T, "right", gemm.Workspace()))):
        assert (got.nc, got.kc, got.shape, got.applied) == (want.nc, want.kc, want.shape, want.applied)
        assert np.array_equal(got.slices[0][0], want.slices[0][0])
        assert np.array_equal(got.slices[0][1], want.slices[0][1])
    x, dy = rng.standard_normal((9, shape[0])).astype(np.float32), rng.standard_normal((9, shape[1])).astype(np.float32)
    assert np.array_equal(gemm.matmul(x, prepared.right), gemm.matmul(x, w))
    assert np.array_equal(gemm.matmul(dy, prepared.T), gemm.matmul(dy, w.T))


@pytest.mark.parametrize("shape", [(128, 784, 1024), (1024, 128, 1024), (128, 1024, 10), (25, 3584, 6)])
def test_portable_products_are_at_least_as_accurate_as_float32_blas(shape):
    """Against the float64 product of the same float32 operands: the portable product's relative error
    (Frobenius) is no larger than the float32 GEMM's. Operands shaped as the MLP's and LeNet-5's GEMMs
    (forward, weight gradient, LeNet's conv weight gradient), with ReLU-like and heavy-tailed values."""
    m, k, n = shape
    rng = np.random.default_rng(m + k + n)
    a = np.maximum(rng.standard_normal((m, k)), 0).astype(np.float32)
    b = (rng.standard_t(4, (k, n)) * np.exp(rng.standard_normal(n))).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert rel_error(gemm.matmul(a, b), want) <= rel_error(a @ b, want)


def conv_errors(conv: Conv2d, x: np.ndarray, dy: np.ndarray, kinds: tuple[str, ...]) -> dict[str, list[float]]:
    """Relative errors of y, dW and dx of one Conv2d (batch last inside: x and dy are (C, H, W, N)) with
    each kind of kernels in float32, against the same layer in float64."""
    got = {}
    for kind in ("float64", *kinds):
        model = conv.materialize(np, "float64" if kind == "float64" else "float32", seed=0)
        model.ctx.kernels = kernels_for("fast" if kind == "float64" else kind)
        layer = model.module
        layer.batch_last = True
        dtype = model.flat.params.dtype
        y = np.array(layer.forward_bl(x.astype(dtype)), np.float64)
        dx = np.array(layer.backward_bl(dy.astype(dtype)), np.float64)
        got[kind] = [y, np.array(layer.grads["W"], np.float64), dx]
    return {kind: [rel_error(g, w) for g, w in zip(got[kind], got["float64"], strict=True)] for kind in kinds}


@pytest.mark.parametrize("layer,shape,relu", [((1, 6, 5, 1, 2), (1, 28, 28), False),
                                              ((6, 16, 5, 1, 0), (6, 14, 14), True),
                                              ((16, 16, 3, 1, 1), (16, 8, 8), True),
                                              ((8, 12, 3, 2, 1), (8, 9, 9), True)])
def test_portable_convolutions_are_at_least_as_accurate_as_float32_blas(layer, shape, relu):
    """Conv2d's output, weight gradient and input gradient from integers with one power of two per sample
    (mpisgd.portable.samples): no less accurate than the fast kernels' float32 BLAS, against float64. LeNet-5's two
    convolutions (image-like input; ReLU-like input), ResNet's "same" 3 x 3 (its input gradient a
    convolution of dy: per-sample scales of dy) and a strided one; samples of very different magnitudes."""
    c_in, c_out, k, stride, pad = layer
    rng = np.random.default_rng(sum(shape) + k)
    n = 32
    x = rng.standard_normal((*shape, n)) * np.exp(rng.standard_normal(n) * 2)  # one magnitude per sample
    x = np.maximum(x, 0) if relu else np.abs(x)
    conv = Conv2d(c_in, c_out, k, stride=stride, padding=pad)
    ho = (shape[1] + 2 * pad - k) // stride + 1
    dy = rng.standard_normal((c_out, ho, ho, n)) * np.exp(rng.standard_normal(n))
    x, dy = x.astype(np.float32), dy.astype(np.float32)
    errors = conv_errors(conv, x, dy, ("fast", "portable"))
    for name, fast, portable in zip(("y", "dW", "dx"), errors["fast"], errors["portable"], strict=True):
        assert portable <= fast, (name, portable, fast)


# A child process: the portable and the float32 product of fixed operands, the portable and NumPy's
# float32 exp, and a portable tree sum, as digests (the machine under test is the child's environment).
CHILD = """
import hashlib, json, numpy as np
from mpisgd.portable import elementwise, gemm, reduce
rng = np.random.default_rng(0)
a = (rng.standard_normal((128, 784)) * np.exp(rng.standard_normal((128, 1)))).astype(np.float32)
b = rng.standard_normal((784, 300)).astype(np.float32)
x = rng.uniform(-80, 80, 100000).astype(np.float32)
d = lambda v: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16]
print(json.dumps({"portable": d(gemm.matmul(a, b)) + d(elementwise.exp(x)) + d(elementwise.log(np.abs(x)))
                  + d(elementwise.tanh(x / 9)) + d(reduce.tree_sum(a, 0)),
                  "gemm": d(a @ b), "exp": d(np.exp(x)), "tanh": d(np.tanh(x / 9))}))
"""


def machines() -> list[dict[str, str]]:
    """Emulated machines: OpenBLAS core types this CPU can run (SkylakeX needs AVX-512) x NumPy dispatch."""
    flags = pinning.cpu_flags()
    cores = [c for c in ("SkylakeX", "Haswell", "Sandybridge", "Prescott")
             if c != "SkylakeX" or "avx512f" in flags]
    # NumPy >= 2.4's names (X86_V4 ...) and earlier ones (AVX512F ...): each NumPy ignores the other's
    dispatch = ["", "X86_V4 AVX512_ICL AVX512_SPR AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL",
                "X86_V3 X86_V4 AVX512_ICL AVX512_SPR AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX2 FMA3 "
                "F16C AVX"]
    return [{"OPENBLAS_CORETYPE": c, "NPY_DISABLE_CPU_FEATURES": d, "OPENBLAS_NUM_THREADS": t}
            for c in cores for d, t in zip(dispatch, ("1", "2", "1"), strict=True)]


def child(env: dict[str, str], python: str = sys.executable) -> dict[str, str]:
    r = subprocess.run([python, "-c", CHILD], capture_output=True, text=True, timeout=300,
                       env={**clean_env(), "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", **env})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_same_bits_under_every_emulated_machine_and_the_fast_kernels_differ():
    """Four OpenBLAS core types x three NumPy dispatch levels (and 1 or 2 threads), NumPy's passes in place
    of the compiled ones, and Debian's NumPy and OpenBLAS where installed: the portable results agree bit
    for bit, while the float32 GEMM, NumPy's exp and tanh take several values (the negative control: the
    emulation changes what it should)."""
    runs = [child(env) for env in machines()]
    runs.append(child({"MPISGD_PORTABLE_PASSES": "ufunc"}))  # NumPy's passes where the C ones are built
    debian = openmpi_env()
    if debian is not None:
        runs.append(child({}, str(debian / "bin" / "python")))
    assert len({r["portable"] for r in runs}) == 1, runs
    assert len({r["gemm"] for r in runs}) >= 3
    assert len({r["exp"] for r in runs}) >= 2 and len({r["tanh"] for r in runs}) >= 2


# -- sums and elementwise functions ------------------------------------------------------------------
def test_tree_sums_follow_one_order_whatever_the_layout():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((37, 129)) * 10.0 ** rng.integers(-8, 8, (37, 129))).astype(np.float32)
    rows = reduce.tree_sum(x, 1)
    assert rows.dtype == np.float32
    assert np.array_equal(rows, reduce.tree_sum(np.asfortranarray(x), 1))
    assert np.array_equal(reduce.tree_sum(x, 0), reduce.tree_sum(x.T.copy(), 1))
    exact = np.array([math.fsum(r) for r in x.astype(np.float64)], dtype=np.float32)
    assert np.array_equal(rows, exact) or np.abs(rows - exact).max() <= np.abs(exact).max() * 2**-22
    out = np.empty((37, 1), np.float32)
    reduce.tree_sum(x, 1, out=out, keepdims=True)
    assert np.array_equal(out[:, 0], rows)
    assert reduce.tree_sum(np.zeros((3, 0), np.float32), 1).tolist() == [0.0] * 3
    assert reduce.tree_mean(np.arange(10, dtype=np.float32)) == np.float32(4.5)


def ulps(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want) / np.spacing(np.abs(want))))


@pytest.mark.parametrize("name,lo,hi,limit", [("exp", -740, 709, 1), ("exp", -1, 1, 1), ("expm1", -2, 2, 4),
                                              ("log", 1e-300, 1e300, 1), ("log", 0.5, 2, 1),
                                              ("tanh", -20, 20, 4), ("erf", -6.5, 6.5, 8), ("erf", 1.5, 2.5, 8)])
def test_elementary_functions_are_within_a_few_float64_ulps(name, lo, hi, limit):
    rng = np.random.default_rng(4)
    x = np.exp(rng.uniform(math.log(lo), math.log(hi), 20000)) if name == "log" and lo > 0 and hi / lo > 1e6 \
        else rng.uniform(lo, hi, 20000)
    got = getattr(elementwise, f"{name}64" if name != "expm1" else "expm1_64")(x)
    want = np.array([getattr(math, name)(v) for v in x])
    assert ulps(got, want) <= limit


def test_elementary_functions_special_values_and_float32_rounding():
    assert np.array_equal(elementwise.exp64(np.array([-np.inf, 0.0, 800.0, -800.0])), [0.0, 1.0, np.inf, 0.0])
    assert np.isnan(elementwise.exp64(np.array([np.nan]))).all()
    assert elementwise.log64(np.array([0.0, 1.0, np.inf])).tolist() == [-np.inf, 0.0, np.inf]
    assert np.isnan(elementwise.log64(np.array([-1.0, np.nan]))).all()
    assert elementwise.tanh64(np.array([-np.inf, 0.0, np.inf])).tolist() == [-1.0, 0.0, 1.0]
    assert elementwise.erf64(np.array([-np.inf, -0.0, np.inf])).tolist() == [-1.0, -0.0, 1.0]
    # float32 results: rounded once from float64 values within an ulp: correctly rounded but at near-ties
    x = np.random.default_rng(5).uniform(-80, 80, 100000).astype(np.float32)
    want = np.exp(x.astype(np.float64)).astype(np.float32)
    assert np.count_nonzero(elementwise.exp(x) != want) <= 10
    assert elementwise.exp(x).dtype == np.float32
    assert np.array_equal(elementwise.rsqrt(np.float32([4.0, 0.25])), np.float32([0.5, 2.0]))


def test_portable_cosine_and_powers():
    for p in np.linspace(0, 1, 4001):
        assert abs(scalar.cos_pi(p) - math.cos(math.pi * p)) <= 4e-16
    assert scalar.cos_pi(0.5) == 0.0 and scalar.cos_pi(1.0) == -1.0 and scalar.cos_pi(2.5) == 0.0
    assert all(scalar.power(0.999, t) == pytest.approx(0.999**t, rel=1e-13) for t in range(3000))
    assert scalar.power(2.0, 10) == 1024.0 and scalar.power(0.5, 0) == 1.0
    with pytest.raises(ValueError):
        scalar.power(2.0, -1)
    # the default schedule computes exactly what it did before (the C library's); the reproducible one portably
    plain = Schedule(0.1, 0.4, 0, 1000, "cosine")
    assert all(plain(s) == 0.5 * 0.4 * (1.0 + math.cos(math.pi * (s / 1000))) for s in range(1000))
    portable = Schedule(0.1, 0.4, 0, 1000, "cosine", scalar_math=scalar.PORTABLE)
    assert all(portable(s) == 0.5 * 0.4 * (1.0 + scalar.cos_pi(s / 1000)) for s in range(1000))
    assert Schedule(0.1, 0.1, 0, 100, "step", (10, 20), 0.1, scalar.PORTABLE)(25) == 0.1 * scalar.power(0.1, 2)


# -- layers ------------------------------------------------------------------------------------------
LAYERS = {
    "linear": (lambda: Sequential(Linear(6, 5), ReLU(), Linear(5, 4)), (3, 6)),
    "conv": (lambda: Sequential(Permute((1, 2, 3, 0)), Conv2d(2, 3, 3, padding=1), MaxPool2d(2), ReLU(),
                                Conv2d(3, 2, 3), Permute((3, 0, 1, 2)), Flatten(), Linear(8, 3)), (2, 2, 8, 8)),
    "residual": (lambda: Sequential(Linear(4, 4), Residual(Sequential(Linear(4, 4), ReLU(), Linear(4, 4))),
                                    Dropout(0.25), Linear(4, 2)), (5, 4)),
    "batchnorm": (lambda: Sequential(Conv2d(2, 4, 3, padding=1), BatchNorm2d(4), ReLU(), AvgPool2d(2),
                                     GlobalAvgPool2d(), Linear(4, 5), BatchNorm1d(5), Linear(5, 3)), (6, 2, 6, 6)),
}


@pytest.mark.parametrize("name", LAYERS)
def test_every_layer_passes_the_gradient_check_with_portable_kernels(name):
    make, shape = LAYERS[name]
    x = np.random.default_rng(6).standard_normal(shape)
    errors = check_gradients(make(), x, kernels=PortableKernels())
    assert errors and all(e.ok for e in errors), [e for e in errors if not e.ok]


def test_the_loss_through_the_portable_kernels():
    from mpisgd.nn import SoftmaxCrossEntropy

    rng = np.random.default_rng(7)
    logits, labels = rng.standard_normal((16, 10)).astype(np.float32) * 5, rng.integers(0, 10, 16)
    fast, portable = SoftmaxCrossEntropy(), SoftmaxCrossEntropy(kernels_for("portable"))
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = -np.mean(np.log(p[np.arange(16), labels]))
    assert float(portable.forward_array(logits.copy(), labels)) == pytest.approx(want, rel=1e-6)
    assert float(fast.forward_array(logits.copy(), labels)) == pytest.approx(want, rel=1e-6)
    g = portable.backward(0.5)
    onehot = np.eye(10)[labels]
    assert np.abs(g - 0.5 * (p - onehot)).max() < 1e-7


def test_fast_kernels_are_the_array_module_s_own():
    """The default: the same functions with the same arguments as before the choice existed."""
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((9, 17)).astype(np.float32), rng.standard_normal((17, 4)).astype(np.float32)
    assert np.array_equal(FAST.matmul(a, b), np.matmul(a, b)) and FAST.right(b) is b and FAST.left(a) is a
    assert np.array_equal(FAST.sum(a, axis=0), np.sum(a, axis=0)) and FAST.mean(a) == a.mean()
    assert np.array_equal(FAST.exp(a), np.exp(a)) and np.array_equal(FAST.log(np.abs(a)), np.log(np.abs(a)))
    assert kernels_for("fast") is FAST and kernels_for("portable").name == "portable"
    with pytest.raises(ValueError, match="unknown kernels"):
        kernels_for("fastest")


def test_a_portable_model_trains_and_agrees_with_the_fast_one_to_float32_rounding():
    from mpisgd.nn import SoftmaxCrossEntropy, cnn

    rng = np.random.default_rng(9)
    x, y = rng.standard_normal((16, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 16)
    grads = {}
    for kind in ("fast", "portable"):
        model = cnn().materialize(np, "float32", seed=0)
        model.ctx.kernels = kernels_for(kind)
        loss = SoftmaxCrossEntropy(model.ctx.kernels)
        loss.forward_array(model.forward(x), y)
        model.backward(loss.backward())
        grads[kind] = model.flat.grads.copy()
    assert not np.array_equal(grads["fast"], grads["portable"])  # other roundings...
    assert rel_error(grads["portable"], grads["fast"].astype(np.float64)) < 1e-5  # ...of the same gradient


# -- models the portable kernels do not cover ----------------------------------------------------------
class Squash(Module):
    """A module of one's own whose forward calls NumPy's tanh: its bits are NumPy's SIMD loop's."""

    def forward(self, x):
        self._y = np.tanh(x)
        return self._y

    def backward(self, dy, need_dx=True):
        return dy * (1 - self._y * self._y) if need_dx else None


def squashed(input_shape, n_classes):
    return Sequential(Flatten(), Linear(int(np.prod(input_shape)), 8), Squash(), Linear(8, n_classes))


@serial_only  # in this process, one rank
@pytest.mark.parametrize("model,names", [("test_portable:squashed", "(Squash:")])
def test_the_portable_level_refuses_a_model_it_does_not_cover_in_one_line(model, names, monkeypatch):
    """Its bits would change with the machine while the banner promised otherwise (and the portable level
    skips the check that every rank rounds alike): refused before training, naming the modules."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    run = ["--dataset", "synthetic", "--synthetic-samples", "96", "--model", model, "--batch-size", "8",
           "--global-batch", "16", "--max-steps", "1", "--progress", "off", "--limit-test", "32",
           "--warmup-epochs", "0"]
    r = train_here([*run, "--reproducible", "portable"])
    assert r.statuses == (2,) and "epoch " not in r.out, r
    line = r.error
    assert line.startswith(f"mpisgd: error: --reproducible portable: --model {model} has modules the portable "
                           "kernels do not cover yet") and names in line, line
    assert train_here(run).status == 0  # the model itself trains (the pinned level re-executes: not in process)


def test_a_small_gpt_passes_the_gradient_check_with_portable_kernels():
    from mpisgd.nn import GPTShape, gpt

    shape = GPTShape(vocab=11, context=6, layers=1, heads=2, width=8, dropout=0.2)
    ids = np.random.default_rng(10).integers(0, 11, (3, 6))
    errors = check_gradients(gpt(shape), ids, samples=6, kernels=PortableKernels())
    assert len(errors) == 2 + 12 + 4 and all(e.ok for e in errors), [e for e in errors if not e.ok]


def test_the_per_position_loss_through_the_portable_kernels():
    from mpisgd.nn import TokenCrossEntropy

    rng = np.random.default_rng(11)
    logits, labels = rng.standard_normal((4, 5, 7)).astype(np.float32) * 4, rng.integers(0, 7, (4, 5))
    labels[0, :2] = -1  # ignored
    fast, portable = TokenCrossEntropy(), TokenCrossEntropy(kernels=kernels_for("portable"))
    got, want = float(portable.forward_array(logits.copy(), labels)), float(fast.forward_array(logits.copy(), labels))
    assert got == pytest.approx(want, rel=1e-6)
    np.testing.assert_allclose(portable.backward(0.5), fast.backward(0.5), rtol=1e-5, atol=1e-7)
