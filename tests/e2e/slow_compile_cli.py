"""`ingot` whose grammar compiles take as long as the schema says: a JSON schema titled
``slow:SECONDS:TAG`` holds its compile-pool thread that long before compiling, as a slow
xgrammar compile would (it cannot be interrupted either). Each such compile's start and end
are printed ("compile started: TAG", "compile finished: TAG"), so a test can tell a compile
that ran from one withdrawn from the queue. Run as ``python slow_compile_cli.py serve ...``
(tests/e2e/server_utils.run_server's launcher)."""

from __future__ import annotations

import re
import sys
import time
from typing import Any

from ingot.cli import main as cli
from ingot.structured_output.manager import StructuredOutputManager

_compile_now = StructuredOutputManager._compile_now
_SLOW = re.compile(r'"title": "slow:([0-9.]+):(\w+)"')


def slow_compile(self: StructuredOutputManager, params: Any) -> Any:
    match = _SLOW.search(params.spec or "")
    if match is None:
        return _compile_now(self, params)
    print(f"compile started: {match[2]}", flush=True)
    time.sleep(float(match[1]))
    try:
        return _compile_now(self, params)
    finally:
        print(f"compile finished: {match[2]}", flush=True)


StructuredOutputManager._compile_now = slow_compile  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
