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
import math
import os
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ingot.config import EngineConfig, ProfilerConfig
from ingot.engine.arg_utils import EngineArgs
from ingot.engine.async_engine import AsyncLLM
from ingot.engine.llm_engine import LLMEngine
from ingot.engine.protocol import EngineClient, EngineDeadError
from ingot.entrypoints.openai.access_log import AccessLogMiddleware
from ingot.entrypoints.openai.limits import ServerLimits, check_request_shape
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
from ingot.entrypoints.openai.serving import (
    ChatOptions,
    IdleLimitedStreamingResponse,
    OpenAIServing,
    sse,
)
from ingot.entrypoints.openai.serving_pooling import OpenAIServingPooling
from ingot.errors import (
    EngineRequestError,
    PromptTooLongError,
    ServerBusyError,
    TokenIdError,
    new_error_id,
)
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
    415: "invalid_request_error",
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


def is_json_media_type(content_type: str) -> bool:
    """application/json (any parameters, e.g. charset) or an application/*+json type."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


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
    limits: ServerLimits = field(default_factory=ServerLimits)  # docs/serving.md, Security
    # The engine's profiler output directory (additional_config.profiler, --profiler-dir or
    # $VLLM_TORCH_PROFILER_DIR); None: profiling is off and its routes answer 404.
    profiler_dir: str | None = None

    def needs_key(self, path: str) -> bool:
        if not self.api_key or path in OPEN_PATHS:
            return False
        return path != "/metrics" or self.api_key_protect_metrics


class GuardMiddleware:
    """API key, declared body size and body type, checked before any route runs.

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
        if scope["method"] in ("POST", "PUT", "PATCH"):
            # Bodies are JSON. A browser may send another page's "simple" cross-site POST
            # (text/plain, a form) to a key-less local server: refused unread. A POST without
            # a body and without a type (curl -X POST /start_profile) is fine.
            content_type = headers.get("content-type")
            has_body = (length.isdigit() and int(length) > 0) or "transfer-encoding" in headers
            if (content_type is not None or has_body) and not is_json_media_type(
                    content_type or ""):
                got = repr(content_type[:60]) if content_type is not None else "none"
                message = (f"the request body must be JSON: send 'Content-Type: "
                           f"application/json' (got {got})")
                await error_response(415, message)(scope, receive, send)
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
    """Python's json accepts NaN and Infinity, which are not JSON, and parses 1e400 as
    infinity: both would pass range checks. They are parsed into this marker, then refused
    with the field they were found in."""

    def __init__(self, name: str) -> None:
        self.name = name


def _parse_float(text: str) -> float | _BadConstant:
    value = float(text)
    return value if math.isfinite(value) else _BadConstant(text)


_NESTED = frozenset({dict, list, _BadConstant})


def check_json_body(data: Any, max_depth: int) -> None:
    """Every non-finite number and every container deeper than ``max_depth``, refused with
    its field. Level by level, not recursive (a deep body must not exhaust the interpreter's
    stack); a container's items are visited one by one only when some of them nest, so a body
    of millions of numbers costs about what parsing it did."""
    # levels[d]: the containers at depth d + 1, each (value, index of its parent one level up,
    # its key there); a field's path is rebuilt from them only for the error.
    levels: list[list[tuple[Any, int, str | int]]] = [[(data, -1, "")]]

    def field(depth: int, index: int, key: str | int | None = None) -> str:
        keys = [] if key is None else [key]
        while depth > 0:
            _, index, parent_key = levels[depth][index]
            keys.append(parent_key)
            depth -= 1
        out = ""
        for k in reversed(keys):
            out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
        return out

    while levels[-1]:
        depth = len(levels) - 1
        if depth >= max_depth:
            path = field(depth, 0)
            raise bad_request(
                f"{path} nests JSON deeper than the server's limit of {max_depth} levels "
                "(--max-json-depth); send a flatter body", path.split(".")[0].split("[")[0],
            )
        deeper: list[tuple[Any, int, str | int]] = []
        for index, (value, _, _) in enumerate(levels[-1]):
            items = value.values() if type(value) is dict else value
            if _NESTED.isdisjoint(map(type, items)):
                continue  # only scalars: checked in C, no item visited here
            for key, item in value.items() if type(value) is dict else enumerate(value):
                kind = type(item)
                if kind is dict or kind is list:
                    deeper.append((item, index, key))
                elif kind is _BadConstant:
                    path = field(depth, index, key)
                    raise bad_request(
                        f"the request body is not valid JSON: {path} is {item.name}, which is "
                        "not a finite number; send a finite number", path,
                    )
        levels.append(deeper)


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


