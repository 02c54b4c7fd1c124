"""What the engine core reports per request and step (``Scheduler.update_from_output``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ingot.core.request import RequestStatus
from ingot.errors import new_error_id
from ingot.runner_output import PromptLogprobsChunk, SampledLogprobs


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[SampledLogprobs] = field(default_factory=list)  # one per new token
    new_prompt_logprobs: PromptLogprobsChunk | None = None
    # Set when the core finished the request this step (EOS, stop token, length).
    finish_status: RequestStatus | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    pooled: list[float] | None = None  # a pooling request's output (it finishes with it)
    # Why the core failed the request (aborted): its constraint did not compile, or admitting
    # it raised (``failed_output``).
    error: str | None = None
    # Set when the failure is the engine's, not the request's: the key to the traceback in the
    # log (the server answers 500 with it, and never the exception's own text).
    error_id: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_status is not None


logger = logging.getLogger("ingot")


def failed_output(request_id: str, exc: Exception, during: str) -> EngineCoreOutput:
    """The output that fails one request whose admission or finishing raised; nothing else in
    the engine is touched. A ``ValueError`` is the request's own fault: its message goes back
    (a 400). Anything else is the engine's: the log gets the traceback under a fresh error id
    and the caller only the id (a 500), so no internals reach a client."""
    aborted = RequestStatus.FINISHED_ABORTED
    if isinstance(exc, ValueError):
        logger.warning("request %s refused while %s: %s", request_id, during, exc)
        return EngineCoreOutput(request_id, finish_status=aborted, error=str(exc)[:1000])
    error_id = new_error_id()
    logger.error("request %s failed while %s (error id %s)", request_id, during, error_id,
                 exc_info=exc)
    return EngineCoreOutput(
        request_id, finish_status=aborted, error_id=error_id,
        error=f"internal error while {during} this request (error id {error_id}; the server "
              "log has the details); the server keeps serving other requests",
    )
