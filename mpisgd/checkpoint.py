"""Files: final parameters (and, with checkpoint/resume, the training state)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mpisgd.backend import to_numpy


def atomic_savez(path: str, **arrays: Any) -> None:
    """Write an .npz so that ``path`` is either the old file or the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable
    finally:
        os.close(fd)


def save_params(path: str, model: Any) -> None:
    """The flat parameter vector and each named parameter, as NumPy arrays."""
    named = {name: to_numpy(p) for name, p in model.named_parameters()}
    atomic_savez(path, flat=to_numpy(model.flat.params), **named)


def load_params(path: str) -> np.ndarray:
    with np.load(path, allow_pickle=False) as z:
        return z["flat"]
