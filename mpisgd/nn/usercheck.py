"""The start-up check of modules mpisgd did not write: their backward against float64 finite differences.

A model factory (``--model package.module:function``) may bring modules of its own: classes whose
``forward`` or ``backward`` is written outside mpisgd. Before any training, :func:`check_user_modules`
builds the factory's model again, materialises it in float64 on NumPy in train mode, passes two
random samples through it while recording what each of those modules is given, then checks each one
where it sits, with that input (mpisgd.nn.gradcheck.check_in_place: its context, mode and layout as
the model gave them). mpisgd's own layers are tested in its suite and are not checked again: a model
made only of them (every stock model) costs nothing here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpisgd.nn.gradcheck import GradientError, check_in_place
from mpisgd.nn.module import Module

METHODS = ("forward", "backward", "forward_bl", "backward_bl")  # what a module computes with (SpatialModule: *_bl)
SAMPLES = 2  # the check's batch: small, so that even a large model's check takes seconds


def written_elsewhere(module: Module) -> bool:
    """Whether ``module`` computes with code from outside mpisgd (a method of METHODS defined elsewhere)."""
    for name in METHODS:
        fn = getattr(type(module), name, None)
        if fn is not None and not str(getattr(fn, "__module__", "")).startswith("mpisgd."):
            return True
    return False


def user_modules(root: Module) -> list[tuple[str, Module]]:
    """The modules of ``root`` (pre-order, with their paths) that mpisgd did not write."""
    return [(path or "the root", m) for path, m in root.named_modules() if written_elsewhere(m)]


@dataclass(frozen=True)
class UserModuleError:
    """A module of the user's whose backward disagrees with finite differences."""

    path: str  # where it is in the model ("3.main", or "the root")
    cls: str  # its class, qualified ("mymodels.Scale")
    worst: GradientError  # the worst quantity: "input" or one of its parameters

    def describe(self) -> str:
        w = self.worst
        what = "its input" if w.name == "input" else w.name
        return (f"the backward of module {self.path} ({self.cls}) disagrees with float64 finite differences: "
                f"d(loss)/d({what}) is {w.analytic:.6g} by backward, {w.numeric:.6g} numerically; fix its backward "
                "(docs/modules.md: check it with mpisgd.nn.gradcheck.check_gradients; a module that draws random "
                "numbers must draw the same ones for the same step and samples, as Dropout does)")


def check_user_modules(build: Callable[[], Module], in_shape: tuple[int, ...], seed: int = 0,
                       skip: Module | None = None) -> tuple[UserModuleError | None, list[str]]:
    """Check the backward of every module of ``build()``'s model that mpisgd did not write. Returns the
    error to refuse the model with (the deepest failing module: an enclosing module of the user's fails
    with it) or None, and warnings (modules that cannot be checked in float64). ``skip``: a model already
    built from the same factory; when it has no module of the user's, nothing is built or checked."""
    if skip is not None and not user_modules(skip):
        return None, []
    root = build()
    mine = user_modules(root)
    if not mine:
        return None, []
    model = root.materialize(np, "float64", seed)
    model.train()
    model.begin_batch(step=0, sample_ids=np.arange(SAMPLES, dtype=np.int64),
                      stat_row=np.zeros(model.stat_size) if model.stat_size else None)
    x = np.random.default_rng(seed + 1).standard_normal((SAMPLES, *in_shape))
    with _recording(mine) as inputs:
        model.forward(x)
    failed: list[UserModuleError] = []
    warnings: list[str] = []
    for path, m in mine:
        if path not in inputs:
            warnings.append(f"module {path} ({_name(m)}) was not used by forward: its backward was not checked")
            continue
        given = inputs[path]
        if np.issubdtype(given.dtype, np.floating) and given.dtype != np.float64:
            warnings.append(f"module {path} ({_name(m)}) is given {given.dtype} in a float64 model: its backward "
                            "was not checked")
            continue
        errors = check_in_place(m, given, seed=seed)
        bad = [e for e in errors if not e.ok]
        if bad:
            failed.append(UserModuleError(path, _name(m), max(bad, key=lambda e: e.worst)))
    deepest = [f for f in failed if not any(g.path.startswith(f.path + ".") or f.path == "the root" and g is not f
                                            for g in failed)]
    return (deepest[0] if deepest else None), warnings


def _name(m: Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


@contextlib.contextmanager
def _recording(modules: list[tuple[str, Module]]) -> Iterator[dict[str, Any]]:
    """While open, each module's first input is copied into the dict (by path); the modules are as they
    were afterwards (the recorder is an attribute of the instance, in front of its class's forward)."""
    inputs: dict[str, Any] = {}

    def recorder(path: str, forward: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def record(x: Any) -> Any:
            inputs.setdefault(path, np.array(x))
            return forward(x)
        return record

    try:
        for path, m in modules:
            m.forward = recorder(path, m.forward)  # type: ignore[method-assign,assignment]
        yield inputs
    finally:
        for _, m in modules:
            m.__dict__.pop("forward", None)
