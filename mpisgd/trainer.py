"""The training run behind the CLI: set-up, the epoch loop, evaluation, checkpoints, metrics records.

What rank 0 prints is formatted in mpisgd.report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from mpisgd import report
from mpisgd.backend import set_threads, to_numpy
from mpisgd.checkpoint import CheckpointError, TrainState, check_compatible, find_resume, save_checkpoint
from mpisgd.comm import create_reducer
from mpisgd.config import Config, UsageError
from mpisgd.context import Context, agree, blas_threads, init
from mpisgd.data import BatchLoader, Dataset, GlobalBatches, epoch_permutation, load_fashion_mnist, synthetic
from mpisgd.lars import LARS
from mpisgd.metrics import MetricsWriter
from mpisgd.nn import accuracy_count, build_model
from mpisgd.optim import SGD
from mpisgd.parallel import DataParallel, ReplicaError
from mpisgd.report import peak_rss_mib
from mpisgd.schedule import Schedule, effective_batch
from mpisgd.timeline import Timeline

T = TypeVar("T")


class Trainer:
    def __init__(self, cfg: Config, world: Any) -> None:
        self.t_launch = time.perf_counter()
        self.cfg, self.world = cfg, world
        self.ctx: Context = self._agreed(lambda: init(world, cfg.device))
        self.rss_start_mib = peak_rss_mib()  # the interpreter, NumPy, MPI, mpisgd and the backend: no data yet
        self.k, self.rank = self.ctx.size, self.ctx.rank
        self.is_root = self.rank == 0
        self._agreed(self._verify_config)
        self._agreed(self._verify_device_options)
        self.threads, self.threads_from = blas_threads(cfg.threads, self.ctx.local_size)
        if self.ctx.backend.device == "cpu":
            set_threads(self.threads)
        self.fail_at = _injected_failure()
        self.train_set, self.test_set, self.data_source = self._agreed(self._load_data)
        xp = self.ctx.xp
        self.model = build_model(cfg.model, cfg.hidden).materialize(xp, cfg.dtype, cfg.seed)
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
                               shared_grads=cfg.shared_grads)
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
        self.history: list[dict[str, Any]] = []
        self._resume()

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

    def _verify_config(self) -> None:
        """Every rank must run the same options; name the options and ranks that differ."""
        digests = self.world.allgather(self.cfg.digest())
        if len(set(digests)) == 1:
            return
        configs = self.world.allgather(self.cfg.to_dict())
        diffs = []
        for key in configs[0]:
            values = [c.get(key) for c in configs]
            if any(v != values[0] for v in values):
                odd = [r for r, v in enumerate(values) if v != values[0]]
                diffs.append(f"--{key.replace('_', '-')} is {values[0]!r} on rank 0 but "
                             + ", ".join(f"{values[r]!r} on rank {r}" for r in odd))
        raise UsageError("ranks were started with different options: " + "; ".join(diffs))

    def _verify_device_options(self) -> None:
        if self.cfg.shard_optimizer and self.ctx.backend.is_gpu:
            raise UsageError("--shard-optimizer runs on the CPU only (its all-gather takes host buffers); "
                             "drop it or pass --device cpu")

    def _load_data(self) -> tuple[Dataset, Dataset, str]:
        cfg = self.cfg
        if cfg.dataset == "synthetic":
            train, test, source = synthetic(cfg.synthetic_samples, cfg.seed), synthetic(2000, cfg.seed, split=1), \
                "synthetic"
        else:
            train, test, directory = load_fashion_mnist(cfg.data_dir)
            source = f"Fashion-MNIST from {directory}"
        # copies, so that the whole set is freed rather than kept alive behind a view
        if cfg.limit_train:
            train = Dataset(train.images[:cfg.limit_train].copy(), train.labels[:cfg.limit_train].copy())
        if cfg.limit_test:
            test = Dataset(test.images[:cfg.limit_test].copy(), test.labels[:cfg.limit_test].copy())
        return train, test, source

    def log(self, msg: str) -> None:
        if self.is_root:
            print(msg, flush=True)

    # -- checkpoints ----------------------------------------------------------------------
    def _resume(self) -> None:
        """Rank 0 picks the checkpoint (falling back past corrupt ones) and broadcasts it."""
        cfg = self.cfg
        if cfg.resume == "no":
            return
        state, path, warnings, error = None, "", [], None
        if self.is_root:
            try:
                state, path, warnings = find_resume(cfg.resume, cfg.checkpoint_dir)
                if state is not None:
                    check_compatible(state, cfg.to_dict(), self.B)
                    if state.params.size != self.model.flat.size:
                        raise CheckpointError(f"{path} holds {state.params.size} parameters, "
                                              f"the model has {self.model.flat.size}")
            except CheckpointError as exc:
                error = exc
        agree(self.world, error)
        for w in warnings:
            self.log(f"warning: {w}")
        header = self.world.bcast(None if state is None else (
            path, state.global_step, state.epoch, state.step_in_epoch, state.skipped_steps, state.prev_lr,
            state.world_size), root=0)
        if header is None:
            self.log(f"resume: no usable checkpoint in {cfg.checkpoint_dir}; starting from step 0")
            return
        path, self.global_step, self.start_epoch, self.start_step, skipped, prev_lr, old_k = header
        if self.is_root:
            assert state is not None
            self.model.flat.params[...] = self.ctx.xp.asarray(state.params)
            if self.optimizer.velocity is not None and state.velocity is not None:
                self.optimizer.velocity[...] = self.ctx.xp.asarray(state.velocity)
        self.dp.broadcast_parameters()  # every rank continues from rank 0's copy
        self.optimizer.prev_lr = None if prev_lr < 0 else prev_lr
        self.dp.step_count, self.dp.skipped_steps = self.global_step, skipped
        self.log(f"resumed from {path} at step {self.global_step} (epoch {self.start_epoch + 1}, "
                 f"step {self.start_step} of {self.batches.steps_per_epoch})"
                 + (f"; written by k={old_k} ranks, now k={self.k} with the same B={self.B}" if old_k != self.k
                    else ""))

    def _maybe_checkpoint(self, epoch: int, step: int, end_of_epoch: bool) -> None:
        cfg = self.cfg
        if not cfg.checkpoint_dir:
            return
        due = self.global_step % cfg.checkpoint_every == 0 if cfg.checkpoint_every else end_of_epoch
        if not due:
            return
        spe = self.batches.steps_per_epoch
        next_epoch, next_step = (epoch + 1, 0) if step + 1 >= spe else (epoch, step + 1)
        self.dp.gather_optimizer_state()  # collective (sharded step): due on every rank at the same step
        if self.is_root:  # only rank 0 writes; no collective, so nothing waits on it
            v = self.optimizer.velocity
            save_checkpoint(cfg.checkpoint_dir, TrainState(
                params=to_numpy(self.model.flat.params), velocity=None if v is None else to_numpy(v),
                prev_lr=-1.0 if self.optimizer.prev_lr is None else self.optimizer.prev_lr,
                global_step=self.global_step, epoch=next_epoch, step_in_epoch=next_step,
                skipped_steps=self.dp.skipped_steps, world_size=self.k, effective_batch=self.B,
                config=cfg.to_dict()), keep=cfg.checkpoint_keep)

    # -- training -----------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        cfg, dp = self.cfg, self.dp
        places = self.world.gather((self.ctx.host, self.ctx.local_rank, self.ctx.backend.gpu_id), root=0)
        for line in report.banner(self, places or []):
            self.log(line)
        spe = self.batches.steps_per_epoch
        n_epochs = -(-self.total_steps // spe)
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
                self._maybe_fail()
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
                self._maybe_checkpoint(epoch, step, end_of_epoch=step + 1 == spe)
                bar.update()
            bar.close()
            train_time = time.perf_counter() - t0
            self._end_epoch(epoch, steps, loss_sum, train_time)
        self._finish()
        return self.history

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
        self.dp.watchdog.exit()
        step_time = train_time / max(1, steps)
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
            "allreduce": self.dp.describe(),
        }
        self.history.append(record)
        self.metrics.write(record)
        self.log(report.format_epoch(record, -(-self.total_steps // self.batches.steps_per_epoch)))

    def _state_mib(self) -> float:
        """What training needs in memory, in MiB (the speed issue's bound counts these): parameters,
        gradients and optimizer state, one batch of activations, and the data this rank holds."""
        held = self.dp.buffer_nbytes() + self.model.buffer_nbytes() + self.train_loader.buffer_nbytes() + \
            self.test_loader.buffer_nbytes()
        return held / 2**20

    def _finish(self) -> None:
        cfg = self.cfg
        if cfg.save_model and self.is_root:
            from mpisgd.checkpoint import save_params  # noqa: PLC0415

            save_params(cfg.save_model, self.model)
        if cfg.timeline:
            self.timeline.save(f"{cfg.timeline}.rank{self.rank}.json")
        for line in report.final_lines(self, time.perf_counter() - self.t_launch):
            self.log(line)

    def close(self, collective: bool = True) -> None:
        """Flush and close the metrics file; with ``collective`` also shut down the data-parallel
        machinery, which every rank must do together (the watchdog waits for every rank's close)."""
        self.metrics.close()
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
