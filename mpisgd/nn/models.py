"""The models the CLI offers (``mlp``, ``cnn``, ``resnet``, ``gpt``), and your own:
``--model package.module:function``.

Built on the host; ``materialize`` puts them on a device. A model factory takes the input shape (one
sample's, e.g. (3, 32, 32)) and the number of classes, and returns a :class:`~mpisgd.nn.Module` (e.g.
a :class:`Sequential`) whose output is one score per class, or a ``torch.nn.Module``, which
mpisgd.torch wraps (its tensors become views of the flat buffers; docs/torch.md). A factory runs with
torch's generator seeded by ``seed`` when it uses torch, so every rank builds the same initial values.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from mpisgd.errors import ModelOutputError
from mpisgd.nn.containers import Sequential
from mpisgd.nn.gpt import GPTShape, gpt
from mpisgd.nn.layers import Conv2d, Flatten, Linear, MaxPool2d, Permute, ReLU, image_shape
from mpisgd.nn.module import Model, Module, parameter_shapes
from mpisgd.nn.resnet import resnet

STOCK = ("mlp", "cnn", "resnet", "gpt")  # the models --model names; anything else is package.module:function


def mlp(hidden: tuple[int, ...] = (1024, 1024), n_in: int = 784, n_classes: int = 10) -> Sequential:
    """Flatten, then (Linear, ReLU) per hidden width, then a Linear classifier."""
    layers: list = [Flatten()]
    width = n_in
    for h in hidden:
        # ReLU may overwrite the Linear's own output buffer: it is not needed afterwards
        layers += [Linear(width, h), ReLU(inplace=True)]
        width = h
    layers.append(Linear(width, n_classes))
    return Sequential(*layers)


def cnn(n_classes: int = 10, in_shape: tuple[int, ...] = (1, 28, 28)) -> Sequential:
    """LeNet-5: conv(6,5x5,pad 2)-pool-conv(16,5x5)-pool-120-84-classes, ReLU, for C x H x W inputs of any
    channels and size from 12 x 12 (28 x 28 for Fashion-MNIST).

    The convolutional part runs batch last (CHWN, see Conv2d): one permutation of the NCHW input at the
    start, one back before Flatten, so the features reach the first Linear in NCHW's (c, h, w) order.
    (The layout plan, mpisgd.nn.layout, would place the same two transposes by itself; the explicit
    Permute layers keep the parameters' names, and so the model files, of earlier versions.)
    Each max-pool comes before its ReLU: the two commute (both are monotone), so this is the same
    function and gradient as conv-ReLU-pool, with the ReLU on a quarter of the elements.
    """
    c, h, w = image_shape("cnn", in_shape)
    h4, w4 = (h // 2 - 4) // 2, (w // 2 - 4) // 2  # after pool, the unpadded 5x5 conv, pool
    if h4 < 1 or w4 < 1:
        raise ValueError(f"--model cnn needs images of at least 12 x 12; the data's are {h} x {w}")
    return Sequential(
        Permute((1, 2, 3, 0)),  # NCHW -> CHWN
        Conv2d(c, 6, 5, padding=2), MaxPool2d(2), ReLU(inplace=True),
        Conv2d(6, 16, 5), MaxPool2d(2), ReLU(inplace=True),
        Permute((3, 0, 1, 2)),  # CHWN -> NCHW
        Flatten(),
        Linear(16 * h4 * w4, 120), ReLU(inplace=True),
        Linear(120, 84), ReLU(inplace=True),
        Linear(84, n_classes),
    )


def _gpt(in_shape: tuple[int, ...], n_classes: int, arch: dict[str, Any] | None) -> Module:
    """--model gpt: samples are windows of T = in_shape[0] token ids, the classes its vocabulary."""
    if len(in_shape) != 1:
        raise ValueError(f"--model gpt reads token ids (a text file or an .npz of tokens: windows of --context "
                         f"tokens); the data's samples are {'x'.join(map(str, in_shape))}")
    return gpt(GPTShape(vocab=n_classes, context=in_shape[0], **(arch or {})))


def factory(name: str) -> Callable[..., Module]:
    """``mlp``, ``cnn``, ``resnet``, ``gpt`` or ``package.module:function`` (importable from the working
    directory or PYTHONPATH). Raises ValueError saying what is wrong, in one line: whatever importing the
    user's module does (a SyntaxError, named by file and line; an exception; ``sys.exit()``) is reported, not raised."""
    if name == "mlp":
        return lambda in_shape, n_classes, hidden=(1024, 1024): mlp(hidden, math.prod(in_shape), n_classes)
    if name == "cnn":
        return lambda in_shape, n_classes, hidden=(): cnn(n_classes, in_shape)
    if name == "gpt":
        return lambda in_shape, n_classes, hidden=(), arch=None: _gpt(tuple(in_shape), n_classes, arch)
    if name == "resnet":
        return lambda in_shape, n_classes, hidden=(): resnet(tuple(in_shape), n_classes)
    module, _, fn = name.partition(":")
    if not module or not fn:
        raise ValueError(f"--model {name}: use mlp, cnn, resnet, gpt, or package.module:function for a model of your "
                         "own")
    try:
        found = getattr(importlib.import_module(module), fn)
    except ModuleNotFoundError as exc:
        if exc.name == "torch":  # a PyTorch model, and no PyTorch here
            from mpisgd.torch._import import INSTALL  # noqa: PLC0415 - imports nothing of torch

            raise ValueError(f"--model {name} is a PyTorch model ({module} imports torch), and PyTorch is not "
                             f"installed: {INSTALL}") from None
        raise ValueError(f"--model {name}: cannot import {module} ({exc})") from None
    except SyntaxError as exc:  # before ImportError's handler: the user's typo, where it is
        raise ValueError(f"--model {name}: {exc.filename}, line {exc.lineno}: {type(exc).__name__}: {exc.msg}") \
            from None
    except ImportError as exc:
        raise ValueError(f"--model {name}: cannot import {module} ({exc})") from None
    except AttributeError:
        raise ValueError(f"--model {name}: {module} has no {fn}") from None
    except (Exception, SystemExit) as exc:  # the module's own code failed (or exited) while importing
        raise ValueError(f"--model {name}: importing {module} {_raised(exc)}") from None
    return lambda in_shape, n_classes, hidden=(), seed=0: _seeded(found, tuple(in_shape), n_classes, seed)


def _seeded(found: Callable[..., Module], in_shape: tuple[int, ...], n_classes: int, seed: int) -> Module:
    """The user's factory, under torch's generator seeded by ``seed`` where torch is loaded (the caller's
    generator state is kept), so that a torch model starts from the same values on every rank and run."""
    torch = sys.modules.get("torch")
    if torch is None:
        return found(in_shape, n_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return found(in_shape, n_classes)


def is_torch_module(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.nn.Module`` (without importing torch where it is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # mpisgd/


def _raised(exc: BaseException) -> str:
    """'raised KeyError: 'x' (at file.py:12)', or 'called sys.exit(3)': the user's code failing, in words."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})" if exc.code is not None else "called sys.exit()"
    frames = traceback.extract_tb(exc.__traceback__)
    theirs = [f for f in frames if not f.filename.startswith(_PACKAGE)]  # the user's code: where it went wrong
    if theirs:
        where = f" (at {theirs[-1].filename}:{theirs[-1].lineno})"
    elif frames:  # in mpisgd's own call of the factory: the call's arguments did not fit
        where = " (mpisgd calls a factory as f(input_shape, n_classes))"
    else:
        where = ""
    return f"raised {type(exc).__name__}: {exc}{where}"


def build_model(name: str, in_shape: tuple[int, ...] = (1, 28, 28), n_classes: int = 10,
                hidden: tuple[int, ...] = (1024, 1024), arch: dict[str, Any] | None = None, seed: int = 0) -> Module:
    """The model ``name`` for samples of ``in_shape`` and ``n_classes`` classes (ValueError on a bad
    name, a factory that raises or exits, or one that does not return a Module). ``arch``: the GPT's
    sizes (mpisgd.nn.gpt.GPTShape's layers, heads, width, dropout). A factory's ``torch.nn.Module`` comes
    back as an mpisgd.torch.TorchModule; ``seed`` seeds torch's generator while the factory runs."""
    make = factory(name)
    if name == "gpt":
        model = make(in_shape, n_classes, arch=arch)
    elif name in STOCK:
        model = make(in_shape, n_classes, hidden)
    else:
        try:
            model = make(in_shape, n_classes, seed=seed)
        except (Exception, SystemExit) as exc:  # the user's code: say whose error it is, in one line
            raise ValueError(f"--model {name} {_raised(exc)}") from None
    module = as_module(model, f"--model {name}")
    for what, shape in parameter_shapes(module):  # a layer built with a size of 0 or less fails here, not later
        if not all(isinstance(d, int | np.integer) and d >= 1 for d in shape):
            raise ValueError(f"--model {name}: parameter {what} has shape {tuple(shape)}: a parameter's dimensions "
                             "must be integers >= 1 (a layer built with a size of 0 or less?)")
    return module


def as_module(model: object, what: str) -> Module:
    """``model`` as an mpisgd Module: itself, or a ``torch.nn.Module`` wrapped (mpisgd.torch); ValueError
    naming ``what`` made it otherwise."""
    if is_torch_module(model):
        from mpisgd.torch.model import TorchModule  # noqa: PLC0415 - only for torch models
        from mpisgd.torch.modules import UnsupportedModule  # noqa: PLC0415

        try:
            return TorchModule(model)
        except UnsupportedModule as exc:
            raise ValueError(f"{what}: {exc}") from None
    if not isinstance(model, Module):
        raise ValueError(f"{what} must return an mpisgd.nn.Module (e.g. a Sequential) or a torch.nn.Module, got "
                         f"{type(model).__name__}")
    return model


LAYOUT_HINT = ("image layers (Conv2d, MaxPool2d, BatchNorm2d, ...) take (N, C, H, W) batches as they come: no "
               "Permute is needed; a model that keeps Permute((1, 2, 3, 0)) must put Permute((3, 0, 1, 2)) back "
               "before Flatten (see examples/model_factory.py)")


def _layout_hint(model: Model) -> str:
    """The hint for a model with a Permute to batch last (a model written for the layers of before), or ""."""
    if any(isinstance(m, Permute) and m.axes == (1, 2, 3, 0) for m in model.modules()):
        return f"; {LAYOUT_HINT}"
    return ""


def check_output(model: Model, xp: object, in_shape: tuple[int, ...], n_classes: int, dtype: str,
                 tokens: bool = False, samples: int = 2) -> None:
    """``samples`` samples (two, or one where the run's micro-batches hold one) through the materialised
    model, forward then backward (a loss gradient of ones), in the mode it is in: it must give one score per
    class (``tokens``: at every position of a window of token ids), and both passes must run. ValueError names
    the failing pass and the user's exception, with a hint about the layout where it may help. The gradients
    this leaves are overwritten by the first step; the buffers (BatchNorm's running statistics, which a
    train-mode pass updates) are put back as they were."""
    state = model.state
    kept = None if state is None else state.copy()
    try:
        _check_output(model, xp, in_shape, n_classes, dtype, tokens, samples)
    finally:
        if state is not None:
            state[...] = kept


def gives(shape: tuple[int, ...], n: int) -> str:
    """What a model's output of ``shape`` for a batch of ``n`` samples gives, in words (a wrong shape's)."""
    if shape[:1] == (n,):
        return f"gives {shape[1:]} outputs per sample"
    return f"gives an output of shape {shape} for a batch of {n}, not one row per sample"


def _check_output(model: Model, xp: object, in_shape: tuple[int, ...], n_classes: int, dtype: str,
                  tokens: bool, n: int) -> None:
    x = xp.zeros((n, *in_shape), dtype="int64" if tokens else dtype)  # type: ignore[attr-defined]
    try:
        out = model.forward(x)
    except ModelOutputError as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:
        if n == 1 and model.training:
            raise ValueError(f"the model cannot train on a micro-batch of one sample ({type(exc).__name__}: {exc}); "
                             "give each rank --batch-size 2 or more") from None
        raise ValueError(f"the model cannot take samples of shape {tuple(in_shape)} "
                         f"({type(exc).__name__}: {exc}){_layout_hint(model)}") from None
    want = (n, *in_shape, n_classes) if tokens else (n, n_classes)
    if tuple(out.shape) != want:
        said = gives(tuple(out.shape), n)
        if tokens:
            raise ValueError(f"the model {said}; the data are windows of {in_shape[0]} tokens of a vocabulary of "
                             f"{n_classes}, so it must give {want[1:]}: a score per token at every position")
        raise ValueError(f"the model {said}; the data have {n_classes} classes (labels 0..C-1), so it must "
                         "give one score per class per sample" + _layout_hint(model))
    try:
        model.backward(xp.ones_like(out) / 2)  # type: ignore[attr-defined]
    except Exception as exc:
        raise ValueError(f"the model's backward fails ({type(exc).__name__}: {exc}){_layout_hint(model)}") from None
