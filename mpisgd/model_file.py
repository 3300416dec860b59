"""The trained model as a file, and back: ``mpisgd.load_model(path) -> Sequential``.

Two kinds of file hold a model (both ``.npz``, read with ``allow_pickle=False``; docs/api.md has the
layout):

* ``--save-model PATH``: ``flat`` (every parameter, in model order), one array per parameter
  (``"1.Linear.W"``: layer index, layer class, name) and ``meta``, JSON saying what model it is
  (:func:`describe`);
* a checkpoint (``ckpt-<step>.npz``): ``params`` and, from this version on, ``model``, the same JSON.

Files written before the model was recorded still load where the model can be told from what they
hold: a ``--save-model`` file of the stock ``mlp`` or ``cnn`` from its parameters' names and shapes, a
checkpoint from its configuration (an ``mlp``'s input size from the parameter count; anything else
needs ``in_shape``).
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mpisgd.checkpoint import CheckpointError, find_resume, load_checkpoint
from mpisgd.config import UsageError
from mpisgd.nn import Sequential, build_model

if TYPE_CHECKING:
    from mpisgd.run import Run

FORMAT = "mpisgd-model"
VERSION = 1


class ModelFileError(UsageError):
    """A file that holds no model mpisgd can rebuild (one line, exit 2, in mpisgd.evaluate)."""


def describe(run: Run, step: int | None = None) -> dict[str, Any]:
    """What model ``run`` trains, as a JSON-able dict: enough to build it again (the model's name or
    factory, one sample's shape, the classes, the MLP's hidden widths, the dtype), and how its inputs
    were scaled (``x * input_scale + input_shift``), the data set's identity and the step."""
    cfg, data = run.cfg, run.data
    meta = {"format": FORMAT, "version": VERSION, "model": cfg.model, "in_shape": list(data.in_shape),
            "classes": data.n_classes, "hidden": list(cfg.hidden), "dtype": cfg.dtype,
            "parameters": int(run.model.flat.size), "input_scale": float(data.train.scale),
            "input_shift": float(data.train.shift), "data": data.identity, "seed": cfg.seed}
    if step is not None:
        meta["step"] = step
    return meta


@dataclass
class SavedModel:
    model: Sequential  # materialised, with the file's parameters
    meta: dict[str, Any]  # what describe() says (for older files: what could be told)
    path: str  # the file read (a directory's newest good checkpoint)


def load_model(path: str, in_shape: tuple[int, ...] | None = None, xp: Any = None) -> Sequential:
    """The ``Sequential`` that ``path`` (a --save-model file, a checkpoint, or a checkpoint directory:
    its newest good checkpoint) holds, with its parameters, on ``xp`` (NumPy by default). ``in_shape``
    (one sample's) is needed only for older files that do not record it. ModelFileError says what is
    wrong."""
    return read_model(path, in_shape, xp).model


def read_model(path: str, in_shape: tuple[int, ...] | None = None, xp: Any = None) -> SavedModel:
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
            if "params" in files and "config" in files:
                flat, meta = _from_checkpoint(p, in_shape)
            elif "flat" in files:
                flat = z["flat"]
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
    model = _build(meta, flat, named, p, xp)
    return SavedModel(model, meta, str(p))


def _from_checkpoint(p: Path, in_shape: tuple[int, ...] | None) -> tuple[np.ndarray, dict[str, Any]]:
    try:
        state = load_checkpoint(p)
    except CheckpointError as exc:
        raise ModelFileError(str(exc)) from None
    if state.model:
        return state.params, {**state.model, "step": state.global_step}
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
    return state.params, meta


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
        if {n: s for _, n, s in _param_shapes(model)} == shapes:
            return {**meta, "dtype": str(flat.dtype)}
    raise ModelFileError(f"{p} does not say what model it holds (written by an older mpisgd, and its parameters "
                         "are not those of the stock mlp or cnn for this input shape)")


def _param_shapes(model: Sequential) -> list[tuple[int, str, tuple[int, ...]]]:
    return [(i, f"{i}.{type(layer).__name__}.{name}", tuple(shape))
            for i, layer in enumerate(model.layers) for name, shape in layer.param_shapes]


def _build(meta: dict[str, Any], flat: np.ndarray, named: dict[str, np.ndarray], p: Path, xp: Any) -> Sequential:
    try:
        model = build_model(meta["model"], tuple(meta["in_shape"]), int(meta["classes"]),
                            tuple(meta.get("hidden") or ()))
    except (KeyError, TypeError) as exc:
        raise ModelFileError(f"{p}: its model description lacks {exc}") from None
    except ValueError as exc:
        raise ModelFileError(f"{p}: cannot build its model ({exc})") from None
    size = sum(math.prod(s) for _, _, s in _param_shapes(model))
    if flat.ndim != 1 or flat.size != size:
        raise ModelFileError(f"{p} holds {flat.size} parameters; its model ({meta['model']}, in_shape "
                             f"{tuple(meta['in_shape'])}, {meta['classes']} classes) has {size}")
    wrong = [n for _, n, s in _param_shapes(model) if n in named and tuple(named[n].shape) != s]
    if wrong:
        raise ModelFileError(f"{p}: parameters {', '.join(wrong)} do not have the shapes its model gives them")
    model.materialize(np if xp is None else xp, meta.get("dtype") or str(flat.dtype), seed=0)
    model.flat.params[...] = model.flat.xp.asarray(flat)
    return model
