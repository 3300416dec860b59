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
        (tmp_path / "x.gz").write_bytes(gzip.compress((tmp_path / "x").read_bytes(), compresslevel=1))
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


def test_synthetic_data_are_the_formula_written_out():
    """The generator works in place: its images must stay the bits of the formula as written out (every run
    on synthetic data, and every figure made with it, depends on them)."""
    for seed, split in ((0, 0), (3, 1)):
        data = synthetic(300, seed=seed, split=split)
        templates = np.random.default_rng([seed, 12345]).uniform(0, 1, (10, 1, 28, 28))
        rng = np.random.default_rng([seed, 777, split])
        labels = rng.integers(0, 10, 300)
        images = 0.5 + 0.15 * (templates[labels] - 0.5) + 0.3 * rng.standard_normal((300, 1, 28, 28))
        assert np.array_equal(data.labels, labels)
        assert np.array_equal(data.images, np.clip(images * 255, 0, 255).astype(np.uint8))


def test_loader_counts_the_data_it_holds_and_its_batch_buffers():
    data = synthetic(100, seed=0)
    loader = BatchLoader(data, np, "float32")
    held = data.images.nbytes + data.labels.nbytes
    assert loader.buffer_nbytes() == held
    loader.batch(np.arange(8))
    loader.batch(np.arange(8))  # the same buffer again
    loader.batch(np.arange(3))  # a shorter last batch: one more
    assert loader.buffer_nbytes() == held + (8 + 3) * 784 * 4


# -- refused at load: one clear line naming the file and what is accepted instead -----------------------
def four_arrays(n_train: int = 64, n_test: int = 16, dtype: str = "float32", seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x_train": rng.normal(size=(n_train, 5)).astype(dtype), "y_train": rng.integers(0, 3, n_train),
            "x_test": rng.normal(size=(n_test, 5)).astype(dtype), "y_test": rng.integers(0, 3, n_test)}


