"""The training CLI: ``mpiexec -n K python -m mpisgd.train [options]``.

Exit codes: 0 done; 2 bad input (one line from rank 0, every rank exits 2);
1 an error every rank saw (diverged replicas, non-finite gradient); any other
error on one rank aborts the whole job through ``MPI_Abort`` so nothing hangs.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

from mpisgd.abort import abort_job
from mpisgd.config import Config, UsageError, parse_config


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI  # noqa: PLC0415 - MPI starts here, not at import

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    try:
        error: BaseException | None = None
        cfg = None
        try:
            cfg = parse_config(argv, quiet=rank != 0)
        except UsageError as exc:
            error = exc
        except SystemExit as exc:  # --help: printed by rank 0, every rank leaves
            return int(exc.code or 0)
        from mpisgd.context import agree  # noqa: PLC0415

        agree(world, error)
        assert cfg is not None
        return run(cfg, world)
    except Exception as exc:
        return _report(exc, world)


def _report(exc: BaseException, world: Any) -> int:
    """Agreed errors: rank 0 prints one line, every rank returns. Others: print with rank, abort all."""
    from mpisgd.context import AgreedError  # noqa: PLC0415

    rank, size = world.Get_rank(), world.Get_size()
    if isinstance(exc, _errors_every_rank_raises()):
        if rank == 0:
            print(f"mpisgd: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code if isinstance(exc, AgreedError) else 1
    if isinstance(exc, UsageError):
        msg = f"mpisgd: error on rank {rank}: {exc}"
        code = 2
    else:
        msg = f"mpisgd: rank {rank} of {size} failed:\n" + "".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
        code = 1
    print(msg, file=sys.stderr, flush=True)
    if size > 1:
        print(f"mpisgd: rank {rank} aborts the job (MPI_Abort) so that no rank waits forever",
              file=sys.stderr, flush=True)
        abort_job(world, code)
    return code


def _errors_every_rank_raises() -> tuple[type[Exception], ...]:
    """Errors raised by every rank together (decided collectively): no abort, a collective shutdown."""
    from mpisgd.context import AgreedError  # noqa: PLC0415
    from mpisgd.parallel import NonFiniteError, ReplicaError  # noqa: PLC0415

    return AgreedError, ReplicaError, NonFiniteError


def run(cfg: Config, world: Any) -> int:
    from mpisgd.trainer import Trainer  # noqa: PLC0415 - heavy imports after argument checks

    trainer = Trainer(cfg, world)
    try:
        trainer.fit()
    except _errors_every_rank_raises():
        trainer.close()
        raise
    except BaseException:
        # only this rank failed: the others may be inside a collective, so no collective shutdown
        # (it would wait for them for ever); keep the metrics written so far, then _report aborts
        trainer.close(collective=False)
        raise
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

