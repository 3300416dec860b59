"""The training loop behind the CLI: epochs of steps, evaluation, checkpoints, metrics records.

Set-up is mpisgd.app.run's (``build_run``); what rank 0 prints is mpisgd.app.report's. :class:`Trainer`
drives the run's objects through their methods and keeps only the loop's own state: where it is,
what it wrote, what each epoch measured.
"""

from __future__ import annotations

import math
import sys
import time
import typing
from dataclasses import fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import mpisgd
from mpisgd.app import report
from mpisgd.app.inject import NoHooks
from mpisgd.app.metrics import MetricsWriter
from mpisgd.app.records import SCHEMA, EpochRecord, Record, RunRecord, StepRecord, TestRecord
from mpisgd.app.run import SHARD_MIN_BYTES, Run, model_record
from mpisgd.app.signals import EXIT_PREEMPTED, EXIT_TERMINATED, Stop
from mpisgd.app.straggler import REPORT_SHARE, Clock, analyse
from mpisgd.app.straggler import describe as describe_straggler
from mpisgd.app.tensorboard import open_writer
from mpisgd.backend import peak_rss_mib, to_numpy
from mpisgd.checkpoint import SaveError, TrainState, checkpoint_path, list_checkpoints, step_of
from mpisgd.data import epoch_permutation
from mpisgd.files import free_bytes
from mpisgd.model_file import model_fallbacks, save_params
from mpisgd.nn import scoring
from mpisgd.nn.scoring import Tally
from mpisgd.noise import estimate
from mpisgd.parallel.data_parallel import StepStats


def mean_over_ranks(comm: Any, stats: StepStats, extra: dict[str, float]) -> tuple[StepStats, dict[str, float]]:
    """The ranks' mean of every number in ``stats`` (a StepStats: its int and float fields, by name) and in
    ``extra`` (collective: one Allreduce of a vector whose order is the fields' own, the same on every
    rank). Lists (the per-step arrival times) are left as this rank's."""
    hints = typing.get_type_hints(type(stats))
    names = [f.name for f in fields(stats) if hints[f.name] in (int, float)]  # by declaration: NumPy values too
    keys = sorted(extra)
    local = np.array([float(getattr(stats, n)) for n in names] + [float(extra[k]) for k in keys])
    total = np.empty_like(local)
    comm.Allreduce(local, total, op=MPI.SUM)
    mean = total / comm.Get_size()
    typed: dict[str, Any] = {n: (round(float(v)) if hints[n] is int else float(v)) for n, v in zip(names, mean)}
    return replace(stats, **typed), {k: float(v) for k, v in zip(keys, mean[len(names):])}


STRAGGLER_FIELDS = ("wait_caused_ms", "lag_ms", "rank_step_ms", "slowest_rank", "slowest_wait_ms", "slowest_share")


def _straggler_fields(report: dict[str, Any]) -> dict[str, Any]:
    """mpisgd.app.straggler.analyse's report as EpochRecord fields (lists as tuples; {} at k = 1)."""
    return {k: tuple(report[k]) if isinstance(report[k], list) else report[k] for k in STRAGGLER_FIELDS
            if k in report}


def run_record(run: Run) -> RunRecord:
    """What ``run`` is, for the metrics file's first line of this run (docs/metrics.md): the batch, the
    buckets and overlap, the update's sharding, the optimizer and its rate."""
    cfg, dp, flat = run.cfg, run.dp, run.model.flat
    assert flat is not None  # materialized at set-up
    per_node: dict[str, int] = {}
    for host, _, _ in run.places:
        per_node[host] = per_node.get(host, 0) + 1
    itemsize = dp.gradients.reduced.dtype.itemsize  # int64 integers when reproducible
    return RunRecord(
        schema=SCHEMA, started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        version=mpisgd.__version__, world_size=run.k, nodes=len(per_node), ranks_per_node=max(per_node.values()),
        device="gpu" if run.ctx.backend.is_gpu else "cpu", threads=run.threads, model=cfg.model, dtype=str(flat.dtype),
        parameters=int(flat.size), grad_nbytes=int(flat.nbytes),
        bucket_nbytes=tuple(int((b.stop - b.start) * itemsize) for b in dp.buckets), bucket_cap_mb=cfg.bucket_cap_mb,
        overlap=bool(dp.overlap), allreduce=cfg.allreduce, allreduce_plan=dp.describe(),
        reproducible=cfg.reproducible, sharded=bool(dp.sharded), shard_min_bytes=SHARD_MIN_BYTES,
        optimizer=cfg.optimizer,
        optimizer_state_nbytes=int(sum(b.nbytes for b in run.optimizer.state_buffers().values())),
        lr=cfg.lr, base_batch=cfg.base_batch, lr_scaling=cfg.lr_scaling, peak_lr=run.schedule.peak_lr,
        warmup_steps=run.schedule.warmup_steps, local_batch=run.batches.local_batch,
        accum_steps=run.batches.accum_steps, effective_batch=run.B, steps_per_epoch=run.batches.steps_per_epoch,
        total_steps=run.total_steps, train_samples=len(run.data.train), noise_scale_every=cfg.noise_scale_every,
        shard_optimizer=cfg.shard_optimizer, resumed_from_step=run.resume.global_step if run.resume else None)


