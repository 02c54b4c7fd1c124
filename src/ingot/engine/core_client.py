"""What ``LLMEngine`` needs of the engine core it drives (vLLM's ``EngineCoreClient``).

Two implementations: ``EngineCore`` in this process (engine/core.py) and
``DPEngineCoreClient``, N engine-core processes behind one front end (engine/dp_client.py).
``LLMEngine`` (and so ``LLM``, ``AsyncLLM`` and the server) holds either as this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import Request, RequestStatus
from ingot.sampling_params import SamplingParams
from ingot.worker.executor import RpcMethod


class EngineCoreClient(Protocol):
    #: Forward steps run (not counting empty schedules).
    num_steps: int

    def add_request(self, request: Request) -> None: ...

    def submit_structured_output(self, params: SamplingParams) -> Future | None:
        """Start compiling ``params``' constraint, never waiting for it (the server awaits the
        future before a response starts); None without a constraint."""
        ...

    def release_structured_output(self, params: SamplingParams, future: Future) -> None:
        """The server stopped waiting for ``future`` before it was done: a compile nobody
        waits for leaves the queue if it has not started."""
        ...

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> None: ...

    def has_pending_work(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]: ...

    def collective_rpc(self, method: RpcMethod, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]: ...

    @property
    def workers_are_local(self) -> bool: ...

    def check_health(self) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def request_blocks(self, request_id: str) -> list[int]: ...

    def get_stats(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...
