"""Data sets and sharding.

* :func:`read_idx` reads MNIST-format IDX files (optionally gzipped) and rejects
  bad ones with a message naming the file and the problem.
* :func:`load_fashion_mnist` finds the four files in ``--data-dir``, then
  ``$MPISGD_DATA``, then Debian's ``/usr/share/datasets/fashion-mnist``.
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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpisgd.config import UsageError

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
INSTALL_HINT = "install it with: apt-get install dataset-fashion-mnist (Debian), or pass --data-dir DIR"
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
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
            got = header + _read_into(f, memoryview(data).cast("B") if data.nbytes else memoryview(b""))
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
        missing = [stem for stem in FILES.values() if _find(directory, stem) is None]
        if not missing:
            return directory
        why = "does not exist" if not directory.is_dir() else "lacks " + ", ".join(missing)
        tried.append(f"{d} ({source}: {why})")
        if source == "--data-dir":  # an explicit directory that is wrong is an error, not a hint
            break
    raise DataError("Fashion-MNIST not found; searched " + "; ".join(tried) + ". " + INSTALL_HINT)


@dataclass
class Dataset:
    """Images as uint8 (N, 1, 28, 28) on the host, labels as int64; standardised per batch."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


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
        sets.append(Dataset(images[:, None, :, :], labels.astype(np.int64)))
    return sets[0], sets[1], directory


def check_labels(data: Dataset, n_classes: int, what: str) -> None:
    """Refuse a set the models cannot learn from: empty, or labels outside 0 .. n_classes - 1 (a label of -1
    would index the last class silently; a label too large crashes mid-epoch)."""
    if len(data) == 0:
        raise DataError(f"the {what} set is empty")
    if data.labels.dtype.kind not in "iu":
        raise DataError(f"{what} labels must be integers, got {data.labels.dtype}")
    lo, hi = int(data.labels.min()), int(data.labels.max())
    if lo < 0 or hi >= n_classes:
        bad = int(np.count_nonzero((data.labels < 0) | (data.labels >= n_classes)))
        raise DataError(f"{what} labels must lie in 0..{n_classes - 1}; {bad} do not (from {lo} to {hi})")


def identity(name: str, train: Dataset, test: Dataset) -> dict[str, Any]:
    """The data set in a few fields, to compare across ranks and with a checkpoint's run: its name, its
    sizes and a fingerprint (a hash of the shapes, every label and 256 evenly spaced training samples)."""
    h = hashlib.blake2b(digest_size=8)
    for d in (train, test):
        h.update(repr((d.images.shape, d.images.dtype.str)).encode())
        h.update(np.ascontiguousarray(d.labels).tobytes())
    picks = np.linspace(0, len(train) - 1, num=min(256, len(train)), dtype=np.int64)
    h.update(np.ascontiguousarray(train.images[picks]).tobytes())
    return {"name": name, "n_train": len(train), "n_test": len(test), "fingerprint": h.hexdigest()}


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
    images = 0.5 + separation * (templates[labels] - 0.5) + noise * rng.standard_normal((n, 1, 28, 28))
    return Dataset(np.clip(images * 255, 0, 255).astype(np.uint8), labels.astype(np.int64))


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
        start = step * self.global_batch + (self.rank * m + micro) * b
        return perm[start:start + b]


class BatchLoader:
    """Gathers a batch of uint8 images into preallocated buffers and standardises it on the device."""

    def __init__(self, data: Dataset, xp: Any, dtype: str | np.dtype) -> None:
        self.xp = xp
        self.data = data
        self.dtype = np.dtype(dtype)
        self._images = xp.asarray(data.images)  # uint8 on the device: 4x smaller than floats
        self._labels = xp.asarray(data.labels)
        self._bufs: dict[tuple[int, int], Any] = {}

    def buffer_nbytes(self) -> int:
        """Bytes of the data this loader holds: the images and labels, and its batch buffers."""
        held = {id(a): int(a.nbytes) for a in (self._images, self._labels, *self._bufs.values())}
        return sum(held.values())

    def batch(self, idx: np.ndarray, slot: int = 0) -> tuple[Any, Any]:
        """Standardised images and labels of samples ``idx``; ``slot`` keeps micro-batches apart."""
        xp = self.xp
        n = len(idx)
        buf = self._bufs.get((n, slot))
        if buf is None:
            buf = self._bufs[(n, slot)] = xp.empty((n, *self._images.shape[1:]), dtype=self.dtype)
        idx_dev = xp.asarray(idx)
        buf[...] = self._images[idx_dev]  # gather uint8, convert once into the float buffer
        buf *= 1.0 / (255.0 * PIXEL_STD)
        buf -= PIXEL_MEAN / PIXEL_STD
        return buf, self._labels[idx_dev]
