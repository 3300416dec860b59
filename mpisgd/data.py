"""Data sets and sharding.

* :func:`load_data` reads ``--data PATH``: an IDX directory (Fashion-MNIST and
  the MNIST family), an ``.npz`` with ``x_train, y_train, x_test, y_test``, or a
  directory of those four ``.npy`` files, which are memory-mapped (ranks on a
  node share one copy through the page cache; a set larger than a rank's
  memory still trains). Any per-sample shape; inputs uint8 (scaled to [0, 1])
  or floating point (used as they are); integer labels 0..C-1, C inferred.
  Only regular files are opened (a FIFO would block); anything that is not
  one of these formats is refused saying which are read, and nothing is ever
  unpickled. :func:`validate` refuses what cannot train, naming the array,
  the sample and the problem (finiteness in the model's dtype);
  :func:`label_warnings` says when classes have no sample; :func:`identity`
  fingerprints both sets in bounded time.
* :func:`read_idx` reads MNIST-format IDX files (optionally gzipped) and rejects
  bad ones with a message naming the file and the problem.
* :func:`load_fashion_mnist` finds the four files in ``--data-dir``, then
  ``$MPISGD_DATA``, then Debian's ``/usr/share/datasets/fashion-mnist``; its
  inputs are standardised with the training set's pixel mean and deviation.
* :class:`GlobalBatches` decides which samples form global batch t: a pure
  function of (seed, epoch, t, B). Rank r takes its contiguous share of that
  batch, so k ranks x b and 1 rank x k*b see the same batches in the same order,
  and every rank runs the same number of steps (the tail that does not fill a
  global batch is dropped), so no rank waits forever in a collective.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import mmap
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpisgd.config import check_names
from mpisgd.errors import UsageError

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
INSTALL_HINT = "install it with: apt-get install dataset-fashion-mnist (Debian), or pass --data-dir DIR"
_IDX_DTYPES: dict[int, np.dtype] = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
                                    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
# Fashion-MNIST training-set pixel statistics, used to standardise inputs
PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530


class DataError(UsageError):
    """A missing, unreadable or malformed data set."""


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (``.gz`` or plain) into a NumPy array in native byte order.

    The payload is read into the array a MiB at a time: reading the whole file
    as bytes (or gzip's ``readinto`` of the whole array) holds the data twice
    at the peak, 45 MiB more for the training images.
    """
    path = Path(path)
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            magic = f.read(4)
            if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
                raise DataError(f"{path} is not an IDX file (bad magic number {magic.hex() or 'none'})")
            dtype, ndim = np.dtype(_IDX_DTYPES[magic[2]]), magic[3]
            header = 4 + 4 * ndim
            raw_dims = f.read(4 * ndim)
            if len(raw_dims) < 4 * ndim:
                raise DataError(f"{path} is truncated: header needs {header} bytes, file has {4 + len(raw_dims)}")
            dims = tuple(int(d) for d in np.frombuffer(raw_dims, ">u4"))
            expected = header + math.prod(dims) * dtype.itemsize  # Python ints: a corrupt header cannot overflow
            # never allocate what the file cannot hold: plain files have their exact size, and deflate
            # expands at most ~1032-fold (a corrupt header must give this error, not a MemoryError)
            on_disk = path.stat().st_size
            if expected > (on_disk * 1032 if path.suffix == ".gz" else on_disk):
                raise DataError(f"{path} is truncated: dims {dims} need {expected} bytes, file has {on_disk}")
            data = np.empty(dims, dtype)
            got = header + _read_into(f, data.data.cast("B") if data.nbytes else memoryview(b""))
            if got == expected and f.read(1):
                raise DataError(f"{path} is longer than its header says: dims {dims} need {expected} bytes")
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if got != expected:
        raise DataError(f"{path} is truncated: dims {dims} need {expected} bytes, file has {got}")
    if dtype.itemsize > 1 and dtype.byteorder not in ("=", "|"):
        data = data.astype(dtype.newbyteorder("="))
    return data


