"""Which of the portable level's C extensions serve: ``MPISGD_PORTABLE_PASSES``.

The portable level has two optional C extensions, built by ``pip install`` where a C compiler exists
(setup.py): ``_passes`` (the splits' memory-bound passes, mpisgd.portable.passes) and ``_functions``
(exp, expm1, log, tanh and erf, mpisgd.portable.elementwise). Each makes the same IEEE operations in the
same order as its NumPy form, so a run's bits do not depend on them. ``MPISGD_PORTABLE_PASSES=ufunc``
runs NumPy's forms even where they are built; ``compiled`` insists on the extensions; unset, they serve
NumPy arrays where they are built.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import numpy as np

from mpisgd.errors import UsageError

ENV = "MPISGD_PORTABLE_PASSES"
MODULES = ("_passes", "_functions")
FLOATS = (np.dtype(np.float32), np.dtype(np.float64))  # the dtypes the extensions take (_arrays.h)


def wanted() -> str:
    """MPISGD_PORTABLE_PASSES: ``ufunc``, ``compiled`` or empty (compiled where built); anything else, or
    ``compiled`` where an extension is not built, is a UsageError (the portable kernels check it at
    set-up, so a bad value is one line on every rank, not a failed first product)."""
    value = os.environ.get(ENV, "")
    if value not in ("", "ufunc", "compiled"):
        raise UsageError(f"{ENV}={value!r}: use ufunc (NumPy's passes) or compiled (mpisgd's C passes), or unset it")
    missing = [name for name in MODULES if extension(name) is None]
    if value == "compiled" and missing:
        raise UsageError(f"{ENV}=compiled, but mpisgd.portable.{missing[0]} is not built: install mpisgd with a C "
                         "compiler and Python's headers (bash scripts/install.sh), or unset it")
    return value


def extension(name: str) -> Any:
    """The built extension mpisgd.portable.``name``, or None."""
    try:
        return importlib.import_module(f"mpisgd.portable.{name}")
    except ImportError:
        return None


def serving(name: str, xp: Any) -> Any:
    """The extension ``name`` where it serves arrays of module ``xp`` (NumPy's, built, not turned off by
    MPISGD_PORTABLE_PASSES=ufunc), else None."""
    return extension(name) if xp is np and wanted() != "ufunc" else None
