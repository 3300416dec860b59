"""IDX reading, the data-set search path, and the global-batch sharding rule."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from mpisgd.data import (
    FILES,
    BatchLoader,
    DataError,
    GlobalBatches,
    epoch_permutation,
    find_data_dir,
    load_fashion_mnist,
    read_idx,
    synthetic,
)


def write_idx(path: Path, array: np.ndarray, code: int = 0x08, compress: bool = False) -> None:
    header = struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


def fake_dataset(directory: Path, n_train: int = 20, n_test: int = 10, compress: bool = True) -> None:
    rng = np.random.default_rng(0)
    for key, stem in FILES.items():
        n = n_train if key.startswith("train") else n_test
        arr = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8) if "images" in key else \
            rng.integers(0, 10, n, dtype=np.uint8)
        write_idx(directory / (stem + (".gz" if compress else "")), arr, compress=compress)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trip(tmp_path, compress):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz" if compress else tmp_path / "a", arr, compress=compress)
    out = read_idx(tmp_path / ("a.gz" if compress else "a"))
    assert out.dtype == np.uint8 and np.array_equal(out, arr)


def test_idx_other_dtypes(tmp_path):
    arr = np.array([[1.5, -2.0], [3.25, 4.0]], dtype=np.float32)
    write_idx(tmp_path / "f", arr, code=0x0D)
    np.testing.assert_array_equal(read_idx(tmp_path / "f"), arr)


def test_idx_rejects_truncated(tmp_path):
    arr = np.zeros((4, 28, 28), np.uint8)
    write_idx(tmp_path / "t", arr)
    data = (tmp_path / "t").read_bytes()
    (tmp_path / "t").write_bytes(data[:-10])
    with pytest.raises(DataError, match="truncated"):
        read_idx(tmp_path / "t")


@pytest.mark.parametrize("cut", [3, 10, 4 * 28 * 28 - 1])  # in the magic, in the dims, in the payload
def test_idx_rejects_truncated_anywhere(tmp_path, cut):
    write_idx(tmp_path / "t", np.zeros((4, 28, 28), np.uint8))
    (tmp_path / "t").write_bytes((tmp_path / "t").read_bytes()[:cut])
    with pytest.raises(DataError, match="truncated|not an IDX file"):
        read_idx(tmp_path / "t")


@pytest.mark.parametrize("compress", [False, True])
def test_idx_with_an_impossible_header_is_a_clear_error_not_an_allocation(tmp_path, compress):
    header = struct.pack(">BBBB", 0, 0, 0x08, 3) + struct.pack(">III", 2**31, 2**31, 28)
    raw = header + b"\0" * 100
    name = "h.gz" if compress else "h"
    (tmp_path / name).write_bytes(gzip.compress(raw) if compress else raw)
    with pytest.raises(DataError, match="truncated"):
        read_idx(tmp_path / name)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_rejects_trailing_bytes(tmp_path, compress):
    arr = np.arange(3 * 1024 * 700, dtype=np.uint32).astype(">i4").reshape(3, -1)  # several read pieces
    write_idx(tmp_path / "x", arr, code=0x0C)
    (tmp_path / "x").write_bytes((tmp_path / "x").read_bytes() + b"\0")
    if compress:
        (tmp_path / "x.gz").write_bytes(gzip.compress((tmp_path / "x").read_bytes()))
    with pytest.raises(DataError, match="longer than its header says"):
        read_idx(tmp_path / ("x.gz" if compress else "x"))
    write_idx(tmp_path / "ok", arr, code=0x0C)  # and without the extra byte: big-endian int32 read back
    np.testing.assert_array_equal(read_idx(tmp_path / "ok"), arr.astype(np.int32))


def test_idx_rejects_wrong_magic(tmp_path):
    (tmp_path / "m").write_bytes(b"\x12\x34\x08\x01" + b"\x00" * 8)
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(tmp_path / "m")


def test_idx_rejects_bad_gzip(tmp_path):
    (tmp_path / "g.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="cannot read"):
        read_idx(tmp_path / "g.gz")


def test_search_order_and_message(tmp_path, monkeypatch):
    fake_dataset(tmp_path)
    monkeypatch.setenv("MPISGD_DATA", str(tmp_path))
    assert find_data_dir(None) == tmp_path
    with pytest.raises(DataError) as err:
        find_data_dir(str(tmp_path / "nope"))
    assert "nope" in str(err.value) and "apt-get install dataset-fashion-mnist" in str(err.value)
    monkeypatch.setenv("MPISGD_DATA", str(tmp_path / "empty"))
    monkeypatch.setattr("mpisgd.data.DEBIAN_DIR", str(tmp_path / "debian"))
    with pytest.raises(DataError, match="empty.*debian"):
        find_data_dir(None)


def test_load_plain_files(tmp_path):
    fake_dataset(tmp_path, compress=False)
    train, test, _ = load_fashion_mnist(str(tmp_path))
    assert train.images.shape == (20, 1, 28, 28) and len(test) == 10 and train.labels.dtype == np.int64


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="dataset-fashion-mnist absent")
def test_real_fashion_mnist_shapes():
    train, test, _ = load_fashion_mnist("/usr/share/datasets/fashion-mnist")
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert set(np.unique(train.labels)) == set(range(10))


def test_global_batches_do_not_depend_on_k():
    """k ranks x b see exactly the samples of 1 rank x k*b, batch by batch."""
    n, b = 1000, 8
    perm = epoch_permutation(n, seed=1, epoch=3)
    for k in (2, 3, 5):
        one = GlobalBatches(n, k * b, rank=0, world_size=1)
        shards = [GlobalBatches(n, k * b, rank=r, world_size=k) for r in range(k)]
        assert all(s.steps_per_epoch == one.steps_per_epoch for s in shards)
        for step in range(one.steps_per_epoch):
            together = np.concatenate([s.indices(perm, step, 0) for s in shards])
            assert np.array_equal(together, one.indices(perm, step, 0))


def test_shards_are_disjoint_and_equal_sized_with_accumulation():
    n, k, b, m = 997, 3, 4, 2
    perm = epoch_permutation(n, seed=0, epoch=0)
    seen = []
    for r in range(k):
        g = GlobalBatches(n, k * b * m, r, k, m)
        for step in range(g.steps_per_epoch):
            for micro in range(m):
                idx = g.indices(perm, step, micro)
                assert len(idx) == b
                seen.extend(idx.tolist())
    assert len(seen) == len(set(seen)) == (n // (k * b * m)) * k * b * m


def test_more_ranks_than_samples_is_an_error():
    with pytest.raises(DataError, match="fewer than one global batch"):
        GlobalBatches(10, 16, 0, 16)


def test_permutation_is_pure_function_of_seed_and_epoch():
    assert np.array_equal(epoch_permutation(50, 1, 2), epoch_permutation(50, 1, 2))
    assert not np.array_equal(epoch_permutation(50, 1, 2), epoch_permutation(50, 1, 3))


def test_synthetic_is_deterministic_and_shaped_like_fashion_mnist():
    a, b = synthetic(64, seed=2), synthetic(64, seed=2)
    assert a.images.shape == (64, 1, 28, 28) and a.images.dtype == np.uint8
    assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)


def test_loader_counts_the_data_it_holds_and_its_batch_buffers():
    data = synthetic(100, seed=0)
    loader = BatchLoader(data, np, "float32")
    held = data.images.nbytes + data.labels.nbytes
    assert loader.buffer_nbytes() == held
    loader.batch(np.arange(8))
    loader.batch(np.arange(8))  # the same buffer again
    loader.batch(np.arange(3))  # a shorter last batch: one more
    assert loader.buffer_nbytes() == held + (8 + 3) * 784 * 4