def per_token(record: EpochRecord | TestRecord, context: int) -> dict[str, float]:
    """A language model's epoch or test record's losses (mean nats per token) also in bits per token (bits
    per character for a character-level model), and its speed in tokens per second (context per window)."""
    out = {f"{key[:-5]}_bits_per_token": getattr(record, key) / math.log(2)
           for key in ("train_loss", "val_loss", "test_loss") if getattr(record, key, None) is not None}
    if isinstance(record, EpochRecord):
        out["tokens_per_s"] = record.samples_per_s * context
    return out


class NoSignals:
    """For a Trainer driven without the CLI's signal thread: nobody asks it to stop."""

    stop_requested = False

    def note_progress(self) -> None: ...

    def training(self) -> None: ...

    def stop_word(self) -> int:
        return 0

    def stopping(self) -> bool:
        return True


class Trainer:
    """The loop over one run: every rank builds one, then ``fit()`` returns the exit status (0, or
    EXIT_PREEMPTED when a SIGTERM stopped it at a step with a checkpoint). ``signals`` says when to
    stop (mpisgd.app.signals); ``hooks.before_step(step, rank)`` runs before each step's compute (the
    test suite's injected failures, mpisgd.app.inject)."""

    def __init__(self, run: Run, signals: Any = None, hooks: Any = None) -> None:
        self.run, self.cfg, self.dp = run, run.cfg, run.dp
        self.signals, self.hooks = signals or NoSignals(), hooks or NoHooks()
        self.comm = run.ctx.comm
        self.metrics = MetricsWriter(run.cfg.metrics_file, enabled=run.is_root)
        self.tensorboard = open_writer(run.cfg.tensorboard, enabled=run.is_root)  # a no-op unless asked
        plan = run.resume
        self.global_step = plan.global_step if plan else 0
        self.start_epoch, self.start_step = (plan.epoch, plan.step_in_epoch) if plan else (0, 0)
        self.saved_at = plan.global_step if plan else -1  # the step of the newest checkpoint this run wrote
        self.clock = Clock(self.comm) if run.k > 1 and run.cfg.straggler_report else None  # the report's time base
        self.history: list[EpochRecord] = []
        self.final_test: TestRecord | None = None  # with --val-split: the test set, scored once at the end

    def log(self, msg: str) -> None:
        if self.run.is_root:
            print(msg, flush=True)

    def record(self, record: Record) -> None:
        """One record to the metrics file and to TensorBoard (rank 0; no-ops where not asked)."""
        self.metrics.write(record)
        self.tensorboard.write(record)

    # -- the loop -------------------------------------------------------------------------
    def fit(self) -> int:
        """Train; returns 0, or EXIT_PREEMPTED when a SIGTERM stopped every rank at a step (checkpointed)."""
        run, cfg, dp = self.run, self.cfg, self.dp
        for line in report.banner(run) + run.warnings:
            self.log(line)
        if run.is_root and cfg.metrics_file:
            self.metrics.write(run_record(run))  # what the run is, before its steps (docs/metrics.md)
        if self.global_step >= run.total_steps:
            self.log(f"resume: the run is finished (step {self.global_step} of {run.total_steps}); nothing to train")
            status, where = self._save_model()
            if where:
                print(where, file=sys.stderr if status else sys.stdout, flush=True)
            return status
        spe = run.batches.steps_per_epoch
        self.signals.training()  # set-up is over: a stop signal's grace counts from here
        for epoch in range(self.start_epoch, self.n_epochs):
            perm = epoch_permutation(len(run.data.train), cfg.seed, epoch)
            bar = report.progress_bar(spe, cfg.progress if run.is_root else "off", f"epoch {epoch + 1}")
            dp.reset_times()
            loss_sum = run.ctx.xp.zeros((), dtype=cfg.dtype)
            steps, t0 = 0, time.perf_counter()
            for step in range(self.start_step if epoch == self.start_epoch else 0, spe):
                if self.global_step >= run.total_steps:
                    break
                word = dp.check_in_step(stop=self.signals.stop_word())  # every rank learns of a SIGTERM here
                if word:
                    bar.close()
                    return self._stop(epoch, step, Stop.of(word))
                loss_sum += self._step(perm, step, epoch)
                steps += 1
                if cfg.checkpoint_dir and self._checkpoint_due(step):
                    self._save(epoch, step + 1)
                bar.update()
            bar.close()
            self._end_epoch(epoch, steps, loss_sum, time.perf_counter() - t0)
        if cfg.checkpoint_dir and self.saved_at != self.global_step:  # the last step, whatever --checkpoint-every
            self._save(self.n_epochs - 1, spe)
        self._test_once()
        return self._finish()

    @property
    def n_epochs(self) -> int:
        return -(-self.run.total_steps // self.run.batches.steps_per_epoch)

    def _step(self, perm: np.ndarray, step: int, epoch: int) -> Any:
        """One optimizer step (``step`` of ``epoch``); returns this rank's mean loss."""
        run, cfg, dp = self.run, self.cfg, self.dp
        self.signals.note_progress()
        self.hooks.before_step(self.global_step, run.rank)
        t0 = time.perf_counter()
        lr = run.schedule(self.global_step)
        micro = [run.train_loader.batch(run.batches.indices(perm, step, i), slot=i) for i in range(cfg.accum_steps)]
        loss = dp.train_step(micro, lr)
        if dp.step_skipped and (dp.skipped_steps <= 10 or dp.skipped_steps % 100 == 0):
            self.log(f"warning: non-finite gradient at step {self.global_step}: step skipped "
                     f"(--on-nan skip; {dp.skipped_steps} skipped so far)")
        self.global_step += 1
        if cfg.metrics_file or cfg.tensorboard:
            grad_norm = getattr(dp, "last_grad_norm", None)  # the averaged gradient's, where DataParallel has it
            self.record(StepRecord(step=self.global_step, epoch=epoch + 1, lr=lr, loss=float(loss),
                                   step_ms=1e3 * (time.perf_counter() - t0),
                                   grad_norm=None if grad_norm is None else float(grad_norm)))
        if cfg.check_replicas and self.global_step % cfg.check_replicas == 0:
            dp.check_replicas()
        return loss

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint_every
        return self.global_step % every == 0 if every else step + 1 == self.run.batches.steps_per_epoch

    def _stop(self, epoch: int, step: int, stop: Stop) -> int:
        """Every rank stops before ``step`` of ``epoch`` (a SIGTERM or SIGUSR1 reached one of them): checkpoint
        it, unless a second signal asked to end at once."""
        self.signals.stopping()  # from here every rank ends with this stop's code, whatever signal comes
        self.signals.note_progress()
        path = self._save(epoch, step) if self.cfg.checkpoint_dir and not stop.urgent else None
        where = f"before step {self.global_step} (epoch {epoch + 1}, step {step} of {self.run.batches.steps_per_epoch})"
        with self.dp.watchdog.watching(f"the stop before step {self.global_step}"):  # bounded: no grace now
            written = bool(self.comm.allreduce(path is not None if self.run.is_root else True, op=MPI.LAND))
        code = EXIT_PREEMPTED if written else EXIT_TERMINATED  # 75 promises the checkpoint of this very step
        if self.run.is_root:
            why = "a second signal asked to end at once" if stop.urgent else \
                "no --checkpoint-dir, or it could not be written"
            saved = f"checkpoint {path} written; continue with --resume auto" if path else \
                f"no checkpoint of this step ({why}): the work since the last checkpoint is lost"
            by = f"a second {stop.signal}" if stop.urgent else stop.signal
            print(f"mpisgd: stopped by {by} {where}: {saved} (exit {code})", file=sys.stderr, flush=True)
        return code

    # -- checkpoints ----------------------------------------------------------------------
    def _save(self, epoch: int, step_in_epoch: int) -> Path | None:
        """Checkpoint of the state before step ``step_in_epoch`` of ``epoch`` (collective: the sharded step
        gathers the optimizer's state first). A write that fails (a full disk) warns and training goes on; the
        checkpoints already written stay as they were."""
        run, cfg = self.run, self.cfg
        if step_in_epoch >= run.batches.steps_per_epoch:
            epoch, step_in_epoch = epoch + 1, 0
        buffers = self.dp.gather_optimizer_state()  # whole on rank 0 (sharded: from every rank's chunks)
        self.saved_at = self.global_step
        if not run.is_root:  # only rank 0 writes; no collective, so nothing waits on it
            return None
        opt = run.optimizer
        state = TrainState(
            params=to_numpy(run.model.flat.params),
            buffers={name: to_numpy(buf) for name, buf in buffers.items()}, optimizer_state=opt.state(),
            global_step=self.global_step, epoch=epoch, step_in_epoch=step_in_epoch,
            skipped_steps=self.dp.skipped_steps, world_size=run.k, effective_batch=run.B,
            config=cfg.to_dict(), data=run.data.identity,
            grad_exponents=None if self.dp.exponents is None else np.asarray(self.dp.exponents),
            environment=run.environment, structure=run.structure, model=model_record(run),
            model_state=None if run.model.state is None else to_numpy(run.model.state))
        try:
            return run.run_dir.save(state, keep=cfg.checkpoint_keep)  # type: ignore[union-attr]
        except OSError as exc:
            free = free_bytes(cfg.checkpoint_dir)  # type: ignore[arg-type]
            self.log(f"warning: checkpoint of step {self.global_step} not written ({exc}; {free / 2**20:.0f} MiB "
                     f"free in {cfg.checkpoint_dir}); the earlier checkpoints are kept and training goes on")
            return None

    # -- the end of an epoch --------------------------------------------------------------
    def evaluate(self) -> float:
        """Test accuracy (collective)."""
        return self.score(self.run.test_loader)[0]

    def score(self, loader: Any, loss: bool = False) -> tuple[float, float | None]:
        """Accuracy, and with ``loss`` the mean loss, of the set ``loader`` holds (collective): each rank
        scores a disjoint part of it, counts and sums are added."""
        run = self.run
        mine = np.array_split(np.arange(len(loader.data)), run.k)[run.rank]
        b = run.batches.local_batch  # the training shape: the model's activation buffers are reused, not doubled
        batches = (loader.batch(mine[start:start + b]) for start in range(0, len(mine), b))
        # a long evaluation is not a stuck job: each batch is progress
        sums = scoring.score(run.model, batches, on_batch=self.signals.note_progress).to_array()
        self.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        total = Tally.from_array(sums)
        return total.accuracy, total.mean_loss if loss else None

    def _scores(self) -> dict[str, float]:
        """What an epoch's end measures on held-out data: the test set's accuracy or, with --val-split,
        the validation set's loss and accuracy (and the test set's with --test-every-epoch)."""
        run = self.run
        if run.val_loader is None:
            return {"test_acc": self.evaluate()}
        val_acc, val_loss = self.score(run.val_loader, loss=True)
        assert val_loss is not None  # asked for
        return {"val_loss": val_loss, "val_acc": val_acc,
                **({"test_acc": self.evaluate()} if self.cfg.test_every_epoch else {})}

    def _test_once(self) -> None:
        """With --val-split: the test set, scored once, after the training (collective)."""
        if self.run.val_loader is None:
            return
        with self.dp.watchdog.watching("the test set, after training"):
            acc, loss = self.score(self.run.test_loader, loss=True)
        assert loss is not None  # score(loss=True) returns one
        self.final_test = TestRecord(step=self.global_step, test_acc=acc, test_loss=loss)
        if self.run.data.tokens:
            bits = per_token(self.final_test, self.run.data.in_shape[0])
            self.final_test = replace(self.final_test, test_bits_per_token=bits.get("test_bits_per_token"))
        self.record(self.final_test)

    def _end_epoch(self, epoch: int, steps: int, loss_sum: Any, train_time: float) -> None:
        run = self.run
        with self.dp.watchdog.watching(f"end of epoch {epoch + 1}: metrics and evaluation"):
            # every rank's timings and norms and its loss, averaged in one all-reduce keyed by field name
            mean, extra = mean_over_ranks(self.comm, self.dp.times, {"loss_sum": float(loss_sum)})
            scores: dict[str, Any] = dict(self._scores())
            # the largest rank's peak, its RSS at start-up and what it holds for training (see _state_mib)
            mem = np.array([peak_rss_mib(), run.rss_start_mib, self._state_mib()])
            self.comm.Allreduce(MPI.IN_PLACE, mem, op=MPI.MAX)
            step_time = train_time / max(1, steps)
            straggler = self._straggler(1e3 * step_time)
        peak_mib, start_mib, state_mib = (float(v) for v in mem)
        # achieved bandwidth of the real gradient buckets, in nccl-tests terms (start to observed completion)
        algbw = mean.bytes_reduced / mean.comm_total_s / 1e9 if mean.comm_total_s > 0 else 0.0
        per_step = 1e3 / max(1, steps)
        record = EpochRecord(
            epoch=epoch + 1, step=self.global_step, steps=steps, lr=run.schedule(max(0, self.global_step - 1)),
            train_loss=extra["loss_sum"] / max(1, steps), **scores,
            samples_per_s=steps * run.B / train_time if train_time > 0 else 0.0,
            comm_frac=mean.comm_exposed_s / max(1e-12, train_time),
            comm_exposed_ms=per_step * mean.comm_exposed_s, comm_total_ms=per_step * mean.comm_total_s,
            forward_ms=per_step * mean.forward_s, backward_ms=per_step * mean.backward_s,
            optimizer_ms=per_step * mean.optimizer_s, step_ms=1e3 * step_time,
            epoch_time_s=train_time, skipped_steps=self.dp.skipped_steps,
            world_size=run.k, effective_batch=run.B, local_batch=run.batches.local_batch,
            accum_steps=run.batches.accum_steps, grad_nbytes=run.model.flat.nbytes,
            bucket_algbw_gbps=algbw, bucket_busbw_gbps=algbw * 2 * (run.k - 1) / run.k,
            peak_rss_mib=peak_mib, rss_start_mib=start_mib, state_mib=state_mib,
            **self._noise_scale(mean), **_straggler_fields(straggler))
        if run.data.tokens:  # a language model: per token, in nats and bits, and tokens per second
            bits = per_token(record, run.data.in_shape[0])
            record = replace(record, tokens_per_s=bits["tokens_per_s"],
                             train_bits_per_token=bits["train_bits_per_token"],
                             val_bits_per_token=bits.get("val_bits_per_token"))
        self.history.append(record)
        self.record(record)
        self.log(report.format_epoch(record, self.n_epochs, report.token_unit(run)))
        if straggler and straggler["slowest_share"] >= REPORT_SHARE:
            self.log(describe_straggler(straggler, run.places))

    def _noise_scale(self, mean: StepStats) -> dict[str, Any]:
        """The epoch's gradient noise scale from the ranks' mean squared norms (mpisgd.noise): the small
        batch is a rank's gradient (or, at k = 1, a micro-batch's), the big one the average. The fields
        are read by name, both in true units (mpisgd.parallel.stats.StepStats); a language model's batches
        are counted in tokens, so its noise scale is in tokens."""
        steps = mean.noise_steps  # every rank measured the same steps
        if steps < 1:
            return {}
        targets = self.run.data.in_shape[0] if self.run.data.tokens else 1  # per sample: a window's tokens
        est = estimate(mean.b_small, mean.small_sq / steps, self.run.B * targets, mean.big_sq / steps)
        if est is None:
            return {}
        return {"noise_scale": est.noise_scale, "grad_sqr": est.grad_sqr, "grad_var": est.grad_var,
                "noise_steps": int(steps)}

    def _straggler(self, step_ms: float) -> dict[str, Any]:
        """Rank 0's straggler report for this epoch (collective; {} at k = 1 or on other ranks)."""
        if self.clock is None:
            return {}
        self.clock.sync()
        t = self.dp.times
        mine = self.clock.common(np.stack([t.arrived_check_in, t.arrived_gradients], axis=1))
        every = self.comm.gather(mine, root=0)
        return analyse(np.stack(every), step_ms) if self.run.is_root and every[0].size else {}

    def _state_mib(self) -> float:
        """What training needs in memory, in MiB: parameters, gradients and optimizer state, one batch of
        activations, and the data this rank holds."""
        run = self.run
        held = self.dp.buffer_nbytes() + run.model.buffer_nbytes() + run.train_loader.buffer_nbytes() + \
            run.test_loader.buffer_nbytes()
        return held / 2**20

    def _finish(self) -> int:
        """Save the model and the timeline, print the closing lines; 1 if the model could be written nowhere,
        or the last step's checkpoint was not written (rank 0)."""
        run, cfg = self.run, self.cfg
        status, where = self._save_model()
        lost = self._last_checkpoint_lost()
        if lost:
            status, where = 1, "\n".join(line for line in (where, lost) if line)
        if cfg.timeline:
            path = f"{cfg.timeline}.rank{run.rank}.json"
            try:
                run.timeline.save(path)
            except OSError as exc:  # every rank writes its own: say which one failed, and go on
                print(f"warning: rank {run.rank}: --timeline {path} not written ({exc.strerror or exc})", flush=True)
        for line in report.final_lines(run, self.history, self.global_step, time.perf_counter() - run.t_launch,
                                       self.final_test):
            self.log(line)
        if where:  # the last line: where the model is, when not where asked
            print(where, file=sys.stderr if status else sys.stdout, flush=True)
        return status

    def _last_checkpoint_lost(self) -> str:
        """Rank 0's error line where --checkpoint-dir holds no checkpoint of the last step (its write failed:
        a warning said why), "" otherwise: the run did not leave what it was asked to, so it does not exit 0."""
        run, cfg = self.run, self.cfg
        if not (cfg.checkpoint_dir and run.is_root) or checkpoint_path(cfg.checkpoint_dir, self.global_step).is_file():
            return ""
        found = list_checkpoints(cfg.checkpoint_dir)  # newest first
        newest = (f"the newest checkpoint is of step {step_of(found[0])}, so a resume repeats steps "
                  f"{step_of(found[0]) + 1} to {self.global_step}") if found else "there is no checkpoint"
        return (f"mpisgd: error: the checkpoint of the last step ({self.global_step}) was not written in "
                f"{cfg.checkpoint_dir} (the warning above says why); {newest}")

    def _save_model(self) -> tuple[int, str]:
        """Rank 0 writes --save-model, or where that fails beside the checkpoints or in the temporary
        directory: (0, "") as asked; (0, a warning saying where) elsewhere; (1, an error line) nowhere."""
        cfg = self.cfg
        if not (cfg.save_model and self.run.is_root):
            return 0, ""
        try:
            where = save_params(cfg.save_model, self.run.model, model_fallbacks(cfg.checkpoint_dir),
                                model_record(self.run, self.global_step))
        except SaveError as exc:
            ckpt = checkpoint_path(cfg.checkpoint_dir, self.global_step) if cfg.checkpoint_dir else None
            kept = f"; the checkpoint {ckpt} holds the same parameters" if ckpt and ckpt.is_file() else ""
            return 1, f"mpisgd: error: {exc}{kept}"
        if where == cfg.save_model:
            return 0, ""
        return 0, f"warning: --save-model {cfg.save_model} could not be written; the final model is in {where}"

    def close(self, collective: bool = True) -> None:
        """Flush and close the metrics file; with ``collective`` also shut down the data-parallel
        machinery, which every rank must do together (the watchdog waits for every rank's close)."""
        self.metrics.close()
        self.tensorboard.close()
        if self.clock is not None and collective:
            self.clock.close()
        if self.run.run_dir is not None:
            self.run.run_dir.close()
        if collective:
            self.dp.close()
