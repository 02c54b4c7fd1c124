"""``--contend N``: N CPU-bound competing processes for the duration of a benchmark, so the
effect of a busy machine (issue #21) is reproducible. Each competitor is
``python -c "while True: pass"``; they are stopped when the block exits, on error too, and
die with the parent if it is killed (PR_SET_PDEATHSIG on Linux)."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
from collections.abc import Iterator

COMPETITOR = "while True: pass"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def check_contend(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"--contend must be 0 or a positive number of processes, got {n!r}")
    return n


@contextlib.contextmanager
def contention(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run ``n`` competitors while the block runs; yields their Popen objects."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(check_contend(n)):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", COMPETITOR], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            ))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
