"""Set-up of a training run: every stage on every rank, in order, agreed before the next.

``build_run(cfg, comm) -> Run`` checks the options across ranks, the outputs, the checkpoint
directory, the data, the model, the resume plan and the memory, then builds the model, the
optimizer, the data-parallel step, the batches and the schedule. A stage that can fail on some ranks
only runs through :func:`agreed`: if it fails anywhere, every rank raises the same AgreedError, so
rank 0 prints one line and every rank exits 2 before any training. The result is one typed
description of the run, which the loop (mpisgd.app.trainer) drives and the banner (mpisgd.app.report) reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from mpisgd import data, text
from mpisgd.agreement import ReplicaError, agree, same_arithmetic
from mpisgd.app import preflight, run_files
from mpisgd.app.resume import ResumePoint, resume_point
from mpisgd.app.run_dir import RunDirectory
from mpisgd.backend import arithmetic, bits_depend_on, peak_rss_mib, set_threads
from mpisgd.backend import environment as backend_environment
from mpisgd.checkpoint import CheckpointError, TrainState, find_resume
from mpisgd.comm import create_reducer
from mpisgd.config import Config
from mpisgd.context import Context, blas_threads, init
from mpisgd.data import BatchLoader, DataError, Dataset, GlobalBatches, load_data, synthetic
from mpisgd.errors import UsageError
from mpisgd.kernels import kernels_for
from mpisgd.model_file import FORMAT, VERSION, model_structure
from mpisgd.nn import Model, Module, SoftmaxCrossEntropy, SyncBatchNorm, TokenCrossEntropy, build_model
from mpisgd.nn.models import STOCK, check_output
from mpisgd.nn.usercheck import check_user_modules
from mpisgd.optim import SGD, Optimizer
from mpisgd.optim.adam import LAMB, AdamW, matrices
from mpisgd.optim.lars import LARS
from mpisgd.parallel import DataParallel
from mpisgd.portable.scalar import LIBM, PORTABLE
from mpisgd.schedule import Schedule, accum_steps_for, effective_batch, total_steps
from mpisgd.timeline import Timeline

T = TypeVar("T")


@dataclass
class RunData:
    train: Dataset
    test: Dataset
    source: str  # where it came from, for the banner
    identity: dict[str, Any]  # name, sizes, fingerprint, classes: compared across ranks and with checkpoints
    warnings: list[str] = field(default_factory=list)  # e.g. classes without a sample
    val: Dataset | None = None  # the validation samples held out of the training set (--val-split)

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.train.images.shape[1:])

    @property
    def n_classes(self) -> int:
        return int(self.identity["classes"])

    @property
    def tokens(self) -> bool:
        """Sequence data (mpisgd.text): windows of token ids, a target at every position."""
        return self.train.tokens


@dataclass
class Run:
    """What set-up decided, on this rank."""

    cfg: Config
    ctx: Context
    places: list[tuple[str, int, int | None]]  # every rank's (host, local rank, GPU id)
    threads: int  # BLAS threads per rank, and where that number came from
    threads_from: str
    data: RunData
    model: Model
    optimizer: Optimizer
    dp: DataParallel
    batches: GlobalBatches
    schedule: Schedule
    total_steps: int
    train_loader: BatchLoader
    test_loader: BatchLoader
    timeline: Timeline
    run_dir: RunDirectory | None  # rank 0's lock on the checkpoint directory
    resume: ResumePoint | None  # where the run continues from, if it does
    rss_start_mib: float  # this rank's memory before any data: the runtime's own
    t_launch: float
    environment: dict[str, Any]  # what exact bits depend on (BLAS, threads, CPU), kept in checkpoints
    structure: dict[str, Any]  # the model's layers and shapes, kept in checkpoints (a resume must match)
    shard_why: str  # why the update is sharded or not, for the banner
    warnings: list[str] = field(default_factory=list)  # for rank 0 to print after the banner
    val_loader: BatchLoader | None = None  # the validation set's (--val-split)

    @property
    def k(self) -> int:
        return self.ctx.size

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def is_root(self) -> bool:
        return self.ctx.rank == 0

    @property
    def B(self) -> int:  # noqa: N802 - the effective batch's name everywhere in the docs
        return self.batches.global_batch


def agreed(comm: Any, fn: Callable[[], T], watchdog: Any, what: str, collective: bool = False,
           on_root: bool = False) -> T:
    """Run set-up stage ``what`` on every rank; if it fails anywhere, every rank fails together. The
    agreement is watched, so a rank stuck in the stage (a blocking model factory, a slow disk) is named;
    a ``collective`` stage (one that communicates itself) is watched whole; an ``on_root`` stage's checks are
    rank 0's for every rank (its error is not prefixed "rank 0:")."""
    error: BaseException | None = None
    result: Any = None
    with watchdog.watching(f"set-up: {what}") if collective else contextlib.nullcontext():
        try:
            result = fn()
        except (UsageError, ReplicaError) as exc:
            error = exc
        with contextlib.nullcontext() if collective else watchdog.watching(f"set-up: {what}"):
            agree(comm, error, on_root=on_root)
    return result


