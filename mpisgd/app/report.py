"""What rank 0 prints: the banner, the progress bar, one line per epoch, the final line, memory in parts."""

from __future__ import annotations

import functools
import math
import os
import sys
from typing import TYPE_CHECKING, Any

from mpisgd.app.records import EpochRecord, TestRecord
from mpisgd.noise import why_none

if TYPE_CHECKING:  # report reads the run
    from mpisgd.app.run import Run
    from mpisgd.config import Config

MAX_WIDTH = 120  # a banner line longer than this is cut, ending in "..."


class _NoBar:
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


def progress_bar(total: int, mode: str, desc: str) -> Any:
    """A tqdm bar on stderr: with ``on`` always, with ``auto`` when it reaches a terminal: stderr is one,
    or, under mpiexec (where rank 0's stderr is a pipe the launcher forwards), the launcher's is. A log
    redirected to a file gets no bar."""
    direct = sys.stderr.isatty()
    tty = None if direct or mode == "off" else launcher_terminal()
    if mode == "off" or (mode == "auto" and not direct and tty is None):
        return _NoBar()
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, mininterval=0.5,
                dynamic_ncols=direct, ncols=None if direct else _columns(tty))


LAUNCHERS = ("mpiexec", "mpirun", "orterun", "prterun", "prte")  # process names (Linux's comm) of MPI launchers


@functools.cache
def launcher_terminal() -> str | None:
    """The terminal (e.g. /dev/pts/3) that the MPI launcher which started this process writes its stderr
    to; None when there is none: no launcher among the nearest ancestors (or no /proc to ask), or the
    launcher's stderr is a file or a pipe (a redirected log, a test harness)."""
    pid = os.getppid()
    for _ in range(4):  # rank <- hydra_pmi_proxy <- mpiexec (hydra); rank <- mpirun (Open MPI)
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            if name.startswith(LAUNCHERS):
                target = os.readlink(f"/proc/{pid}/fd/2")
                return target if target.startswith(("/dev/pts/", "/dev/tty")) else None
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if pid <= 1:
            return None
    return None


