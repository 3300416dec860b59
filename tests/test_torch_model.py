"""The PyTorch adapter (mpisgd.torch.model) against mpisgd's model contract, in one process: zero-copy
views, autograd into the flat gradient buffer, one report per module when its gradients are final, unused
parameters, accumulation, BatchNorm through the statistics row, keyed dropout, the --reproducible
refusals, saving and loading."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'mpisgd[torch]')")

from conftest import train_here  # noqa: E402
from torch_factories import TiedTokens, TinyResNet, functional_dropout  # noqa: E402

from mpisgd.nn.dropout import keyed_uniform16  # noqa: E402
from mpisgd.torch import TorchModule, from_torch  # noqa: E402
from mpisgd.torch.modules import KeyedDropout, StatBatchNorm  # noqa: E402
from mpisgd.torch.views import same_memory  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread_and_no_determinism(torch_one_thread):
    yield
    torch.use_deterministic_algorithms(False)


def _resnet(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return TinyResNet(p=0.0).to(dtype)


def _x(n=6, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 1, 8, 8))


def _torch_grads(module):
    return np.concatenate([p.grad.detach().numpy().ravel() if p.grad is not None else np.zeros(p.numel())
                           for p in module.parameters()])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parameters_gradients_and_state_are_views_of_the_flat_buffers(dtype):
    model = from_torch(_resnet(torch.float32), np, dtype)
    assert model.views_ok()
    assert model.flat.dtype == np.dtype(dtype) and model.state.dtype == np.dtype(dtype)
    for part in model.parts:
        for _, p in part.trained:
            assert np.shares_memory(p.detach().numpy(), model.flat.params)
            assert np.shares_memory(p.grad.numpy(), model.flat.grads)
    for name, b in model.torch_module.named_buffers():
        assert np.shares_memory(b.numpy(), model.state), name
    out = model.forward(_x().astype(dtype))
    model.backward(np.ones_like(out))
    assert model.views_ok()  # autograd added into our views, never replaced them
    model.flat.params[0] = 123.0  # mpisgd's optimizer writes the flat buffer: torch sees it
    assert next(model.torch_module.parameters()).detach().reshape(-1)[0].item() == 123.0
    moved = np.zeros_like(model.flat.grads)
    model.move_grads(moved)  # node-shared memory: the gradients follow
    assert model.views_ok() and all(same_memory(p.grad, g) for p, g, _ in model._grads)
    assert np.shares_memory(next(model.torch_module.parameters()).grad.numpy(), moved)


def test_forward_and_backward_match_plain_torch_and_reports_come_once_per_module_when_final():
    net = _resnet()
    ref = copy.deepcopy(net)
    model = from_torch(net, np, "float64")
    x = _x()
    out = model.forward(x)
    want = ref(torch.from_numpy(x))
    np.testing.assert_array_equal(out, want.detach().numpy())
    dy = np.random.default_rng(1).standard_normal(out.shape)
    snapshots, ranges = {}, model.layer_param_ranges()

    def report(i):
        a, b = ranges[i]
        snapshots.setdefault(i, []).append(model.flat.grads[a:b].copy())

    model.backward(dy.copy(), report)
    want.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(model.flat.grads, _torch_grads(ref), rtol=1e-12, atol=1e-14)
    owners = [i for i, (a, _) in enumerate(ranges) if a >= 0]
    assert sorted(snapshots) == owners and all(len(v) == 1 for v in snapshots.values())  # each exactly once
    for i, (snap,) in snapshots.items():  # final when reported: nothing was added to them afterwards
        a, b = ranges[i]
        np.testing.assert_array_equal(snap, model.flat.grads[a:b])
    order = list(snapshots)  # the dict keeps the reports' order
    assert order[0] == owners[-1]  # the head reports first: buckets can start during backward
    # without a statistics row BatchNorm behaves as torch's: running statistics after one forward
    np.testing.assert_array_equal(model.state, np.concatenate([b.numpy().ravel().astype(np.float64)
                                                               for _, b in ref.named_buffers()]))


def test_unused_and_tied_parameters_per_token_logits_and_accumulation():
    torch.manual_seed(0)
    net = TiedTokens().double()
    ref = copy.deepcopy(net)
    model = from_torch(net, np, "float64")
    assert [n for n, _ in model.named_parameters()] == ["embed.weight", "mix.weight", "mix.bias", "spare.weight",
                                                        "spare.bias"]  # the head's weight is the embedding's
    ids = np.random.default_rng(0).integers(0, 11, (3, 5)).astype(np.float64)
    logits = model.forward(ids)
    assert logits.shape == (3, 5, 11)  # per-token scores
    model.flat.grads[:] = 7.0  # stale values: a fresh backward must overwrite, not add
    reported = []
    dy = np.random.default_rng(2).standard_normal(logits.shape)
    model.backward(dy, reported.append)
    spare = model.layer_param_ranges()[[p.path for p in model.parts].index("spare") + 1]
    assert not model.flat.grads[spare[0]:spare[1]].any()  # unused: zero
    assert len(reported) == 3 and reported[-1] == [p.path for p in model.parts].index("spare") + 1  # and reported
    ref(torch.from_numpy(ids).long()).backward(torch.from_numpy(dy))
    np.testing.assert_allclose(model.flat.grads, _torch_grads(ref), rtol=1e-12)  # tied: both uses summed
    once = model.flat.grads.copy()
    model.set_accumulate(True)  # a second micro-batch adds
    model.forward(ids)
    model.backward(dy)
    np.testing.assert_allclose(model.flat.grads, 2 * once, rtol=1e-12)


def test_batchnorm_statistics_go_through_the_row_and_apply_stats_moves_the_running_ones():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3, momentum=0.25)).double()
    ref = copy.deepcopy(net)
    model = from_torch(net, np, "float64")
    bn = model.torch_module[1]
    assert isinstance(bn, StatBatchNorm) and model.stat_size == 6
    before = model.state.copy()
    rows = np.zeros((2, model.stat_size))
    xs = [_x(4, seed) for seed in (0, 1)]
    for i, x in enumerate(xs):
        model.begin_batch(step=0, sample_ids=np.arange(4) + 4 * i, stat_row=rows[i])
        out = model.forward(x)
        np.testing.assert_array_equal(out, ref(torch.from_numpy(x)).detach().numpy())  # batch statistics
        model.backward(np.ones_like(out))
    np.testing.assert_array_equal(model.state, before)  # the forward left the running statistics alone
    for i, x in enumerate(xs):
        h = ref[0](torch.from_numpy(x)).detach()
        np.testing.assert_allclose(rows[i][:3], h.mean(dim=(0, 2, 3)).numpy(), rtol=1e-12)
        np.testing.assert_allclose(rows[i][3:], h.var(dim=(0, 2, 3), unbiased=True).numpy(), rtol=1e-12)
    mean = rows.mean(axis=0)
    model.apply_stats(mean)
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.75 * 0 + 0.25 * mean[:3], rtol=1e-15)
    np.testing.assert_allclose(bn.running_var.numpy(), 0.75 * 1 + 0.25 * mean[3:], rtol=1e-15)
    assert bn.num_batches_tracked.item() == 1
    model.eval()  # eval mode: the running statistics normalise
    ref.eval()
    ref[1].running_mean.copy_(bn.running_mean)
    ref[1].running_var.copy_(bn.running_var)
    np.testing.assert_array_equal(model.forward(xs[0]), ref(torch.from_numpy(xs[0])).detach().numpy())


def test_keyed_dropout_mask_is_a_function_of_the_sample_not_the_batch():
    torch.manual_seed(0)
    model = from_torch(torch.nn.Sequential(torch.nn.Linear(5, 64), torch.nn.Dropout(0.3)).double(), np, "float64",
                       seed=7)
    drop = model.torch_module[1]
    assert isinstance(drop, KeyedDropout)
    x = np.ones((4, 5))

    def masks(ids, step=3):
        model.begin_batch(step=step, sample_ids=np.asarray(ids))
        out = model.forward(x[:len(ids)])
        model._out = None
        h = model.torch_module[0](torch.from_numpy(x[:len(ids)])).detach().numpy()
        return out != 0, out, h

    a, out, h = masks([10, 11, 12, 13])
    b, _, _ = masks([12, 99, 10])  # the same samples in another batch, other positions
    np.testing.assert_array_equal(a[0], b[2])
    np.testing.assert_array_equal(a[2], b[0])
    assert (a[0] != a[1]).any() and (masks([10, 11, 12, 13], step=4)[0] != a).any()  # per sample, per step
    want = keyed_uniform16(np, 7, 3, drop.stream, np.array([10, 11, 12, 13]), 64) >= round(0.3 * 65536)
    np.testing.assert_array_equal(a, want)  # mpisgd.nn.dropout's rule
    np.testing.assert_allclose(out[a], h[a] / 0.7, rtol=1e-15)  # the kept ones scaled by 1/(1-p)
    assert abs(1 - a.mean() - 0.3) < 0.1
    model.eval()
    np.testing.assert_array_equal(model.forward(x), model.torch_module[0](torch.from_numpy(x)).detach().numpy())


def test_reproducible_refuses_unkeyed_randomness_and_nondeterministic_kernels():
    from mpisgd.torch.runtime import prepare

    torch.manual_seed(0)
    ok = from_torch(TinyResNet(), np, "float32")
    env = prepare(ok, (1, 8, 8), 1, reproducible=True)
    assert ok.keyed_randomness and torch.are_deterministic_algorithms_enabled() and "torch" in env["torch"]
    with pytest.raises(ValueError, match="drew from torch's random generator"):
        prepare(from_torch(functional_dropout((1, 2, 2), 3), np, "float32"), (1, 2, 2), 1, reproducible=True)
    for module, what in ((torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RReLU()), "RReLU"),
                         (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.AlphaDropout(0.1)), "AlphaDropout")):
        with pytest.raises(ValueError, match=what):
            prepare(from_torch(module, np, "float32"), (4,), 1, reproducible=True)

    class Put(torch.nn.Module):  # put_ has no deterministic kernel
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x).put_(torch.tensor([0]), torch.tensor([1.0]))

    with pytest.raises(ValueError, match="put_ does not have a deterministic implementation"):
        prepare(from_torch(Put(), np, "float32"), (4,), 1, reproducible=True)
    torch.use_deterministic_algorithms(False)
    loose = from_torch(functional_dropout((1, 2, 2), 3), np, "float32")
    prepare(loose, (1, 2, 2), 1, reproducible=False)  # without --reproducible: allowed, as in torch
    assert not loose.keyed_randomness


def test_refused_modules_say_what_to_do():
    from mpisgd.torch.modules import UnsupportedModule

    with pytest.raises(UnsupportedModule, match="SyncBatchNorm, which needs torch.distributed"):
        TorchModule(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.SyncBatchNorm(2)))
    with pytest.raises(UnsupportedModule, match="uninitialised parameters"):
        TorchModule(torch.nn.Sequential(torch.nn.LazyLinear(2)))
    with pytest.raises(UnsupportedModule, match="nothing to train"):
        TorchModule(torch.nn.Sequential(torch.nn.Linear(2, 2).requires_grad_(False)))


def test_a_saved_torch_model_loads_only_from_a_factory_the_caller_names(tmp_path, monkeypatch):
    from mpisgd.model_file import ModelFileError, load_model, save_params
    from mpisgd.nn import build_model

    module = build_model("torch_factories:tiny_resnet", (1, 8, 8), 10, seed=3)
    model = module.materialize(np, "float32", 3)
    model.state[:] = np.arange(model.state.size)  # running statistics worth keeping
    meta = {"format": "mpisgd-model", "version": 1, "model": "torch_factories:tiny_resnet", "framework": "torch",
            "in_shape": [1, 8, 8], "classes": 10, "dtype": "float32", "seed": 3}
    path = save_params(str(tmp_path / "m.npz"), model, meta=meta)
    with pytest.raises(ModelFileError, match="reading a file runs no code it names"):
        load_model(path)
    back = load_model(path, factory="torch_factories:tiny_resnet")
    np.testing.assert_array_equal(back.flat.params, model.flat.params)
    np.testing.assert_array_equal(back.state, model.state)
    x = _x(3).astype(np.float32)
    model.eval()
    back.eval()
    np.testing.assert_array_equal(back.forward(x), model.forward(x))
    with pytest.raises(ModelFileError, match=r"holds 1078 parameters; the model torch_factories:tiny_mlp builds .* "
                                             r"has 2410 \(the file.s model: torch_factories:tiny_resnet\)"):
        load_model(path, factory="torch_factories:tiny_mlp")
    assert dict(np.load(path)).keys() >= {"flat", "state", "stem.0.weight", "head.bias"}  # torch's own names


@pytest.mark.parametrize("model,extra,says", [
    ("batchnorm_1d", ["--batch-size", "1"], "cannot train on a micro-batch of one sample (ValueError: Expected more "
                                            "than 1 value per channel when training"),
    ("batchnorm_1d", ["--batch-size", "1", "--accum-steps", "4"], "give each rank --batch-size 2 or more"),
    ("Pair", [], "the torch module must return one tensor (the scores), got tuple"),
    ("Total", [], "gives an output of shape () for a batch of 2, not one row per sample; the data have 10 classes"),
])
def test_a_module_the_run_cannot_train_is_refused_in_one_line(model, extra, says):
    """Found before training, exit 2, the reason in one line: no traceback from the first step (a BatchNorm1d
    on micro-batches of one sample), no word about the input's shape where the output is the matter."""
    r = train_here(["--model", f"torch_factories:{model}", "--dataset", "synthetic", "--synthetic-samples", "64",
                    "--limit-test", "20", "--max-steps", "2", "--progress", "off", "--warmup-epochs", "0", *extra])
    assert r.statuses == (2,) * len(r.statuses) and says in r.error, r
    assert "shape (1, 28, 28)" not in r.error, r.error


def test_deterministic_algorithms_without_loading_inductor():
    """In a fresh process: the eager kernels' switch is on (put_, which has no deterministic kernel, is
    refused), TorchInductor's configuration was not imported for it, and where a module imports it later
    it reads deterministic mode too."""
    import subprocess
    import sys

    from conftest import ROOT, clean_env

    code = ("import sys, torch\n"
            "from mpisgd.torch.runtime import deterministic_algorithms\n"
            "deterministic_algorithms()\n"
            "print(torch.are_deterministic_algorithms_enabled(), 'torch._inductor.config' in sys.modules)\n"
            "try:\n    torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))\n"
            "except RuntimeError as exc:\n    print('refused' if 'deterministic' in str(exc) else exc)\n"
            "import torch._inductor.config as c\nprint(c.deterministic)\n")
    env = {k: v for k, v in clean_env().items() if k != "TORCHINDUCTOR_DETERMINISTIC"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "False", "refused", "True"], r.stdout