def _read_into(f: Any, view: memoryview, piece: int = 1 << 20) -> int:
    """Fill view from f a piece at a time (gzip's readinto of a large view makes a whole-size temporary)."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done: done + piece])
        if not n:
            break
        done += n
    return done


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def _lacks(directory: Path) -> list[str]:
    """The IDX files ``directory`` lacks, each as it will be named in a message."""
    missing = []
    for stem in FILES.values():
        if _find(directory, stem) is None:
            odd = any((directory / n).exists() for n in (stem, stem + ".gz"))  # a FIFO, a directory...
            missing.append(f"{stem}[.gz]" + (" (not a regular file)" if odd else ""))
    return missing


def find_data_dir(data_dir: str | None) -> Path:
    """The first of --data-dir, $MPISGD_DATA, the Debian path that holds all four files."""
    candidates: list[tuple[str, str]] = []
    if data_dir:
        candidates.append(("--data-dir", data_dir))
    if os.environ.get("MPISGD_DATA"):
        candidates.append(("$MPISGD_DATA", os.environ["MPISGD_DATA"]))
    candidates.append(("default", DEBIAN_DIR))
    tried = []
    for source, d in candidates:
        directory = Path(d)
        missing = _lacks(directory)
        if not missing:
            return directory
        if source == "--data-dir" and directory.is_dir():  # the user's own directory: say what it lacks
            raise DataError(f"--data-dir {d} lacks {', '.join(missing)}: an IDX directory needs "
                            f"{', '.join(FILES.values())} (each plain or .gz)")
        why = "does not exist" if not directory.is_dir() else "lacks " + ", ".join(missing)
        tried.append(f"{d} ({source}: {why})")
        if source == "--data-dir":  # an explicit directory that is wrong is an error, not a hint
            break
    raise DataError("Fashion-MNIST not found; searched " + "; ".join(tried) + ". " + INSTALL_HINT)


@dataclass
class Dataset:
    """Inputs (N, ...) on the host (uint8 or float, possibly memory-mapped) and integer labels (N,).
    A batch becomes ``x * scale + shift`` in the model's dtype (BatchLoader)."""

    images: np.ndarray
    labels: np.ndarray
    scale: float = 1.0
    shift: float = 0.0
    rows: np.ndarray | None = None  # the samples of the arrays this set uses (hold_out), None: all of them
    tokens: bool = False  # inputs are token ids (mpisgd.text): delivered as int64, not scaled; labels per position

    def __len__(self) -> int:
        return len(self.labels) if self.rows is None else len(self.rows)

    def head(self, n: int) -> Dataset:
        """The first n samples, copied (so that a large set is freed, or not read, behind a view)."""
        if self.images.ndim == 0 or self.labels.ndim == 0:  # nothing to take from: validate() says why
            return self
        pick = slice(None, n) if self.rows is None else self.rows[:n]
        return Dataset(np.array(self.images[pick]), np.array(self.labels[pick]), self.scale, self.shift,
                       tokens=self.tokens)


