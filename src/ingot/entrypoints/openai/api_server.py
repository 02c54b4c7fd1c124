"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): `ingot serve`.

Routes follow vLLM: /v1/completions, /v1/chat/completions, /v1/models[/{model}], /health, /version,
/tokenize, /detokenize, /metrics, /start_profile, /stop_profile; for pooling models
(--runner pooling) /v1/embeddings, /pooling, /classify, /score, /v1/score, /rerank, /v1/rerank. Every error a client can cause
gets OpenAI's error JSON and the right status; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ingot.engine.arg_utils import EngineArgs
from ingot.engine.async_engine import AsyncLLM
from ingot.engine.llm_engine import LLMEngine
from ingot.engine.protocol import EngineClient, EngineDeadError
from ingot.engine.tokenizer import apply_chat_template
from ingot.entrypoints.openai.access_log import AccessLogMiddleware
from ingot.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingRequest,
    RequestValueError,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    message_dicts,
    now,
)
from ingot.entrypoints.openai.serving import ChatOptions, OpenAIServing, sse
from ingot.entrypoints.openai.serving_pooling import OpenAIServingPooling
from ingot.errors import EngineRequestError, PromptTooLongError, TokenIdError
from ingot.metrics.prometheus import EngineMetrics
from ingot.version import __version__

logger = logging.getLogger("ingot")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
M = TypeVar("M", bound=BaseModel)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, err_type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, err_type: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, err_type: str | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, err_type, param), status_code=status)


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", param)


def body_too_large(max_bytes: int) -> HTTPError:
    return HTTPError(
        413, f"the request body is larger than the server's limit of {max_bytes} bytes; send "
        "a smaller request (the limit is `ingot serve --max-request-body-bytes`)",
    )


# Routes that answer without the API key: probes and version checks (and the scraper's
# /metrics unless --api-key-protect-metrics). Everything else, /docs included, needs the key.
OPEN_PATHS = frozenset({"/health", "/version"})


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key_protect_metrics: bool = False
    access_log: bool = True  # one line per request (off: --disable-uvicorn-access-log)
    log_requests: bool = False  # each generation request's parameters (--enable-log-requests)
    # Chat: --chat-template (the text), tools and reasoning parsers (resolved by cli.py).
    chat_options: ChatOptions = field(default_factory=ChatOptions)

    def needs_key(self, path: str) -> bool:
        if not self.api_key or path in OPEN_PATHS:
            return False
        return path != "/metrics" or self.api_key_protect_metrics


class GuardMiddleware:
    """API key and declared body size, checked before any route runs.

    A plain ASGI middleware rather than FastAPI's ``@app.middleware("http")``: that one wraps
    ``receive``, which hides a client's disconnect from the routes (a non-streaming request
    would then run to the end for nobody instead of being aborted).
    """

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        limit = self.settings.max_body_bytes
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            exc = body_too_large(limit)
            await error_response(exc.status, exc.message)(scope, receive, send)
            return
        key = self.settings.api_key
        if key and self.settings.needs_key(scope["path"]):
            auth = headers.get("authorization", "")
            token = auth[7:] if auth[:7].lower() == "bearer " else ""
            # Constant time: the comparison must not reveal how much of a guess was right.
            if not hmac.compare_digest(token.encode(), key.encode()):
                message = (
                    "invalid API key; send the server's key as 'Authorization: Bearer KEY'"
                    if token else
                    "missing API key; send the server's key as 'Authorization: Bearer KEY'"
                )
                await error_response(401, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Pydantic tags a union member's error with the member's type ("str", "list[int]"): not a field.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[a-z-]+\[.*\])$")


_PARAM_IN_MESSAGE = re.compile(r"^([a-z_]+) must be ")


def _split_loc(loc: tuple[Any, ...]) -> tuple[str | None, str | None]:
    """('messages', 0, 'content', 'str') -> ('messages[0].content', 'str'): the field path and
    the union member the error is about, if any."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _TYPE_TAG.match(part):
            return path or None, part
        else:
            path += ("." if path else "") + part
    return path or None, None


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    err = errors[0]
    loc, member = _split_loc(tuple(err.get("loc", ())))
    if err.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {loc}; remove it", loc
    if err.get("type") == "missing":
        return f"{loc} is required", loc
    got = err.get("input")
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    if member is not None:
        # A union field: pydantic reports one error per member; name them all as the choices.
        accepted: list[str] = []
        for e in errors:
            e_loc, e_member = _split_loc(tuple(e.get("loc", ())))
            if e_loc == loc and e_member is not None and e_member not in accepted:
                accepted.append(e_member)
        return (
            f"{loc} has the wrong type: got {type(got).__name__} {shown}; expected one of "
            f"{', '.join(accepted)}", loc,
        )
    message = f"{loc}: {err.get('msg')} (got {shown})" if loc else str(err.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return message, loc


def value_error_param(exc: ValueError) -> str | None:
    """The request field a ValueError is about: named by the request checks, or the leading
    name of SamplingParams' messages ("top_p must be ...")."""
    if isinstance(exc, RequestValueError):
        return exc.param
    match = _PARAM_IN_MESSAGE.match(str(exc))
    return match.group(1) if match else None


