"""The same --reproducible job on emulated machines (experiments/portable_machines.py): a covering subset
of its matrix in the suite — every OpenBLAS core type, every NumPy dispatch level, k = 1, 2, 3, one and
two BLAS threads, MPICH with PyPI's NumPy and OpenBLAS and Open MPI with Debian's — for the MLP,
LeNet-5, ResNet-20 and a small GPT. At the portable level every machine ends with the same checkpoint
state; at the pinned level every machine whose CPU the level supports; the default (fast) path gives
different states on two machines: the negative control, which shows the emulation changes what it should."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import openmpi_env, script, serial_only

pytestmark = serial_only


def machines():
    return script("experiments", "portable_machines")


def states(model: str, level: str, plan: list, tmp_path: Path) -> dict[str, list[str]]:
    pm = machines()
    if any(m.stack == "openmpi" for m in plan):
        openmpi_env()  # where the suite requires it, its machines run or the test fails
    runs = [(m, pm.run(m, model, level, tmp_path)) for m in plan if pm.runnable(m)]
    assert len(runs) >= 2, "too few of the machines can run here"
    return pm.groups(runs)


def test_the_portable_level_gives_one_state_on_every_machine(tmp_path):
    pm = machines()
    M = pm.Machine
    mlp = [M("Haswell", "all", 1), M("SkylakeX", "all", 2, threads=2), M("Sandybridge", "no-avx512", 3),
           M("Prescott", "no-avx2", 1, threads=2), M("Haswell", "no-avx512", 2, "openmpi")]
    got = states("mlp", "portable", mlp, tmp_path)
    assert len(got) == 1, got
    cnn = [M("Haswell", "all", 2), M("Prescott", "no-avx2", 3, threads=2), M("SkylakeX", "no-avx512", 1, "openmpi")]
    got = states("cnn", "portable", cnn, tmp_path)
    assert len(got) == 1, got
    resnet = [M("Haswell", "no-avx512", 2), M("Prescott", "no-avx2", 3, "openmpi")]
    got = states("resnet", "portable", resnet, tmp_path)  # BatchNorm's sums and the pooling's, residual adds
    assert len(got) == 1, got
    gpt = [M("Haswell", "all", 1), M("Sandybridge", "no-avx512", 2), M("Prescott", "no-avx2", 3, "openmpi")]
    got = states("gpt", "portable", gpt, tmp_path)  # attention, LayerNorm, GELU, embeddings, the per-position loss
    assert len(got) == 1, got


def test_the_pinned_level_gives_one_state_where_the_cpu_supports_it(tmp_path):
    """The emulated AVX-512 Xeon (SkylakeX kernels, every NumPy loop) and an AVX2 laptop or AMD server
    (Haswell kernels, no AVX-512 loops) at different k: the pinning makes them compute alike."""
    M = machines().Machine
    got = states("mlp", "pinned", [M("SkylakeX", "all", 1), M("Haswell", "no-avx512", 2)], tmp_path)
    assert len(got) == 1, got


def test_the_fast_path_differs_between_machines(tmp_path):
    """The negative control: without --reproducible, the same job on two emulated machines (k = 1) ends
    with different states, so the tests above could fail."""
    M = machines().Machine
    got = states("mlp", "default", [M("SkylakeX", "all", 1), M("Sandybridge", "all", 1)], tmp_path)
    assert len(got) == 2, got
    got = states("gpt", "default", [M("Haswell", "all", 1), M("Prescott", "no-avx2", 1)], tmp_path)
    assert len(got) == 2, got  # the GPT's exp, tanh and GEMMs change with the machine on the fast path


def test_the_experiment_s_matrix_covers_the_issue_s():
    pm = machines()
    portable = pm.matrix("portable", [1, 2, 3], ["mpich", "openmpi"])
    assert {m.core for m in portable} == set(pm.CORES) and {m.dispatch for m in portable} == set(pm.DISPATCH)
    assert len(portable) == 4 * 3 * 3 * 2 and {m.threads for m in portable} == {1, 2}
    assert {(m.core, m.dispatch) for m in pm.matrix("pinned", [1], ["mpich"])} == \
        {("SkylakeX", "all"), ("SkylakeX", "no-avx512"), ("Haswell", "all"), ("Haswell", "no-avx512")}
    summary = pm.summary({"date": "d", "command": "c", "job": "j", "results": {
        "mlp portable": {"runs": [{}, {}], "states": {"abc": ["m1", "m2"]}}}})
    assert "| mlp portable | 2 | 1 | 2 |" in summary
    with pytest.raises(KeyError):
        pm.DISPATCH["none"]