def load_fashion_mnist(data_dir: str | None = None) -> tuple[Dataset, Dataset, Path]:
    directory = find_data_dir(data_dir)
    parts = {key: read_idx(_find(directory, stem)) for key, stem in FILES.items()}  # type: ignore[arg-type]
    sets = []
    for split in ("train", "test"):
        images, labels = parts[f"{split}_images"], parts[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{directory}: {split} images {images.shape} and labels {labels.shape} do not match")
        if images.dtype != np.uint8:
            raise DataError(f"{directory}: {split} images must be unsigned bytes, got {images.dtype}")
        sets.append(Dataset(images[:, None, :, :], labels.astype(np.int64), 1.0 / (255.0 * PIXEL_STD),
                            -PIXEL_MEAN / PIXEL_STD))
    return sets[0], sets[1], directory


ARRAYS = ("x_train", "y_train", "x_test", "y_test")
FORMATS = ("mpisgd reads an .npz holding x_train, y_train, x_test, y_test (numpy.savez), a directory of those "
           "four .npy files, or a directory of IDX files (docs/data.md)")
_ZIP, _NPY = b"PK\x03\x04", b"\x93NUMPY"


def available_bytes() -> float:
    """Memory the node can still give (MemAvailable), or all of it where /proc does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _npy_header(f: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    """(shape, dtype) from the header of an .npy stream, read without its data (None: not readable)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = fmt.read_array_header_2_0(f)
        else:
            return None
    except (ValueError, OSError, EOFError, SyntaxError):
        return None
    return tuple(shape), np.dtype(dtype)


def _check_header(where: str, name: str, header: tuple[tuple[int, ...], np.dtype] | None) -> int:
    """Refuse an array mpisgd would have to unpickle; returns its size in bytes (0 if unknown)."""
    if header is None:
        return 0
    shape, dtype = header
    if dtype.hasobject:
        raise DataError(f"--data {where}: {name} holds Python objects (a pickled array), which mpisgd never "
                        "loads: save numeric arrays (uint8 or float inputs, integer labels)")
    return math.prod(shape) * dtype.itemsize


def _sniff(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(6)


def load_arrays(path: str) -> tuple[Dataset, Dataset]:
    """An ``.npz`` with the four arrays, or a directory of ``x_train.npy`` ... (memory-mapped).

    Only regular files are opened (a FIFO would block the rank for ever); an .npz's arrays are read
    whole, so one larger than the memory available is refused from its header, before any is read."""
    p = Path(path)
    try:
        if p.is_dir():
            missing = [f"{name}.npy" + ("" if not (p / f"{name}.npy").exists() else " (not a regular file)")
                       for name in ARRAYS if not (p / f"{name}.npy").is_file()]
            if missing:
                raise DataError(f"--data {path}: missing {', '.join(missing)} (a directory needs x_train.npy, "
                                "y_train.npy, x_test.npy, y_test.npy)")
            for name in ARRAYS:
                with open(p / f"{name}.npy", "rb") as f:
                    _check_header(path, f"{name}.npy", _npy_header(f))
            arrays = {name: np.load(p / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in ARRAYS}
        else:
            if not p.is_file():
                raise DataError(f"--data {path} is not a regular file or a directory (a FIFO or a device is "
                                f"never opened): {FORMATS}")
            magic = _sniff(p)
            if magic == _NPY:
                raise DataError(f"--data {path} is a single .npy array; {FORMATS}")
            if magic[:4] != _ZIP:
                raise DataError(f"--data {path} is not an .npz (a zip of .npy arrays); {FORMATS}")
            with np.load(p, allow_pickle=False) as z:
                missing = [name for name in ARRAYS if name not in z.files]
                if missing:
                    raise DataError(f"--data {path}: missing {', '.join(missing)} (it holds {', '.join(z.files)})")
                need, members = 0, set(z.zip.namelist())
                for name in ARRAYS:
                    with z.zip.open(f"{name}.npy" if f"{name}.npy" in members else name) as f:
                        need += _check_header(path, name, _npy_header(f))
                if need > available_bytes():
                    raise DataError(f"--data {path}: its arrays need {need / 2**30:.1f} GiB, more than this node's "
                                    f"{available_bytes() / 2**30:.1f} GiB available (an .npz is read whole): save "
                                    "them as .npy files in a directory, which is memory-mapped")
                arrays = {name: z[name] for name in ARRAYS}
                raw = [name for name, a in arrays.items() if not isinstance(a, np.ndarray)]  # NpzFile's bytes
                if raw:
                    raise DataError(f"--data {path}: its {raw[0]} is not a NumPy array (no .npy header): save the "
                                    "four arrays with numpy.savez")
    except DataError:
        raise
    except MemoryError:
        raise DataError(f"--data {path}: its arrays do not fit in memory (an .npz is read whole): save them as "
                        ".npy files in a directory, which is memory-mapped") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"--data {path}: cannot read it ({type(exc).__name__}: {exc})") from None
    sets = []
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype == np.uint8:
            scale = 1.0 / 255.0
        elif x.dtype.kind == "f":
            scale = 1.0
        else:
            raise DataError(f"--data {path}: x_{split} must be uint8 or floating point, got {x.dtype}")
        sets.append(Dataset(x, y, scale))
    return sets[0], sets[1]


def load_data(path: str | None, data_dir: str | None) -> tuple[Dataset, Dataset, str, str]:
    """(train, test, name, where) for ``--data`` / ``--data-dir`` (IDX), else the Fashion-MNIST search."""
    check_names(path, "--data")
    check_names(data_dir, "--data-dir")
    if path and not (Path(path).is_dir() and any(_find(Path(path), stem) for stem in FILES.values())):
        if not Path(path).exists():
            raise DataError(f"--data {path}: no such file or directory")
        train, test = load_arrays(path)
        return train, test, Path(path).name, str(path)
    if path and _lacks(Path(path)):  # some IDX files but not all four: say which, not how to install Fashion-MNIST
        raise DataError(f"--data {path}: an IDX directory needs {', '.join(FILES.values())} (each plain or .gz); "
                        f"it lacks {', '.join(_lacks(Path(path)))}")
    train, test, directory = load_fashion_mnist(path or data_dir)
    if path:  # an IDX directory of the user's (the MNIST family): scaled to [0, 1], not by Fashion-MNIST's statistics
        train.scale = test.scale = 1.0 / 255.0
        train.shift = test.shift = 0.0
        return train, test, Path(path).name, f"IDX files from {directory}"
    return train, test, "fashion-mnist", f"Fashion-MNIST from {directory}"


def input_files(path: str | None, data_dir: str | None) -> list[Path]:
    """The files a run with ``--data path`` / ``--data-dir data_dir`` reads (those that exist): outputs
    are checked against them, so that no output replaces its own input."""
    if path:
        p = Path(path)
        if not p.is_dir():
            return [p] if p.exists() else []
        dirs = [p]
        names = [f"{a}.npy" for a in ARRAYS]
    else:
        dirs = [Path(d) for d in (data_dir, os.environ.get("MPISGD_DATA"), DEBIAN_DIR) if d]
        names = []
    names += [n for stem in FILES.values() for n in (stem, stem + ".gz")]
    return [d / n for d in dirs for n in names if (d / n).exists()]


def resident_nbytes(*sets: Dataset) -> int:
    """Bytes of these sets' arrays held in this process's own memory: a memory-mapped array is the page
    cache's, shared by the ranks of a node and evicted under pressure, so it is not counted."""
    return sum(int(a.nbytes) for d in sets for a in (d.images, d.labels) if not _mapped(a))


def _mapped(a: Any) -> bool:
    while a is not None:
        if isinstance(a, np.memmap | mmap.mmap):
            return True
        a = getattr(a, "base", None)
    return False


CHECK_PIECE_BYTES = 16 << 20  # the finiteness scan reads this much at a time
FINGERPRINT_BYTES = 8 << 20  # inputs hashed per set by identity(), at least FINGERPRINT_MIN_SAMPLES samples
FINGERPRINT_MIN_SAMPLES = 64


def validate(train: Dataset, test: Dataset, global_batch: int | None = None, dtype: str | np.dtype | None = None,
             warnings: list[str] | None = None) -> int:
    """Refuse what cannot train, naming the array and the problem; returns the number of classes C
    (labels 0..C-1, inferred). Checks: one input per sample and inputs with values, non-empty, one label
    per sample, the same per-sample shape in both sets, integer labels >= 0 and not absurdly many classes,
    inputs finite in ``dtype``, the model's (NaN, inf, or a float64 value that overflows float32; checked in
    pieces: a memory-mapped set is read once, never held), and at least one global batch of training samples."""
    for what, d in (("training", train), ("test", test)):
        if d.images.ndim == 0 or d.labels.ndim == 0:
            raise DataError(f"the {what} {'inputs' if d.images.ndim == 0 else 'labels'} are a single number (a 0-d "
                            "array): they must hold one entry per sample")
        if d.images.shape[0] == 0 or len(d) == 0:
            raise DataError(f"the {what} set is empty")
        if 0 in d.images.shape[1:]:
            raise DataError(f"the {what} samples have shape {d.images.shape[1:]}: no input values")
        if d.images.shape[0] != d.labels.shape[0] or d.labels.ndim != 1:
            one_hot = d.labels.ndim == 2 and d.labels.shape[0] == d.images.shape[0] and d.labels.shape[1] > 1
            raise DataError(f"the {what} set has {d.images.shape[0]} inputs but labels of shape {d.labels.shape}"
                            + (": one row of scores per sample (one-hot)? mpisgd takes one class index per sample: "
                               "y.argmax(axis=1)" if one_hot else ""))
        if d.labels.dtype.kind not in "iu":
            whole = d.labels.dtype.kind == "f" and bool(np.all(np.isfinite(d.labels) & (np.mod(d.labels, 1) == 0)))
            raise DataError(f"{what} labels must be integers, got {d.labels.dtype}"
                            + (" (whole numbers: y.astype(np.int64))" if whole else ""))
        if int(d.labels.min()) < 0:
            at = int(np.argmin(d.labels))
            raise DataError(f"{what} labels must be >= 0 (classes 0..C-1); the smallest is {int(d.labels.min())} "
                            f"({what} sample {at})")
        largest = _check_finite(what, d, np.dtype(dtype) if dtype is not None else None)
        if what == "training" and warnings is not None and largest > LARGE_INPUT:
            warnings.append(_magnitude_warning(largest))
    if train.images.shape[1:] != test.images.shape[1:]:
        raise DataError(f"training samples are {train.images.shape[1:]}, test samples {test.images.shape[1:]}: "
                        "they must have one shape")
    if global_batch is not None and len(train) < global_batch:
        raise DataError(f"the training set has {len(train)} samples, fewer than one global batch B = {global_batch}")
    what, d = max((("training", train), ("test", test)), key=lambda p: int(p[1].labels.max()))
    top = int(d.labels.max())
    classes = top + 1
    present = _present(train, test, classes)
    if present < classes / 2:  # most outputs would score classes no sample has: one stray label, 200 among 0..9
        raise DataError(f"{what} label {top} (sample {int(np.argmax(d.labels))}) makes {classes:,} classes "
                        f"(labels are 0..C-1), but only {present:,} of them have a sample: a stray label? Fix it, or "
                        "relabel the classes 0..C-1 (numpy.unique(y, return_inverse=True))")
    return classes


def _counts(labels: np.ndarray, classes: int) -> np.ndarray | None:
    """Samples per class 0..classes-1 (None where that table would be large: count distinct labels then)."""
    if classes > 1 << 22:
        return None
    return np.bincount(labels.astype(np.int64, copy=False), minlength=classes)[:classes]


def _present(train: Dataset, test: Dataset, classes: int) -> int:
    """How many of the classes 0..classes-1 have a sample (training or test)."""
    a, b = _counts(train.labels, classes), _counts(test.labels, classes)
    if a is None or b is None:
        return len(np.union1d(np.unique(train.labels), np.unique(test.labels)))
    return int(np.count_nonzero(a + b))


def label_warnings(train: Dataset, test: Dataset, classes: int) -> list[str]:
    """What looks wrong in labels that validate() accepts: classes 0..C-1 of which some have no training
    sample (one stray label, 200 among 0..9, makes a 201-class model)."""
    counts = _counts(train.labels, classes)
    if counts is None:
        empty = classes - len(np.unique(train.labels))
        examples = ""
    else:
        missing = np.flatnonzero(counts == 0)
        empty = len(missing)
        examples = " (" + ", ".join(map(str, missing[:5])) + (", ..." if empty > 5 else "") + ")"
    if not empty:
        return []
    d, what = (train, "training") if int(train.labels.max()) + 1 == classes else (test, "test")
    return [f"labels 0..{classes - 1} make {classes} classes, but {empty} of them have no training sample{examples}; "
            f"the largest label, {classes - 1}, is {what} sample {int(np.argmax(d.labels))}: if it is a stray, "
            "fix the data (the model gets one output per class)"]


def scale_warnings(train: Dataset, test: Dataset) -> list[str]:
    """Training and test inputs fed on different scales (uint8 training images, divided by 255, with float
    test images, used as they are): scored so, the test accuracy is that of other inputs, unless the float
    set was scaled to [0, 1] beforehand."""
    if (train.scale, train.shift) == (test.scale, test.shift):
        return []
    return [f"training inputs are {train.images.dtype}, fed as x * {train.scale:.4g} + {train.shift:.4g}, test inputs "
            f"{test.images.dtype}, fed as x * {test.scale:.4g} + {test.shift:.4g}: unless the test set was scaled so "
            "beforehand, it is scored on other inputs than those trained on; give both sets in one dtype"]


LARGE_INPUT = 100.0  # fed inputs beyond this: warned of (models train on inputs of order 1)


def _magnitude_warning(largest: float) -> str:
    """Float training inputs fed at a magnitude far from 1 (raw pixel values 0..255, features in their own
    units): they usually make the first steps' gradients overflow or the training crawl."""
    return (f"the training inputs reach {largest:.3g} in magnitude: models train best on inputs of order 1 "
            "(standardise them, (x - mean) / std, or divide images by 255); the first steps' gradients may overflow")


def _check_finite(what: str, d: Dataset, dtype: np.dtype | None) -> float:
    """NaN or inf in the float inputs, or values that become inf in ``dtype``: refused, naming the sample.
    Returns the largest magnitude of the inputs as fed (0 for integer inputs, which mpisgd scales)."""
    if d.images.dtype.kind != "f":
        return 0.0
    n = len(d)
    rows = max(1, CHECK_PIECE_BYTES // max(1, d.images[:1].nbytes))
    largest = 0.0
    for lo in range(0, n, rows):
        x = np.asarray(d.images[lo:lo + rows])
        with np.errstate(over="ignore", invalid="ignore"):
            y = x if dtype is None or dtype == x.dtype else (x * d.scale + d.shift).astype(dtype)
        finite = np.isfinite(y).reshape(len(y), -1).all(axis=1)
        if finite.all():
            with np.errstate(over="ignore"):
                largest = max(largest, float(np.max(np.abs(x * d.scale + d.shift))))
            continue
        i = int(np.argmin(finite))
        j = int(np.argmin(np.isfinite(y[i]).ravel()))
        value = x[i].ravel()[j]
        if np.isfinite(value):
            raise DataError(f"{what} inputs hold {float(value):g} (sample {lo + i}), which overflows {dtype}, the "
                            "model's dtype: scale the inputs, or pass --dtype float64")
        raise DataError(f"{what} inputs hold {'NaN' if np.isnan(value) else 'inf'} (sample {lo + i}, the first)")
    return largest


def identity(name: str, train: Dataset, test: Dataset) -> dict[str, Any]:
    """The data set in a few fields, to compare across ranks and with a checkpoint's run: its name, its
    sizes and a fingerprint: a hash of both sets' shapes, every label, and for each set the inputs of
    about FINGERPRINT_BYTES of samples, one drawn at random from each of as many equal strata (every
    part of the set is probed, in bounded time even for a memory-mapped set larger than memory)."""
    h = hashlib.blake2b(digest_size=8)
    for d in (train, test):
        h.update(repr((d.images.shape, d.images.dtype.str, d.labels.dtype.str)).encode())
        h.update(np.ascontiguousarray(d.labels).tobytes())
        h.update(np.ascontiguousarray(d.images[_probes(len(d), d.images[:1].nbytes)]).tobytes())
    return {"name": name, "n_train": len(train), "n_test": len(test), "fingerprint": h.hexdigest(),
            "fingerprint_version": 2}


def _probes(n: int, row_bytes: int) -> np.ndarray:
    """Sorted distinct sample indices, one at a random place in each of ``count`` equal strata of 0..n-1
    (the same on every rank: a fixed seed)."""
    count = min(n, max(FINGERPRINT_MIN_SAMPLES, FINGERPRINT_BYTES // max(1, row_bytes)))
    edges = (np.arange(count + 1, dtype=np.int64) * n) // count
    return edges[:-1] + (np.random.default_rng(0).random(count) * (edges[1:] - edges[:-1])).astype(np.int64)


def synthetic(n: int, seed: int = 0, n_classes: int = 10, noise: float = 0.3, separation: float = 0.15,
              split: int = 0) -> Dataset:
    """A learnable stand-in of Fashion-MNIST's shape: one random template per class plus noise.

    For benchmarks and tests: same layout and dtype as the real data set. The
    templates depend on ``seed`` only, the samples on (seed, split): split 0
    and 1 are a training and a test set of the same problem.
    """
    templates = np.random.default_rng([seed, 12345]).uniform(0, 1, (n_classes, 1, 28, 28))
    rng = np.random.default_rng([seed, 777, split])
    labels = rng.integers(0, n_classes, n)
    # 255 (0.5 + separation (template - 0.5) + noise z), clipped: the class means made once, the rest in place
    # in one array (the same operations per element as written out, so the same bits, at a fifth of the time)
    images = rng.standard_normal((n, 1, 28, 28))
    images *= noise
    images += (0.5 + separation * (templates - 0.5))[labels]
    images *= 255
    np.clip(images, 0, 255, out=images)
    return Dataset(images.astype(np.uint8), labels.astype(np.int64),
                   1.0 / (255.0 * PIXEL_STD), -PIXEL_MEAN / PIXEL_STD)  # scaled as Fashion-MNIST


VAL_STREAM = 0x76616C  # the validation split's random stream: not one of the epoch orders' (seed, epoch)


def hold_out(train: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(the rest, validation): ``fraction`` of the training samples, chosen by ``seed`` alone, before any
    sharding, so every rank and every k hold out the same ones. The rest keeps the arrays (a memory-mapped
    set stays mapped) and uses only its rows; the validation samples are copied (they are few)."""
    n = len(train)
    n_val = max(1, round(fraction * n))
    if n_val >= n:
        raise DataError(f"--val-split {fraction:g} of {n} training samples leaves none to train on")
    perm = np.random.default_rng([seed, VAL_STREAM]).permutation(n)
    val, rest = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    held = Dataset(np.array(train.images[val]), np.array(train.labels[val]), train.scale, train.shift)
    return Dataset(train.images, train.labels, train.scale, train.shift, rows=rest), held


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of ``epoch``: a pure function of (seed, epoch), shared by all ranks."""
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclass(frozen=True)
class GlobalBatches:
    """Which samples this rank uses for each micro-batch of each step."""

    n_samples: int
    global_batch: int  # B = k * b * m
    rank: int
    world_size: int
    accum_steps: int = 1

    def __post_init__(self) -> None:
        k, m = self.world_size, self.accum_steps
        if k < 1 or m < 1 or not 0 <= self.rank < k:
            raise ValueError(f"GlobalBatches: rank {self.rank} of world_size {k} with accum_steps {m}: the rank must "
                             "be in 0..world_size-1, world_size and accum_steps >= 1")
        if self.global_batch < 1 or self.global_batch % (k * m):
            raise ValueError(f"GlobalBatches: the global batch {self.global_batch} is not a positive multiple of "
                             f"world_size x accum_steps = {k * m}: the ranks' micro-batches would differ in size")
        if self.steps_per_epoch < 1:
            raise DataError(f"the training set has {self.n_samples} samples, fewer than one global batch "
                            f"B = {self.global_batch} (k={self.world_size} ranks x b={self.local_batch} "
                            f"x m={self.accum_steps}); use fewer ranks or a smaller --batch-size")

    @property
    def local_batch(self) -> int:
        return self.global_batch // (self.world_size * self.accum_steps)

    @property
    def steps_per_epoch(self) -> int:
        return self.n_samples // self.global_batch

    def indices(self, perm: np.ndarray, step: int, micro: int) -> np.ndarray:
        """Sample indices of this rank's micro-batch ``micro`` of step ``step`` (within the epoch)."""
        b, m = self.local_batch, self.accum_steps
        if not (0 <= step < self.steps_per_epoch and 0 <= micro < m):
            raise IndexError(f"GlobalBatches.indices: step {step}, micro-batch {micro}; an epoch has steps "
                             f"0..{self.steps_per_epoch - 1} of micro-batches 0..{m - 1} (the step within the epoch)")
        start = step * self.global_batch + (self.rank * m + micro) * b
        return perm[start:start + b]


class BatchLoader:
    """Gathers a batch of inputs into preallocated buffers, in the model's dtype, scaled on the device;
    token ids (a set of ``tokens``) as int64, with their (N, T) targets."""

    def __init__(self, data: Dataset, xp: Any, dtype: str | np.dtype) -> None:
        self.xp = xp
        self.data = data
        if np.dtype(dtype) not in (np.float32, np.float64):
            raise ValueError(f"BatchLoader: inputs in float32 or float64 (the model's dtype), got {np.dtype(dtype)}")
        self.dtype = np.dtype(np.int64) if data.tokens else np.dtype(dtype)
        self._images = xp.asarray(data.images)  # uint8 on the device: 4x smaller than floats
        self._labels = xp.asarray(data.labels)
        self._bufs: dict[tuple[int, int], Any] = {}

    def buffer_nbytes(self) -> int:
        """Bytes of the data this loader holds: the images and labels, and its batch buffers."""
        held = {id(a): int(a.nbytes) for a in (self._images, self._labels, *self._bufs.values())}
        return sum(held.values())

    def batch(self, idx: np.ndarray, slot: int = 0) -> tuple[Any, Any]:
        """Scaled inputs and labels of samples ``idx``; ``slot`` keeps micro-batches apart."""
        xp = self.xp
        if self.data.rows is not None:  # a set with samples held out: idx counts its own samples
            idx = self.data.rows[idx]
        n = len(idx)
        buf = self._bufs.get((n, slot))
        if buf is None:
            buf = self._bufs[(n, slot)] = xp.empty((n, *self._images.shape[1:]), dtype=self.dtype)
        idx_dev = xp.asarray(idx)
        buf[...] = self._images[idx_dev]  # gather (uint8 stays 4x smaller until here), convert once
        if self.data.tokens:
            targets = self._bufs.get((n, -1 - slot))
            if targets is None:
                targets = self._bufs[(n, -1 - slot)] = xp.empty((n, *self._labels.shape[1:]), dtype=np.int64)
            targets[...] = self._labels[idx_dev]
            return buf, targets
        if self.data.scale != 1.0:
            buf *= self.data.scale
        if self.data.shift:
            buf += self.data.shift
        return buf, self._labels[idx_dev]
