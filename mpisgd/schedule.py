"""The learning rate as a pure function of the step.

Phases, in order (Goyal et al. 2017, "Accurate, Large Minibatch SGD"):
  1. scale:  the target rate eta = f(B / B0) * eta0, f = identity (linear), sqrt, or 1;
  2. warm up: over ``warmup_steps`` the rate rises linearly, per iteration, from
     min(eta0, eta) (or ``warmup_start``: 0 for a transformer's warmup) to eta;
  3. decay:  then ``cosine`` to zero at the last step, or ``step``: times
     ``decay_factor`` at each milestone, or none.
Every rank computes the same value from the same inputs; nothing is stateful.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mpisgd.config import MODEL_DEFAULTS, Config
from mpisgd.errors import UsageError
from mpisgd.portable.scalar import LIBM, PORTABLE, ScalarMath


def effective_batch(batch_size: int, world_size: int, accum_steps: int = 1) -> int:
    """B = k * b * m: the samples behind one optimizer step."""
    for name, value in (("batch size", batch_size), ("world size", world_size), ("accumulation steps", accum_steps)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    return world_size * batch_size * accum_steps


def total_steps(epochs: int, steps_per_epoch: int, max_steps: int | None = None) -> int:
    """The run's optimizer steps: ``epochs`` whole epochs, or ``max_steps`` if that comes first."""
    whole = epochs * steps_per_epoch
    return whole if max_steps is None else min(max_steps, whole)


def accum_steps_for(global_batch: int, world_size: int, batch_size: int) -> int:
    """m = B / (k * b): the micro-batches each rank runs for effective batch B (UsageError when k * b
    does not divide B, naming the k that would)."""
    if global_batch % (world_size * batch_size):
        ks = [k for k in range(1, global_batch // batch_size + 1) if (global_batch // batch_size) % k == 0] \
            if global_batch % batch_size == 0 else []
        fits = f"k in {', '.join(map(str, ks[:12]))}{', ...' if len(ks) > 12 else ''}" if ks else \
            f"a --batch-size that divides {global_batch}"
        other_b = f", or at k={world_size} a --batch-size that divides {global_batch // world_size}" \
            if ks and global_batch % world_size == 0 else ""
        raise UsageError(f"--global-batch {global_batch} is not k*b*m for k={world_size} ranks and b={batch_size}: "
                         f"use {fits}{other_b}")
    return global_batch // (world_size * batch_size)


def scaled_lr(base_lr: float, base_batch: int, batch: int, scaling: str) -> float:
    """Phase 1: the rate for batch B from the base pair (eta0, B0)."""
    if base_batch < 1:
        raise UsageError(f"base batch must be >= 1, got {base_batch}")
    ratio = batch / base_batch
    if scaling == "linear":
        return base_lr * ratio
    if scaling == "sqrt":
        return base_lr * math.sqrt(ratio)
    if scaling == "none":
        return base_lr
    raise UsageError(f"unknown lr scaling {scaling!r}: use linear, sqrt or none")


@dataclass(frozen=True)
class Schedule:
    base_lr: float  # eta0
    peak_lr: float  # the scaled rate eta reached after warmup
    warmup_steps: int
    total_steps: int
    decay: str = "none"  # none | step | cosine
    milestones: tuple[int, ...] = ()  # steps at which step decay applies
    decay_factor: float = 0.1
    warmup_start: float | None = None  # the rate of step 0 (None: min(base_lr, peak_lr))
    scalar_math: ScalarMath = LIBM  # the cosine and powers: the C library's, or portable (the reproducible mode's)

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise UsageError(f"the run has {self.total_steps} steps; it needs at least 1")
        if not (0 < self.base_lr < math.inf and 0 < self.peak_lr < math.inf):
            raise UsageError(f"learning rates must be finite and > 0, got eta0={self.base_lr}, eta={self.peak_lr} "
                             "(eta is --lr scaled to the effective batch)")
        if self.warmup_steps < 0:
            raise UsageError(f"warmup must be >= 0 steps, got {self.warmup_steps}")
        if self.warmup_steps > self.total_steps:
            raise UsageError(f"warmup of {self.warmup_steps} steps is longer than the run "
                             f"({self.total_steps} steps): shorten --warmup-epochs/--warmup-steps "
                             "or train longer")
        if self.decay not in ("none", "step", "cosine"):
            raise UsageError(f"unknown decay {self.decay!r}: use none, step or cosine")
        if not 0 < self.decay_factor <= 1:
            raise UsageError(f"decay factor must be in (0, 1], got {self.decay_factor}")

    def __call__(self, step: int) -> float:
        """The rate for optimizer step ``step`` (0-based)."""
        # 2. warmup, per iteration
        if step < self.warmup_steps:
            start = min(self.base_lr, self.peak_lr) if self.warmup_start is None else self.warmup_start
            return start + (self.peak_lr - start) * step / self.warmup_steps
        # 3. decay over the steps after warmup
        if self.decay == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return 0.5 * self.peak_lr * (1.0 + self.scalar_math.cos_pi(progress))
        if self.decay == "step":
            return self.peak_lr * self.scalar_math.power(self.decay_factor, sum(step >= m for m in self.milestones))
        return self.peak_lr

    @classmethod
    def for_run(cls, cfg: Config, world_size: int, steps_per_epoch: int,
                total_steps: int) -> tuple[Schedule, list[str]]:
        """:meth:`from_config`, except where the model's own recipe warms up for longer than the run (a short
        --max-steps run of the ResNet or the GPT, or a rerun of its effective configuration): then the warmup
        takes the whole run, and the second value says so (the trainer's and ``plot lr``'s warning). Any other
        warmup longer than the run stays an error."""
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_epochs * steps_per_epoch)
        recipe = MODEL_DEFAULTS.get(cfg.model, {})
        own = (recipe.get("warmup_steps", Config.warmup_steps), recipe.get("warmup_epochs", Config.warmup_epochs))
        if warmup <= total_steps or (cfg.warmup_steps, cfg.warmup_epochs) != own:
            return cls.from_config(cfg, world_size, steps_per_epoch, total_steps), []
        named = f"--warmup-steps {cfg.warmup_steps}" if cfg.warmup_steps is not None else \
            f"--warmup-epochs {cfg.warmup_epochs:g}, {warmup} steps"
        short = dataclasses.replace(cfg, warmup_steps=total_steps)
        return cls.from_config(short, world_size, steps_per_epoch, total_steps), [
            f"--model {cfg.model}'s recipe warms up for longer ({named}) than this run of {total_steps} step(s): "
            "the warmup takes the whole run (give --warmup-steps to choose)"]

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, steps_per_epoch: int, total_steps: int) -> Schedule:
        batch = effective_batch(cfg.batch_size, world_size, cfg.accum_steps)
        peak = scaled_lr(cfg.lr, cfg.base_batch, batch, cfg.lr_scaling)
        if cfg.warmup_steps is not None:
            warmup = cfg.warmup_steps
        else:
            warmup = round(cfg.warmup_epochs * steps_per_epoch)
        return cls(base_lr=cfg.lr, peak_lr=peak, warmup_steps=warmup, total_steps=total_steps,
                   decay=cfg.decay, milestones=tuple(e * steps_per_epoch for e in cfg.decay_epochs),
                   decay_factor=cfg.decay_factor, warmup_start=0.0 if cfg.warmup_from == "zero" else None,
                   scalar_math=PORTABLE if cfg.reproducible else LIBM)
