"""Progress a person can see: under mpiexec rank 0's stderr is a pipe, so --progress auto asks whether the
launcher's stderr is a terminal; launched from one, the bar shows; a log redirected to a file gets none."""

from __future__ import annotations

import fcntl
import os
import pty
import shlex
import struct
import subprocess
import termios

import pytest
from conftest import ONE_THREAD, ROOT, mpiexec_cmd, serial_only

from mpisgd.app.report import launcher_terminal

pytestmark = [serial_only, pytest.mark.alone]  # times its job's bar: run apart (pytest.ini)
TRAIN = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "16384", "--hidden", "16",
         "--batch-size", "8", "--epochs", "1"]
# where no bar may show, a short epoch: tqdm draws its first and last state however short the epoch
SHORT = [*TRAIN[:5], "2048", *TRAIN[6:]]
BAR = ("it/s", "\u2588", "%|")  # what tqdm draws
# tqdm redraws every 0.5 s, and this epoch alone can take 0.3 s: rank 1 sleeps 3 ms a step so that the
# epoch lasts at least 3 s whatever the machine's speed
SLOW = {"MPISGD_DELAY_RANK": "1:3"}


def on_terminal(argv: list[str], columns: int = 90, extra_env: dict[str, str] | None = None) -> str:
    """Run argv with stdin, stdout and stderr on a new pseudo-terminal of ``columns``; what it showed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, columns, 0, 0))
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(extra_env or {})}
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT, start_new_session=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(timeout=300) == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


def test_launched_from_a_terminal_the_default_shows_a_bar_as_wide_as_it():
    shown = on_terminal(mpiexec_cmd(2, *TRAIN), extra_env=SLOW)
    assert all(mark in shown for mark in BAR), shown[-2000:]
    assert "epoch   1/1" in shown and "final test accuracy" in shown
    bars = [part for part in shown.split("\r") if "it/s" in part]
    assert bars and max(len(b.rstrip("\n")) for b in bars) <= 90, bars


def test_a_log_redirected_to_a_file_stays_clean(tmp_path):
    log = tmp_path / "train.log"
    cmd = " ".join(map(shlex.quote, mpiexec_cmd(2, *SHORT)))
    shown = on_terminal(["bash", "-c", f"{cmd} > {shlex.quote(str(log))} 2>&1"])
    text = log.read_text()
    assert "final test accuracy" in text and not any(mark in text for mark in BAR), text
    assert "\r" not in text and shown.strip() == ""


def test_progress_off_shows_nothing_even_on_a_terminal():
    shown = on_terminal(mpiexec_cmd(2, *SHORT, "--progress", "off"))
    assert "final test accuracy" in shown and not any(mark in shown for mark in BAR)


def test_no_launcher_terminal_when_stderr_is_captured():
    """pytest captures this process's output, and no MPI launcher started it."""
    r = subprocess.run(mpiexec_cmd(1, "-c", "from mpisgd.app.report import launcher_terminal as t; print(t())"),
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stdout + r.stderr
    assert launcher_terminal() is None
