"""What a run pins in PyTorch before it trains a torch model, and what it refuses under --reproducible.

:func:`prepare` sets torch's intra-op threads to the rank's BLAS threads (ranks sharing cores must not
fight) and, for ``--reproducible``:

- ``torch.use_deterministic_algorithms(True)`` (and, on a GPU, cuDNN's deterministic kernels and
  cuBLAS's fixed workspace), so an operation whose kernel is not deterministic fails at start-up
  instead of changing bits from run to run;
- refuses modules that draw from torch's generator and cannot be keyed by sample (AlphaDropout, RReLU,
  attention with ``dropout > 0``), and probes one train-mode forward: any draw from torch's generator
  there (``F.dropout`` in a forward, ``dropout_p=``) is refused, and every later forward checks it again.

It returns what the bits depend on besides mpisgd's own (the banner and checkpoints record it): the
torch version and its threads; the CPU model and NumPy's BLAS are in the run's environment already.
"""

from __future__ import annotations

import os
import sys

import torch

from mpisgd.torch.model import TorchModel, UnkeyedRandomness
from mpisgd.torch.modules import unkeyed_randomness


def pin(threads: int, reproducible: bool, gpu: bool) -> None:
    """torch's threads, and deterministic kernels when ``reproducible`` (process-wide settings)."""
    torch.set_num_threads(max(1, threads))
    if reproducible:
        if gpu:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic reductions
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.deterministic = True
        deterministic_algorithms()


def deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)`` without its import of TorchInductor's configuration,
    1.4 s of every rank's start-up on a CPU: the eager kernels' switch is set directly, and Inductor, if a
    module compiles later, reads its own from ``TORCHINDUCTOR_DETERMINISTIC``. Where Inductor is loaded
    already, or this torch lacks the switch, the public call does both."""
    switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if "torch._inductor.config" in sys.modules or switch is None:
        torch.use_deterministic_algorithms(True)
        return
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    switch(True, warn_only=False)


def environment(threads: int) -> dict[str, str]:
    """What a torch model's bits depend on besides the CPU and NumPy: torch's version and threads."""
    return {"torch": f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)"}


def prepare(model: TorchModel, in_shape: tuple[int, ...], threads: int, reproducible: bool, rank: int = 0,
            seed: int = 0) -> dict[str, str]:
    """Pin torch for this run (module docstring); under ``reproducible`` refuse what cannot give the same
    bits at any k (ValueError, one line) and make every train-mode forward check that nothing drew from
    torch's generator. Otherwise reseed torch's generator per rank, so modules that draw from it (if any)
    do not draw the same numbers on every rank. Returns :func:`environment`."""
    gpu = model.device.type == "cuda"
    pin(threads, reproducible, gpu)
    if not reproducible:
        torch.manual_seed((seed * 1_000_003 + rank) % 2**63)
        return environment(threads)
    found = unkeyed_randomness(model.torch_module)
    if found:
        raise ValueError(f"--reproducible: {', '.join(found)} draw(s) random numbers mpisgd cannot key by sample, "
                         "so the bits would depend on k: drop those (nn.Dropout modules are keyed), or drop "
                         "--reproducible")
    probe(model, in_shape)
    model.keyed_randomness = True
    return environment(threads)


def probe(model: TorchModel, in_shape: tuple[int, ...]) -> None:
    """One train-mode forward and backward of two samples with the deterministic checks on, then the
    state (running statistics) as it was. ValueError says what would break the same bits at any k."""
    xp = model.flat.xp
    x = xp.zeros((2, *in_shape), dtype=model.flat.dtype)
    saved = None if model.state is None else model.state.copy()
    was = model.training
    model.train()
    model.keyed_randomness = True
    try:
        out = model.forward(x)
        model.backward(xp.ones_like(out) / 2)
    except UnkeyedRandomness as exc:
        raise ValueError(f"--reproducible: {exc}") from None
    except RuntimeError as exc:
        if "deterministic" not in str(exc):
            raise
        first = str(exc).strip().splitlines()[0]
        raise ValueError(f"--reproducible: {first} (a kernel without a deterministic implementation: the bits would "
                         "change from run to run); drop that operation or --reproducible") from None
    finally:
        model.keyed_randomness = False
        model.train(was)
        if saved is not None and model.state is not None:
            model.state[...] = saved
        model.flat.grads.fill(0)