def _returns_promptly(fn, *args, timeout_s: float = 20):
    """fn(*args) in a thread: its result or exception, or a failure if it blocks (opening a FIFO would)."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn.__name__} blocked (it opened something that never answers)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fifo_as_data_is_refused_never_opened(tmp_path):
    import os

    from mpisgd.data import load_data

    fifo = tmp_path / "set.npz"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="is not a regular file or a directory"):
        _returns_promptly(load_data, str(fifo), None)
    d = tmp_path / "d"
    d.mkdir()
    for name, a in four_arrays().items():
        np.save(d / f"{name}.npy", a)
    (d / "x_test.npy").unlink()
    os.mkfifo(d / "x_test.npy")
    with pytest.raises(DataError, match=r"x_test.npy \(not a regular file\)"):
        _returns_promptly(load_data, str(d), None)
    idx = tmp_path / "idx"
    idx.mkdir()
    fake_dataset(idx, compress=False)
    (idx / "t10k-labels-idx1-ubyte").unlink()
    os.mkfifo(idx / "t10k-labels-idx1-ubyte")
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte\[.gz\] \(not a regular file\)"):
        _returns_promptly(load_data, str(idx), None)


@pytest.mark.parametrize("case,says", [
    ("npy", "is a single .npy array; mpisgd reads an .npz holding x_train"),
    ("csv", "is not an .npz (a zip of .npy arrays); mpisgd reads an .npz holding x_train"),
    ("pickle", "is not an .npz"),
    ("/dev/zero", "is not a regular file or a directory"),
    ("objects", "x_train holds Python objects (a pickled array), which mpisgd never loads"),
    ("objects-dir", "x_train.npy holds Python objects"),
    ("member", "its y_train is not a NumPy array (no .npy header)"),  # a pickle or text stored as y_train.npy
])
def test_what_is_not_a_data_set_says_what_is_one(tmp_path, case, says):
    """Never an invitation to unpickle (the old message quoted allow_pickle); never a TypeError."""
    import pickle

    from mpisgd.data import load_data

    path = tmp_path / f"data.{case}"
    if case == "npy":
        np.save(tmp_path / "x.npy", np.zeros((4, 3)))
        path = tmp_path / "x.npy"
    elif case == "csv":
        path.write_text("1,2,3\n4,5,6\n")
    elif case == "pickle":
        path.write_bytes(pickle.dumps({"x_train": [1, 2]}))
    elif case == "/dev/zero":
        path = Path("/dev/zero")
    elif case == "member":
        import zipfile

        path = tmp_path / "data.member.npz"
        np.savez(path, **{k: v for k, v in four_arrays().items() if k != "y_train"})
        with zipfile.ZipFile(path, "a") as z:
            z.writestr("y_train.npy", pickle.dumps([1, 2, 3]))
    elif case == "objects":
        np.savez(path, **{**four_arrays(), "x_train": np.array([object()] * 64, dtype=object)})
        path = tmp_path / "data.objects.npz"
    else:
        path.mkdir()
        for name, a in four_arrays().items():
            np.save(path / f"{name}.npy", a if name != "x_train" else np.array([{}] * 64, dtype=object))
    with pytest.raises(DataError) as err:
        _returns_promptly(load_data, str(path), None)
    assert says in str(err.value) and "allow_pickle" not in str(err.value), err.value


def test_an_npz_larger_than_memory_is_refused_from_its_header(tmp_path):
    """Its arrays are read whole: the header says how large before a byte is read (no MemoryError)."""
    import zipfile

    path = tmp_path / "huge.npz"
    with zipfile.ZipFile(path, "w") as z:  # x_train's header claims 10 TB; a few bytes follow
        for name, a in four_arrays().items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                if name == "x_train":
                    np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False,
                                                             "shape": (10**7, 10**6)})
                    f.write(b"\0" * 64)
                else:
                    np.lib.format.write_array(f, a)
    from mpisgd.data import load_data

    with pytest.raises(DataError, match=r"its arrays need 9313\d?\.\d GiB, more than this node's .* memory-mapped"):
        load_data(str(path), None)


def test_an_idx_directory_lacking_files_names_them_not_the_fashion_mnist_package(tmp_path):
    from mpisgd.data import load_data

    fake_dataset(tmp_path)
    for stem in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (tmp_path / f"{stem}.gz").unlink()
    for call in (lambda: load_data(str(tmp_path), None), lambda: load_data(None, str(tmp_path))):
        with pytest.raises(DataError) as err:
            call()
        msg = str(err.value)
        assert "t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]" in msg and "apt-get" not in msg, msg


# -- validate: what cannot train, in the model's dtype; labels that look wrong -------------------------
def _sets(a: dict):
    from mpisgd.data import Dataset

    return Dataset(a["x_train"], a["y_train"]), Dataset(a["x_test"], a["y_test"])


@pytest.mark.parametrize("change,says", [
    ({"x_train": np.float32(3.0)}, "the training inputs are a single number (a 0-d array)"),
    ({"y_test": np.int64(1)}, "the test labels are a single number"),
    ({"x_train": np.zeros((64, 0), np.float32)}, "the training samples have shape (0,): no input values"),
])
def test_arrays_of_no_samples_or_no_values_are_one_line(change, says):
    from mpisgd.data import validate

    with pytest.raises(DataError) as err:
        validate(*_sets({**four_arrays(), **change}))
    assert says in str(err.value)


def test_finiteness_is_checked_in_the_models_dtype_and_names_the_sample():
    from mpisgd.data import validate

    a = four_arrays(n_train=2048, dtype="float64")
    a["x_train"][1500, 3] = 1e39  # finite in float64, inf in float32
    assert validate(*_sets(a), dtype="float64") == 3
    with pytest.raises(DataError, match=r"training inputs hold 1e\+39 \(sample 1500\), which overflows float32, the "
                                        r"model's dtype: scale the inputs, or pass --dtype float64"):
        validate(*_sets(a), dtype="float32")
    a["x_train"][1500, 3] = 1.0
    a["x_train"][2000, 1] = np.nan
    with pytest.raises(DataError, match=r"training inputs hold NaN \(sample 2000, the first\)$"):
        validate(*_sets(a), dtype="float32")  # never a range past the set's end (was "samples 0..4095")


def test_a_class_without_samples_warns_and_a_stray_label_is_refused_by_name_and_place():
    """A class with no training sample (a small --limit-train) is warned about; one stray label, 200 among
    0..9, would make a 201-class model of which 191 outputs score classes no sample has: refused (it trained
    with a warning before)."""
    from mpisgd.data import label_warnings, validate

    a = four_arrays()
    a["y_train"] = np.arange(64) % 10
    assert label_warnings(*_sets(a), validate(*_sets(a))) == []
    a["y_train"][a["y_train"] == 4] = 3
    a["y_test"] = a["y_test"] % 4  # 0..3: class 4 has no sample at all, yet most classes do
    (w,) = label_warnings(*_sets(a), validate(*_sets(a)))
    assert "labels 0..9 make 10 classes, but 1 of them have no training sample (4)" in w
    a["y_train"][17] = 200
    with pytest.raises(DataError, match=r"training label 200 \(sample 17\) makes 201 classes \(labels are 0..C-1\), "
                                        r"but only 10 of them have a sample: a stray label\?"):
        validate(*_sets(a))
    a["y_train"][17] = 10**9
    with pytest.raises(DataError, match=r"training label 1000000000 \(sample 17\) makes 1,000,000,001 classes"):
        validate(*_sets(a))


def test_uint8_training_inputs_with_float_test_inputs_are_warned_about(tmp_path):
    """x_train uint8 (divided by 255 as it is fed) with x_test float (fed as it is): the test accuracy would be
    that of inputs on another scale; said at start-up (it was silent)."""
    from mpisgd.data import load_arrays, scale_warnings

    a = four_arrays()
    a["x_train"] = (np.abs(a["x_train"]) * 50).astype(np.uint8)
    a["x_test"] = a["x_train"][:16].astype(np.float32)
    np.savez(tmp_path / "mixed.npz", **a)
    (w,) = scale_warnings(*load_arrays(str(tmp_path / "mixed.npz")))
    assert "training inputs are uint8, fed as x * 0.003922 + 0, test inputs float32, fed as x * 1 + 0" in w
    a["x_test"] = a["x_test"].astype(np.uint8)
    np.savez(tmp_path / "same.npz", **a)
    assert scale_warnings(*load_arrays(str(tmp_path / "same.npz"))) == []


# -- the fingerprint the ranks compare ---------------------------------------------------------------------
def test_the_fingerprint_sees_the_test_set_and_most_changes_to_the_training_set():
    from mpisgd.data import Dataset, identity

    a = four_arrays(n_train=6000, n_test=500)
    base = identity("x", *_sets(a))["fingerprint"]
    blank = dict(a, x_test=np.zeros_like(a["x_test"]))
    assert identity("x", *_sets(blank))["fingerprint"] != base
    # 97 % of the training inputs different, but the 256 evenly spaced samples the old fingerprint read kept
    other = a["x_train"] + 1
    old_picks = np.linspace(0, 5999, num=256, dtype=np.int64)
    other[old_picks] = a["x_train"][old_picks]
    other[::33] = a["x_train"][::33]
    assert identity("x", Dataset(other, a["y_train"]), Dataset(a["x_test"], a["y_test"]))["fingerprint"] != base


def test_the_fingerprint_reads_a_bounded_part_of_a_large_set():
    from mpisgd.data import FINGERPRINT_BYTES, _probes

    picks = _probes(10**9, 784)  # a memory-mapped set far larger than memory: some MiB of it are read
    assert len(picks) * 784 <= FINGERPRINT_BYTES and len(np.unique(picks)) == len(picks)
    assert picks.min() >= 0 and picks.max() < 10**9 and np.all(np.diff(picks) > 0)
    assert len(_probes(100, 10**7)) == 64 and len(_probes(10, 784)) == 10


def test_memory_mapped_data_is_not_counted_as_this_ranks_memory(tmp_path, monkeypatch):
    """preflight.memory counts what a rank holds; a memory-mapped set is the page cache's (docs/data.md:
    a set larger than memory trains)."""
    from mpisgd.app import preflight
    from mpisgd.data import load_data, resident_nbytes
    from mpisgd.errors import UsageError
    from mpisgd.nn import build_model

    for name, arr in four_arrays(n_train=4096).items():
        np.save(tmp_path / f"{name}.npy", arr)
    train, test, _, _ = load_data(str(tmp_path), None)
    assert resident_nbytes(train, test) == 0
    assert resident_nbytes(train.head(100), test) == train.images[:100].nbytes + train.labels[:100].nbytes
    model = build_model("mlp", (5,), 3, (8,))
    monkeypatch.setattr(preflight, "available_bytes", lambda: 4 * train.images.nbytes)
    preflight.memory(model, "float32", resident_nbytes(train, test), ranks_here=8)  # mapped: fits
    with pytest.raises(UsageError, match="GiB for the data it holds|the run needs at least"):
        preflight.memory(model, "float32", train.images.nbytes + test.images.nbytes, ranks_here=8)
