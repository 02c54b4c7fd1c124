"""`ingot` for the hardening tests: every engine step slowed by $INGOT_TEST_STEP_DELAY seconds
(slow_step_cli.py), and an internal failure on demand, whose message names a server path (what
must not reach a client): a completion whose prompt is "boom" fails before it starts, one whose
prompt is "boom-stream" fails after its first chunk. Run as ``python hardening_cli.py serve
...`` (tests/e2e/server_utils.run_server's launcher)."""

from __future__ import annotations

import sys
from typing import Any

import slow_step_cli  # noqa: F401 - slows every engine step on import

from ingot.cli import main as cli
from ingot.entrypoints.openai.serving import OpenAIServing

SECRET = "/srv/secret/ingot_internal.py"
_prepare = OpenAIServing.prepare_completion
_stream = OpenAIServing.completion_stream


def prepare_completion(self: OpenAIServing, request: Any) -> Any:
    if request.prompt == "boom":
        raise RuntimeError(f"internal failure in {SECRET}")
    return _prepare(self, request)


async def completion_stream(self: OpenAIServing, request: Any, *args: Any) -> Any:
    async for piece in _stream(self, request, *args):
        yield piece
        if request.prompt == "boom-stream":
            raise RuntimeError(f"internal failure in {SECRET}")


OpenAIServing.prepare_completion = prepare_completion  # type: ignore[method-assign]
OpenAIServing.completion_stream = completion_stream  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
