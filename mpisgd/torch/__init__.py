"""PyTorch models in mpisgd (docs/torch.md). Needs PyTorch; ``import mpisgd`` never imports it.

- **Your own loop, DDP-style**: ``model = mpisgd.torch.wrap(model, comm)`` in place of
  ``DistributedDataParallel(model)``: parameters and gradients in mpisgd's flat buffers, the all-reduce
  overlapped with backward through mpisgd's reducers, ``no_sync()``, the noise scale, a metrics file for
  the planner (mpisgd.torch.distributed).
- **mpisgd's loop** (``python -m mpisgd.train --model package.module:function`` with a function that
  returns a ``torch.nn.Module``, or ``mpisgd.DataParallel``): :class:`TorchModule` / :func:`from_torch`
  make the module an mpisgd model whose tensors are views of the flat buffers, so every feature of the
  CLI applies (mpisgd.torch.model).

The names load on first use (PEP 562), after a check that says how to install PyTorch where it is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

from mpisgd.torch._import import INSTALL, TorchMissing, require_torch

_LAZY = {"TorchModel": "mpisgd.torch.model", "TorchModule": "mpisgd.torch.model", "from_torch": "mpisgd.torch.model",
         "DistributedModel": "mpisgd.torch.distributed", "wrap": "mpisgd.torch.distributed"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mpisgd.torch' has no attribute {name!r}")
    require_torch()
    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = ["INSTALL", "DistributedModel", "TorchMissing", "TorchModel", "TorchModule", "from_torch", "require_torch",
           "wrap"]