def build_run(cfg: Config, world: Any, watchdog: Any, progress: Callable[[], None] | None = None) -> Run:
    """Every set-up stage, in order (collective). ``watchdog`` watches their agreements, then the
    training's collectives (DataParallel closes it); ``progress()`` is called after each stage."""
    t_launch = time.perf_counter()
    wd = watchdog

    def stage(what: str, fn: Callable[[], T], collective: bool = False, on_root: bool = False) -> T:
        result = agreed(world, fn, wd, what, collective, on_root)
        if progress is not None:
            progress()
        return result

    with wd.watching("set-up: finding the nodes and the device"):
        ctx = init(world, cfg.device)  # every rank ends on one kind of device, or all raise
    rss_start_mib = peak_rss_mib()  # the interpreter, NumPy, MPI, mpisgd and the backend: no data yet
    is_root = ctx.rank == 0
    stage("the options", lambda: preflight.same_options(cfg, world), collective=True)
    device_warnings = stage("the device", lambda: preflight.device_options(cfg, ctx.backend.is_gpu))
    stage("the output paths", lambda: preflight.outputs(cfg, ctx.rank),  # a path that cannot be written fails now
          on_root=True)
    stage("the configuration's copies and TensorBoard", lambda: run_files.check(cfg, ctx.rank), on_root=True)
    run_dir = stage("the checkpoint directory", lambda: RunDirectory(cfg.checkpoint_dir, cfg.resume,
                                                                     cfg.overwrite_checkpoints)
                    if cfg.checkpoint_dir and is_root else None, on_root=True)
    try:
        level = cfg.reproducible_level if cfg.reproducible else ""
        threads, threads_from = (1, "the pinned level") if level == "pinned" else \
            stage("the BLAS threads", lambda: blas_threads(cfg.threads, ctx.local_size))
        if ctx.backend.device == "cpu":
            set_threads(threads)
        environment = backend_environment(ctx.backend, threads, level)
        if level == "pinned":  # every rank pinned, and alike (mpisgd.pinning)
            stage("the pinned kernels", lambda: preflight.pinned(environment, world), collective=True)
        run_data = stage("loading the data", lambda: _load_data(cfg))
        stage("comparing the data", lambda: preflight.same_data(run_data.identity, world), collective=True)
        stage("the effective batch", lambda: _global_batch(cfg, ctx.size))
        module = stage("building the model", lambda: _build_model(cfg, run_data))  # before resuming: it must match
        structure = model_structure(module)
        stage("the model on every rank", lambda: preflight.same_model(structure, world), collective=True)
        with wd.watching("set-up: the checkpoint to resume"):
            resume, state, warnings = _resume_point(cfg, world, run_data.identity, run_dir, structure)
        warnings = [f"warning: {w}" for w in (*getattr(cfg, "option_warnings", ()), *device_warnings,
                                              *run_data.warnings)] + warnings
        if not ctx.backend.is_gpu:
            stage("the memory", lambda: preflight.memory(module, cfg.dtype, data.resident_nbytes(
                run_data.train, run_data.test, *([run_data.val] if run_data.val else [])),
                                                         ctx.local_size, preflight.state_buffers(cfg)))
        xp = ctx.xp
        model = module.materialize(xp, cfg.dtype, cfg.seed)
        model.ctx.kernels = stage("the kernels", lambda: kernels_for("portable" if level == "portable" else "fast"))
        stage("the model's output", lambda: _check_model_output(cfg, model, xp, run_data))
        warnings += stage("the backward of your own modules", lambda: _check_user_modules(cfg, module, run_data))
        if getattr(model, "framework", "") == "torch":  # pin torch's threads; --reproducible: what it needs
            environment.update(stage("the PyTorch model", lambda: _prepare_torch(cfg, model, run_data, threads,
                                                                                  ctx.rank, level)))
        if resume is not None and resume.environment and cfg.reproducible:  # this run's environment complete now
            keys = (*bits_depend_on(level), "torch")  # a PyTorch model's bits depend on torch's build and threads too
            differs = ", ".join(f"{k} {resume.environment.get(k)!r} -> {environment.get(k)!r}"
                                for k in keys if resume.environment.get(k) != environment.get(k))
            if differs:
                warnings.append(f"warning: resume: the checkpoint was written with other arithmetic ({differs}); "
                                f"--reproducible at the {level} level promises the same bits only where these are "
                                "the same")
        optimizer = _optimizer(cfg, model)
        params = model.flat.params
        if level != "portable":  # every rank rounds alike, or the replicas drift apart (DataParallel checks it too)
            stage("the arithmetic", lambda: same_arithmetic(world, arithmetic(params, _level1(optimizer)),
                                                            UsageError), collective=True)
        timeline = Timeline(enabled=bool(cfg.timeline), rank=ctx.rank)
        reducer = stage("the all-reduce strategy", lambda: _reducer(cfg, world, ctx))
        shard, shard_why = shard_policy(cfg.shard_optimizer, ctx.size, ctx.backend.is_gpu, model.flat.nbytes)
        with wd.watching("set-up: data parallelism (model check, broadcast, all-reduce plan)"):
            dp = DataParallel(model, optimizer, world, reducer=reducer, bucket_cap_mb=cfg.bucket_cap_mb,
                              overlap=cfg.overlap, on_nan=cfg.on_nan, timeline=timeline, watchdog=wd,
                              shard_optimizer=shard, shared_grads=cfg.shared_grads,
                              loss=(TokenCrossEntropy(kernels=model.ctx.kernels) if run_data.tokens
                                    else SoftmaxCrossEntropy(model.ctx.kernels)),
                              reproducible=cfg.reproducible, noise_every=cfg.noise_scale_every,
                              clip_grad_norm=cfg.clip_grad_norm, measure_grad_norm=bool(cfg.tensorboard),
                              check_in=False)  # the loop checks in itself, with its stop flag
        B = effective_batch(cfg.batch_size, ctx.size, cfg.accum_steps)
        batches = stage("the batches", lambda: GlobalBatches(len(run_data.train), B, ctx.rank, ctx.size,
                                                             cfg.accum_steps))
        spe = batches.steps_per_epoch
        n_steps = total_steps(cfg.epochs, spe, cfg.max_steps)
        schedule, short = stage("the schedule", lambda: Schedule.for_run(cfg, ctx.size, spe, n_steps))
        warnings += [f"warning: {w}" for w in short]
        with wd.watching("set-up: the rank map"):
            places = world.allgather((ctx.host, ctx.local_rank, ctx.backend.gpu_id))
        run = Run(cfg, ctx, places, threads, threads_from, run_data, model, optimizer, dp, batches, schedule,
                  n_steps, BatchLoader(run_data.train, xp, cfg.dtype), BatchLoader(run_data.test, xp, cfg.dtype),
                  timeline, run_dir, resume, rss_start_mib, t_launch, environment, structure, shard_why, warnings,
                  val_loader=BatchLoader(run_data.val, xp, cfg.dtype) if run_data.val else None)
        if resume is not None:
            with wd.watching("set-up: restoring the checkpoint"):
                _restore(run, state)
        if is_root:  # the configuration as set-up settled it (a resumed run's b and m included)
            run.warnings += run_files.write_config(cfg, ctx.size)
            vocab = text.Vocabulary.from_identity(run_data.identity)
            if vocab is not None:
                run.warnings += run_files.write_vocab(cfg, text.vocab_json(vocab))
        return run
    except BaseException:  # refused (or interrupted) before training: the checkpoint directory as it was found
        if run_dir is not None:
            run_dir.release()
        raise


