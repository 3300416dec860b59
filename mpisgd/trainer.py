"""The training run behind the CLI: set-up, the epoch loop, evaluation, checkpoints, metrics records.

What rank 0 prints is formatted in mpisgd.report.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from mpisgd import data, preflight, report
from mpisgd.backend import set_threads, to_numpy
from mpisgd.checkpoint import (
    CheckpointError,
    ResumePlan,
    RunDirectory,
    SaveError,
    TrainState,
    checkpoint_path,
    find_resume,
    model_fallbacks,
    model_structure,
    plan_resume,
    save_params,
)
from mpisgd.comm import create_reducer
from mpisgd.config import Config, UsageError
from mpisgd.context import Context, agree, blas_threads, init
from mpisgd.data import BatchLoader, Dataset, GlobalBatches, epoch_permutation, load_data, synthetic
from mpisgd.files import free_bytes
from mpisgd.lars import LARS
from mpisgd.metrics import MetricsWriter
from mpisgd.nn import accuracy_count, build_model
from mpisgd.nn.models import check_output
from mpisgd.optim import SGD
from mpisgd.parallel import DataParallel, ReplicaError
from mpisgd.report import peak_rss_mib
from mpisgd.schedule import Schedule, effective_batch
from mpisgd.signals import EXIT_PREEMPTED
from mpisgd.straggler import REPORT_SHARE, Clock, analyse
from mpisgd.straggler import describe as describe_straggler
from mpisgd.timeline import Timeline

T = TypeVar("T")


class NoSignals:
    """For a Trainer driven without the CLI's signal thread: nobody asks it to stop."""

    stop_requested = False


