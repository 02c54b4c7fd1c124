"""The server's access log: one line per HTTP request, written when the response has been
sent in full (a stream at its end), with the tokens the request used.

uvicorn's own access log is off (it knows neither tokens nor a stream's real duration); this
line takes its place, and ``--disable-uvicorn-access-log`` (vLLM's flag) turns it off.

Handlers report tokens through :func:`record_usage`, which finds the request's record in a
context variable set by the middleware: the route, and the stream task Starlette starts for a
streaming response, run in copies of the middleware's context, which share the record.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("ingot.access")


@dataclass
class _Record:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


_CURRENT: ContextVar[_Record | None] = ContextVar("ingot_access_record", default=None)


def record_usage(prompt_tokens: int, completion_tokens: int) -> None:
    """The current request's token counts (a no-op outside a logged request)."""
    record = _CURRENT.get()
    if record is not None:
        record.prompt_tokens, record.completion_tokens = prompt_tokens, completion_tokens


def access_line(method: str, path: str, status: int | None, record: _Record,
                seconds: float, client: str) -> str:
    def num(v: int | None) -> str:
        return "-" if v is None else str(v)

    return (
        f'{client} "{method} {path}" {status if status is not None else "-"} '
        f"prompt_tokens={num(record.prompt_tokens)} "
        f"completion_tokens={num(record.completion_tokens)} latency={seconds:.3f}s"
    )


class AccessLogMiddleware:
    """Outermost middleware, so that requests refused early (401, 413) are logged too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = _Record()
        token = _CURRENT.set(record)
        status: list[int] = []

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            _CURRENT.reset(token)
            client = scope.get("client")
            access_logger.info(access_line(
                scope["method"], scope["path"], status[0] if status else None, record,
                time.perf_counter() - start, f"{client[0]}:{client[1]}" if client else "-",
            ))
