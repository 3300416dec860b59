"""The model replica as DataParallel sees it: the contract's defaults for a model that predates it, the
layout every rank must share, and a step's micro-batches with their sample indices and target counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.base import Optimizer
from mpisgd.parallel.protocols import Array, BasicModel, LeafDone, Loss, ReplicaModel


class WithoutState:
    """A model offering only :class:`BasicModel` (no modes, no state, no statistics), wrapped to offer the
    whole :class:`ReplicaModel` contract: one mode, no state, ``stat_size`` 0, the rest its own. Models
    that offer the contract themselves are used as they are (:func:`as_replica`)."""

    state = None
    stat_size = 0

    def __init__(self, model: BasicModel) -> None:
        self.model = model

    @property
    def flat(self) -> FlatBuffer | None:
        return self.model.flat

    def forward(self, x: Array) -> Array:
        return self.model.forward(x)

    def backward(self, dy: Array, on_layer_done: LeafDone | None = None) -> None:
        self.model.backward(dy, on_layer_done)

    def set_accumulate(self, on: bool) -> None:
        self.model.set_accumulate(on)

    def move_grads(self, buf: Array) -> None:
        self.model.move_grads(buf)

    def layer_param_ranges(self) -> list[tuple[int, int]]:
        return self.model.layer_param_ranges()

    def train(self, mode: bool = True) -> object:
        return self

    def eval(self) -> object:
        return self

    def begin_batch(self, step: int, sample_ids: Array, stat_row: np.ndarray) -> None:
        return None

    def apply_stats(self, mean_row: np.ndarray) -> None:
        return None

    def __repr__(self) -> str:
        return repr(self.model)


def as_replica(model: ReplicaModel | BasicModel) -> ReplicaModel:
    """``model`` itself where it offers the whole contract, else wrapped in :class:`WithoutState`."""
    return model if isinstance(model, ReplicaModel) else WithoutState(model)


def model_layout(model: ReplicaModel, flat: FlatBuffer) -> dict[str, Any]:
    """What every rank's replica must share: its layers, their parameter shapes, the dtype and the size of
    its state."""
    state = model.state
    return {"model": repr(model), "parameter shapes": [tuple(s) for s in flat.shapes], "dtype": str(flat.dtype),
            "state size": 0 if state is None else int(state.size), "statistics": model.stat_size}


def optimizer_layout(optimizer: Optimizer) -> dict[str, Any]:
    """What every rank's optimizer must share: its kind and its state buffers (broadcast and gathered
    by name, so a rank with other buffers would mismatch those collectives)."""
    return {"optimizer": type(optimizer).__name__, "optimizer state": sorted(optimizer.state_buffers())}


@dataclass
class MicroBatch:
    x: Array  # inputs
    y: Array  # targets
    ids: Array  # each sample's global index (Dropout keys its masks by it)
    count: int  # targets the loss scores (Loss.count)


def micro_batches_of(given: Sequence[tuple[Array, ...]], rank: int, loss: Loss) -> list[MicroBatch]:
    """A step's micro-batches, each ``(x, y)`` or ``(x, y, ids)``. Without ids, a sample's index is its
    position in this step's global batch when every rank's micro-batches are that batch's consecutive
    slices in rank order (as mpisgd.data.GlobalBatches makes them): ``rank * n + position`` among this
    rank's n samples of the step. That is deterministic, and the same at any k only as long as those
    slices are; pass the data set's sample indices as ids to key by the samples themselves."""
    if not given:
        raise ValueError("train_step needs at least one micro-batch")
    for batch in given:
        if len(batch) not in (2, 3):
            raise ValueError(f"a micro-batch is (x, y) or (x, y, sample_ids), got a tuple of {len(batch)}")
    n = sum(len(batch[0]) for batch in given)
    out, at = [], rank * n
    for batch in given:
        x, y = batch[0], batch[1]
        ids = batch[2] if len(batch) == 3 else np.arange(at, at + len(x), dtype=np.int64)
        if len(ids) != len(x):
            raise ValueError(f"a micro-batch of {len(x)} samples came with {len(ids)} sample ids")
        out.append(MicroBatch(x, y, ids, int(loss.count(y))))
        at += len(x)
    return out
