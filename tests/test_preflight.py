"""preflight.outputs: no output replaces an input or another output (resolved paths and inodes), checked
before any file is made; preflight.memory is in test_data.py beside the memory-mapped case; preflight.same_model:
a model built otherwise on some rank is refused, each value named with the rank that built it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, drop, train_here

from mpisgd.app.preflight import outputs, same_model
from mpisgd.app.resume import structure_difference
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


# -- every rank built the same model: each value is named with the rank that built it (F7b) ----------------
class Gathers:
    """A stand-in communicator whose allgather returns every rank's value as given."""

    def __init__(self, values: list) -> None:
        self.values = values

    def allgather(self, mine):
        return self.values


def _structure(*hidden: int) -> dict:
    from mpisgd.model_file import model_structure
    from mpisgd.nn.models import mlp

    return model_structure(mlp(hidden, n_in=6, n_classes=3))


def test_a_model_built_otherwise_on_some_rank_names_each_value_with_its_rank():
    a, b = _structure(16), _structure(17)
    same_model(a, Gathers([a, a, a]))  # the same everywhere: nothing raised
    for every, odd, usual in (([a, b], 1, 0), ([a, a, b], 2, 0), ([b, a, a], 0, 1)):
        with pytest.raises(UsageError) as err:
            same_model(every[0], Gathers(every))
        assert str(err.value) == (f"ranks [{odd}] built another model than rank {usual} (layer 1 is Linear(6, 17) on "
                                  f"rank {odd}, Linear(6, 16) on rank {usual}): the model factory must build the "
                                  "same layers on every rank"), err.value


def test_a_model_difference_names_the_rank_of_each_count_and_shape():
    short = _structure(16)
    longer = {**short, "layers": [*short["layers"], "ReLU()"]}  # the same parameters, one more layer
    assert structure_difference(longer, short, "on rank 1", "on rank 0") == \
        "5 layers on rank 1, 4 on rank 0 (layer 4 is ReLU() on rank 1)"
    assert structure_difference(short, longer, "on rank 1", "on rank 0") == \
        "4 layers on rank 1, 5 on rank 0 (layer 4 is ReLU() on rank 0)"
    one = {"layers": ["L()"], "shapes": [["w", [2, 3]]]}
    turned = {"layers": ["L()"], "shapes": [["w", [3, 2]]]}
    assert structure_difference(turned, one, "on rank 2", "on rank 0") == \
        "parameter array 0 is w (3, 2) on rank 2, w (2, 3) on rank 0"
    more = {"layers": ["L()"], "shapes": [["w", [2, 3]], ["b", [3]]]}
    assert structure_difference(more, one, "on rank 1", "on rank 0") == "2 parameter arrays on rank 1, 1 on rank 0"
    assert structure_difference(one, dict(one), "on rank 1", "on rank 0") == ""


RANK_MODELS = """
import math
from mpi4py import MPI

WIDTH = 17 if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1 else 16  # the last rank builds 17


def native(in_shape, n_classes):
    from mpisgd.nn import Flatten, Linear, ReLU, Sequential
    return Sequential(Flatten(), Linear(math.prod(in_shape), WIDTH), ReLU(), Linear(WIDTH, n_classes))


def torch(in_shape, n_classes):
    from torch import nn
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), WIDTH), nn.ReLU(), nn.Linear(WIDTH, n_classes))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("factory", ["native", "torch"])
def test_a_factory_that_builds_another_width_on_the_last_rank_is_refused_naming_whose_width(factory, own_module):
    """The last rank builds 17 units, the others 16: the refusal puts 17 with the last rank, 16 with rank 0."""
    from mpi4py import MPI

    if factory == "torch":
        pytest.importorskip("torch")
    last = MPI.COMM_WORLD.Get_size() - 1
    own_module("rank_models", RANK_MODELS)
    r = train_here([*drop(TINY, "--hidden"), "--max-steps", "3", "--model", f"rank_models:{factory}"])
    assert r.statuses == (2,) * len(r.statuses) and "epoch " not in r.out, r
    assert f"ranks [{last}] built another model than rank 0 (layer " in r.error, r.error
    if factory == "native":
        assert f"(layer 1 is Linear(784, 17) on rank {last}, Linear(784, 16) on rank 0): " in r.error, r.error
    else:
        assert re.search(rf"out_features=17, bias=True\)+ on rank {last}, \S+ Linear\(in_features=784, "
                         r"out_features=16, bias=True\)+ on rank 0\): ", r.error), r.error


def test_a_vocab_json_of_ones_own_is_kept_and_an_earlier_runs_replaced(tmp_path):
    """A language model's run writes vocab.json into its checkpoint directory: over a file of the user's, no (a
    warning, the file kept); over an earlier run's vocabulary, yes."""
    from types import SimpleNamespace

    from mpisgd.app import run_files

    cfg = SimpleNamespace(metrics_file=None, checkpoint_dir=str(tmp_path))
    mine = tmp_path / "vocab.json"
    mine.write_text('{"my": "tokenizer"}')
    warnings = run_files.write_vocab(cfg, '{"size": 3, "chars": "abc"}')  # type: ignore[arg-type]
    assert mine.read_text() == '{"my": "tokenizer"}' and len(warnings) == 1 and "kept" in warnings[0], warnings
    mine.write_text('{"size": 2, "chars": "ab"}')
    assert run_files.write_vocab(cfg, '{"size": 3, "chars": "abc"}') == []  # type: ignore[arg-type]
    assert mine.read_text() == '{"size": 3, "chars": "abc"}'


def test_cuda_aware_on_the_cpu_runs_with_a_warning_and_sharding_on_a_gpu_is_refused():
    from mpisgd.app.preflight import device_options

    assert device_options(Config(cuda_aware="staged"), gpu=False) == [
        "--cuda-aware staged has no effect on the CPU (host buffers go to MPI as they are)"]  # was silent
    assert device_options(Config(cuda_aware="staged"), gpu=True) == device_options(Config(), gpu=False) == []
    with pytest.raises(UsageError, match="--shard-optimizer runs on the CPU only"):
        device_options(Config(shard_optimizer=True), gpu=True)
