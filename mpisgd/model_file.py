"""The trained model as a file, and back: ``mpisgd.load_model(path) -> Model``.

Two kinds of file hold a model (both ``.npz``, read with ``allow_pickle=False``; docs/api.md has the
layout):

* ``--save-model PATH``: ``flat`` (every parameter, in model order), one array per parameter
  (``"1.Linear.W"``: layer index, layer class, name), ``meta``, JSON saying what model it is
  (:func:`mpisgd.app.run.model_record`), and ``state``, the model's buffers in model order (BatchNorm's
  running statistics: ``model.state``), for a model that has them;
* a checkpoint (``ckpt-<step>.npz``): ``params`` and, from this version on, ``model``, the same JSON
  (and ``model_state``, the buffers).

Files written before the model was recorded still load where the model can be told from what they
hold: a ``--save-model`` file of the stock ``mlp`` or ``cnn`` from its parameters' names and shapes, a
checkpoint from its configuration (an ``mlp``'s input size from the parameter count; anything else
needs ``in_shape``).

Reading a file runs no code it names: the stock models are built by mpisgd's own builders, and a model
of the user's own (``package.module:function`` in the file) is built only by a factory the caller names
(``factory=``, ``--model-factory``), as ``torch.load(weights_only=True)`` loads no code by default. Every
field of the description is type-checked before use (:func:`check_meta`), and the parameters must be
finite floats. A PyTorch model (``framework: torch`` in its description) is such a model of the user's.
The model's state (running statistics) is saved as ``state`` beside ``flat``.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from mpisgd.backend import to_numpy
from mpisgd.checkpoint import CheckpointError, SaveError, find_resume, load_checkpoint
from mpisgd.errors import UsageError
from mpisgd.files import atomic_write, free_bytes, write_npz
from mpisgd.files import replaceable as files_replaceable
from mpisgd.nn import Model, Module, build_model
from mpisgd.nn.models import STOCK, as_module  # the models mpisgd builds itself; anything else is the user's
from mpisgd.nn.module import parameter_shapes

FORMAT = "mpisgd-model"
VERSION = 1
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:function
_LARGE = 1 << 31  # no dimension, width or class count of a real model is this large
Factory = Callable[[tuple[int, ...], int], Module]


class ModelFileError(UsageError):
    """A file that holds no model mpisgd can rebuild (one line, exit 2, in mpisgd.evaluate)."""


@dataclass
class SavedModel:
    model: Model  # materialised, with the file's parameters
    meta: dict[str, Any]  # what the writer recorded (mpisgd.app.run.model_record) (for older files: what could be told)
    path: str  # the file read (a directory's newest good checkpoint)


def load_model(path: str, in_shape: tuple[int, ...] | None = None, xp: Any = None,
               factory: str | Factory | None = None) -> Model:
    """The model that ``path`` (a --save-model file, a checkpoint, or a checkpoint directory:
    its newest good checkpoint) holds, with its parameters and buffers, on ``xp`` (NumPy by default), in
    eval mode (``model.train()`` to train it further). ``in_shape`` (one sample's) is needed only for older
    files that do not record it. ModelFileError says what is wrong.

    A file of a stock model (``mlp``, ``cnn``, ``resnet``, ``gpt``) is built by mpisgd's own builders. A file
    of a model of your own names its factory, which is never imported from the file: pass ``factory``, a
    function of ``(input_shape, n_classes)`` returning the module, or its ``"package.module:function"``
    (then imported and called; name only code you trust)."""
    return read_model(path, in_shape, xp, factory).model


def read_model(path: str, in_shape: tuple[int, ...] | None = None, xp: Any = None,
               factory: str | Factory | None = None) -> SavedModel:
    """load_model, with the file's description of the model."""
    p = Path(path)
    try:
        p.stat()
    except FileNotFoundError:
        pass  # said below
    except OSError as exc:  # a name too long, a loop of links: what the file system says, in one line
        raise ModelFileError(f"{path}: {exc.strerror or exc}") from None
    if p.is_dir():
        try:
            state, found, _ = find_resume("auto", str(p))
        except CheckpointError as exc:
            raise ModelFileError(str(exc)) from None
        if state is None:
            raise ModelFileError(f"{path}: a directory with no usable checkpoint (ckpt-<step>.npz)")
        p = Path(found)
    if not p.is_file():
        raise ModelFileError(f"{path}: no such file")
    if not zipfile.is_zipfile(p):
        raise ModelFileError(f"{p} is not a model file (an .npz written by --save-model, or a checkpoint)")
    try:
        with np.load(p, allow_pickle=False) as z:
            files = set(z.files)
            named = {k: z[k] for k in files if k[:1].isdigit()}
            if "params" in files and "config" in files:
                flat, meta, buffers = _from_checkpoint(p, in_shape)
            elif "flat" in files:
                flat = z["flat"]
                _check_params(flat, p)
                meta = json.loads(str(z["meta"])) if "meta" in files else _infer(named, flat, in_shape, p)
                buffers = z["state"] if "state" in files else None
            else:
                raise ModelFileError(f"{p} holds neither a --save-model file's 'flat' nor a checkpoint's 'params' "
                                     f"(it holds {', '.join(sorted(files)) or 'nothing'})")
    except ModelFileError:
        raise
    except (OSError, EOFError, KeyError, ValueError, IndexError, TypeError, RecursionError,
            zipfile.BadZipFile) as exc:
        raise ModelFileError(f"{p} is not a usable model file ({type(exc).__name__}: {exc})") from None
    check_meta(meta, p)
    if meta.get("in_shape") is None:
        if in_shape is None:
            raise ModelFileError(f"{p} does not record its input shape (written by an older mpisgd): pass in_shape")
        meta["in_shape"] = list(in_shape)
    model = _build(meta, flat, named, p, xp, factory)
    _load_state(model, buffers, p)
    model.eval()  # a trained model, for scoring: running statistics, no dropout
    return SavedModel(model, meta, str(p))


def replaceable(path: str | os.PathLike) -> bool:
    """``path`` may take a new --save-model file: nothing is there, an empty file, or a model mpisgd saved (an
    .npz holding ``flat``: the earlier run's, which a run saving to the same path means to replace). Anything
    else there is someone's data, kept (the run refuses the path before training)."""
    def saved_model(f: IO[bytes]) -> bool:
        with zipfile.ZipFile(f) as z:
            return "flat.npy" in z.namelist()

    return files_replaceable(path, saved_model)


def _check_params(flat: Any, p: Path) -> None:
    """The parameters: a 1-D array of finite float32 or float64 values."""
    if not isinstance(flat, np.ndarray) or flat.ndim != 1 or flat.dtype not in (np.float32, np.float64):
        raise ModelFileError(f"{p}: its parameters must be a 1-D float32 or float64 array, got "
                             f"{getattr(flat, 'dtype', type(flat).__name__)} {getattr(flat, 'shape', '')}")
    bad = int(np.count_nonzero(~np.isfinite(flat)))
    if bad:
        raise ModelFileError(f"{p}: its parameters hold {bad:,} non-finite values (NaN or inf): not a model to use")


def _count(x: Any, low: int = 1) -> bool:
    """An integer (not a bool) in [low, 2**31)."""
    return isinstance(x, int) and not isinstance(x, bool) and low <= x < _LARGE


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def check_meta(meta: Any, p: Path | str) -> None:
    """Every field of a model description (mpisgd.app.run.model_record) of the right type and range before
    anything uses it; ModelFileError names the first that is not. Fields an older file lacks may be
    missing (``in_shape`` then comes from the caller)."""
    def bad(field: str, want: str) -> ModelFileError:
        got = json.dumps(meta.get(field), default=str)
        return ModelFileError(f"{p}: its model description is not mpisgd's: {field} must be {want}, got "
                              f"{got[:80]}{'...' if len(got) > 80 else ''}")

    if not isinstance(meta, dict):
        raise ModelFileError(f"{p}: its model description must be a JSON object, got {type(meta).__name__}")
    if "format" in meta and meta["format"] != FORMAT:
        raise ModelFileError(f"{p} is not an mpisgd model file: its format is {json.dumps(meta['format'])[:80]}, "
                             f"not {FORMAT!r}")
    if "version" in meta and not (_count(meta["version"]) and meta["version"] <= VERSION):
        raise ModelFileError(f"{p}: model file version {json.dumps(meta['version'])[:40]}, this mpisgd reads "
                             f"{VERSION}: use the mpisgd that wrote it, or a newer one")
    name = meta.get("model")
    if not (isinstance(name, str) and (name in STOCK or _FACTORY.match(name))):
        raise bad("model", f"{', '.join(STOCK)} or package.module:function")
    shape = meta.get("in_shape")
    if shape is not None and not (isinstance(shape, list) and 1 <= len(shape) <= 8 and all(map(_count, shape))):
        raise bad("in_shape", "a list of 1 to 8 positive integers (one sample's shape)")
    if not _count(meta.get("classes")):
        raise bad("classes", "a positive integer")
    hidden = meta.get("hidden")
    if hidden is not None and not (isinstance(hidden, list) and all(map(_count, hidden))):
        raise bad("hidden", "a list of positive integers")
    if meta.get("dtype") is not None and meta["dtype"] not in ("float32", "float64"):
        raise bad("dtype", "float32 or float64")
    for field in ("parameters", "seed", "step"):
        if field in meta and not _count(meta[field], 0):
            raise bad(field, "an integer >= 0")
    for field in ("input_scale", "input_shift"):
        if meta.get(field) is not None and not _finite(meta[field]):
            raise bad(field, "a finite number")
    arch = meta.get("arch")
    if arch is not None and not (isinstance(arch, dict) and set(arch) <= {"layers", "heads", "width", "dropout"}
                                 and all(_count(arch[k]) for k in set(arch) - {"dropout"})
                                 and _finite(arch.get("dropout", 0.0)) and 0 <= arch.get("dropout", 0.0) < 1):
        raise bad("arch", "a JSON object of the GPT's sizes (layers, heads, width: positive integers; dropout in "
                          "[0, 1))")
    if meta.get("data") is not None and not isinstance(meta["data"], dict):
        raise bad("data", "a JSON object (the training set's identity)")


def _load_state(model: Model, state: np.ndarray | None, p: Path) -> None:
    """The file's buffers (running statistics) into the model, which must have as many."""
    if model.state is None and state is None:
        return
    if model.state is None or state is None or state.ndim != 1 or state.size != model.state.size:
        have = "none" if state is None else f"{state.size}"
        need = 0 if model.state is None else model.state.size
        raise ModelFileError(f"{p} holds {have} values of model state (running statistics); its model has {need}")
    if state.dtype.kind != "f" or not np.isfinite(state).all():
        raise ModelFileError(f"{p}: its model state (running statistics) must be finite floats, got {state.dtype}")
    model.state[...] = model.flat.xp.asarray(state)


def _from_checkpoint(p: Path, in_shape: tuple[int, ...] | None
                     ) -> tuple[np.ndarray, dict[str, Any], np.ndarray | None]:
    try:
        state = load_checkpoint(p)
    except CheckpointError as exc:
        raise ModelFileError(str(exc)) from None
    if state.model:
        check_meta(state.model, p)
        return state.params, {**state.model, "step": state.global_step}, state.model_state
    cfg = state.config  # an older checkpoint: what its configuration says
    meta = {"model": cfg.get("model", "mlp"), "hidden": cfg.get("hidden", [1024, 1024]),
            "dtype": cfg.get("dtype", str(state.params.dtype)), "classes": state.data.get("classes", 10),
            "data": state.data, "seed": cfg.get("seed", 0), "step": state.global_step,
            "in_shape": list(in_shape) if in_shape else None}
    check_meta(meta, p)
    if meta["in_shape"] is None and meta["model"] == "mlp":  # its input size follows from the parameter count
        widths = [*meta["hidden"], meta["classes"]]
        rest = sum(a * b + b for a, b in zip(widths, widths[1:])) + widths[0]
        n_in, odd = divmod(state.params.size - rest, widths[0])
        if n_in >= 1 and not odd:
            meta["in_shape"] = [n_in]
    return state.params, meta, state.model_state


def _infer(named: dict[str, np.ndarray], flat: np.ndarray, in_shape: tuple[int, ...] | None,
           p: Path) -> dict[str, Any]:
    """An older --save-model file (no 'meta'): the stock mlp or cnn whose parameter names and shapes
    it holds."""
    shapes = {k: tuple(v.shape) for k, v in named.items()}
    layers = sorted({(int(k.split(".")[0]), k.split(".")[1]) for k in shapes})
    weights = [shapes[f"{i}.{kind}.W"] for i, kind in layers if f"{i}.{kind}.W" in shapes]
    candidates = []
    if weights and all(kind == "Linear" for _, kind in layers):
        candidates.append({"model": "mlp", "hidden": [w[1] for w in weights[:-1]], "classes": weights[-1][1],
                           "in_shape": list(in_shape or (weights[0][0],))})
    if [kind for _, kind in layers] == ["Conv2d", "Conv2d", "Linear", "Linear", "Linear"]:
        h4 = math.isqrt(weights[2][0] // 16)  # LeNet-5's first Linear takes 16 x h4 x w4: guess square images
        candidates.append({"model": "cnn", "hidden": [], "classes": weights[-1][1],
                           "in_shape": list(in_shape or (weights[0][1], 4 * h4 + 8, 4 * h4 + 8))})
    for meta in candidates:
        try:
            model = build_model(meta["model"], tuple(meta["in_shape"]), meta["classes"], tuple(meta["hidden"]))
        except ValueError:
            continue
        if dict(parameter_shapes(model)) == shapes:
            return {**meta, "dtype": str(flat.dtype)}
    raise ModelFileError(f"{p} does not say what model it holds (written by an older mpisgd, and its parameters "
                         "are not those of the stock mlp or cnn for this input shape)")


def _build(meta: dict[str, Any], flat: np.ndarray, named: dict[str, np.ndarray], p: Path, xp: Any,
           factory: str | Factory | None) -> Model:
    """The model the checked ``meta`` describes, with ``flat`` as its parameters: the stock models by
    mpisgd's builders; a model of the user's own only by the ``factory`` the caller named."""
    in_shape, classes, name = tuple(meta["in_shape"]), int(meta["classes"]), meta["model"]
    try:
        if name in STOCK:
            module = build_model(name, in_shape, classes, tuple(meta.get("hidden") or ()), arch=meta.get("arch"))
        elif factory is None:
            raise ModelFileError(
                f"{p} holds a model of its own, built by {name}; reading a file runs no code it names: if you "
                f"trust that code, pass it as the factory (load_model(path, factory={name!r}), or "
                f"--model-factory {name} to python -m mpisgd.evaluate or mpisgd.sample)")
        elif isinstance(factory, str):
            module = build_model(factory, in_shape, classes, seed=int(meta.get("seed", 0)))
        else:
            module = as_module(factory(in_shape, classes), "the factory")
    except ModelFileError:
        raise
    except ValueError as exc:
        raise ModelFileError(f"{p}: cannot build its model ({exc})") from None
    size = sum(math.prod(s) for _, s in parameter_shapes(module))
    if flat.ndim != 1 or flat.size != size:
        built = meta["model"] if factory is None else (factory if isinstance(factory, str) else "the factory given")
        raise ModelFileError(f"{p} holds {flat.size} parameters; the model {built} builds (in_shape "
                             f"{tuple(meta['in_shape'])}, {meta['classes']} classes) has {size}"
                             + (f" (the file's model: {meta['model']})" if factory is not None else ""))
    wrong = [n for n, s in parameter_shapes(module) if n in named and tuple(named[n].shape) != s]
    if wrong:
        raise ModelFileError(f"{p}: parameters {', '.join(wrong)} do not have the shapes its model gives them")
    model = module.materialize(np if xp is None else xp, meta.get("dtype") or str(flat.dtype), seed=0)
    model.flat.params[...] = model.flat.xp.asarray(flat)
    return model


def save_params(path: str, model: Any, fallback_dirs: Sequence[str | os.PathLike] = (),
                meta: dict[str, Any] | None = None) -> str:
    """Write the final parameters (the flat vector and each named parameter, as NumPy arrays) and ``meta``,
    what model it is (mpisgd.app.run.model_record; the file mpisgd.load_model reads, docs/api.md), to ``path``;
    where that fails (a full disk, a directory gone), to the first of ``fallback_dirs`` that takes them,
    under the same file name (never replacing a file there). Returns where they went; SaveError, naming
    every place tried and why, when nowhere."""
    named = {name: to_numpy(p) for name, p in model.named_parameters()}
    flat = to_numpy(model.flat.params)
    extra = {"meta": np.array(json.dumps(meta))} if meta else {}
    if getattr(model, "state", None) is not None:  # running statistics: part of the model
        extra["state"] = to_numpy(model.state)
    tried = []
    for target in [Path(path), *(free_name(Path(d), Path(path).name) for d in fallback_dirs)]:
        try:
            atomic_write(target, lambda f: write_npz(f, {"flat": flat, **named, **extra}))
            return str(target)
        except OSError as exc:
            tried.append(f"{target} ({exc.strerror or exc}{_free(target)})")
    raise SaveError("the final model was not written: " + "; ".join(tried))


def model_fallbacks(checkpoint_dir: str | None) -> list[str]:
    """Where save_params tries when --save-model cannot be written: beside the checkpoints, then the
    temporary directory."""
    return [d for d in (checkpoint_dir, tempfile.gettempdir()) if d]


def free_name(directory: Path, name: str) -> Path:
    p, n = directory / name, 1
    while p.exists():
        p, n = directory / f"{Path(name).stem}-{n}{Path(name).suffix}", n + 1
    return p


def _free(target: Path) -> str:
    try:
        return f"; {free_bytes(target.parent) / 2**20:.0f} MiB free there"
    except OSError:
        return ""


def model_structure(module: Module) -> dict[str, Any]:
    """The model's structure, for a checkpoint (JSON): the repr of each of the root's children (of the
    root, if it has none) and each parameter's qualified name and shape. A resumed run must build the
    same (resume_point)."""
    return {"layers": [repr(m) for _, m in module.children()] or [repr(module)],
            "shapes": [[name, list(shape)] for name, shape in parameter_shapes(module)]}
