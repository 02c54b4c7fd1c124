"""Progress for long start-up work (weight loading, warmup) and benchmarks.

On a terminal: a tqdm bar on stderr. Elsewhere (a log file, CI, a service manager), a bar's
carriage returns are noise, so it logs lines instead: one when the work starts, one at most
every ``interval`` seconds while it runs, one when it is done.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

logger = logging.getLogger("ingot")

T = TypeVar("T")

LOG_INTERVAL_S = 5.0


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def progress(
    iterable: Iterable[T],
    desc: str,
    total: int | None = None,
    unit: str = "it",
    interval: float = LOG_INTERVAL_S,
) -> Iterator[T]:
    """Yield from ``iterable``, showing how far it has got (see the module doc)."""
    if _is_terminal():
        from tqdm.auto import tqdm

        # leave=False: the bar disappears when done; the caller logs the summary line.
        yield from tqdm(iterable, desc=desc, total=total, unit=unit, leave=False)
        return
    of = f"/{total}" if total is not None else ""
    logger.info("%s: started (%s %s)", desc, total if total is not None else "?", unit)
    start = last = time.perf_counter()
    count = 0
    for item in iterable:
        yield item
        count += 1
        now = time.perf_counter()
        if now - last >= interval:
            logger.info("%s: %d%s %s, %.1fs", desc, count, of, unit, now - start)
            last = now
    logger.info("%s: done, %d %s in %.1fs", desc, count, unit, time.perf_counter() - start)
