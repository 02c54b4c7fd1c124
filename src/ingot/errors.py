"""Errors a user can cause. Each message says what to change."""

import uuid


def new_error_id() -> str:
    """The id a client is given for a failure on the server's side; the log holds the details
    (the traceback) under it."""
    return uuid.uuid4().hex[:16]


class IngotError(Exception):
    """Base class for ingot's user-facing errors."""


class ModelNotFoundError(IngotError, ValueError):
    """The --model path does not exist or holds no loadable model."""


class PromptTooLongError(IngotError, ValueError):
    """A prompt is longer than max_model_len allows."""


class TokenIdError(IngotError, ValueError):
    """A token id a request carries is not one of the model's; ``param`` names its field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class EngineRequestError(IngotError, RuntimeError):
    """The engine failed one request through no fault of the request; the server answers 500
    with ``error_id``, under which its log holds the traceback. Other requests are unaffected."""

    def __init__(self, message: str, error_id: str) -> None:
        super().__init__(message)
        self.error_id = error_id


class ServerBusyError(IngotError):
    """A server-wide limit is reached for now (not the request's fault): HTTP 503 with
    ``Retry-After: retry_after_s`` seconds, before any stream starts. The same request may
    succeed later (the waiting queue, the grammar compile queue)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        # Across a process boundary (a data-parallel replica's answer) only the message
        # travels: the front end's 503 then says 1 s.
        super().__init__(message)
        self.retry_after_s = retry_after_s