def _load_data(cfg: Config) -> RunData:
    own = cfg.model not in STOCK  # a model of your own may be a language model: a file that is no array set is text
    if text.is_token_data(cfg.data, text=cfg.model == "gpt" or own):
        try:
            return _load_tokens(cfg)
        except DataError as exc:
            if not own or text.is_token_data(cfg.data, text=False):
                raise
            raise DataError(f"{exc} (--model {cfg.model} is your own: a file that is not an .npz or .npy is "
                            "read as its text)") from None
    if cfg.model == "gpt":
        if cfg.data and not Path(cfg.data).exists():
            raise UsageError(f"--data {cfg.data}: no such file or directory")
        raise UsageError("--model gpt reads sequence data: --data a UTF-8 text file or an .npz of 'tokens' "
                         "(docs/data.md)")
    if "context" in getattr(cfg, "given", ()) and cfg.context != Config.context:
        raise UsageError(f"--context {cfg.context} would do nothing in this run: it is the window of sequence data "
                         "(--data a text file or an .npz of tokens), and this data is images or features")
    if cfg.dataset == "synthetic":
        train, test, name, source = synthetic(cfg.synthetic_samples, cfg.seed), \
            synthetic(2000, cfg.seed, split=1), "synthetic", "synthetic"
    else:
        train, test, name, source = load_data(cfg.data, cfg.data_dir)
    if cfg.limit_train:
        train = train.head(cfg.limit_train)
    if cfg.limit_test:
        test = test.head(cfg.limit_test)
    scale: list[str] = []  # float inputs far from order 1: found by validate's pass over them
    classes = data.validate(train, test, dtype=cfg.dtype, warnings=scale)
    identity = {**data.identity(name, train, test), "classes": classes}
    warnings = data.label_warnings(train, test, classes) + data.scale_warnings(train, test) + scale
    if not cfg.val_split:
        return RunData(train, test, source, identity, warnings)
    train, val = data.hold_out(train, cfg.val_split, cfg.seed)  # before sharding: the same samples at any k
    identity.update(n_train=len(train), val_split=cfg.val_split, n_val=len(val))  # a resume keeps the split
    return RunData(train, test, source, identity, warnings, val)


