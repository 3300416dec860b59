"""Resuming a run: whether a checkpoint may be continued by this configuration, and at which b and m
(``resume_point``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from mpisgd.checkpoint import CheckpointError, TrainState
from mpisgd.config import IDENTITY, OPTIMIZER_OPTIONS, STRUCTURE, Config
from mpisgd.schedule import total_steps


def identity_changes(saved: dict[str, Any], now: dict[str, Any], allowed: tuple[str, ...]) -> dict[str, str]:
    """The differences between two runs' identities, by option: '--key OLD -> NEW'. Raises CheckpointError for
    any not in ``allowed`` (and always for the model's structure), naming every one. A key the saved
    configuration lacks (an older mpisgd's) compares as that option's default; an option that neither
    run's optimizer reads (OPTIMIZER_OPTIONS: SGD's momentum in two AdamW runs) does not count."""
    def show(key: str, v: Any) -> str:
        if isinstance(v, dict):  # the data set
            return f"{v.get('name')} ({v.get('n_train')} train, {v.get('n_test')} test, {v.get('fingerprint')})"
        return ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)

    defaults = Config().to_dict()
    saved = {k: saved.get(k, defaults.get(k)) for k in IDENTITY}
    for k, readers in OPTIMIZER_OPTIONS.items():  # an option neither run's update rule reads may change
        if saved.get("optimizer") not in readers and now.get("optimizer") not in readers:
            saved[k] = now.get(k)
    diffs = {k: (saved.get(k), now.get(k)) for k in IDENTITY
             if json.dumps(saved.get(k), default=list) != json.dumps(now.get(k), default=list)}
    text = {k: f"--{k.replace('_', '-')} {show(k, a)} -> {show(k, b)}" for k, (a, b) in diffs.items()}
    refused = [k for k in diffs if k in STRUCTURE or k not in allowed]
    if refused:
        fixed = [f"--{k.replace('_', '-')}" for k in refused if k in STRUCTURE]
        allowable = [k for k in refused if k not in STRUCTURE]
        hints = ([f"{' and '.join(fixed)} cannot change on a resume (the model's structure): give the checkpoint's "
                  f"{'value' if len(fixed) == 1 else 'values'}"] if fixed else []) + \
            ([f"to continue with {'the other' if fixed else 'these'} changes on purpose pass --resume-allow "
              + ",".join(allowable)] if allowable else [])
        raise CheckpointError("this run differs from the checkpoint's: " + "; ".join(text[k] for k in refused)
                              + "".join(f"; {h}" for h in hints))
    return {k: text[k] for k in diffs}


def structure_difference(a: dict[str, Any], b: dict[str, Any], at_a: str, at_b: str) -> str:
    """The first difference between two model_structure() records, in words, each value followed by where it
    was built (``at_a``, ``at_b``: "in this run", "in the checkpoint", "on rank 1"); "" if there is none."""

    def both(x: Any, y: Any) -> str:
        return f"{x} {at_a}, {y} {at_b}"

    la, lb = a.get("layers", []), b.get("layers", [])
    for i, (x, y) in enumerate(zip(la, lb, strict=False)):
        if x != y:
            return f"layer {i} is " + both(x, y)
    if len(la) != len(lb):
        n, more, longer = min(len(la), len(lb)), la if len(la) > len(lb) else lb, at_a if len(la) > len(lb) else at_b
        return f"{len(la)} layers {at_a}, {len(lb)} {at_b} (layer {n} is {more[n]} {longer})"
    sa, sb = a.get("shapes", []), b.get("shapes", [])
    for i, ((na, xa), (nb, xb)) in enumerate(zip(sa, sb, strict=False)):
        if (na, xa) != (nb, xb):
            return f"parameter array {i} is " + both(f"{na} {tuple(xa)}", f"{nb} {tuple(xb)}")
    if len(sa) != len(sb):
        return f"{len(sa)} parameter arrays {at_a}, {len(sb)} {at_b}"
    return ""


@dataclass
class ResumePoint:
    """How a run continues from a checkpoint (decided on rank 0, then broadcast)."""

    path: str
    global_step: int
    epoch: int
    step_in_epoch: int
    skipped_steps: int
    optimizer_state: dict[str, float]  # the optimizer's scalars (its buffers: rank 0 reads, then broadcasts)
    world_size: int  # the checkpoint's k
    batch_size: int  # this run's b and m: as given, or derived to keep the checkpoint's B
    accum_steps: int
    changes: list[str]  # differences from the checkpoint's run that --resume-allow accepted
    derived: str  # what was derived, for the banner ("" if nothing)
    grad_exponents: list[int] | None = None  # reproducible: the next step's fixed-point exponents
    environment: dict[str, Any] = field(default_factory=dict)  # the checkpoint's (BLAS, threads, CPU)
    changed: tuple[str, ...] = ()  # the options of ``changes``, by name
    warnings: list[str] = field(default_factory=list)  # for rank 0 to print (without "warning: ")


def divisors(n: int, limit: int = 1 << 20) -> tuple[list[int], bool]:
    """The divisors of ``n`` in increasing order, by trial division up to min(sqrt(n), limit); the flag
    says whether the list is complete (False: only those <= limit and their cofactors)."""
    small, large, d = [], [], 1
    root = math.isqrt(n)
    while d <= min(root, limit):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    return small + large[::-1], root <= limit


def resume_point(state: TrainState, path: str, config: dict[str, Any], given: set[str], allowed: tuple[str, ...],
                k: int, data: dict[str, Any], structure: dict[str, Any] | None = None) -> ResumePoint:
    """Check that this run (``config`` at k ranks, on ``data``, building the model ``structure``, from
    model_structure()) can continue the checkpoint's, and find its b and m: the same effective batch
    B = k*b*m keeps the data order and the schedule; where the user gave neither --batch-size nor
    --accum-steps they are derived from B (keeping b in a reproducible run, whose bits depend on it), and
    where --batch-size alone, m follows from B. CheckpointError says what to change. The model's structure is
    compared when both are known (older checkpoints hold none); the checkpoint's position must lie
    within this run."""
    B, old_k = state.effective_batch, state.world_size
    old_b, old_m = state.config.get("batch_size"), state.config.get("accum_steps", 1)
    b, m, derived, warnings = config["batch_size"], config["accum_steps"], "", []
    if "global_batch" in given and config.get("global_batch") not in (None, B):
        raise CheckpointError(f"--global-batch {config['global_batch']}, but the checkpoint's run has effective batch "
                              f"B={B}: a resumed run keeps its B, so that the data order and the schedule continue; "
                              f"pass --global-batch {B}, or leave it out")
    bits = bool(config.get("reproducible") and state.config.get("reproducible") and old_b)  # b decides the bits
    b0 = old_b if bits and isinstance(old_b, int) else 1  # the checkpoint's b, where it decides the bits
    if config.get("model") != state.config.get("model", config.get("model")):
        raise CheckpointError(f"--model {config.get('model')}, but the checkpoint ({path}) is of --model "
                              f"{state.config.get('model')}: a resumed run must build the same model")
    if structure is not None and state.structure:
        diff = structure_difference(structure, state.structure, "in this run", "in the checkpoint")
        if diff:
            raise CheckpointError(f"this run's model differs from the checkpoint's ({path}): {diff}; a resumed run "
                                  "must build the same layers")
    n_train = data.get("n_train")
    if isinstance(n_train, int) and B > n_train:
        raise CheckpointError(f"{path}: the checkpoint's effective batch B={B} is larger than this run's training "
                              f"set ({n_train} samples)")
    if k * b * m != B and "batch_size" in given and "accum_steps" not in given and B % (k * b) == 0:
        m = B // (k * b)  # --batch-size given: the micro-batches follow from B and k
        derived = f"m={m} derived to keep B={B} (the checkpoint's run: k={old_k}, b={old_b}, m={old_m})"
    elif k * b * m != B:
        if given & {"batch_size", "accum_steps"} and B % k == 0:
            m_fit = old_m if B % (k * old_m) == 0 else 1
            raise CheckpointError(
                f"the checkpoint's run has effective batch B={B} (k={old_k} x b={old_b} x m={old_m}), this run "
                f"k*b*m={k * b * m}: resuming needs the same B, so that the data order and the schedule continue; "
                f"pass --batch-size and --accum-steps with {k} x b x m = {B} (e.g. --batch-size {B // (k * m_fit)} "
                f"--accum-steps {m_fit}), or neither, and they are derived (a --config file's batch-size and "
                "accum-steps count as given)")
        if bits and B % (k * b0):
            ks, complete = divisors(B // b0)
            raise CheckpointError(
                f"--reproducible: the checkpoint's run summed micro-batches of b={old_b} samples (B={B}), and other "
                f"micro-batches give other bits; k={k} ranks cannot keep them (k must divide B/b = {B // b0}: "
                f"{', '.join(map(str, ks[:16]))}{', ...' if len(ks) > 16 or not complete else ''}): resume on one of "
                f"those k, or pass --batch-size and --accum-steps with k x b x m = {B} to continue with other bits")
        if bits:
            fits = [B // (k * b0)]  # the same micro-batches of b samples: the same bits on any k
        else:
            fits = [mm for mm in dict.fromkeys((old_m, 1)) if B % (k * mm) == 0]
        if not fits:
            ks, complete = divisors(B)
            more = ", ..." if len(ks) > 16 or not complete else ""
            raise CheckpointError(f"the checkpoint's effective batch B={B} cannot be split over k={k} ranks: k must "
                                  f"divide B ({', '.join(map(str, ks[:16]))}{more})")
        b, m = B // (k * fits[0]), fits[0]
        derived = f"b={b}, m={m} derived to keep B={B} (the checkpoint's run: k={old_k}, b={old_b}, m={old_m})"
    if bits and b != old_b:
        warnings.append(f"resume: --batch-size {b} is not the checkpoint's b={old_b}: --reproducible's bits depend on "
                        "b, so from here they differ from the run this one continues")
    if state.grad_exponents is not None and structure is not None and structure.get("shapes") is not None \
            and len(state.grad_exponents) != len(structure["shapes"]):
        raise CheckpointError(f"{path}: inconsistent checkpoint: {len(state.grad_exponents)} fixed-point exponents for "
                              f"a model of {len(structure['shapes'])} parameter tensors")
    if isinstance(n_train, int):
        _check_position(state, path, config, n_train // B)
    saved_data, now_data = _comparable(state.data, data)
    saved = dict(state.config, data=saved_data)
    now = dict(config, data=now_data if state.data else {})  # checkpoints of older versions hold no data identity
    changes = identity_changes(saved, now, allowed)
    exponents = None if state.grad_exponents is None else [int(e) for e in state.grad_exponents]
    return ResumePoint(path, state.global_step, state.epoch, state.step_in_epoch, state.skipped_steps,
                      state.optimizer_state, old_k, b, m, list(changes.values()), derived, exponents,
                      state.environment, tuple(changes), warnings)


def _check_position(st: TrainState, path: str, config: dict[str, Any], spe: int) -> None:
    """The checkpoint's place (epoch, step within it, step count) lies within this run of ``spe`` steps
    per epoch: a position past the last epoch with steps still to do would train nothing and report
    success."""
    epochs, max_steps = config.get("epochs"), config.get("max_steps")
    if st.step_in_epoch >= spe:
        raise CheckpointError(f"{path}: its position, step {st.step_in_epoch} of epoch {st.epoch + 1}, lies past the "
                              f"end of an epoch of this run ({spe} steps): a checkpoint edited by hand, or a smaller "
                              "data set?")
    if isinstance(epochs, int):
        total = total_steps(epochs, spe, max_steps)
        if st.epoch >= epochs and st.global_step < total:
            raise CheckpointError(f"{path}: its position, epoch {st.epoch + 1}, is past this run's last epoch "
                                  f"({epochs}) although only {st.global_step} of its {total} steps are done: a "
                                  "checkpoint edited by hand?")


def _comparable(saved: dict[str, Any], now: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two data identities to compare: fingerprints of different kinds (an older checkpoint's) are left
    out of both, so that the name and sizes still are compared."""
    if saved.get("fingerprint_version") == now.get("fingerprint_version"):
        return saved, now
    strip = ("fingerprint", "fingerprint_version")
    return ({k: v for k, v in saved.items() if k not in strip}, {k: v for k, v in now.items() if k not in strip})