class _BadConstant:
    """Python's json accepts NaN and Infinity, which are not JSON and would pass range checks:
    they are parsed into this marker, then refused with the field they were found in."""

    def __init__(self, name: str) -> None:
        self.name = name


def _find_bad_constant(value: Any, path: str = "") -> tuple[str, str] | None:
    if isinstance(value, _BadConstant):
        return path, value.name
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ()
    )
    for key, item in items:
        sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)
        found = _find_bad_constant(item, sub)
        if found:
            return found
    return None


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, read up to the limit: a body without Content-Length (chunked) is cut off as
    soon as it passes the limit instead of being buffered whole."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    raw = await read_body(request, max_bytes)
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        data = json.loads(raw, parse_constant=_BadConstant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    bad = _find_bad_constant(data)
    if bad:
        field, name = bad
        raise bad_request(
            f"the request body is not valid JSON: {field} is {name}, which is not a valid JSON "
            "number; send a finite number", field,
        )
    try:
        # Strict: a JSON string is not a number and 1 is not true; floats accept integers.
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise bad_request(message, param) from None


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client goes away first, cancel it (which aborts its requests).

    The body has been read, so the next ASGI message can only be the disconnect.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the client left (or this handler was cancelled): abort the work
    if task not in done:
        raise HTTPError(499, "the client disconnected; the request was aborted")
    return task.result()


def build_app(engine: EngineClient, settings: ServerSettings, metrics: EngineMetrics) -> FastAPI:
    app = FastAPI(title="ingot", version=__version__)
    app.add_middleware(GuardMiddleware, settings=settings)
    if settings.access_log:
        app.add_middleware(AccessLogMiddleware)  # added last: outermost, sees 401s and 413s
    serving = OpenAIServing(engine, settings.served_model_name, settings.log_requests,
                            settings.chat_options)
    pooling = OpenAIServingPooling(engine, settings.served_model_name)
    model_config = engine.model_config

    @app.exception_handler(HTTPError)
    async def on_http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.err_type, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods: the same error shape as everything else.
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path}; see /docs for the routes"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, message)

    @app.exception_handler(PromptTooLongError)
    async def on_too_long(_: Request, exc: PromptTooLongError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error",
                              getattr(exc, "param", "prompt"))

    @app.exception_handler(ValueError)
    async def on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error", value_error_param(exc))

    @app.exception_handler(TemplateError)
    async def on_template_error(_: Request, exc: TemplateError) -> JSONResponse:
        return error_response(
            400, f"the chat template failed on these messages: {exc}", "invalid_request_error",
            "messages",
        )

    @app.exception_handler(EngineDeadError)
    async def on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), "server_error")

    @app.exception_handler(EngineRequestError)
    async def on_request_failed(_: Request, exc: EngineRequestError) -> JSONResponse:
        # The engine failed this request only (logged under the id the message carries).
        return error_response(500, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request", exc_info=exc)
        return error_response(500, f"internal server error: {exc!r}", "server_error")

    def check_running() -> None:
        if not engine.is_running:
            # Before a stream starts: a dead engine is a 503, not a 200 with an error event.
            raise engine.dead()

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.served_model_name:
            raise HTTPError(
                404, f"The model `{name}` does not exist; this server serves "
                f"`{settings.served_model_name}`", "not_found_error", "model",
            )

    def stream_response(body: AsyncIterator[str]) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            # Headers (200) are already sent: a failure can only be reported in the stream.
            try:
                async with aclosing(body) as pieces:
                    async for piece in pieces:
                        yield piece
            except (ValueError, EngineDeadError, EngineRequestError) as exc:
                status = (503 if isinstance(exc, EngineDeadError)
                          else 500 if isinstance(exc, EngineRequestError) else 400)
                param = value_error_param(exc) if isinstance(exc, ValueError) else None
                yield sse(error_body(status, str(exc), param=param))
                yield "data: [DONE]\n\n"

        return StreamingResponse(guarded(), media_type="text/event-stream")

    def check_generative(route: str) -> None:
        if model_config.is_pooling:
            raise bad_request(
                f"{route} generates text, and this server runs {model_config.architecture} as a "
                "pooling model (--runner pooling); use /v1/embeddings, /pooling, /classify, "
                "/score or /rerank, or serve a generative model", "model",
            )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, settings.max_body_bytes)
        check_model(body.model)
        check_generative("/v1/completions")
        check_running()
        if body.stream:
            # Prepared before the response starts, so a bad request still gets its status.
            prompts, params = serving.prepare_completion(body)
            await serving.check_constraints(params, "structured_outputs")
            return stream_response(serving.completion_stream(body, prompts, params))
        return JSONResponse(await _until_disconnected(request, serving.completion(body)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, settings.max_body_bytes)
        check_model(body.model)
        check_generative("/v1/chat/completions")
        check_running()
        if body.stream:
            prompt, params = serving.prepare_chat(body)
            await serving.check_constraints([params], body.constraint_field)
            return stream_response(serving.chat_stream(body, prompt, params))
        return JSONResponse(await _until_disconnected(request, serving.chat(body)))

    async def pooling_route(request: Request, model: type[M], handler: Any) -> Response:
        body = await parse_body(request, model, settings.max_body_bytes)
        check_model(body.model)
        check_running()
        return JSONResponse(await _until_disconnected(request, handler(body)))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await pooling_route(request, EmbeddingRequest, pooling.embeddings)

    @app.post("/pooling")
    async def pooling_output(request: Request) -> Response:
        return await pooling_route(request, PoolingRequest, pooling.pooling)

    @app.post("/classify")
    async def classify(request: Request) -> Response:
        return await pooling_route(request, ClassificationRequest, pooling.classify)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request) -> Response:
        return await pooling_route(request, ScoreRequest, pooling.score)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(request: Request) -> Response:
        return await pooling_route(request, RerankRequest, pooling.rerank)

    def model_card() -> dict[str, Any]:
        return {
            "id": settings.served_model_name,
            "object": "model",
            "created": now(),
            "owned_by": "ingot",
            "root": model_config.model,
            "max_model_len": model_config.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        # OpenAI's route; the name may hold slashes ("org/model"), hence :path.
        check_model(model)
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return error_response(
            503, f"the engine is not running: {engine.dead_error!r}; restart the server",
            "server_error",
        )

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest, settings.max_body_bytes)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages",
                              "prompt" if body.prompt is None else "messages")
        tokenizer = serving.need_tokenizer("prompt" if body.prompt is not None else "messages")
        if body.messages is not None:
            text = apply_chat_template(
                tokenizer, message_dicts(body.messages),
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
        try:  # the engine's one vocabulary check
            engine.input_processor.check_vocab("tokens", body.tokens)
        except TokenIdError as exc:
            raise bad_request(str(exc), exc.param) from None
        return {"prompt": serving.need_tokenizer("tokens").decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/start_profile")
    async def start_profile() -> dict[str, Any]:
        await engine.start_profile()
        return {"status": "profiling"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await engine.reset_prefix_cache():
            raise HTTPError(
                409, "the prefix cache is in use by running requests; retry when they finish",
                "invalid_request_error",
            )
        return JSONResponse({"status": "reset"})

    @app.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        trace = await engine.stop_profile()
        return {"status": "stopped", "trace": trace}

    return app


def build_engine(
    args: EngineArgs, metrics_name_prefix: str = "ingot"
) -> tuple[AsyncLLM, EngineMetrics, float]:
    """The engine with its metrics wired in; returns (engine, metrics, start-up seconds)."""
    start = time.perf_counter()
    config = args.create_engine_config()
    metrics = EngineMetrics(config.model_config.served_model_name, prefix=metrics_name_prefix)

    def on_abort(eng: LLMEngine, request_id: str, num_seqs: int) -> None:
        metrics.record_abort(eng, request_id, num_seqs)

    llm_engine = LLMEngine(config)
    metrics.init_buckets(llm_engine.get_stats()["buckets"])
    metrics.record_gauges(llm_engine)  # idle values (all blocks free) before any traffic
    engine = AsyncLLM(llm_engine, on_step=metrics.record_step, on_abort=on_abort)
    elapsed = time.perf_counter() - start
    startup = llm_engine.startup_stats()
    metrics.record_startup(
        elapsed, startup["load_seconds"], startup["load_bytes"], startup["compile_seconds"]
    )
    return engine, metrics, elapsed


def serve(engine_args: EngineArgs, host: str, port: int, settings_kwargs: dict[str, Any],
          metrics_name_prefix: str = "ingot") -> int:
    """Build the engine, then serve until interrupted."""
    import uvicorn

    engine, metrics, elapsed = build_engine(engine_args, metrics_name_prefix)
    served = engine.model_config.served_model_name
    settings = ServerSettings(served_model_name=served, **settings_kwargs)
    app = build_app(engine, settings, metrics)
    logger.info("ready: serving %s on http://%s:%d (%.1fs)", served, host, port, elapsed)
    try:
        # A bounded graceful shutdown: Ctrl-C must not wait forever on open streams.
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0
