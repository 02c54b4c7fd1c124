"""`make run` ended with Ctrl-C as in a terminal: a pseudo-terminal whose line discipline turns
the typed ^C into SIGINT for the whole foreground process group (make, its shell, ingot)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from server_utils import free_port

REPO = Path(__file__).resolve().parents[2]


def _read(fd: int, seconds: float, until: bytes | None = None) -> bytes:
    """What the terminal shows within ``seconds``; sooner once ``until`` has shown."""
    out = b""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (until and until in out):
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:  # the other side closed
                break
    return out


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("when", ["starting", "serving"])
def test_make_run_ctrl_c_exits_without_make_error(tiny_llama_dir, when):
    """``starting``: ^C at ingot's first log line, while it builds the engine (before the
    server's own signal handling); ``serving``: once it answers."""
    port = free_port()
    venv = Path(sys.prefix)  # this interpreter's environment stands in for .venv
    master, slave = pty.openpty()

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a terminal's shell leaves it

    proc = subprocess.Popen(
        ["make", "-o", str(venv / ".ingot-installed"), "run", f"VENV={venv}", f"PORT={port}",
         f"SERVE_ARGS={tiny_llama_dir} --dtype float32 --max-model-len 256"],
        cwd=REPO, stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal,
    )
    os.close(slave)
    output = b""
    try:
        # Events, not a clock: ingot's first log line ("INFO <time> ingot...", after make's
        # banner) comes while it loads, long before "ready: serving".
        mark = b"ready: serving" if when == "serving" else b"INFO "
        deadline = time.monotonic() + 120
        while mark not in output and time.monotonic() < deadline:
            output += _read(master, 0.2, until=mark)
            assert proc.poll() is None, output.decode(errors="replace")
        assert mark in output, output.decode(errors="replace")
        if when == "starting":
            assert b"Ctrl-C stops it" in output  # make's banner came first
            assert b"ready: serving" not in output  # still starting
        os.write(master, b"\x03")  # Ctrl-C
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            output += _read(master, 0.2)
        output += _read(master, 0.3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        os.close(master)
    text = output.decode(errors="replace")
    assert "make: ***" not in text, text  # no "Interrupt", "Error" or "Terminated" line
    assert "Traceback" not in text, text
    # make itself ends by the SIGINT (what a shell expects of an interrupted job), quietly.
    assert proc.returncode in (0, -signal.SIGINT), text
