"""Between tests: drop what a finished test left (conftest after every module; the Gemma
module after every test)."""

import ctypes
import gc
import sys


def release_memory() -> None:
    """Collect reference cycles (engines, logit sets), then hand the freed heap back to the
    system (glibc keeps it otherwise)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
