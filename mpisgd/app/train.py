"""The training CLI: ``mpiexec -n K python -m mpisgd.train [options]``.

Exit codes: 0 done; 2 bad input (one line from rank 0, every rank exits 2);
1 an error every rank saw (diverged replicas, non-finite gradient), or an error
on one rank, which ends the whole job through ``MPI_Abort`` so nothing hangs;
75 stopped by SIGTERM at a step, with a checkpoint (run again with --resume
auto); 130 interrupted (SIGINT, Ctrl-C); 143 SIGTERM without a clean stop
(mpisgd.app.signals).
"""

from __future__ import annotations

import sys
from typing import Any

from mpisgd.abort import abort_job, fail_alone
from mpisgd.app.inject import Injected
from mpisgd.app.options import parse_config
from mpisgd.app.signals import Signals
from mpisgd.config import Config
from mpisgd.errors import UsageError


def main(argv: list[str] | None = None) -> int:
    signals = Signals.block()  # before MPI starts its threads: they inherit the mask
    from mpi4py import MPI  # noqa: PLC0415 - MPI starts here, not at import

    world = MPI.COMM_WORLD
    signals.start(world)
    rank = world.Get_rank()
    try:
        # from the first collective on, with the default bounds until the options are read: a rank stuck
        # reading its --config (a hung file system) is named, and the job ends
        watchdog = _watchdog(world)
        error: BaseException | None = None
        cfg, hooks = None, None
        try:
            cfg = parse_config(argv, quiet=rank != 0)
            hooks = Injected.from_environ()
        except UsageError as exc:
            error = exc
        except SystemExit as exc:  # --help: printed by rank 0, every rank leaves
            watchdog.close()
            return int(exc.code or 0)
        from mpisgd.agreement import AgreedError, agree  # noqa: PLC0415

        try:
            with watchdog.watching("set-up: reading the options"):
                agree(world, error)
        except AgreedError:
            watchdog.close()  # every rank failed together: a collective shutdown is safe
            raise
        assert cfg is not None
        watchdog.configure(cfg.stall_timeout_s, cfg.stall_abort, cfg.stall_abort_s)
        status = run(cfg, world, signals, watchdog, hooks)
    except BaseException as exc:  # whatever ends this rank must end the job, not leave the others waiting
        status = _report(exc, world)
    # a second SIGTERM (or no progress after the first) ends the job with 143, even if the loop got further
    return signals.exit_code if signals.exit_code is not None else status


def _report(exc: BaseException, world: Any) -> int:
    """Agreed errors: rank 0 prints one line, every rank returns. Others: print with rank, abort all."""
    from mpisgd.agreement import AgreedError  # noqa: PLC0415

    rank, size = world.Get_rank(), world.Get_size()
    if isinstance(exc, _errors_every_rank_raises()):
        if rank == 0:
            print(f"mpisgd: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code if isinstance(exc, AgreedError) else 1
    if isinstance(exc, UsageError):
        print(f"mpisgd: error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        if size > 1:
            abort_job(world, 2)
        return 2
    fail_alone(exc, world)
    return 1


def _errors_every_rank_raises() -> tuple[type[Exception], ...]:
    """Errors raised by every rank together (decided collectively): no abort, a collective shutdown."""
    from mpisgd.agreement import AgreedError, ReplicaError  # noqa: PLC0415
    from mpisgd.parallel import NonFiniteError  # noqa: PLC0415

    return AgreedError, ReplicaError, NonFiniteError


def run(cfg: Config, world: Any, signals: Any = None, watchdog: Any = None, hooks: Any = None) -> int:
    """Set up, train, shut down (collective). The stall watchdog (one with ``cfg``'s bounds unless given)
    watches set-up and training alike; ``hooks`` (before each step) default to those the environment
    injects (the test suite's failures and delays, mpisgd.app.inject)."""
    import numpy as np  # noqa: PLC0415 - heavy imports after argument checks

    from mpisgd.app.inject import Injected  # noqa: PLC0415
    from mpisgd.app.run import build_run  # noqa: PLC0415
    from mpisgd.app.trainer import Trainer  # noqa: PLC0415

    if watchdog is None:
        watchdog = _watchdog(world)
        watchdog.configure(cfg.stall_timeout_s, cfg.stall_abort, cfg.stall_abort_s)
    try:
        setup = build_run(cfg, world, watchdog, progress=signals.note_progress if signals else None)
    except _errors_every_rank_raises():
        watchdog.close()  # every rank failed set-up together: a collective shutdown is safe
        raise
    trainer = Trainer(setup, signals, hooks=Injected.from_environ() if hooks is None else hooks)
    try:
        # an overflow is the trainer's to report (--on-nan), once, not NumPy's RuntimeWarning per array per rank
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            status = trainer.fit()
    except _errors_every_rank_raises():
        trainer.close()
        raise
    except BaseException:
        # only this rank failed: the others may be inside a collective, so no collective shutdown
        # (it would wait for them for ever); keep the metrics written so far, then _report aborts
        trainer.close(collective=False)
        raise
    trainer.close()
    return status


def _watchdog(world: Any) -> Any:
    """The run's stall watchdog, with Config's default bounds (configure() sets the run's): every rank makes
    one, whatever its options say, so that all take part in its messages (k = 1: nothing to wait for)."""
    from mpisgd.watchdog import NullWatchdog, Watchdog  # noqa: PLC0415 - starts a thread

    if world.Get_size() == 1:
        return NullWatchdog()
    defaults = Config()
    return Watchdog(world, defaults.stall_timeout_s, defaults.stall_abort, abort_comm=world,
                    abort_after_s=defaults.stall_abort_s)