async def parse_body(request: Request, model: type[M], settings: ServerSettings) -> M:
    raw = await read_body(request, settings.max_body_bytes)
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    limits = settings.limits
    try:
        data = json.loads(raw, parse_constant=_BadConstant, parse_float=_parse_float)
    except RecursionError:
        # Far deeper than any limit (the parser's own stack ran out): refused like one.
        raise bad_request(
            "the request body nests JSON deeper than the server's limit of "
            f"{limits.max_json_depth} levels (--max-json-depth); send a flatter body"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    check_request_shape(data, limits)  # first: O(1) a field, refuses huge lists unwalked
    check_json_body(data, limits.max_json_depth)
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
    serving = OpenAIServing(engine, settings.served_model_name, settings.log_requests,
                            settings.chat_options, settings.limits)
    pooling = OpenAIServingPooling(engine, settings.served_model_name)
    model_config = engine.model_config

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not model_config.is_pooling and engine.tokenizer is not None:
            serving.renderer.start()  # chat requests will render templates
        try:
            yield
        finally:
            serving.renderer.close()

    app = FastAPI(title="ingot", version=__version__, lifespan=lifespan)
    app.add_middleware(GuardMiddleware, settings=settings)
    if settings.access_log:
        app.add_middleware(AccessLogMiddleware)  # added last: outermost, sees 401s and 413s
    # The engine's failure, logged once with its traceback under the id clients are given.
    dead_ids: dict[int, tuple[BaseException, str]] = {}

    def dead_message() -> str:
        error = engine.dead_error
        if error is None:
            return "the engine is shut down; restart the server"
        if id(error) not in dead_ids:
            dead_ids[id(error)] = (error, new_error_id())
            logger.error("engine failure %s", dead_ids[id(error)][1], exc_info=error)
        return (f"the engine failed ({type(error).__name__}, error id "
                f"{dead_ids[id(error)][1]}; the server log has the details); restart the server")

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

    @app.exception_handler(EngineDeadError)
    async def on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, dead_message(), "server_error")

    @app.exception_handler(ServerBusyError)
    async def on_busy(_: Request, exc: ServerBusyError) -> JSONResponse:
        response = error_response(503, str(exc), "server_error")
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    def internal_error(request: Request, exc: BaseException) -> dict[str, Any]:
        """A 500's body: a message and an id; the traceback goes to the log under the id."""
        error_id = new_error_id()
        logger.error("internal error %s in %s %s", error_id, request.method, request.url.path,
                     exc_info=exc)
        return error_body(500, f"internal server error (error id {error_id}; the server log "
                          "has the details)", "server_error")

    @app.exception_handler(EngineRequestError)
    async def on_request_failed(_: Request, exc: EngineRequestError) -> JSONResponse:
        # The engine failed this request only (logged under the id the message carries).
        return error_response(500, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(internal_error(request, exc), status_code=500)

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

    def stream_response(request: Request, body: AsyncIterator[str]) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            # Headers (200) are already sent: a failure can only be reported in the stream.
            try:
                async with aclosing(body) as pieces:
                    async for piece in pieces:
                        yield piece
            except EngineDeadError:
                yield sse(error_body(503, dead_message()))
                yield "data: [DONE]\n\n"
            except EngineRequestError as exc:  # its message carries the logged error id
                yield sse(error_body(500, str(exc)))
                yield "data: [DONE]\n\n"
            except ValueError as exc:
                yield sse(error_body(400, str(exc), param=value_error_param(exc)))
                yield "data: [DONE]\n\n"
            except Exception as exc:  # noqa: BLE001 - reported by id, logged in full
                yield sse(internal_error(request, exc))
                yield "data: [DONE]\n\n"

        return IdleLimitedStreamingResponse(guarded(), settings.limits.stream_idle_timeout,
                                            media_type="text/event-stream")

    def check_generative(route: str) -> None:
        if model_config.is_pooling:
            raise bad_request(
                f"{route} generates text, and this server runs {model_config.architecture} as a "
                "pooling model (--runner pooling); use /v1/embeddings, /pooling, /classify, "
                "/score or /rerank, or serve a generative model", "model",
            )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, settings)
        check_model(body.model)
        check_generative("/v1/completions")
        check_running()
        if body.stream:
            # Prepared before the response starts, so a bad request still gets its status.
            prompts, params = serving.prepare_completion(body)
            # A client that leaves while its grammar waits for the compile pool withdraws it.
            await _until_disconnected(request, serving.check_constraints(
                params, "structured_outputs"))
            return stream_response(request, serving.completion_stream(body, prompts, params))
        return JSONResponse(await _until_disconnected(request, serving.completion(body)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, settings)
        check_model(body.model)
        check_generative("/v1/chat/completions")
        check_running()
        if body.stream:
            prompt, params = await serving.prepare_chat(body)
            await _until_disconnected(request, serving.check_constraints(
                [params], body.constraint_field))
            return stream_response(request, serving.chat_stream(body, prompt, params))
        return JSONResponse(await _until_disconnected(request, serving.chat(body)))

    async def pooling_route(request: Request, model: type[M], handler: Any) -> Response:
        body = await parse_body(request, model, settings)
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
        return error_response(503, dead_message(), "server_error")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest, settings)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages",
                              "prompt" if body.prompt is None else "messages")
        tokenizer = serving.need_tokenizer("prompt" if body.prompt is not None else "messages")
        if body.messages is not None:
            text = await serving.render_chat(message_dicts(body.messages),
                                             body.add_generation_prompt)
            tokens = tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": model_config.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest, settings)
        check_model(body.model)
        try:  # the engine's one vocabulary check
            engine.input_processor.check_vocab("tokens", body.tokens)
        except TokenIdError as exc:
            raise bad_request(str(exc), exc.param) from None
        return {"prompt": serving.need_tokenizer("tokens").decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # Off unless enabled: a disabled route is a 404 (as vLLM's are) that names its flag.
    def check_profiling(path: str) -> None:
        if settings.profiler_dir is None:
            raise HTTPError(
                404, f"{path} is off: profiling is enabled by starting the server with "
                "--profiler-dir DIR (or $VLLM_TORCH_PROFILER_DIR, or --additional-config "
                "'{\"profiler\": {...}}')", "not_found_error",
            )

    @app.post("/start_profile")
    async def start_profile() -> dict[str, Any]:
        check_profiling("/start_profile")
        await engine.start_profile()
        return {"status": "profiling"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not settings.limits.enable_admin_routes:
            raise HTTPError(
                404, "/reset_prefix_cache is off: start the server with --enable-admin-routes "
                "to serve it", "not_found_error",
            )
        if not await engine.reset_prefix_cache():
            raise HTTPError(
                409, "the prefix cache is in use by running requests; retry when they finish",
                "invalid_request_error",
            )
        return JSONResponse({"status": "reset"})

    @app.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        check_profiling("/stop_profile")
        trace = await engine.stop_profile()
        # Relative to the profiler directory: the client learns no path of the server's.
        if trace is not None and settings.profiler_dir is not None:
            trace = os.path.relpath(trace, settings.profiler_dir)
        return {"status": "stopped", "trace": trace}

    return app


def build_engine(
    config: EngineConfig, metrics_name_prefix: str = "ingot", start: float | None = None,
) -> tuple[AsyncLLM, EngineMetrics, float]:
    """The engine with its metrics wired in; returns (engine, metrics, start-up seconds since
    ``start``, default now: pass when resolving the config began)."""
    start = time.perf_counter() if start is None else start
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


# Data a connection's socket may hold that the client's TCP window does not take (Linux's
# TCP_NOTSENT_LOWAT, inherited by accepted sockets): past it the server's sends wait, so a
# client that stopped reading shows within this much output (the stream idle limit then
# applies), and each such connection holds this much kernel memory rather than up to the
# 4 MB send buffer autotuning allows. Data in flight is not counted: throughput is the same.
UNSENT_LIMIT_BYTES = 128 * 1024


def limit_unsent_bytes(sock: Any) -> None:
    option = getattr(socket, "TCP_NOTSENT_LOWAT", 25 if sys.platform == "linux" else None)
    if option is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, UNSENT_LIMIT_BYTES)
    except OSError:  # not TCP (a Unix socket), or not supported: the kernel's default
        pass


def serve(engine_args: EngineArgs, host: str, port: int, settings_kwargs: dict[str, Any],
          metrics_name_prefix: str = "ingot") -> int:
    """Build the engine, then serve until interrupted."""
    import uvicorn

    start = time.perf_counter()
    config = engine_args.create_engine_config()
    engine, metrics, elapsed = build_engine(config, metrics_name_prefix, start)
    served = engine.model_config.served_model_name
    profiler = config.additional_config.get("profiler")
    settings = ServerSettings(
        served_model_name=served,
        profiler_dir=ProfilerConfig.from_dict(profiler).output_dir if profiler is not None
        else None,
        **settings_kwargs,
    )
    app = build_app(engine, settings, metrics)
    logger.info("ready: serving %s on http://%s:%d (%.1fs)", served, host, port, elapsed)

    class Server(uvicorn.Server):
        """uvicorn's server, its listening sockets given the unsent-bytes limit (accepted
        connections inherit it)."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            for listener in getattr(self, "servers", ()):
                for sock in listener.sockets:
                    limit_unsent_bytes(sock)

    # A bounded graceful shutdown: Ctrl-C must not wait forever on open streams.
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  access_log=False, timeout_graceful_shutdown=5))
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C after its graceful shutdown (uvicorn.run ignores it)
    finally:
        engine.shutdown()
    return 0 if server.started else 3  # uvicorn.run's exit code when it could not start
