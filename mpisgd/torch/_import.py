"""Importing PyTorch, or saying in one line how to install it: mpisgd itself never needs it."""

from __future__ import annotations

from types import ModuleType

INSTALL = ("pip install 'mpisgd[torch]' (the CPU build alone: pip install torch --index-url "
           "https://download.pytorch.org/whl/cpu)")


class TorchMissing(ImportError):
    """PyTorch is not installed (or cannot be imported); the message says how to install it."""


def require_torch(what: str = "mpisgd.torch") -> ModuleType:
    """The ``torch`` module, or TorchMissing naming ``what`` needed it and how to install it."""
    try:
        import torch  # noqa: PLC0415 - optional: only torch models need it
    except ImportError as exc:
        raise TorchMissing(f"{what} needs PyTorch, which is not installed ({exc}): {INSTALL}") from None
    return torch