class Trainer:
    """One training run: every rank builds one, then ``fit()`` returns the exit status (0, or
    EXIT_PREEMPTED when a SIGTERM stopped it at a step with a checkpoint)."""

    def __init__(self, cfg: Config, world: Any, signals: Any = None) -> None:
        self.t_launch = time.perf_counter()
        self.cfg, self.world, self.signals = cfg, world, signals or NoSignals()
        self.ctx: Context = init(world, cfg.device)  # every rank ends on one kind of device, or all raise
        self.rss_start_mib = peak_rss_mib()  # the interpreter, NumPy, MPI, mpisgd and the backend: no data yet
        self.k, self.rank = self.ctx.size, self.ctx.rank
        self.is_root = self.rank == 0
        self._agreed(lambda: preflight.same_options(cfg, world))
        self._agreed(lambda: preflight.device_options(cfg, self.ctx.backend.is_gpu))
        self._agreed(lambda: preflight.outputs(cfg, self.rank))  # a path that cannot be written fails now
        self.run_dir = self._agreed(self._own_checkpoint_dir)
        self.threads, self.threads_from = blas_threads(cfg.threads, self.ctx.local_size)
        if self.ctx.backend.device == "cpu":
            set_threads(self.threads)
        self.fail_at, self.delay = _injected_failure(), _injected_delay()
        self.train_set, self.test_set, self.data_source, self.data_id = self._agreed(self._load_data)
        self.in_shape, self.n_classes = self.train_set.images.shape[1:], self.data_id["classes"]
        self._agreed(lambda: preflight.same_data(self.data_id, world))
        xp = self.ctx.xp
        self.model = self._agreed(self._build_model)  # before resuming: the checkpoint's layers must match
        self.structure = model_structure(self.model)
        self.resume, resume_warnings = self._agreed(self._plan_resume)
        if not self.ctx.backend.is_gpu:
            self._agreed(lambda: preflight.memory(self.model, cfg.dtype, data.resident_nbytes(
                self.train_set, self.test_set), self.ctx.local_size))
        self.model.materialize(xp, cfg.dtype, cfg.seed)
        self._agreed(lambda: self._check_model_output(xp))
        if cfg.optimizer == "lars":
            self.optimizer: SGD = LARS(self.model.flat, cfg.momentum, cfg.nesterov, cfg.weight_decay,
                                       cfg.momentum_correction, cfg.trust_coef)
        else:
            self.optimizer = SGD(self.model.flat, cfg.momentum, cfg.nesterov, cfg.weight_decay, cfg.momentum_correction)
        self.timeline = Timeline(enabled=bool(cfg.timeline), rank=self.rank)
        reducer = self._agreed(lambda: self._reducer(cfg))
        self.dp = DataParallel(self.model, self.optimizer, world, reducer=reducer, bucket_cap_mb=cfg.bucket_mb,
                               overlap=cfg.overlap, on_nan=cfg.on_nan, timeline=self.timeline,
                               watchdog=self._watchdog(), shard_optimizer=cfg.shard_optimizer,
                               shared_grads=cfg.shared_grads, fingerprint=False)  # fit() checks in itself
        self.B = effective_batch(cfg.batch_size, self.k, cfg.accum_steps)
        self.batches = self._agreed(lambda: GlobalBatches(len(self.train_set), self.B, self.rank, self.k,
                                                          cfg.accum_steps))
        spe = self.batches.steps_per_epoch
        self.total_steps = cfg.epochs * spe if cfg.max_steps is None else min(cfg.max_steps, cfg.epochs * spe)
        self.schedule = self._agreed(lambda: Schedule.from_config(cfg, self.k, spe, self.total_steps))
        self.train_loader = BatchLoader(self.train_set, xp, cfg.dtype)
        self.test_loader = BatchLoader(self.test_set, xp, cfg.dtype)
        self.metrics = MetricsWriter(cfg.metrics_file, enabled=self.is_root)
        self.start_epoch, self.start_step, self.global_step = 0, 0, 0
        self.saved_at = -1  # the step of the newest checkpoint this run wrote
        self.places = world.allgather((self.ctx.host, self.ctx.local_rank, self.ctx.backend.gpu_id))
        self.clock = Clock(world) if self.k > 1 and cfg.straggler_report else None  # the report's time base
        self.history: list[dict[str, Any]] = []
        for w in [*self.data_warnings, *resume_warnings]:
            self.log(f"warning: {w}")
        self._restore()

    # -- helpers ------------------------------------------------------------------------
    def _reducer(self, cfg: Config) -> Any:
        try:
            return create_reducer(cfg.allreduce, self.world, deterministic=cfg.deterministic,
                                  device=self.ctx.backend.is_gpu, cuda_aware=cfg.cuda_aware)
        except ValueError as exc:  # a strategy that cannot run here: every rank finds it alike
            raise UsageError(str(exc)) from None

    def _watchdog(self) -> Any:
        if not self.cfg.stall_timeout:
            return None
        from mpisgd.watchdog import Watchdog  # noqa: PLC0415 - starts a thread: only when asked

        return Watchdog(self.world, self.cfg.stall_timeout, self.cfg.stall_abort, abort_comm=self.world)

    def _agreed(self, fn: Callable[[], T]) -> T:
        """Run a set-up stage on every rank; if it fails anywhere, every rank fails together."""
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except (UsageError, ReplicaError) as exc:
            error = exc
        agree(self.world, error)
        return result

    def _own_checkpoint_dir(self) -> RunDirectory | None:
        """Rank 0 locks the checkpoint directory for this run, and refuses another run's checkpoints there."""
        cfg = self.cfg
        if not (cfg.checkpoint_dir and self.is_root):
            return None
        return RunDirectory(cfg.checkpoint_dir, cfg.resume, cfg.overwrite_checkpoints)

    def _load_data(self) -> tuple[Dataset, Dataset, str, dict[str, Any]]:
        cfg = self.cfg
        if cfg.dataset == "synthetic":
            train, test, name, source = synthetic(cfg.synthetic_samples, cfg.seed), \
                synthetic(2000, cfg.seed, split=1), "synthetic", "synthetic"
        else:
            train, test, name, source = load_data(cfg.data, cfg.data_dir)
        if cfg.limit_train:
            train = train.head(cfg.limit_train)
        if cfg.limit_test:
            test = test.head(cfg.limit_test)
        classes = data.validate(train, test, dtype=cfg.dtype)
        self.data_warnings = data.label_warnings(train, test, classes)
        return train, test, source, {**data.identity(name, train, test), "classes": classes}

    def _build_model(self) -> Any:
        try:
            return build_model(self.cfg.model, self.in_shape, self.n_classes, self.cfg.hidden)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    def _check_model_output(self, xp: Any) -> None:
        try:
            check_output(self.model, xp, self.in_shape, self.n_classes, self.cfg.dtype)
        except ValueError as exc:
            raise UsageError(f"--model {self.cfg.model}: {exc}") from None

    def _plan_resume(self) -> tuple[ResumePlan | None, list[str]]:
        """Rank 0 finds the checkpoint (falling back past corrupt ones), checks that this run may continue
        it and works out b and m; every rank takes the plan. The state itself is loaded in _restore."""
        cfg = self.cfg
        plan, warnings, error = None, [], None
        if self.is_root and cfg.resume != "no":
            try:
                state, path, warnings = self.run_dir.find_resume(cfg.resume) if self.run_dir is not None \
                    else find_resume(cfg.resume, cfg.checkpoint_dir)
                if state is not None:
                    plan = plan_resume(state, path, cfg.to_dict(), getattr(cfg, "given", set()),
                                       cfg.allowed_changes(), self.k, self.data_id, structure=self.structure)
                    self._state = state
            except CheckpointError as exc:
                error = exc
        agree(self.world, error)
        plan = self.world.bcast(plan, root=0)
        if plan is not None:
            cfg.batch_size, cfg.accum_steps = plan.batch_size, plan.accum_steps
        elif cfg.resume != "no":
            warnings.append(f"resume: no usable checkpoint in {cfg.checkpoint_dir}; starting from step 0")
        return plan, warnings

    def log(self, msg: str) -> None:
        if self.is_root:
            print(msg, flush=True)

    # -- checkpoints ----------------------------------------------------------------------
    def _restore(self) -> None:
        """Continue from the planned checkpoint: rank 0 loads it, every rank takes rank 0's copy."""
        plan = self.resume
        if plan is None:
            return
        error = None
        if self.is_root:
            state = self._state
            del self._state
            if state.params.size != self.model.flat.size:
                error = CheckpointError(f"{plan.path} holds {state.params.size} parameters, the model has "
                                        f"{self.model.flat.size}")
            else:
                self.model.flat.params[...] = self.ctx.xp.asarray(state.params)
                if self.optimizer.velocity is not None and state.velocity is not None:
                    self.optimizer.velocity[...] = self.ctx.xp.asarray(state.velocity)
        agree(self.world, error)
        self.dp.broadcast_parameters()  # every rank continues from rank 0's copy (sharded: whole momentum)
        self.optimizer.prev_lr = None if plan.prev_lr < 0 else plan.prev_lr
        self.global_step, self.start_epoch, self.start_step = plan.global_step, plan.epoch, plan.step_in_epoch
        self.dp.step_count, self.dp.skipped_steps = plan.global_step, plan.skipped_steps
        self.saved_at = plan.global_step

    def _save(self, epoch: int, step_in_epoch: int) -> Path | None:
        """Checkpoint of the state before step ``step_in_epoch`` of ``epoch`` (collective: the sharded step
        gathers its momentum first). A write that fails (a full disk) warns and training goes on; the
        checkpoints already written stay as they were."""
        cfg = self.cfg
        spe = self.batches.steps_per_epoch
        if step_in_epoch >= spe:
            epoch, step_in_epoch = epoch + 1, 0
        self.dp.gather_optimizer_state()
        self.saved_at = self.global_step
        if not self.is_root:  # only rank 0 writes; no collective, so nothing waits on it
            return None
        v = self.optimizer.velocity
        state = TrainState(
            params=to_numpy(self.model.flat.params), velocity=None if v is None else to_numpy(v),
            prev_lr=-1.0 if self.optimizer.prev_lr is None else self.optimizer.prev_lr,
            global_step=self.global_step, epoch=epoch, step_in_epoch=step_in_epoch,
            skipped_steps=self.dp.skipped_steps, world_size=self.k, effective_batch=self.B,
            config=cfg.to_dict(), data=self.data_id, structure=self.structure)
        try:
            return self.run_dir.save(state, keep=cfg.checkpoint_keep)  # type: ignore[union-attr]
        except OSError as exc:
            free = free_bytes(cfg.checkpoint_dir)  # type: ignore[arg-type]
            self.log(f"warning: checkpoint of step {self.global_step} not written ({exc}; {free / 2**20:.0f} MiB "
                     f"free in {cfg.checkpoint_dir}); the earlier checkpoints are kept and training goes on")
            return None

    # -- training -----------------------------------------------------------------------
    def fit(self) -> int:
        """Train; returns 0, or EXIT_PREEMPTED when a SIGTERM stopped every rank at a step (checkpointed)."""
        cfg, dp = self.cfg, self.dp
        for line in report.banner(self, self.places):
            self.log(line)
        if self.global_step >= self.total_steps:
            self.log(f"resume: the run is finished (step {self.global_step} of {self.total_steps}); nothing to train")
            status, where = self._save_model()
            if where:
                print(where, file=sys.stderr if status else sys.stdout, flush=True)
            return status
        spe = self.batches.steps_per_epoch
        n_epochs = -(-self.total_steps // spe)
        stopped = None
        for epoch in range(self.start_epoch, n_epochs):
            perm = epoch_permutation(len(self.train_set), cfg.seed, epoch)
            bar = report.progress_bar(spe, cfg.progress if self.is_root else "off", f"epoch {epoch + 1}")
            dp.times = type(dp.times)()
            loss_sum = self.ctx.xp.zeros((), dtype=cfg.dtype)
            steps = 0
            t0 = time.perf_counter()
            for step in range(self.start_step if epoch == self.start_epoch else 0, spe):
                if self.global_step >= self.total_steps:
                    break
                if dp.check_in_step(stop=self.signals.stop_requested):  # every rank learns of a SIGTERM here
                    stopped = (epoch, step)
                    break
                self._maybe_fail()
                if self.delay and self.delay[0] == self.rank:
                    time.sleep(self.delay[1])  # the straggler experiment's slow rank (benchmarks/straggler.py)
                lr = self.schedule(self.global_step)
                micro = [self.train_loader.batch(self.batches.indices(perm, step, i), slot=i)
                         for i in range(cfg.accum_steps)]
                skipped = dp.skipped_steps
                loss = dp.train_step(micro, lr)
                if dp.skipped_steps > skipped and (dp.skipped_steps <= 10 or dp.skipped_steps % 100 == 0):
                    self.log(f"warning: non-finite gradient at step {self.global_step}: step skipped "
                             f"(--on-nan skip; {dp.skipped_steps} skipped so far)")
                loss_sum += loss
                steps += 1
                self.global_step += 1
                if cfg.metrics_file:
                    self.metrics.write({"kind": "step", "step": self.global_step, "epoch": epoch + 1,
                                        "lr": lr, "loss": float(loss)})
                if cfg.check_replicas and self.global_step % cfg.check_replicas == 0:
                    dp.watchdog.enter(f"replica check at step {self.global_step}")
                    dp.check_replicas()
                    dp.watchdog.exit()
                due = self.global_step % cfg.checkpoint_every == 0 if cfg.checkpoint_every else step + 1 == spe
                if cfg.checkpoint_dir and due:
                    self._save(epoch, step + 1)
                bar.update()
            bar.close()
            if stopped is not None:
                return self._stop(*stopped)
            self._end_epoch(epoch, steps, loss_sum, time.perf_counter() - t0)
        if cfg.checkpoint_dir and self.saved_at != self.global_step:  # the last step, whatever --checkpoint-every
            self._save(n_epochs - 1, spe)
        return self._finish()

    def _stop(self, epoch: int, step: int) -> int:
        """Every rank stops before ``step`` of ``epoch`` (a SIGTERM reached one of them): checkpoint it."""
        path = self._save(epoch, step) if self.cfg.checkpoint_dir else None
        where = f"before step {self.global_step} (epoch {epoch + 1}, step {step} of {self.batches.steps_per_epoch})"
        if self.is_root:
            saved = f"checkpoint {path} written; continue with --resume auto" if path else \
                "no checkpoint (no --checkpoint-dir, or it could not be written): this run's work is lost"
            print(f"mpisgd: stopped by SIGTERM {where}: {saved} (exit {EXIT_PREEMPTED})", file=sys.stderr,
                  flush=True)
        return EXIT_PREEMPTED

    def _maybe_fail(self) -> None:
        if self.fail_at == (self.global_step, self.rank):
            raise RuntimeError(f"injected failure at step {self.global_step} ($MPISGD_FAIL_AT_STEP)")

    def evaluate(self) -> float:
        """Test accuracy: each rank scores a disjoint part of the test set, counts are summed."""
        n = len(self.test_set)
        mine = np.array_split(np.arange(n), self.k)[self.rank]
        correct = 0
        b = self.batches.local_batch  # the training shape: the model's activation buffers are reused, not doubled
        for start in range(0, len(mine), b):
            x, y = self.test_loader.batch(mine[start:start + b])
            correct += accuracy_count(self.model.forward(x), y)
        return self.world.allreduce(correct) / n

    def _end_epoch(self, epoch: int, steps: int, loss_sum: Any, train_time: float) -> None:
        t = self.dp.times
        local = np.array([float(loss_sum), steps, t.comm_exposed, t.comm_total, t.forward, t.backward,
                          t.optimizer, t.bytes_reduced])
        total = np.zeros_like(local)
        from mpi4py import MPI  # noqa: PLC0415

        self.dp.watchdog.enter(f"end of epoch {epoch + 1}: metrics and evaluation")
        self.world.Allreduce(local, total, op=MPI.SUM)
        mean = total / self.k
        test_acc = self.evaluate()
        # the largest rank's peak, its RSS at start-up and what it holds for training (see _state_mib)
        mem = np.array([peak_rss_mib(), self.rss_start_mib, self._state_mib()])
        self.world.Allreduce(MPI.IN_PLACE, mem, op=MPI.MAX)
        peak_mib, start_mib, state_mib = (float(v) for v in mem)
        step_time = train_time / max(1, steps)
        straggler = self._straggler(1e3 * step_time)
        self.dp.watchdog.exit()
        # achieved bandwidth of the real gradient buckets, in nccl-tests terms (start to observed completion)
        algbw = mean[7] / mean[3] / 1e9 if mean[3] > 0 else 0.0
        record = {
            "kind": "epoch", "epoch": epoch + 1, "step": self.global_step,
            "lr": self.schedule(max(0, self.global_step - 1)),
            "train_loss": mean[0] / max(1, steps), "test_acc": test_acc,
            "samples_per_s": steps * self.B / train_time if train_time > 0 else 0.0,
            "comm_frac": mean[2] / max(1e-12, train_time),
            "comm_exposed_ms": 1e3 * mean[2] / max(1, steps), "comm_total_ms": 1e3 * mean[3] / max(1, steps),
            "forward_ms": 1e3 * mean[4] / max(1, steps), "backward_ms": 1e3 * mean[5] / max(1, steps),
            "optimizer_ms": 1e3 * mean[6] / max(1, steps), "step_ms": 1e3 * step_time,
            "epoch_time_s": train_time, "skipped_steps": self.dp.skipped_steps,
            "world_size": self.k, "effective_batch": self.B,
            "bucket_algbw_gbps": algbw, "bucket_busbw_gbps": algbw * 2 * (self.k - 1) / self.k,
            "peak_rss_mib": peak_mib, "rss_start_mib": start_mib, "state_mib": state_mib,
            "allreduce": self.dp.describe(), **straggler,
        }
        self.history.append(record)
        self.metrics.write(record)
        self.log(report.format_epoch(record, -(-self.total_steps // self.batches.steps_per_epoch)))
        if straggler and straggler["slowest_share"] >= REPORT_SHARE:
            self.log(describe_straggler(straggler, self.places))

    def _straggler(self, step_ms: float) -> dict[str, Any]:
        """Rank 0's straggler report for this epoch (collective; {} at k = 1 or on other ranks)."""
        if self.clock is None:
            return {}
        self.clock.sync()
        t = self.dp.times
        mine = self.clock.common(np.stack([t.arrived_check_in, t.arrived_gradients], axis=1))
        every = self.world.gather(mine, root=0)
        return analyse(np.stack(every), step_ms) if self.is_root and every[0].size else {}

    def _state_mib(self) -> float:
        """What training needs in memory, in MiB (the speed issue's bound counts these): parameters,
        gradients and optimizer state, one batch of activations, and the data this rank holds."""
        held = self.dp.buffer_nbytes() + self.model.buffer_nbytes() + self.train_loader.buffer_nbytes() + \
            self.test_loader.buffer_nbytes()
        return held / 2**20

    def _finish(self) -> int:
        """Save the model and the timeline, print the closing lines; 1 if the model could be written nowhere."""
        cfg = self.cfg
        status, where = self._save_model()
        if cfg.timeline:
            path = f"{cfg.timeline}.rank{self.rank}.json"
            try:
                self.timeline.save(path)
            except OSError as exc:  # every rank writes its own: say which one failed, and go on
                print(f"warning: rank {self.rank}: --timeline {path} not written ({exc.strerror or exc})", flush=True)
        for line in report.final_lines(self, time.perf_counter() - self.t_launch):
            self.log(line)
        if where:  # the last line: where the model is, when not where asked
            print(where, file=sys.stderr if status else sys.stdout, flush=True)
        return status

    def _save_model(self) -> tuple[int, str]:
        """Rank 0 writes --save-model, or where that fails beside the checkpoints or in the temporary
        directory: (0, "") as asked; (0, a warning saying where) elsewhere; (1, an error line) nowhere."""
        if not (self.cfg.save_model and self.is_root):
            return 0, ""
        try:
            where = save_params(self.cfg.save_model, self.model, model_fallbacks(self.cfg.checkpoint_dir))
        except SaveError as exc:
            ckpt = checkpoint_path(self.cfg.checkpoint_dir, self.global_step) if self.cfg.checkpoint_dir else None
            kept = f"; the checkpoint {ckpt} holds the same parameters" if ckpt and ckpt.is_file() else ""
            return 1, f"mpisgd: error: {exc}{kept}"
        if where == self.cfg.save_model:
            return 0, ""
        return 0, f"warning: --save-model {self.cfg.save_model} could not be written; the final model is in {where}"

    def close(self, collective: bool = True) -> None:
        """Flush and close the metrics file; with ``collective`` also shut down the data-parallel
        machinery, which every rank must do together (the watchdog waits for every rank's close)."""
        self.metrics.close()
        if self.clock is not None and collective:
            self.clock.close()
        if self.run_dir is not None:
            self.run_dir.close()
        if collective:
            self.dp.close()


def _injected_failure() -> tuple[int, int] | None:
    """(step, rank) from $MPISGD_FAIL_AT_STEP ("STEP" or "STEP:RANK", rank 0 by default): the failure tests
    raise an error there, on that rank only, to check that the whole job ends."""
    text = os.environ.get("MPISGD_FAIL_AT_STEP", "")
    if not text:
        return None
    step, _, rank = text.partition(":")
    return int(step), int(rank or 0)



def _injected_delay() -> tuple[int, float] | None:
    """(rank, seconds) from $MPISGD_DELAY_RANK ("RANK:MS"): that rank sleeps before each step's compute,
    the straggler experiment's slow worker (benchmarks/straggler.py). Not a user option."""
    text = os.environ.get("MPISGD_DELAY_RANK", "")
    if not text:
        return None
    rank, _, ms = text.partition(":")
    return int(rank), float(ms) / 1e3
