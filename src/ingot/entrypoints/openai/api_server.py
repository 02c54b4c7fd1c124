"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): `ingot serve`.

Routes follow vLLM: /v1/completions, /v1/chat/completions, /v1/models, /health, /version,
/tokenize, /detokenize, /metrics, /start_profile, /stop_profile. Every error a client can cause
gets OpenAI's error JSON and the right status; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from ingot.engine.async_engine import AsyncLLM, EngineDeadError
from ingot.engine.tokenizer import apply_chat_template
from ingot.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
)
from ingot.entrypoints.openai.serving import OpenAIServing, sse
from ingot.errors import PromptTooLongError
from ingot.metrics.prometheus import EngineMetrics
from ingot.version import __version__

logger = logging.getLogger("ingot")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
M = TypeVar("M", bound=BaseModel)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}},
        status_code=status,
    )


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", param)


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()) if not isinstance(x, int)) or None
    if err.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {loc}", loc
    return f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")), loc


async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    raw = await request.body()
    if len(raw) > max_bytes:
        raise HTTPError(413, f"request body is larger than {max_bytes} bytes", "invalid_request_error")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise bad_request(message, param) from None


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            raise HTTPError(499, "client disconnected", "invalid_request_error")
    return task.result()


def build_app(engine: AsyncLLM, settings: ServerSettings, metrics: EngineMetrics) -> FastAPI:
    app = FastAPI(title="ingot", version=__version__)
    serving = OpenAIServing(engine, settings.served_model_name)
    model_config = engine.engine.model_config

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return error_response(
                413, f"request body is larger than {settings.max_body_bytes} bytes",
                "invalid_request_error",
            )
        if settings.api_key and request.url.path.startswith("/v1"):
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
                return error_response(401, "invalid or missing API key", "authentication_error")
        return await call_next(request)

    @app.exception_handler(HTTPError)
    async def on_http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.err_type, exc.param)

    @app.exception_handler(PromptTooLongError)
    async def on_too_long(_: Request, exc: PromptTooLongError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error", "prompt")

    @app.exception_handler(ValueError)
    async def on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(EngineDeadError)
    async def on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), "server_error")

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.served_model_name:
            raise HTTPError(
                404, f"The model `{name}` does not exist; this server serves "
                f"`{settings.served_model_name}`", "not_found_error", "model",
            )

    def stream_response(body: AsyncIterator[str]) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            try:
                async for piece in body:
                    yield piece
            except (ValueError, EngineDeadError) as exc:
                status = 503 if isinstance(exc, EngineDeadError) else 400
                yield sse({"error": {"message": str(exc), "type": "server_error", "code": status}})
                yield "data: [DONE]\n\n"

        return StreamingResponse(guarded(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, settings.max_body_bytes)
        check_model(body.model)
        if body.stream:
            prompts, params = serving.prepare_completion(body)
            return stream_response(serving.completion_stream(body, prompts, params))
        return JSONResponse(await _until_disconnected(request, serving.completion(body)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, settings.max_body_bytes)
        check_model(body.model)
        if body.stream:
            prompt, params = serving.prepare_chat(body)
            return stream_response(serving.chat_stream(body, prompt, params))
        return JSONResponse(await _until_disconnected(request, serving.chat(body)))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{
                "id": settings.served_model_name,
                "object": "model",
                "created": now(),
                "owned_by": "ingot",
                "root": model_config.model,
                "max_model_len": model_config.max_model_len,
            }],
        }

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return error_response(503, f"the engine is not running: {engine.dead_error!r}", "server_error")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest, settings.max_body_bytes)
        check_model(body.model)
        tokenizer = serving._need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages")
        if body.messages is not None:
            text = apply_chat_template(
                tokenizer, [m.model_dump(exclude_none=True) for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
            )
            tokens = tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": model_config.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest, settings.max_body_bytes)
        check_model(body.model)
        vocab = model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": serving._need_tokenizer().decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/start_profile")
    async def start_profile() -> dict[str, Any]:
        await engine.call(engine.engine.start_profile)
        return {"status": "profiling"}

    @app.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        trace = await engine.call(engine.engine.stop_profile)
        return {"status": "stopped", "trace": trace}

    return app


def serve(engine_args: Any, host: str, port: int, settings_kwargs: dict[str, Any]) -> int:
    """Build the engine, then serve until interrupted."""
    import uvicorn

    start = time.perf_counter()
    metrics_holder: dict[str, EngineMetrics] = {}

    def on_step(eng: Any, outputs: Any, elapsed: float) -> None:
        metrics_holder["m"].record_step(eng, outputs, elapsed)

    def on_abort(request_id: str) -> None:
        metrics_holder["m"].record_abort(request_id)

    engine = AsyncLLM.from_engine_args(engine_args, on_step=on_step, on_abort=on_abort)
    served = engine.engine.model_config.served_model_name
    metrics = EngineMetrics(served)
    metrics_holder["m"] = metrics
    worker = engine.engine.engine_core.executor.worker
    metrics.init_buckets(worker.model_runner.stats)
    metrics.record_startup(time.perf_counter() - start, worker.load_seconds, worker.load_bytes, 0.0)
    settings = ServerSettings(served_model_name=served, **settings_kwargs)
    app = build_app(engine, settings, metrics)
    logger.info("ready: serving %s on http://%s:%d (%.1fs)", served, host, port, time.perf_counter() - start)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        engine.shutdown()
    return 0
