"""The training loop behind the CLI: epochs of steps, evaluation, checkpoints, metrics records.

Set-up is mpisgd.app.run's (``build_run``); what rank 0 prints is mpisgd.app.report's. :class:`Trainer`
drives the run's objects through their methods and keeps only the loop's own state: where it is,
what it wrote, what each epoch measured.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.app import preflight, report
from mpisgd.app.inject import NoHooks
from mpisgd.app.metrics import MetricsWriter
from mpisgd.app.run import Run, model_record
from mpisgd.app.signals import EXIT_PREEMPTED, EXIT_TERMINATED
from mpisgd.app.straggler import REPORT_SHARE, Clock, analyse
from mpisgd.app.straggler import describe as describe_straggler
from mpisgd.app.tensorboard import open_writer
from mpisgd.backend import to_numpy
from mpisgd.checkpoint import SaveError, TrainState, checkpoint_path
from mpisgd.data import epoch_permutation
from mpisgd.files import free_bytes
from mpisgd.model_file import model_fallbacks, save_params
from mpisgd.nn import scoring
from mpisgd.nn.scoring import Tally
from mpisgd.noise import estimate


class NoSignals:
    """For a Trainer driven without the CLI's signal thread: nobody asks it to stop."""

    stop_requested = False

    def note_progress(self) -> None: ...


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
        self.history: list[dict[str, Any]] = []
        self.final_test: dict[str, Any] | None = None  # with --val-split: the test set, scored once at the end

    def log(self, msg: str) -> None:
        if self.run.is_root:
            print(msg, flush=True)

    def record(self, record: dict[str, Any]) -> None:
        """One record to the metrics file and to TensorBoard (rank 0; no-ops where not asked)."""
        self.metrics.write(record)
        self.tensorboard.write(record)

    # -- the loop -------------------------------------------------------------------------
    def fit(self) -> int:
        """Train; returns 0, or EXIT_PREEMPTED when a SIGTERM stopped every rank at a step (checkpointed)."""
        run, cfg, dp = self.run, self.cfg, self.dp
        for line in report.banner(run) + run.warnings:
            self.log(line)
        if self.global_step >= run.total_steps:
            self.log(f"resume: the run is finished (step {self.global_step} of {run.total_steps}); nothing to train")
            status, where = self._save_model()
            if where:
                print(where, file=sys.stderr if status else sys.stdout, flush=True)
            return status
        spe = run.batches.steps_per_epoch
        for epoch in range(self.start_epoch, self.n_epochs):
            perm = epoch_permutation(len(run.data.train), cfg.seed, epoch)
            bar = report.progress_bar(spe, cfg.progress if run.is_root else "off", f"epoch {epoch + 1}")
            dp.reset_times()
            loss_sum = run.ctx.xp.zeros((), dtype=cfg.dtype)
            steps, t0 = 0, time.perf_counter()
            for step in range(self.start_step if epoch == self.start_epoch else 0, spe):
                if self.global_step >= run.total_steps:
                    break
                if dp.check_in_step(stop=self.signals.stop_requested):  # every rank learns of a SIGTERM here
                    bar.close()
                    return self._stop(epoch, step)
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
            record = {"kind": "step", "step": self.global_step, "epoch": epoch + 1, "lr": lr, "loss": float(loss),
                      "step_ms": 1e3 * (time.perf_counter() - t0)}
            grad_norm = getattr(dp, "last_grad_norm", None)  # the averaged gradient's, where DataParallel has it
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            self.record(record)
        if cfg.check_replicas and self.global_step % cfg.check_replicas == 0:
            dp.check_replicas()
        return loss

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint_every
        return self.global_step % every == 0 if every else step + 1 == self.run.batches.steps_per_epoch

    def _stop(self, epoch: int, step: int) -> int:
        """Every rank stops before ``step`` of ``epoch`` (a SIGTERM reached one of them): checkpoint it."""
        self.signals.note_progress()
        path = self._save(epoch, step) if self.cfg.checkpoint_dir else None
        where = f"before step {self.global_step} (epoch {epoch + 1}, step {step} of {self.run.batches.steps_per_epoch})"
        written = bool(self.comm.allreduce(path is not None if self.run.is_root else True, op=MPI.LAND))
        code = EXIT_PREEMPTED if written else EXIT_TERMINATED  # 75 promises the checkpoint of this very step
        if self.run.is_root:
            saved = f"checkpoint {path} written; continue with --resume auto" if path else \
                "no checkpoint of this step (no --checkpoint-dir, or it could not be written): the work since the " \
                "last checkpoint is lost"
            by = getattr(self.signals, "stop_signal", "SIGTERM")
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
        self.dp.gather_optimizer_state()
        self.saved_at = self.global_step
        if not run.is_root:  # only rank 0 writes; no collective, so nothing waits on it
            return None
        opt = run.optimizer
        state = TrainState(
            params=to_numpy(run.model.flat.params),
            buffers={name: to_numpy(buf) for name, buf in opt.state_buffers().items()}, optimizer_state=opt.state(),
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
        return {"val_loss": val_loss, "val_acc": val_acc,
                **({"test_acc": self.evaluate()} if self.cfg.test_every_epoch else {})}

    def _test_once(self) -> None:
        """With --val-split: the test set, scored once, after the training (collective)."""
        if self.run.val_loader is None:
            return
        with self.dp.watchdog.watching("the test set, after training"):
            acc, loss = self.score(self.run.test_loader, loss=True)
        self.final_test = {"kind": "test", "step": self.global_step, "test_acc": acc, "test_loss": loss}
        self.record(self.final_test)

    def _end_epoch(self, epoch: int, steps: int, loss_sum: Any, train_time: float) -> None:
        run, t = self.run, self.dp.times
        local = np.array([float(loss_sum), steps, t.comm_exposed_s, t.comm_total_s, t.forward_s, t.backward_s,
                          t.optimizer_s, t.bytes_reduced, t.noise_steps, t.small_sq, t.big_sq_share])
        total = np.zeros_like(local)
        with self.dp.watchdog.watching(f"end of epoch {epoch + 1}: metrics and evaluation"):
            self.comm.Allreduce(local, total, op=MPI.SUM)
            scores = self._scores()
            # the largest rank's peak, its RSS at start-up and what it holds for training (see _state_mib)
            mem = np.array([preflight.peak_rss_mib(), run.rss_start_mib, self._state_mib()])
            self.comm.Allreduce(MPI.IN_PLACE, mem, op=MPI.MAX)
            step_time = train_time / max(1, steps)
            straggler = self._straggler(1e3 * step_time)
        mean = total / run.k
        peak_mib, start_mib, state_mib = (float(v) for v in mem)
        # achieved bandwidth of the real gradient buckets, in nccl-tests terms (start to observed completion)
        algbw = mean[7] / mean[3] / 1e9 if mean[3] > 0 else 0.0
        per_step = 1e3 / max(1, steps)
        noise = self._noise_scale(mean, t.b_small)
        record = {
            "kind": "epoch", "epoch": epoch + 1, "step": self.global_step,
            "lr": run.schedule(max(0, self.global_step - 1)),
            "train_loss": mean[0] / max(1, steps), **scores,
            "samples_per_s": steps * run.B / train_time if train_time > 0 else 0.0,
            "comm_frac": mean[2] / max(1e-12, train_time),
            "comm_exposed_ms": per_step * mean[2], "comm_total_ms": per_step * mean[3],
            "forward_ms": per_step * mean[4], "backward_ms": per_step * mean[5],
            "optimizer_ms": per_step * mean[6], "step_ms": 1e3 * step_time,
            "epoch_time_s": train_time, "skipped_steps": self.dp.skipped_steps,
            "world_size": run.k, "effective_batch": run.B, "local_batch": run.batches.local_batch,
            "accum_steps": run.batches.accum_steps, "grad_nbytes": run.model.flat.nbytes,
            "bucket_algbw_gbps": algbw, "bucket_busbw_gbps": algbw * 2 * (run.k - 1) / run.k,
            "peak_rss_mib": peak_mib, "rss_start_mib": start_mib, "state_mib": state_mib,
            "allreduce": self.dp.describe(), **noise, **straggler,
        }
        self.history.append(record)
        self.record(record)
        self.log(report.format_epoch(record, self.n_epochs))
        if straggler and straggler["slowest_share"] >= REPORT_SHARE:
            self.log(describe_straggler(straggler, run.places))

    def _noise_scale(self, mean: np.ndarray, b_small: int) -> dict[str, Any]:
        """The epoch's gradient noise scale from the ranks' summed squared norms (mpisgd.noise): the
        small batch is a rank's gradient (or, at k = 1, a micro-batch's), the big one the average."""
        steps = mean[8]  # every rank measured the same steps
        if steps < 1:
            return {}
        est = estimate(b_small, mean[9] / steps, self.run.B, mean[10] * self.run.k / steps)
        if est is None:
            return {}
        return {"noise_scale": est.noise_scale, "grad_sqr": est.grad_sqr, "grad_var": est.grad_var,
                "noise_steps": int(round(mean[8]))}

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
        """Save the model and the timeline, print the closing lines; 1 if the model could be written nowhere."""
        run, cfg = self.run, self.cfg
        status, where = self._save_model()
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
