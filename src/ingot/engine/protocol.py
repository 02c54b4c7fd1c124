"""The engine as the OpenAI server sees it (vLLM's ``EngineClient``): the model, the prompt
checks, streams of outputs, aborts, health and the few engine-wide calls the routes make.
The server (entrypoints/openai) uses these members only, never what lies behind them, so the
engine's insides (one core, N data-parallel replicas) can change without the server knowing.
``AsyncLLM`` (engine/async_engine.py) implements it, on one engine core or several.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from ingot.config import ModelConfig
from ingot.engine.outputs import PoolingRequestOutput, RequestOutput
from ingot.engine.processor import InputProcessor, PromptType
from ingot.errors import IngotError
from ingot.pooling_params import PoolingParams
from ingot.sampling_params import SamplingParams


class EngineDeadError(IngotError, RuntimeError):
    """The engine loop failed (or was shut down); the server must be restarted."""


class EngineClient(Protocol):
    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def tokenizer(self) -> Any | None:
        """The HF tokenizer (None: started with skip_tokenizer_init)."""
        ...

    @property
    def input_processor(self) -> InputProcessor:
        """The engine's prompt checks, for a 400 before a stream starts."""
        ...

    @property
    def is_running(self) -> bool: ...

    @property
    def dead_error(self) -> BaseException | None:
        """What took the engine down (None while it runs, or after a clean shutdown)."""
        ...

    def dead(self) -> EngineDeadError:
        """The error to raise for work sent to a failed or stopped engine."""
        ...

    def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of ``params.output_kind`` (DELTA: each holds what is new since the last
        one read); the last one has ``finished=True``. Leaving the iteration early aborts the
        request."""
        ...

    def encode(
        self, prompt: PromptType, params: PoolingParams, request_id: str
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request: one finished output."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def check_structured_output(self, params: SamplingParams) -> None:
        """Compile ``params``' constraint (then cached for the request) without holding the
        engine; ``ValueError`` if it is invalid or does not compile within
        ``compile_timeout_s`` (its wait for a pool thread included); ``ServerBusyError`` when
        the compile queue is full."""
        ...

    async def start_profile(self) -> None: ...

    async def stop_profile(self) -> str | None:
        """The trace's path (None if nothing was recorded)."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """False (nothing reset) while running requests hold cached blocks."""
        ...

    def shutdown(self) -> None: ...