def _columns(tty: str | None) -> int:
    """The width of terminal ``tty`` (100 where it cannot be read)."""
    if tty:
        try:
            fd = os.open(tty, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
            try:
                return os.get_terminal_size(fd).columns
            finally:
                os.close(fd)
        except OSError:
            pass
    return 100


def fit(line: str) -> str:
    return line if len(line) <= MAX_WIDTH else line[:MAX_WIDTH - 3] + "..."


def wrap(line: str) -> list[str]:
    """A line too long for MAX_WIDTH, broken at spaces into lines that are not, the later ones indented
    (for what must be read whole: the all-reduce's plan and where it came from)."""
    out, current = [], ""
    for word in line.split(" "):
        if current and len(current) + 1 + len(word) > MAX_WIDTH:
            out.append(current)
            current = "  " + word
        else:
            current = f"{current} {word}" if current else word
    return [*out, current]


def reproducible_scope(level: str, env: dict[str, Any]) -> str:
    """Across what the bits hold at this level, and what they depend on (docs/reproducible.md)."""
    if level == "portable":
        return ("portable level: on any BLAS, CPU, thread count, NumPy version or GPU (exact GEMMs, fixed-order "
                "sums, exp and log from IEEE operations)")
    return (f"pinned level: on any x86-64 CPU with AVX2 and FMA with the same NumPy and BLAS builds "
            f"({env.get('array')}, {env.get('blas')}, NumPy's {env.get('numpy_simd')} loops, "
            f"{env.get('blas_threads', '-')} thread(s))")


def rank_map(places: list[tuple[str, int, int | None]]) -> str:
    """'host-a: ranks 0-3 | host-b: ranks 4-7' (GPU ids when there are any), one group per host."""
    hosts: dict[str, list[tuple[int, int | None]]] = {}
    for r, (host, _, gpu) in enumerate(places):
        hosts.setdefault(host, []).append((r, gpu))
    groups = []
    for host, ranks in hosts.items():
        ids = [r for r, _ in ranks]
        span = f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1 else \
            ",".join(map(str, ids))
        gpus = [g for _, g in ranks if g is not None]
        groups.append(f"{host}: rank{'s' if len(ids) > 1 else ''} {span}" + (f" on gpu {','.join(map(str, gpus))}"
                                                                             if gpus else ""))
    return " | ".join(groups)


def token_unit(run: Run) -> str:
    """What a language model's token is, for the epoch line: 'char' (a text file's) or 'token'."""
    vocab = run.data.identity.get("vocab")
    return "char" if isinstance(vocab, dict) and vocab.get("chars") else "token"


def format_epoch(r: EpochRecord, epochs: int, unit: str = "token") -> str:
    """One epoch: loss, held-out accuracy (validation and/or test), speed, the share of the step spent
    waiting for communication, the gradient noise scale (the batch beyond which a larger one stops paying,
    mpisgd.noise). A language model's (a record with ``tokens_per_s``): losses per token, also in bits per
    ``unit``, token accuracy and tokens per second."""
    noise = f"  noise scale {_samples(r.noise_scale)}" if r.noise_scale is not None else ""
    tail = f"waiting for comm {100 * r.comm_frac:4.1f}%  lr {r.lr:.4g}  {r.epoch_time_s:.1f}s{noise}"
    test = f"test_acc {r.test_acc:.4f}  " if r.test_acc is not None else ""
    if r.tokens_per_s is not None:
        val = (f"val_loss {r.val_loss:.4f} ({r.val_bits_per_token:.3f} bits/{unit})  val_acc {r.val_acc:.4f}  "
               if r.val_acc is not None and r.val_loss is not None and r.val_bits_per_token is not None else "")
        bits = f" ({r.train_bits_per_token:.3f} bits/{unit})" if r.train_bits_per_token is not None else ""
        return (f"epoch {r.epoch:>3}/{epochs}  loss {r.train_loss:.4f}{bits}  {val}{test}"
                f"tokens/s {r.tokens_per_s:>7.0f}  {tail}")
    held = (f"val_loss {r.val_loss:.4f}  val_acc {r.val_acc:.4f}  " if r.val_acc is not None and r.val_loss is not None
            else "") + test
    return f"epoch {r.epoch:>3}/{epochs}  loss {r.train_loss:.4f}  {held}samples/s {r.samples_per_s:>8.0f}  {tail}"


def _samples(n: float) -> str:
    return "inf" if not math.isfinite(n) else f"{n:.0f}" if abs(n) < 1e5 else f"{n:.2g}"


def memory_line(peak: float, start: float, state: float) -> str:
    """Peak RSS in parts that add up: start-up (interpreter, NumPy, MPI; no data yet), what training
    holds (parameters, gradients, optimizer state, activations, data), and the rest (temporaries,
    the allocator's slack, pages of peers' shared gradients this rank read)."""
    other = max(0.0, peak - start - state)
    return (f"memory: peak {peak:.0f} MiB per rank (largest rank) = {start:.0f} at start-up + {state:.0f} "
            f"training state + {other:.0f} other")


def describe_model(model: Any) -> str:
    """The modules that hold parameters, each with its first parameter's shape."""
    parts = [f"{getattr(m, 'kind', type(m).__name__)} {'x'.join(map(str, m.param_shapes[0][1]))}"
             for m in model.modules() if m.param_shapes]
    return ", ".join(parts)


def describe_optimizer(cfg: Config) -> str:
    """The update rule's settings, as given (those it reads)."""
    if cfg.optimizer in ("adamw", "lamb"):
        parts = ["AdamW" if cfg.optimizer == "adamw" else "LAMB",
                 f"betas {cfg.beta1:g}, {cfg.beta2:g}, eps {cfg.eps:g}"]
        if cfg.weight_decay:
            parts.append(f"weight decay {cfg.weight_decay:g}" + (" (decoupled)" if cfg.optimizer == "adamw" else ""))
    else:
        name = f"LARS, trust coefficient {cfg.trust_coef:g}" if cfg.optimizer == "lars" else "SGD"
        parts = [name] + ([f"momentum {cfg.momentum:g}" + (" (Nesterov)" if cfg.nesterov else "")] if cfg.momentum
                           else []) + ([f"weight decay {cfg.weight_decay:g}"] if cfg.weight_decay else [])
    if cfg.clip_grad_norm:
        parts.append(f"gradient clipped to norm {cfg.clip_grad_norm:g}")
    return ", ".join(parts)


def banner(run: Run) -> list[str]:
    """The run in one short line per concern (rank 0)."""
    from mpi4py import MPI  # noqa: PLC0415

    cfg, ctx, s, flat, dp, places = run.cfg, run.ctx, run.schedule, run.model.flat, run.dp, run.places
    library = " ".join(MPI.Get_library_version().splitlines()[0].replace("\x00", "").replace("Version:", "").split())
    device = "cpu, NumPy" if not ctx.backend.is_gpu else ctx.backend.describe()
    if ctx.backend_note:
        device += f" ({ctx.backend_note})"
    if not ctx.backend.is_gpu:
        device += f" | BLAS threads per rank: {run.threads} ({run.threads_from})"
    scaled = f"{cfg.lr_scaling} scaling -> {s.peak_lr:.4g}" if s.peak_lr != cfg.lr else f"{cfg.lr_scaling} scaling"
    train, test = run.data.train, run.data.test
    samples = f"windows of {run.data.in_shape[0]} tokens, a vocabulary of {run.data.n_classes} {token_unit(run)}s" \
        if run.data.tokens else f"samples {'x'.join(map(str, run.data.in_shape))} {train.images.dtype}, " \
                                f"{run.data.n_classes} classes"
    lines = [
        f"mpisgd | {library} | k={run.k} rank(s) on {ctx.n_nodes} node(s) | {rank_map(places)}",
        f"device: {device}",
        f"model: {cfg.model} | {flat.size:,} parameters, {flat.nbytes / 2**20:.2f} MiB {flat.dtype} | "
        f"{describe_model(run.model)}",
        f"data: {run.data.source} | {len(train):,} train, " + (f"{len(run.data.val):,} validation (--val-split "
                                                                f"{cfg.val_split:g}), " if run.data.val else "") +
        f"{len(test):,} test | {samples}",
        f"batch: b={cfg.batch_size} per rank x k={run.k} x m={cfg.accum_steps} accumulated = B={run.B} | "
        f"{run.batches.steps_per_epoch} steps/epoch, {run.total_steps} steps",
        f"lr: {cfg.lr:g} for B0={cfg.base_batch}, {scaled} | warmup {s.warmup_steps} steps | {cfg.decay} decay",
        f"optimizer: {describe_optimizer(cfg)} | " + (
            f"step sharded ({run.shard_why}): each rank updates 1/{run.k}, then all-gather"
            if dp.sharded else f"step replicated ({run.shard_why})"),
    ]
    lines = [line if line.startswith("data:") else fit(line) for line in lines]  # a path is shown whole
    lines += wrap(f"all-reduce: {dp.describe()}")  # its plan and where that came from, whole
    if cfg.reproducible:
        env = run.environment
        lines += wrap(f"reproducible: the same bits for any k dividing B/b = {run.B // cfg.batch_size} | "
                      + reproducible_scope(cfg.reproducible_level, env)
                      + (f"; {env['torch']}, deterministic algorithms" if "torch" in env else ""))
    why = why_none(run.k, cfg.accum_steps, cfg.noise_scale_every)
    if why:
        lines.append(fit(f"noise scale: {why}"))
    cuda_why = getattr(dp.reducer, "why", "")  # GPU buffers: why MPI gets device pointers, or host copies
    if cuda_why:
        lines.append(fit(f"cuda-aware MPI: {cuda_why}"))
    plan = run.resume
    if plan is not None:  # not cut: a path is shown whole
        lines.append(f"resumed from {plan.path} at step {plan.global_step} (epoch {plan.epoch + 1}, step "
                     f"{plan.step_in_epoch} of {run.batches.steps_per_epoch})")
        if plan.world_size != run.k or plan.derived:
            lines.append(fit(f"resume: written by k={plan.world_size} ranks, now k={run.k} with the same B={run.B}"
                             + (f"; {plan.derived}" if plan.derived else "")))
        for change in plan.changes:
            lines.append(fit(f"resume: changed {change} on purpose (--resume-allow): the trajectory differs from "
                             "the original run's"))
    if dp.sharded and not dp.reducer.native_reduce_scatter:
        lines.append(fit(f"warning: --allreduce {cfg.allreduce} has no reduce-scatter, so the sharded step runs a "
                         "full all-reduce, then the all-gather"))
    gpus = [(h, g) for h, _, g in places if g is not None]
    if len(set(gpus)) < len(gpus):
        lines.append("warning: several ranks share a GPU; expect them to contend for it")
    per_host: dict[str, int] = {}
    for host, _, _ in places:
        per_host[host] = per_host.get(host, 0) + 1
    cores = os.cpu_count() or 1  # the node's cores (a bound rank's affinity shows only its own)
    worst = max(per_host.values(), default=1)
    if not ctx.backend.is_gpu and worst * run.threads > cores:
        lines.append(fit(f"warning: {worst} rank(s) x {run.threads} thread(s) on a node with {cores} core(s): "
                         "oversubscribed, expect slow steps"))
    return lines


def bandwidth(gbps: float) -> str:
    """GB/s with two decimals; below 1 GB/s in MB/s, three figures (a tiny model's read 0.00 GB/s)."""
    return f"{gbps:.2f} GB/s" if gbps >= 1 else f"{gbps * 1e3:.3g} MB/s"


def buckets_line(last: EpochRecord, overlap: bool) -> str:
    """The gradient buckets' achieved bandwidth (over the time with a bucket in flight, from a start to the
    observed completion, buckets that overlap counted once) and the time the step waited for them after
    backward. The wait also holds starting the buckets that had not started and the stall watchdog's
    bookkeeping, so it can exceed the time in flight: then, and without overlap, the two are not given as a
    part of a whole."""
    head = f"gradient buckets: busbw {bandwidth(last.bucket_busbw_gbps)} (start to completion"
    waited, total = last.comm_exposed_ms, last.comm_total_ms
    if not overlap:
        return f"{head}), {waited:.2f} ms/step waited for after backward (--no-overlap: nothing hidden)"
    if waited <= total:
        return f"{head}, overlapped with backward), {waited:.2f} of {total:.2f} ms/step not hidden by backward"
    return (f"{head}, overlapped with backward), {total:.2f} ms/step in flight, {waited:.2f} ms/step waited for "
            "after backward (the wait includes its bookkeeping)")


def final_lines(run: Run, history: list[EpochRecord], steps: int, wall_s: float,
                test: TestRecord | None = None) -> list[str]:
    """The closing lines (rank 0): the bucket bandwidth achieved, accuracy (the last epoch's, or ``test``:
    the test set scored once after training), time, memory in parts."""
    last = history[-1] if history else None
    lines = []
    if run.k > 1 and last is not None and last.bucket_busbw_gbps:
        lines.append(buckets_line(last, run.dp.overlap))
    if last is not None and last.val_acc is not None and last.val_loss is not None:
        lines.append(f"validation accuracy {last.val_acc:.4f} (loss {last.val_loss:.4f}) at the last epoch; "
                     "the test set scored once, after training:")
    acc = f"{test.test_acc:.4f}" if test else f"{last.test_acc:.4f}" if last is not None and \
        last.test_acc is not None else "n/a (no epoch finished)"
    if test is not None and test.test_bits_per_token is not None:  # a language model: its test loss says more
        unit = token_unit(run)
        lines.append(f"final test loss {test.test_loss:.4f} nats/{unit} = {test.test_bits_per_token:.3f} "
                     f"bits/{unit}, token accuracy {acc} after {steps} steps | wall time {wall_s:.1f} s")
    else:
        lines.append(f"final test accuracy {acc} after {steps} steps | wall time {wall_s:.1f} s")
    if last is not None and not run.ctx.backend.is_gpu:  # on a GPU the training state is device memory, not RSS
        lines.append(memory_line(last.peak_rss_mib, last.rss_start_mib, last.state_mib))
    return lines
