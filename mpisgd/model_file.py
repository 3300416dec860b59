"""The trained model as a file, and back: ``mpisgd.load_model(path) -> Model``.

Two kinds of file hold a model (both ``.npz``, read with ``allow_pickle=False``; docs/api.md has the
layout):

* ``--save-model PATH``: ``flat`` (every parameter, in model order), one array per parameter
  (``"1.Linear.W"``: layer index, layer class, name) and ``meta``, JSON saying what model it is
  (:func:`mpisgd.app.run.model_record`);
* a checkpoint (``ckpt-<step>.npz``): ``params`` and, from this version on, ``model``, the same JSON.

Files written before the model was recorded still load where the model can be told from what they
hold: a ``--save-model`` file of the stock ``mlp`` or ``cnn`` from its parameters' names and shapes, a
checkpoint from its configuration (an ``mlp``'s input size from the parameter count; anything else
needs ``in_shape``).

A PyTorch model (``framework: torch`` in its description) is rebuilt only from a factory the caller
names (``factory=``; ``python -m mpisgd.evaluate --model-factory``): reading a file never imports the
code it names. Its state (running statistics) is saved as ``state`` beside ``flat``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpisgd.backend import to_numpy
from mpisgd.checkpoint import CheckpointError, SaveError, find_resume, load_checkpoint
from mpisgd.errors import UsageError
from mpisgd.files import atomic_write, free_bytes, write_npz
from mpisgd.nn import Model, Module, build_model
from mpisgd.nn.module import parameter_shapes

FORMAT = "mpisgd-model"
VERSION = 1


class ModelFileError(UsageError):
    """A file that holds no model mpisgd can rebuild (one line, exit 2, in mpisgd.evaluate)."""


@dataclass
class SavedModel:
    model: Model  # materialised, with the file's parameters
    meta: dict[str, Any]  # what the writer recorded (mpisgd.app.run.model_record) (for older files: what could be told)
    path: str  # the file read (a directory's newest good checkpoint)


def load_model(path: str, in_shape: tuple[int, ...] | None = None, xp: Any = None,
               factory: str | None = None) -> Model:
    """The model that ``path`` (a --save-model file, a checkpoint, or a checkpoint directory:
    its newest good checkpoint) holds, with its parameters, on ``xp`` (NumPy by default). ``in_shape``
    (one sample's) is needed only for older files that do not record it. A PyTorch model's file names
    its factory but is built only from the ``factory`` (``"package.module:function"``) the caller
    passes: name only code you trust. ModelFileError says what is wrong."""
    return read_model(path, in_shape, xp, factory).model


def read_model(path: str, in_shape: tuple[int, ...] | None = None, xp: Any = None,
               factory: str | None = None) -> SavedModel:
    """load_model, with the file's description of the model."""
    p = Path(path)
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
            held: np.ndarray | None = None  # the model's state (running statistics)
            if "params" in files and "config" in files:
                flat, meta, held = _from_checkpoint(p, in_shape)
            elif "flat" in files:
                flat = z["flat"]
                held = z["state"] if "state" in files else None
                meta = json.loads(str(z["meta"])) if "meta" in files else _infer(named, flat, in_shape, p)
            else:
                raise ModelFileError(f"{p} holds neither a --save-model file's 'flat' nor a checkpoint's 'params' "
                                     f"(it holds {', '.join(sorted(files)) or 'nothing'})")
    except ModelFileError:
        raise
    except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise ModelFileError(f"{p} is not a usable model file ({type(exc).__name__}: {exc})") from None
    if meta.get("in_shape") is None:
        if in_shape is None:
            raise ModelFileError(f"{p} does not record its input shape (written by an older mpisgd): pass in_shape")
        meta["in_shape"] = list(in_shape)
    if meta.get("framework") == "torch":
        model = _build_torch(meta, flat, held, p, xp, factory)
    else:
        model = _build(meta, flat, named, p, xp)
    return SavedModel(model, meta, str(p))


def _from_checkpoint(p: Path, in_shape: tuple[int, ...] | None
                     ) -> tuple[np.ndarray, dict[str, Any], np.ndarray | None]:
    try:
        state = load_checkpoint(p)
    except CheckpointError as exc:
        raise ModelFileError(str(exc)) from None
    if state.model:
        return state.params, {**state.model, "step": state.global_step}, state.model_state
    cfg = state.config  # an older checkpoint: what its configuration says
    meta = {"model": cfg.get("model", "mlp"), "hidden": cfg.get("hidden", [1024, 1024]),
            "dtype": cfg.get("dtype", str(state.params.dtype)), "classes": state.data.get("classes", 10),
            "data": state.data, "seed": cfg.get("seed", 0), "step": state.global_step,
            "in_shape": list(in_shape) if in_shape else None}
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


def _build(meta: dict[str, Any], flat: np.ndarray, named: dict[str, np.ndarray], p: Path, xp: Any) -> Model:
    try:
        module = build_model(meta["model"], tuple(meta["in_shape"]), int(meta["classes"]),
                            tuple(meta.get("hidden") or ()))
    except (KeyError, TypeError) as exc:
        raise ModelFileError(f"{p}: its model description lacks {exc}") from None
    except ValueError as exc:
        raise ModelFileError(f"{p}: cannot build its model ({exc})") from None
    size = sum(math.prod(s) for _, s in parameter_shapes(module))
    if flat.ndim != 1 or flat.size != size:
        raise ModelFileError(f"{p} holds {flat.size} parameters; its model ({meta['model']}, in_shape "
                             f"{tuple(meta['in_shape'])}, {meta['classes']} classes) has {size}")
    wrong = [n for n, s in parameter_shapes(module) if n in named and tuple(named[n].shape) != s]
    if wrong:
        raise ModelFileError(f"{p}: parameters {', '.join(wrong)} do not have the shapes its model gives them")
    model = module.materialize(np if xp is None else xp, meta.get("dtype") or str(flat.dtype), seed=0)
    model.flat.params[...] = model.flat.xp.asarray(flat)
    return model


def _build_torch(meta: dict[str, Any], flat: np.ndarray, state: np.ndarray | None, p: Path, xp: Any,
                 factory: str | None) -> Model:
    """A PyTorch model from the factory the caller names (never the file's), with the file's parameters
    and state."""
    if not factory:
        raise ModelFileError(f"{p} holds a PyTorch model made by {meta.get('model')!r}; mpisgd does not run code a "
                             "file names: pass the factory you trust (load_model(..., factory=...), or "
                             "python -m mpisgd.evaluate --model-factory package.module:function)")
    try:
        module = build_model(factory, tuple(meta["in_shape"]), int(meta["classes"]), seed=int(meta.get("seed", 0)))
    except (KeyError, TypeError) as exc:
        raise ModelFileError(f"{p}: its model description lacks {exc}") from None
    except ValueError as exc:
        raise ModelFileError(f"{p}: cannot build its model with {factory} ({exc})") from None
    model = module.materialize(np if xp is None else xp, meta.get("dtype") or str(flat.dtype), seed=0)
    if flat.ndim != 1 or flat.size != model.flat.size:
        raise ModelFileError(f"{p} holds {flat.size} parameters; {factory} builds a model of {model.flat.size}")
    have = 0 if model.state is None else model.state.size
    if (0 if state is None else state.size) != have:
        raise ModelFileError(f"{p} holds {0 if state is None else state.size} values of model state (running "
                             f"statistics); {factory} builds a model of {have}")
    model.flat.params[...] = model.flat.xp.asarray(flat)
    if model.state is not None and state is not None:
        model.state[...] = model.flat.xp.asarray(state)
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
