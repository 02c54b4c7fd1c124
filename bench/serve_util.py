"""`ingot serve` in a child process for the serving benchmarks: a free loopback port, ready
when /health answers, stopped afterwards."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ingot_server(
    flags: list[str], timeout_s: float = 300, log: IO[bytes] | None = None,
    procs: list[subprocess.Popen] | None = None,
) -> Iterator[str]:
    """Yields the server's base URL once it is ready. ``log``: where its output goes (default:
    nowhere); ``procs``: the server's process is appended to it (for RSS readings)."""
    port = free_port()
    cmd = [sys.executable, "-m", "ingot.cli.main", "--log-level", "warning", "serve",
           "--host", "127.0.0.1", "--port", str(port), *flags]
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    if procs is not None:
        procs.append(proc)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ingot serve did not start: {' '.join(cmd)}") from None
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
