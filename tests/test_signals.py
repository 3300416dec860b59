"""SIGTERM's grace period (mpisgd.app.signals) without MPI: it runs from the job's last progress, not from the
signal, so a long evaluation or start-up is not taken for a stuck job."""

from __future__ import annotations

import threading
import time

from mpisgd.app import signals


def test_the_grace_restarts_while_the_job_makes_progress_and_ends_it_once_it_stops(monkeypatch):
    monkeypatch.setattr(signals, "TERM_GRACE_S", 1.0)
    s = signals.Signals()
    ended: list[int] = []
    monkeypatch.setattr(s, "_end", lambda code, why: ended.append(code))
    s.note_progress()
    threading.Thread(target=s._grace, daemon=True).start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.0:  # three grace periods of steady progress (an evaluation's batches)
        s.note_progress()
        time.sleep(0.05)
    assert not ended
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:  # no more progress: the job is ended
        time.sleep(0.05)
    assert ended == [signals.EXIT_TERMINATED]
