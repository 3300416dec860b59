"""preflight.outputs: no output replaces an input or another output (resolved paths and inodes), checked
before any file is made; preflight.memory is in test_data.py beside the memory-mapped case."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mpisgd.app.preflight import outputs
from mpisgd.config import Config
from mpisgd.errors import UsageError


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "set.npz"
    np.savez(path, x_train=np.zeros((4, 2)), y_train=np.zeros(4, int), x_test=np.zeros((2, 2)), y_test=np.zeros(2, int))
    return path


def _refused(cfg: Config, says: str, tmp_path: Path) -> None:
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(UsageError) as err:
        outputs(cfg, 0)
    assert says in str(err.value), err.value
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # refused before anything was made


@pytest.mark.parametrize("field,say", [("save_model", "--save-model"), ("metrics_file", "--metrics-file")])
def test_an_output_that_is_the_data_is_refused(tmp_path, data, field, say):
    _refused(Config(data=str(data), **{field: str(data)}), f"{say} {data} is the file --data reads", tmp_path)
    link = tmp_path / "other-name.npz"
    os.link(data, link)  # the same inode under another name
    _refused(Config(data=str(data), **{field: str(link)}), "is the file --data reads", tmp_path)
    spelled = tmp_path / "sub" / ".." / data.name  # another spelling of the path
    _refused(Config(data=str(data), **{field: str(spelled)}), "is the file --data reads", tmp_path)


def test_outputs_inside_a_data_directory_and_the_checkpoint_resumed_are_inputs(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.save(d / f"{name}.npy", np.zeros(3))
    _refused(Config(data=str(d), save_model=str(d / "x_test.npy")), "is the file --data reads", tmp_path)
    ck = tmp_path / "old.npz"
    ck.write_bytes(b"a checkpoint")
    _refused(Config(dataset="synthetic", resume=str(ck), save_model=str(ck)), "is the file --resume reads", tmp_path)


def test_two_outputs_on_one_file_and_the_timelines_files_are_refused(tmp_path):
    m = tmp_path / "out.npz"
    _refused(Config(dataset="synthetic", save_model=str(m), metrics_file=str(m)),
             "--save-model and --metrics-file name the same file", tmp_path)
    _refused(Config(dataset="synthetic", timeline=str(tmp_path / "t"), metrics_file=str(tmp_path / "t.rank1.json")),
             "is one of the files --timeline", tmp_path)


def test_nothing_lies_among_the_checkpoint_directorys_own_names(tmp_path):
    ck = tmp_path / "ck"
    for name in ("ckpt-000000008.npz", ".mpisgd.lock", "ckpt-000000008.npz.tmp.12"):
        _refused(Config(dataset="synthetic", checkpoint_dir=str(ck), save_model=str(ck / name)),
                 "lies in --checkpoint-dir", tmp_path)
    _refused(Config(dataset="synthetic", checkpoint_dir=str(ck), metrics_file=str(ck)), "is the --checkpoint-dir",
             tmp_path)
    outputs(Config(dataset="synthetic", checkpoint_dir=str(ck), save_model=str(ck / "model.npz")), 0)  # fine


def test_the_memory_estimate_counts_each_optimizer_s_state():
    """Adam keeps two moments, SGD with momentum one, plain SGD none; reproducible sums add int64 buffers."""
    from mpisgd.app.preflight import state_buffers
    from mpisgd.config import Config

    assert state_buffers(Config(momentum=0.0)) == 2
    assert state_buffers(Config()) == 3  # SGD with momentum 0.9, the default
    assert state_buffers(Config(optimizer="adamw")) == 4
    assert state_buffers(Config(reproducible=True)) == 3 + 4  # float32: two int64 buffers are four float ones


def test_the_config_file_and_the_configurations_copies_are_among_the_checked_files(tmp_path):
    """--config is an input and the configuration's copies (METRICS.config.toml, CKPT/config.toml) are outputs:
    a --metrics-file on the --config file would append JSON to the user's TOML, one on the checkpoint
    directory's config.toml or a --save-model on the metrics file's copy would be replaced by the copy. A copy
    that is the --config file itself is fine: it is not written (run_files.write_config)."""
    toml = tmp_path / "run.toml"
    toml.write_text("hidden = [8]\n")
    cfg = Config(dataset="synthetic", metrics_file=str(toml))
    cfg.config_file = str(toml)  # type: ignore[attr-defined] - as parse_config sets it
    _refused(cfg, f"--metrics-file {toml} is the file --config reads", tmp_path)
    ck = tmp_path / "ck"
    _refused(Config(dataset="synthetic", checkpoint_dir=str(ck), metrics_file=str(ck / "config.toml")),
             "--metrics-file and the configuration's copy name the same file", tmp_path)
    m = tmp_path / "m.jsonl"
    _refused(Config(dataset="synthetic", metrics_file=str(m), save_model=f"{m}.config.toml"),
             "--save-model and the configuration's copy name the same file", tmp_path)
    again = Config(dataset="synthetic", checkpoint_dir=str(ck))
    again.config_file = str(ck / "config.toml")  # type: ignore[attr-defined] - run again from a run's own copy
    outputs(again, 0)
