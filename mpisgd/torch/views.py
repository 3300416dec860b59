"""Tensors that are views of mpisgd's arrays, and arrays that are views of tensors: no copy either way.

NumPy arrays become CPU tensors through ``torch.from_numpy``, CuPy arrays CUDA tensors through DLPack
(``torch.from_dlpack``), and back (``Tensor.numpy``, ``cupy.from_dlpack``). NumPy has no bfloat16: a
bfloat16 tensor's memory is kept as a ``uint16`` array of its bits (:func:`storage_dtype`), viewed as
bfloat16 by torch; float16 is NumPy's own. Arithmetic on half-precision gradients (averaging, norms)
goes through float32 copies (mpisgd.torch.distributed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mpisgd.backend import is_device_array

_STORAGE: dict[Any, np.dtype] = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
            torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(np.uint16)}
_TORCH: dict[np.dtype, Any] = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
          np.dtype(np.float16): torch.float16}


def storage_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype that holds a floating tensor dtype's values (bfloat16: its bits, as uint16)."""
    if dtype not in _STORAGE:
        raise TypeError(f"mpisgd holds float32, float64, float16 and bfloat16 tensors, not {dtype}")
    return np.dtype(_STORAGE[dtype])


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype of NumPy ``dtype`` (float32, float64, float16)."""
    dtype = np.dtype(dtype)
    if dtype not in _TORCH:
        raise TypeError(f"no torch float dtype for {dtype}")
    return _TORCH[dtype]


def as_tensor(a: Any, dtype: Any = None) -> Any:
    """A tensor over the memory of NumPy or CuPy array ``a`` (no copy). ``dtype=torch.bfloat16`` reads a
    uint16 array as the bfloat16 values whose bits it holds."""
    if is_device_array(a):
        t = torch.from_dlpack(a.view(np.int16) if a.dtype == np.uint16 else a)
    else:
        t = torch.from_numpy(a.view(np.int16) if a.dtype == np.uint16 else a)
    if dtype is not None and t.dtype != dtype:
        t = t.view(dtype)
    return t


def as_array(t: Any) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) array over the memory of tensor ``t`` (no copy; detached). A bfloat16
    tensor comes back as uint16 bits."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
        bits = True
    else:
        bits = False
    a = array_module(t.device).from_dlpack(t) if t.device.type == "cuda" else t.numpy()
    return a.view(np.uint16) if bits else a


def same_memory(t: Any, a: Any) -> bool:
    """Whether tensor ``t`` starts where array ``a`` does (a view of it, not a copy)."""
    ptr = a.data.ptr if is_device_array(a) else a.ctypes.data
    return bool(t.data_ptr() == ptr)


def array_module(device: Any) -> Any:
    """NumPy for the CPU, CuPy for a CUDA device (imported only then)."""
    if device.type != "cuda":
        return np
    import cupy  # noqa: PLC0415 - GPU tensors only

    return cupy


def device_of(xp: Any) -> Any:
    """The torch device of array module ``xp``: the CPU, or the CUDA device CuPy is using."""
    if xp is np:
        return torch.device("cpu")
    return torch.device("cuda", xp.cuda.Device().id)
