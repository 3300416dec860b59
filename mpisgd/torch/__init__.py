"""PyTorch models in mpisgd (docs/torch.md). Needs PyTorch; ``import mpisgd`` never imports it.

- **Your own loop, DDP-style**: ``model = mpisgd.torch.wrap(model, comm)`` in place of
  ``DistributedDataParallel(model)``: parameters and gradients in mpisgd's flat buffers, the all-reduce
  overlapped with backward through mpisgd's reducers, ``no_sync()``, the noise scale, a metrics file for
  the planner (mpisgd.torch.wrap).
- **mpisgd's loop** (``python -m mpisgd.train --model package.module:function`` with a function that
  returns a ``torch.nn.Module``, or ``mpisgd.DataParallel``): :class:`TorchModule` / :func:`from_torch`
  make the module an mpisgd model whose tensors are views of the flat buffers, so every feature of the
  CLI applies (mpisgd.torch.model).
"""

from mpisgd.torch._import import INSTALL, TorchMissing, require_torch

require_torch()

from mpisgd.torch.model import TorchModel, TorchModule, from_torch  # noqa: E402 - after the check above
from mpisgd.torch.wrap import DistributedModel, wrap  # noqa: E402

__all__ = ["INSTALL", "DistributedModel", "TorchMissing", "TorchModel", "TorchModule", "from_torch", "require_torch",
           "wrap"]
