"""The files a run writes beside its metrics and checkpoints: the effective configuration and TensorBoard's
event files. :func:`check` runs at set-up (every path writable, the TensorBoard library importable), so
that neither fails after the training; :func:`write_config` writes the configuration once set-up has
settled it (a resumed run's derived b and m included)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import IO

from mpisgd.app import tensorboard
from mpisgd.app.options import to_toml
from mpisgd.config import Config
from mpisgd.errors import UsageError
from mpisgd.files import atomic_write, check_output_dir, check_output_file, replaceable


def check(cfg: Config, rank: int) -> None:
    """Rank 0's outputs beyond preflight.outputs: the configuration's copies, the TensorBoard directory."""
    if rank != 0:
        return
    for path in copies(cfg):
        if not _is_input(path, cfg):
            check_output_file(str(path), "the configuration's copy")
            if not ours(path, "config.toml"):
                where = "--checkpoint-dir" if path.name == "config.toml" else "--metrics-file"  # METRICS.config.toml
                raise UsageError(f"{path} exists and is not a configuration mpisgd wrote: the run writes its "
                                 f"effective configuration there; move it, or give another {where}")
    if cfg.tensorboard:
        check_output_dir(cfg.tensorboard, "--tensorboard")
        tensorboard.check_installed()


def _is_input(path: Path, cfg: Config) -> bool:
    given = getattr(cfg, "config_file", None)
    if not given:
        return False
    try:
        return path.exists() and os.path.samefile(path, given)
    except OSError:
        return False


def write_config(cfg: Config, k: int) -> list[str]:
    """Write the effective configuration beside the metrics file and into the checkpoint directory, each
    all or nothing (rank 0); never over the --config file itself. Returns warnings for the banner."""
    odd = [name for name, v in cfg.to_dict().items() if isinstance(v, str) and not _utf8(v)]
    if odd:  # a path of bytes that are not UTF-8: TOML cannot hold it, and the copy would not read back
        return [f"warning: the effective configuration was not written: --{odd[0].replace('_', '-')} is not UTF-8 "
                "text, which a TOML file cannot hold"]
    # the run's B as global-batch (m then follows from B, k and b): the copy runs it again, or continues it,
    # on any k that divides B/b, not only on this k
    again = dataclasses.replace(cfg, global_batch=k * cfg.batch_size * cfg.accum_steps)
    text = to_toml(again, f"the effective configuration of a run on k={k} rank(s), written at its start;\nrun it "
                          "again with: python -m mpisgd.train --config THIS_FILE (on any k that divides "
                          "global-batch / batch-size)")
    warnings = []
    for path in copies(cfg):
        if _is_input(path, cfg):
            warnings.append(f"warning: {path} is this run's --config: not replaced by the effective configuration")
            continue
        try:
            atomic_write(path, lambda f: f.write(text.encode()))
        except (OSError, UsageError) as exc:
            warnings.append(f"warning: the effective configuration was not written to {path} ({exc})")
    return warnings


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # os.fsdecode's surrogates for bytes that are not UTF-8
        return False
    return True


def write_vocab(cfg: Config, vocab_json: str) -> list[str]:
    """Write a language model's vocabulary (mpisgd.text) as ``vocab.json`` beside the metrics file and into
    the checkpoint directory (rank 0); returns warnings for the banner."""
    def write(f: IO[bytes]) -> None:
        f.write(vocab_json.encode())

    warnings = []
    for path in copies(cfg, "vocab.json"):
        if not ours(path, "vocab.json"):
            warnings.append(f"warning: {path} exists and is not a vocabulary mpisgd wrote: kept, and this run's "
                            "vocabulary not written there (the checkpoints and the saved model hold it)")
            continue
        try:
            atomic_write(path, write)
        except (OSError, UsageError) as exc:
            warnings.append(f"warning: the vocabulary was not written to {path} ({exc})")
    return warnings


HEADER = "# the effective configuration of a run on k="  # write_config's first line


def ours(path: Path, name: str) -> bool:
    """``path`` may take a run's ``name`` (config.toml, vocab.json): absent, empty, or one a run wrote (its
    header; the vocabulary's JSON). Anything else is someone's file, kept."""
    def written_by_a_run(f: IO[bytes]) -> bool:
        if name == "config.toml":
            return f.read(len(HEADER)) == HEADER.encode()
        value = json.loads(f.read(1 << 24))
        return isinstance(value, dict) and set(value) == {"size", "chars"}

    return replaceable(path, written_by_a_run)


def copies(cfg: Config, name: str = "config.toml") -> list[Path]:
    """Where a run writes its effective configuration (or another of its files, ``name``): beside the metrics
    file and in the checkpoint directory (rank 0)."""
    out = []
    if cfg.metrics_file:
        out.append(Path(f"{cfg.metrics_file}.{name}"))
    if cfg.checkpoint_dir:
        out.append(Path(cfg.checkpoint_dir) / name)
    return out
