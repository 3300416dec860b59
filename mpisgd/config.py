"""The run's configuration: one flat dataclass, one line per field, its checks.

Every field becomes a command-line flag (``batch_size`` → ``--batch-size``, mpisgd.app.options); the
comment string on its line is the flag's help.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpisgd.errors import UsageError

NAME_MAX = 255  # bytes of one file name (Linux's file systems: ext4, XFS, tmpfs, NFS)


def check_names(path: str | None, what: str) -> None:
    """UsageError where a name in ``path`` is longer than NAME_MAX bytes: every file system call on it would
    fail (ENAMETOOLONG), some of them after the training."""
    longest = max((len(part.encode(errors="surrogateescape")) for part in (path or "").split("/")), default=0)
    if longest > NAME_MAX:
        raise UsageError(f"{what} {path[:40] if path else ''}...: a name in it is {longest} bytes long; file systems "
                         f"take at most {NAME_MAX}")

# What a resumed run must share with the run that wrote its checkpoint, unless --resume-allow names it
# ("data": the data set's name, sizes and fingerprint); the model's structure may never change.
IDENTITY = ("model", "hidden", "dtype", "context", "gpt_layers", "gpt_heads", "gpt_width", "dropout", "data", "seed",
            "epochs", "lr", "base_batch", "lr_scaling", "warmup_epochs", "warmup_steps", "warmup_from", "decay",
            "decay_epochs", "decay_factor", "momentum", "nesterov", "momentum_correction", "weight_decay",
            "weight_decay_on", "max_steps", "optimizer", "trust_coef", "reproducible", "reproducible_level", "beta1",
            "beta2", "eps", "clip_grad_norm")
STRUCTURE = ("model", "hidden", "dtype", "context", "gpt_layers", "gpt_heads", "gpt_width", "dropout")
GPT_OPTIONS = ("gpt_layers", "gpt_heads", "gpt_width", "dropout")  # what only --model gpt reads
MAX_THREADS = 1024  # BLAS threads per rank: beyond any node's cores, and within what BLAS libraries take
LEVELS = ("pinned", "portable")  # --reproducible's levels (docs/reproducible.md)
OPTIMIZERS = ("sgd", "lars", "adamw", "lamb")
# The options only some update rules read, and which: the others ignore them, so a resumed run of
# those may change them freely (mpisgd.checkpoint.identity_changes).
OPTIMIZER_OPTIONS = {"momentum": ("sgd", "lars"), "nesterov": ("sgd", "lars"), "momentum_correction": ("sgd", "lars"),
                     "trust_coef": ("lars",), "beta1": ("adamw", "lamb"), "beta2": ("adamw", "lamb"),
                     "eps": ("adamw", "lamb"), "weight_decay_on": ("adamw",)}


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field: its default and its one-line help (and allowed values)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    # model
    model: str = opt("mlp", "mlp, cnn (LeNet-5), resnet (ResNet-20), gpt (a character-level language model: --data "
                            "a text file; docs/gpt.md), or package.module:function: your own (it gets the input shape "
                            "and the number of classes and returns an mpisgd.nn.Module or a torch.nn.Module: "
                            "docs/torch.md)")
    hidden: tuple[int, ...] = opt((1024, 1024), "hidden widths of the MLP, comma-separated")
    gpt_layers: int = opt(4, "--model gpt: transformer blocks")
    gpt_heads: int = opt(4, "--model gpt: attention heads per block (they split --gpt-width)")
    gpt_width: int = opt(128, "--model gpt: the residual stream's dimensions D (the MLP's hidden layer is 4D)")
    dropout: float = opt(0.0, "--model gpt: dropout rate after the embeddings, on the attention weights and after "
                              "each residual branch, keyed by sample (the same masks at any k)")
    dtype: str = opt("float32", "parameter and activation dtype", ("float32", "float64"))
    # data
    dataset: str = opt("fashion-mnist", "fashion-mnist (IDX files, see --data-dir) or synthetic (made up, for tests)",
                       ("fashion-mnist", "synthetic"))
    data: str | None = opt(None, "your data: an .npz with x_train, y_train, x_test, y_test, a directory of those "
                                 "four .npy files (memory-mapped), or an IDX directory (docs/data.md)")
    data_dir: str | None = opt(None, "directory of Fashion-MNIST's IDX files (else $MPISGD_DATA, then the Debian "
                                     "path)")
    context: int = opt(128, "sequence data (a text file, an .npz of tokens): tokens per sample, the model's context "
                            "length T; every position is trained to predict the next token")
    limit_train: int | None = opt(None, "use only the first N training samples")
    limit_test: int | None = opt(None, "use only the first N test samples")
    val_split: float = opt(0.0, "hold out this fraction of the training set (after --limit-train, chosen by --seed) "
                                "for validation: each epoch reports validation loss and accuracy, the test set is "
                                "scored once, at the end (0: no validation set, the test set every epoch)")
    test_every_epoch: bool = opt(False, "with --val-split, score the test set at every epoch's end too")
    synthetic_samples: int = opt(8192, "training samples of the synthetic data set")
    # optimisation
    epochs: int = opt(12, "passes over the training set")
    max_steps: int | None = opt(None, "stop after this many optimizer steps; the schedule (warmup, decay) is "
                                      "shortened to end there")
    batch_size: int = opt(128, "per-rank micro-batch size b")
    accum_steps: int = opt(1, "micro-batches accumulated locally per step m (no communication between them)")
    global_batch: int | None = opt(None, "the effective batch B = k*b*m; with it, m follows from B, k and "
                                         "--batch-size (the same B on any number of ranks)")
    lr: float = opt(0.1, "base learning rate eta0, the rate for a batch of --base-batch")
    base_batch: int = opt(256, "the batch B0 that --lr belongs to")
    lr_scaling: str = opt("linear", "how the rate follows the effective batch B", ("linear", "sqrt", "none"))
    warmup_epochs: float = opt(0.0, "gradual warmup from eta0 to the scaled rate over this many epochs")
    warmup_steps: int | None = opt(None, "warmup length in steps (overrides --warmup-epochs)")
    warmup_from: str = opt("base", "where warmup starts: base, the smaller of --lr and the scaled rate (Goyal et "
                                   "al.'s), or zero (a transformer's)", ("base", "zero"))
    decay: str = opt("cosine", "decay after warmup", ("none", "step", "cosine"))
    decay_epochs: tuple[int, ...] = opt((), "epochs at which --decay step multiplies the rate by --decay-factor")
    decay_factor: float = opt(0.1, "factor of each step decay")
    momentum: float = opt(0.9, "momentum mu of sgd and lars")
    nesterov: bool = opt(False, "Nesterov momentum (sgd, lars)")
    momentum_correction: bool = opt(False, "eta-in-velocity SGD with Goyal et al.'s correction eta_t/eta_(t-1) "
                                           "(sgd, lars)")
    weight_decay: float = opt(0.0, "weight decay: sgd, lars: L2, added to the averaged gradient; adamw: decoupled, "
                                   "w *= 1 - lr*wd; lamb: inside the trust-scaled update")
    weight_decay_on: str = opt("all", "adamw: the parameters weight decay shrinks: all, or matrices (weights and "
                                      "embeddings, 2-D and up; not biases, LayerNorm's gains and shifts)",
                               ("all", "matrices"))
    optimizer: str = opt("sgd", "update rule: sgd; lars (SGD with a layer-wise trust ratio, You et al. 2017); adamw "
                                "(Adam with decoupled weight decay, Loshchilov & Hutter); lamb (Adam's update with "
                                "LARS's layer-wise trust ratio, You et al. 2019), which want Adam-sized rates (--lr "
                                "0.001-0.01); docs/api.md, docs/large_batch.md",
                         OPTIMIZERS)
    trust_coef: float = opt(0.1, "LARS trust coefficient c: each weight tensor steps about c*lr*||w|| (why 0.1, "
                                 "not the paper's 0.001: docs/large_batch.md, Tuning LARS)")
    beta1: float = opt(0.9, "adamw, lamb: decay rate of the gradient's running mean (first moment)")
    beta2: float = opt(0.999, "adamw, lamb: decay rate of the squared gradient's running mean (second moment)")
    eps: float = opt(1e-8, "adamw, lamb: added to the second moment's square root (the update's denominator)")
    clip_grad_norm: float = opt(0.0, "clip the averaged gradient to this global L2 norm before the update, with "
                                     "any --optimizer (0: off)")
    seed: int = opt(0, "seed of initialisation and data order (shared by all ranks)")
    # distribution
    device: str = opt("auto", "auto, cpu or gpu", ("auto", "cpu", "gpu"))
    threads: int | None = opt(None, "BLAS threads per rank (default: $OMP_NUM_THREADS if set, else cores per "
                                    "node / ranks per node)")
    allreduce: str = opt("auto", "all-reduce strategy (docs/allreduce.md)",
                         ("auto", "mpi", "ring", "shared", "deterministic", "nccl"))
    bucket_cap_mb: float = opt(25.0, "gradient bucket size in MiB (first bucket: min(1, this))")
    overlap: bool = opt(True, "start each bucket's all-reduce during backward")
    deterministic: bool = opt(False, "sum every gradient element in rank order: bitwise reproducible across "
                                     "bucket sizes and strategies")
    reproducible: bool = opt(False, "the same parameter bits for any k dividing B/b, any strategy, bucket size "
                                    "and sharding: exact fixed-point gradient sums; --reproducible LEVEL also sets "
                                    "--reproducible-level (docs/reproducible.md)")
    reproducible_level: str = opt("pinned", "with --reproducible, across which machines the bits hold: pinned (every "
                                            "rank pins the BLAS kernel, NumPy's SIMD dispatch and one thread before "
                                            "they load: any x86-64 CPU with AVX2 and FMA, the same NumPy and BLAS "
                                            "builds) or portable (exact GEMMs, fixed-order sums, exp and log from "
                                            "IEEE operations: any BLAS, CPU, thread count or GPU; slower)", LEVELS)
    shard_optimizer: bool | None = opt(None, "reduce-scatter the gradient, update 1/k of the parameters on each "
                                             "rank, all-gather them (the same result); default: on for host buffers "
                                             "at k >= 2 with 1 MiB of parameters or more (docs/benchmarks.md), off "
                                             "on a GPU")
    shared_grads: bool = opt(True, "every rank on one node (auto strategy, CPU): keep gradients in node-shared "
                                   "memory that peers reduce in place")
    cuda_aware: str = opt("auto", "GPU buffers to MPI: probe (auto), pass device pointers (direct) or stage "
                                  "through pinned host memory (staged)", ("auto", "direct", "staged"))
    check_replicas: int = opt(0, "compare parameter checksums across ranks every N steps (0: never)")
    on_nan: str = opt("stop", "non-finite gradient after the all-reduce: stop or skip the step", ("stop", "skip"))
    stall_timeout_s: float = opt(300.0, "seconds a collective may wait before rank 0 reports which ranks have not "
                                        "reached it (0: no report)")
    stall_abort: bool = opt(False, "abort the job as soon as the stall check fires")
    stall_abort_s: float = opt(1800.0, "abort the job when a collective has waited this many seconds, reported or "
                                       "not: the bound on every wait (0: never)")
    noise_scale_every: int = opt(4, "measure the gradient noise scale every N steps (0: never; "
                                    "docs/large_batch.md)")
    straggler_report: bool = opt(True, "at each epoch's end, which rank the others waited for (docs/concepts.md)")
    # files and output
    metrics_file: str | None = opt(None, "append JSON lines to this file, one per step and one per epoch (rank 0)")
    tensorboard: str | None = opt(None, "write TensorBoard event files to this directory (rank 0; needs "
                                        "pip install 'mpisgd[tensorboard]')")
    timeline: str | None = opt(None, "write a Chrome-trace JSON timeline, one file per rank (PATH.rankN.json)")
    save_model: str | None = opt(None, "write the final parameters to this .npz file (rank 0)")
    checkpoint_dir: str | None = opt(None, "directory of checkpoints (rank 0 writes)")
    checkpoint_every: int = opt(0, "write a checkpoint every N steps (0: at each epoch end if a dir is set)")
    checkpoint_keep: int = opt(3, "checkpoints kept")
    resume: str = opt("no", "no, auto (latest good checkpoint), or a checkpoint path")
    resume_allow: str = opt("", "comma-separated options a resumed run may change on purpose (e.g. lr,epochs); "
                                "any other difference from the checkpoint's run is refused")
    overwrite_checkpoints: bool = opt(False, "a fresh run may delete another run's checkpoints in --checkpoint-dir")
    progress: str = opt("auto", "progress bar on rank 0: auto (when it reaches a terminal: rank 0's stderr, or "
                                "under mpiexec the launcher's), on, off", ("auto", "on", "off"))

    def validate(self) -> None:
        """Raise UsageError naming the first invalid value."""
        for name in ("data", "data_dir", "checkpoint_dir", "save_model", "metrics_file", "timeline", "resume",
                     "tensorboard"):
            path = getattr(self, name)
            if path is not None and not path.strip():  # an unset shell variable
                raise UsageError(f"--{name.replace('_', '-')} is empty: give a path (an unset shell variable?)")
            check_names(path, f"--{name.replace('_', '-')}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0, got {self.seed}")
        positive = {
            "epochs": self.epochs, "batch-size": self.batch_size, "accum-steps": self.accum_steps,
            "base-batch": self.base_batch, "synthetic-samples": self.synthetic_samples,
            "checkpoint-keep": self.checkpoint_keep,
        }
        for name, value in positive.items():
            if value < 1:
                raise UsageError(f"--{name} must be >= 1, got {value}")
        if not 0 <= self.val_split < 1:
            raise UsageError(f"--val-split must be in [0, 1), got {self.val_split}")
        for name, value in {"max-steps": self.max_steps, "limit-train": self.limit_train,
                            "limit-test": self.limit_test, "threads": self.threads,
                            "global-batch": self.global_batch}.items():
            if value is not None and value < 1:
                raise UsageError(f"--{name} must be >= 1, got {value}")
        if self.threads is not None and self.threads > MAX_THREADS:
            raise UsageError(f"--threads must be at most {MAX_THREADS} (BLAS threads per rank), got {self.threads}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise UsageError("--nesterov needs --momentum > 0")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.trust_coef) and self.trust_coef > 0):
            raise UsageError(f"--trust-coef must be > 0, got {self.trust_coef}")
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= beta < 1:
                raise UsageError(f"--{name} must be in [0, 1), got {beta}")
        if not self.eps > 0:
            raise UsageError(f"--eps must be > 0, got {self.eps}")
        if self.clip_grad_norm < 0:
            raise UsageError(f"--clip-grad-norm must be >= 0 (0: off), got {self.clip_grad_norm}")
        for name in ("nesterov", "momentum_correction"):
            if getattr(self, name) and self.optimizer not in OPTIMIZER_OPTIONS[name]:
                raise UsageError(f"--{name.replace('_', '-')} is for --optimizer sgd or lars, not "
                                 f"{self.optimizer} (its momentum is --beta1)")
        if self.warmup_epochs < 0 or (self.warmup_steps is not None and self.warmup_steps < 0):
            raise UsageError("warmup length must be >= 0")
        if self.warmup_steps is None and self.warmup_epochs > self.epochs:
            raise UsageError(f"--warmup-epochs {self.warmup_epochs:g} is longer than the run "
                             f"(--epochs {self.epochs})")
        if not 0 < self.decay_factor <= 1:
            raise UsageError(f"--decay-factor must be in (0, 1], got {self.decay_factor}")
        if self.decay == "step" and not self.decay_epochs:
            raise UsageError("--decay step needs --decay-epochs, e.g. --decay-epochs 6,9")
        if any(e < 1 for e in self.decay_epochs) or list(self.decay_epochs) != sorted(self.decay_epochs):
            raise UsageError(f"--decay-epochs must be increasing positive epochs, got {self.decay_epochs}")
        if self.model not in ("mlp", "cnn", "resnet", "gpt") and ":" not in self.model:
            raise UsageError(f"--model must be mlp, cnn, resnet, gpt or package.module:function, got {self.model!r} "
                             "(the stock models: mlp, cnn for LeNet-5, resnet for ResNet-20, gpt for a language model "
                             "on text; or a factory of your own)")
        for name in ("context", "gpt_layers", "gpt_heads", "gpt_width"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.gpt_width % self.gpt_heads:
            raise UsageError(f"--gpt-width {self.gpt_width} does not split into --gpt-heads {self.gpt_heads} heads of "
                             "equal size: choose a width divisible by the heads")
        if not 0 <= self.dropout < 1:
            raise UsageError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.weight_decay_on != "all" and self.optimizer != "adamw":
            raise UsageError(f"--weight-decay-on {self.weight_decay_on} is for --optimizer adamw, not "
                             f"{self.optimizer}: pass --weight-decay-on all")
        if self.data and self.dataset == "synthetic":
            raise UsageError("--data and --dataset synthetic: choose one")
        if any(h < 1 for h in self.hidden):
            raise UsageError(f"--hidden widths must be >= 1, got {self.hidden}")
        if self.bucket_cap_mb <= 0:
            raise UsageError(f"--bucket-cap-mb must be > 0, got {self.bucket_cap_mb}")
        for name, value in {"check-replicas": self.check_replicas, "checkpoint-every": self.checkpoint_every,
                            "noise-scale-every": self.noise_scale_every}.items():
            if value < 0:
                raise UsageError(f"--{name} must be >= 0, got {value}")
        if self.stall_timeout_s < 0 or self.stall_abort_s < 0:
            raise UsageError(f"--stall-timeout-s and --stall-abort-s must be >= 0, got {self.stall_timeout_s} and "
                             f"{self.stall_abort_s}")
        if self.reproducible and self.reproducible_level == "pinned" and self.threads not in (None, 1):
            raise UsageError(f"--reproducible at the pinned level runs one BLAS thread per rank (how a GEMM is "
                             f"split among threads changes its sums): drop --threads {self.threads}, or use "
                             "--reproducible portable")
        if self.resume != "no" and not self.checkpoint_dir and self.resume == "auto":
            raise UsageError("--resume auto needs --checkpoint-dir")
        for name in self.allowed_changes():
            if name not in IDENTITY or name in STRUCTURE:
                raise UsageError(f"--resume-allow: {name!r} is not an option a resumed run can change; "
                                 f"choose from {', '.join(k for k in IDENTITY if k not in STRUCTURE)}")

    def allowed_changes(self) -> tuple[str, ...]:
        return tuple(n.strip().replace("-", "_") for n in self.resume_allow.split(",") if n.strip())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self, exclude: tuple[str, ...] = ()) -> str:
        """A short hash of the configuration, to compare across ranks."""
        d = {k: v for k, v in self.to_dict().items() if k not in exclude}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=list).encode()).hexdigest()[:16]


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low`` (the scripts' counts: steps, repeats, batch sizes)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
        return value

    return parse


def parse_int_tuple(text: str) -> tuple[int, ...]:
    if text.strip() == "":
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# --help in groups, by concern; every field of Config is in exactly one (tests/test_config.py checks)
GROUPS: dict[str, tuple[str, ...]] = {
    "model and data": ("model", "hidden", "gpt_layers", "gpt_heads", "gpt_width", "dropout", "dtype", "dataset",
                       "data", "data_dir", "context", "limit_train", "limit_test", "val_split", "test_every_epoch",
                       "synthetic_samples", "seed"),
    "batch and schedule": ("epochs", "max_steps", "batch_size", "accum_steps", "global_batch", "lr", "base_batch",
                           "lr_scaling", "warmup_epochs", "warmup_steps", "warmup_from", "decay", "decay_epochs",
                           "decay_factor"),
    "optimizer": ("optimizer", "momentum", "nesterov", "momentum_correction", "weight_decay", "weight_decay_on",
                  "trust_coef", "beta1", "beta2", "eps", "clip_grad_norm", "on_nan"),
    "communication": ("device", "threads", "allreduce", "bucket_cap_mb", "overlap", "reproducible",
                      "reproducible_level", "deterministic",
                      "shard_optimizer", "shared_grads", "cuda_aware"),
    "checkpoints and resume": ("checkpoint_dir", "checkpoint_every", "checkpoint_keep", "resume", "resume_allow",
                               "overwrite_checkpoints", "save_model"),
    "output and diagnostics": ("metrics_file", "tensorboard", "timeline", "progress", "check_replicas",
                               "stall_timeout_s", "stall_abort", "stall_abort_s", "noise_scale_every",
                               "straggler_report"),
}
# earlier spellings still accepted
ALIASES: dict[str, tuple[str, ...]] = {"bucket_cap_mb": ("--bucket-mb",), "stall_timeout_s": ("--stall-timeout",)}


# The stock models' own recipes where the command line does not say. The CNN's: docs/benchmarks.md, LeNet-5.
# ResNet-20's (docs/data.md): --lr 0.2 is the rate for B0 = 256, 0.1 at its batch of 128, He et al.'s rate.
# The GPT's: nanoGPT's character-level recipe (AdamW, beta2 0.99, decay 0.1 on matrices, a warmup from zero,
# cosine decay), at the sizes docs/gpt.md measures on 2 cores.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "cnn": {"lr": 0.02, "weight_decay": 5e-4, "epochs": 20},
    "resnet": {"lr": 0.2, "weight_decay": 5e-4, "epochs": 15, "warmup_epochs": 1.0},
    "gpt": {"optimizer": "adamw", "lr": 1e-3, "lr_scaling": "none", "beta2": 0.99, "weight_decay": 0.1,
            "weight_decay_on": "matrices", "warmup_steps": 100, "warmup_from": "zero", "batch_size": 32,
            "context": 64, "val_split": 0.05, "epochs": 1},
}


