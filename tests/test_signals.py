"""The signal rules (mpisgd.app.signals) without MPI: SIGTERM's grace runs from the job's last progress once
set-up is over, so a long evaluation or start-up is not taken for a stuck job; the check-in carries which
signal asked and whether a second one asked to end at once; once every rank agreed to stop, no signal ends
a rank on its own (the launcher would mix its exit code with the others'). Under mpiexec: test_hostile.py."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from mpisgd.app import signals

pytestmark = pytest.mark.alone  # times jobs or waits for them: run apart (pytest.ini)


def test_the_grace_restarts_while_the_job_makes_progress_and_ends_it_once_it_stops(monkeypatch):
    monkeypatch.setattr(signals, "TERM_GRACE_S", 1.0)
    s = signals.Signals()
    ended: list[int] = []
    monkeypatch.setattr(s, "_end", lambda code, why: ended.append(code))
    s.training()  # set-up is over
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


def _aborts(monkeypatch) -> list[int]:
    """The exit codes this process would abort the job with (MPI_Abort replaced by a note)."""
    aborted: list[int] = []
    monkeypatch.setattr(signals, "abort_job", lambda comm, code, grace_s=None: aborted.append(code))
    return aborted


def _wait_for(cond, limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_the_grace_does_not_run_during_set_up(monkeypatch):
    """A set-up stage longer than the grace (loading data, a checkpoint, a slow model factory) is not a stuck
    job: a SIGTERM then stops the job at its first step, with a checkpoint (75), where it ended in 143 with
    none. The grace counts from the end of set-up."""
    monkeypatch.setattr(signals, "TERM_GRACE_S", 0.5)
    aborted = _aborts(monkeypatch)
    s = signals.Signals()
    s.on_signal(signal.SIGTERM)
    time.sleep(1.5)  # three graces in set-up, no progress noted
    assert not aborted and s.stop_word() == signal.SIGTERM
    s.training()
    assert _wait_for(lambda: aborted == [signals.EXIT_TERMINATED])  # training, and no progress: ended


def test_the_stop_word_names_the_signal_and_a_second_one():
    """SIGUSR1 to one rank was reported by rank 0 as "stopped by SIGTERM" (its own default): the check-in now
    carries which signal asked, and whether a second one asked to end at once."""
    s = signals.Signals()
    assert s.stop_word() == 0
    s.stop_requested, s.stop_signal = True, "SIGUSR1"
    assert signals.Stop.of(s.stop_word()) == signals.Stop("SIGUSR1", urgent=False)
    s.urgent = True
    word = s.stop_word()
    assert signals.Stop.of(word) == signals.Stop("SIGUSR1", urgent=True)
    assert signals.Stop.of(max(word, signal.SIGTERM)).urgent  # the largest word over the ranks: urgent wins


def test_a_second_signal_stops_at_the_next_check_in_or_aborts_if_none_comes(monkeypatch):
    monkeypatch.setattr(signals, "URGENT_S", 0.3)
    aborted = _aborts(monkeypatch)
    s = signals.Signals()
    s.on_signal(signal.SIGUSR1)
    s.on_signal(signal.SIGUSR1)
    assert s.urgent and signals.Stop.of(s.stop_word()).urgent
    assert _wait_for(lambda: aborted == [signals.EXIT_TERMINATED])  # no check-in came: aborted, 143
    t = signals.Signals()
    t.on_signal(signal.SIGUSR1)
    t.on_signal(signal.SIGUSR1)
    assert t.stopping()  # the check-in came in time: every rank stops together, no abort of its own
    time.sleep(0.6)
    assert aborted == [signals.EXIT_TERMINATED]


@pytest.mark.parametrize("late", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
def test_once_every_rank_agreed_to_stop_no_signal_ends_a_rank_on_its_own(monkeypatch, capsys, late):
    """A second SIGUSR1 to one rank while the job was stopping made that rank exit 143 while the others exited
    75, and MPICH's launcher ORs the codes: the job exited 207, which the Slurm scripts do not requeue."""
    aborted = _aborts(monkeypatch)
    s = signals.Signals()
    s.on_signal(signal.SIGUSR1)
    assert s.stopping()
    s.on_signal(late)
    time.sleep(0.2)
    assert aborted == [] and s.exit_code is None
    assert "while every rank is stopping: it changes nothing" in capsys.readouterr().err
