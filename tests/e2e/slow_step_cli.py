"""`ingot` with every engine step slowed down by $INGOT_TEST_STEP_DELAY seconds (before the
step runs), so that what a server sends before the model has produced anything is observable.
Run as ``python slow_step_cli.py serve ...`` (tests/e2e/server_utils.run_server's launcher)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from ingot.cli import main as cli
from ingot.engine.llm_engine import LLMEngine

DELAY = float(os.environ["INGOT_TEST_STEP_DELAY"])
_step = LLMEngine.step


def slow_step(self: LLMEngine, *args: Any, **kwargs: Any) -> Any:
    time.sleep(DELAY)
    return _step(self, *args, **kwargs)


LLMEngine.step = slow_step  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