def _load_tokens(cfg: Config) -> RunData:
    """A text file or an .npz of tokens: contiguous training, validation and test parts, windows of
    --context tokens (mpisgd.text)."""
    assert cfg.data is not None
    if cfg.model in STOCK and cfg.model != "gpt":
        raise UsageError(f"--data {cfg.data} holds token ids, which --model {cfg.model} cannot read: use --model gpt "
                         "or a language model of your own")
    d = text.load_tokens(cfg.data, cfg.context, cfg.val_split)
    train, test = d.train, d.test
    if cfg.limit_train:
        train = train.head(cfg.limit_train)
    if cfg.limit_test:
        test = test.head(cfg.limit_test)
    identity = dict(d.identity, n_train=len(train), n_test=len(test))
    return RunData(train, test, d.source, identity, [], d.val)


def gpt_arch(cfg: Config) -> dict[str, Any]:
    """The GPT's sizes from the options (what model_record keeps to build it again)."""
    return {"layers": cfg.gpt_layers, "heads": cfg.gpt_heads, "width": cfg.gpt_width, "dropout": cfg.dropout}


def _build_model(cfg: Config, run_data: RunData) -> Module:
    try:
        module = build_model(cfg.model, run_data.in_shape, run_data.n_classes, cfg.hidden,
                             arch=gpt_arch(cfg) if cfg.model == "gpt" else None, seed=cfg.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    sync = next((path for path, m in module.named_modules() if isinstance(m, SyncBatchNorm)), None)
    if cfg.reproducible and sync is not None:
        raise UsageError(f"--reproducible: the model's SyncBatchNorm ({sync}) normalises by statistics of all k ranks' "
                         "micro-batches, which change with k; use BatchNorm2d (statistics per micro-batch, the same "
                         "at any k)")
    portable = cfg.reproducible and cfg.reproducible_level == "portable"
    if portable and not hasattr(module, "torch_module"):  # a torch model's refusal: _prepare_torch
        _refuse_unportable(cfg, module)
    return module


def _refuse_unportable(cfg: Config, module: Module) -> None:
    """The portable level's bits hold only where every module computes through ctx.kernels (Module.portable):
    one that sums or exponentiates with the array module itself would change its bits with the CPU, the
    BLAS or NumPy, and the portable level skips the check that every rank rounds alike."""
    kinds = sorted({type(m).__name__ for _, m in module.named_modules() if not m.portable})
    if kinds:
        raise UsageError(f"--reproducible portable: --model {cfg.model} has modules the portable kernels do not cover "
                         f"yet ({', '.join(kinds)}: they compute with the array module's own sums and functions, "
                         "whose bits change with the machine); use --reproducible (pinned: the same bits at any k on "
                         "x86-64 CPUs with AVX2 and FMA and the same builds)")


def _check_user_modules(cfg: Config, module: Module, run_data: RunData) -> list[str]:
    """Every rank checks the backward of the modules a --model factory brings of its own (float64 finite
    differences, mpisgd.nn.usercheck: the same verdict everywhere, at the same time); a wrong one is refused.
    The stock models, and factories made only of mpisgd's layers, are not checked."""
    if cfg.model in STOCK:
        return []
    try:
        error, notes = check_user_modules(
            lambda: build_model(cfg.model, run_data.in_shape, run_data.n_classes, cfg.hidden), run_data.in_shape,
            cfg.seed, skip=module)
    except (Exception, SystemExit) as exc:  # the user's code, run in float64: say so and train as asked
        return [f"warning: --model {cfg.model}: the backward of its own modules was not checked (in float64, "
                f"{type(exc).__name__}: {exc})"]
    if error is not None:
        raise UsageError(f"--model {cfg.model}: {error.describe()}")
    return [f"warning: --model {cfg.model}: {note}" for note in notes]


def _prepare_torch(cfg: Config, model: Model, run_data: RunData, threads: int, rank: int,
                   level: str) -> dict[str, str]:
    if level == "portable":
        raise UsageError(f"--model {cfg.model}: a PyTorch model computes with PyTorch's own kernels, which the "
                         "portable level cannot make order-free: use --reproducible-level pinned (the same bits on "
                         "x86-64 CPUs with AVX2 and FMA and the same builds)")
    from mpisgd.torch.runtime import prepare  # noqa: PLC0415 - torch models only

    try:
        return prepare(model, run_data.in_shape, threads, cfg.reproducible, rank, cfg.seed)  # type: ignore[arg-type]
    except ValueError as exc:
        raise UsageError(f"--model {cfg.model}: {exc}") from None


def _check_model_output(cfg: Config, model: Model, xp: Any, run_data: RunData) -> None:
    try:
        for samples in (2, 1) if cfg.batch_size == 1 else (2,):  # then one sample, where micro-batches hold one
            check_output(model, xp, run_data.in_shape, run_data.n_classes, cfg.dtype, tokens=run_data.tokens,
                         samples=samples)
    except ValueError as exc:
        raise UsageError(f"--model {cfg.model}: {exc}") from None


def _level1(optimizer: Optimizer) -> bool:
    """Whether the optimizer's update runs as BLAS level-1 calls (mpisgd.blas), not the ufuncs."""
    return getattr(optimizer, "blas", None) is not None


def _optimizer(cfg: Config, model: Model) -> Optimizer:
    flat = model.flat
    scalar_math = PORTABLE if cfg.reproducible else LIBM  # powers from basic IEEE operations where bits matter
    if cfg.optimizer == "adamw":  # ufuncs only: reproducible as it is
        mask = matrices(flat) if cfg.weight_decay_on == "matrices" else None
        return AdamW(flat, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay, decay_mask=mask, scalar_math=scalar_math)
    if cfg.optimizer == "lamb":
        return LAMB(flat, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay, scalar_math=scalar_math)
    level1 = not cfg.reproducible  # the ufuncs round every element alike wherever a range starts (exact.py)
    if cfg.optimizer == "lars":
        return LARS(flat, cfg.momentum, cfg.nesterov, cfg.weight_decay, cfg.momentum_correction,
                    cfg.trust_coef, level1=level1)
    return SGD(flat, cfg.momentum, cfg.nesterov, cfg.weight_decay, cfg.momentum_correction, level1=level1)


# Below this the update is too small to split: sharding saves (1 - 1/k) of an optimizer step that costs
# about 0.8 ns per parameter here and adds an all-gather of some 0.1 ms, even at k = 2 (LeNet-5's 0.24 MiB
# lost 3 %, the MLP's 7.1 MiB gained 5 %: docs/benchmarks.md, "The sharded step by default").
SHARD_MIN_BYTES = 2**20
# options whose change on purpose (--resume-allow) may give the optimizer a state buffer the checkpoint lacks
NEW_OPTIMIZER_STATE = ("optimizer", "momentum")


def shard_policy(asked: bool | None, k: int, gpu: bool, param_nbytes: int) -> tuple[bool, str]:
    """Whether to shard the update, and why: as asked, else on for host buffers at k >= 2 with at least
    SHARD_MIN_BYTES of parameters, where it is the faster of the two with the same bits; off on a GPU,
    where it has not been measured."""
    if asked is not None:
        why = "--shard-optimizer" if asked else "--no-shard-optimizer"
        return asked and k > 1, why + (": nothing to split at k=1" if asked and k == 1 else "")
    if gpu:
        return False, "default on a GPU"
    if k == 1:
        return False, "nothing to split at k=1"
    if param_nbytes < SHARD_MIN_BYTES:
        return False, f"default under {SHARD_MIN_BYTES // 2**20} MiB of parameters: too small an update to split"
    return True, f"default at k >= 2 on host buffers, {SHARD_MIN_BYTES // 2**20} MiB of parameters or more"


def _global_batch(cfg: Config, k: int) -> None:
    """--global-batch B: m = B / (k * b), unless --accum-steps was given too (then it must agree)."""
    if cfg.global_batch is None:
        return
    m = accum_steps_for(cfg.global_batch, k, cfg.batch_size)
    if "accum_steps" in getattr(cfg, "given", set()) and m != cfg.accum_steps:
        raise UsageError(f"--global-batch {cfg.global_batch} with k={k} and --batch-size {cfg.batch_size} means "
                         f"--accum-steps {m}, not {cfg.accum_steps}: give one of them")
    cfg.accum_steps = m


def _reducer(cfg: Config, world: Any, ctx: Context) -> Any:
    try:
        return create_reducer(cfg.allreduce, world, deterministic=cfg.deterministic, device=ctx.backend.is_gpu,
                              cuda_aware=cfg.cuda_aware)
    except ValueError as exc:  # a strategy that cannot run here: every rank finds it alike
        raise UsageError(str(exc)) from None


def _resume_point(cfg: Config, world: Any, identity: dict[str, Any], run_dir: RunDirectory | None,
                 structure: dict[str, Any]) -> tuple[ResumePoint | None, TrainState | None, list[str]]:
    """Rank 0 finds the checkpoint (falling back past corrupt ones), checks that this run may continue it
    and works out b and m; every rank takes the plan (and the b and m it sets in ``cfg``). The state
    itself (rank 0's) is loaded into the model once it exists (_restore)."""
    plan, state, error = None, None, None
    warnings: list[str] = []
    if world.Get_rank() == 0 and cfg.resume != "no":
        try:
            state, path, warnings = run_dir.find_resume(cfg.resume) if run_dir is not None else \
                find_resume(cfg.resume, cfg.checkpoint_dir)
            if state is not None:
                try:
                    text.check_same_vocabulary(state.data, identity, f"the checkpoint {path}")
                except UsageError as exc:
                    raise CheckpointError(str(exc)) from None
                plan = resume_point(state, path, cfg.to_dict(), getattr(cfg, "given", set()), cfg.allowed_changes(),
                                   world.Get_size(), identity, structure=structure)
                warnings += plan.warnings
        except CheckpointError as exc:
            error = exc
    agree(world, error, on_root=True)
    plan = world.bcast(plan, root=0)
    if plan is not None:
        cfg.batch_size, cfg.accum_steps = plan.batch_size, plan.accum_steps
    elif cfg.resume != "no":
        warnings.append(f"resume: no usable checkpoint in {cfg.checkpoint_dir}; starting from step 0")
    return plan, state, [f"warning: {w}" for w in warnings]


def _restore(run: Run, state: TrainState | None) -> None:
    """Continue from the planned checkpoint: rank 0 loads it, every rank takes rank 0's copy."""
    plan, flat, optimizer = run.resume, run.model.flat, run.optimizer
    assert plan is not None
    error = None
    if run.is_root:
        assert state is not None
        missing = sorted(set(optimizer.state_buffers()) - set(state.buffers))
        if state.params.size != flat.size:
            error = CheckpointError(f"{plan.path} holds {state.params.size} parameters, the model has {flat.size}")
        elif missing and not set(plan.changed) & set(NEW_OPTIMIZER_STATE):
            error = CheckpointError(
                f"{plan.path} lacks the optimizer's state {', '.join(missing)} ({type(optimizer).__name__} keeps it): "
                "resuming would restart it at zero; a checkpoint damaged or edited by hand? (when the optimizer or "
                "its momentum changed on purpose, --resume-allow optimizer or momentum starts it at zero)")
        else:
            error = _model_state_error(plan.path, state.model_state, run.model.state)
        if error is None:
            flat.params[...] = run.ctx.xp.asarray(state.params)
            if run.model.state is not None:
                run.model.state[...] = run.ctx.xp.asarray(state.model_state)
    agree(run.ctx.comm, error, on_root=True)
    # every rank's scalars (the plan's), rank 0's whole state buffers to every rank (sharded: its chunks)
    run.dp.load_optimizer_state(plan.optimizer_state, state.buffers if state is not None else None)
    run.dp.broadcast_parameters()  # every rank continues from rank 0's parameters and running statistics
    run.dp.restore(plan.global_step, plan.skipped_steps, plan.grad_exponents)


def _model_state_error(path: str, saved: Any, state: Any) -> CheckpointError | None:
    """Why the checkpoint's model state cannot be the model's (None: it can, or neither has one)."""
    if state is None:
        return None if saved is None else CheckpointError(f"{path} holds model state (running statistics) the model "
                                                          "does not have")
    if saved is None:
        return CheckpointError(f"{path} holds no model state, and the model has {state.size} values of it (BatchNorm's "
                               "running statistics): it was written for another model")
    if saved.size != state.size:
        return CheckpointError(f"{path} holds {saved.size} values of model state (running statistics), the model has "
                               f"{state.size}")
    return None


def model_record(run: Run, step: int | None = None) -> dict[str, Any]:
    """What model ``run`` trains, as a JSON-able dict: enough to build it again (the model's name or
    factory, ``framework: torch`` for a PyTorch factory's, one sample's shape, the classes, the MLP's
    hidden widths, the dtype), and how its inputs
    were scaled (``x * input_scale + input_shift``), the data set's identity and the step."""
    cfg, data = run.cfg, run.data
    meta = {"format": FORMAT, "version": VERSION, "model": cfg.model, "in_shape": list(data.in_shape),
            **({"framework": "torch"} if getattr(run.model, "framework", "") == "torch" else {}),
            "classes": data.n_classes, "hidden": list(cfg.hidden), "dtype": cfg.dtype,
            "parameters": int(run.model.flat.size), "input_scale": float(data.train.scale),
            "input_shift": float(data.train.shift), "data": data.identity, "seed": cfg.seed}
    if cfg.model == "gpt":
        meta["arch"] = gpt_arch(cfg)
    if step is not None:
        meta["step"] = step
    return meta
