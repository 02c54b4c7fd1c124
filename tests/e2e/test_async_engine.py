"""AsyncLLM in-process on the tiny model: per-request streams, aborts that free blocks at once,
and an engine failure that reaches every pending request (and the health check) without a
hang. The HTTP app is driven directly over ASGI for the failure case."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import aclosing
from typing import Any

import pytest

from ingot import SamplingParams
from ingot.engine.arg_utils import EngineArgs
from ingot.engine.async_engine import AsyncLLM
from ingot.engine.llm_engine import LLMEngine
from ingot.engine.protocol import EngineDeadError
from ingot.entrypoints.openai.api_server import ServerSettings, build_app
from ingot.metrics.prometheus import EngineMetrics

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def _engine(path) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(path), dtype="float32",
                                                 max_model_len=256))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    llm = AsyncLLM(_engine(tiny_llama_dir))
    yield llm
    llm.shutdown()


def _free_blocks(llm: AsyncLLM) -> int:
    return llm.engine.engine_core.kv_cache_manager.pool.num_free_blocks


def _all_blocks(llm: AsyncLLM) -> int:
    return llm.engine.engine_core.kv_cache_manager.pool.num_usable_blocks


async def _idle(llm: AsyncLLM) -> tuple[int, int]:
    """(requests in the engine, free blocks), read on the engine thread between steps."""
    return await llm.call(lambda: (llm.engine.get_num_unfinished_requests(), _free_blocks(llm)))


def test_concurrent_streams_are_separate_and_cumulative(engine):
    async def run(prompt: list[int]) -> list[Any]:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        return [o async for o in engine.generate(prompt, params, f"r{prompt[0]}")]

    async def main() -> list[list[Any]]:
        return await asyncio.wait_for(
            asyncio.gather(*(run([p] * 5) for p in (10, 20, 30, 40))), timeout=60)

    streams = asyncio.run(main())
    for prompt_id, outs in zip((10, 20, 30, 40), streams, strict=True):
        assert all(o.request_id == f"r{prompt_id}" for o in outs)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[-1] == 6  # cumulative, growing
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    # Alone, a prompt gives the same tokens as in the batch.
    alone = asyncio.run(main())
    assert [s[-1].outputs[0].token_ids for s in alone] == [s[-1].outputs[0].token_ids
                                                           for s in streams]


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    async def main() -> tuple[int, int]:
        async with aclosing(engine.generate([5] * 40, LONG, "leave")) as stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 3:
                    break
        return await _idle(engine)

    requests, free = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert requests == 0 and free == _all_blocks(engine)


def test_cancelled_task_aborts_its_request(engine):
    async def main() -> tuple[int, int]:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate([6] * 40, LONG, "cancel-me"):
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), timeout=30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _idle(engine)

    requests, free = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert requests == 0 and free == _all_blocks(engine)


def test_bad_request_fails_only_itself(engine):
    async def main() -> None:
        with pytest.raises(ValueError, match="vocabulary"):
            async for _ in engine.generate([10**6], LONG, "bad"):
                pass
        outs = [o async for o in engine.generate(
            [7, 8], SamplingParams(max_tokens=2, ignore_eos=True), "good")]
        assert outs[-1].finished

    asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert engine.is_running


async def asgi(app: Any, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    """One request through the ASGI app; the client never disconnects."""
    raw = b"" if body is None else json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": method, "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }
    pending = [{"type": "http.request", "body": raw, "more_body": False}]
    forever = asyncio.Event()

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await forever.wait()
        return {"type": "http.disconnect"}

    status, chunks = 0, []

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


def test_engine_failure_reaches_every_pending_request(tiny_llama_dir, caplog):
    """The step raises while two whole requests, one HTTP stream and one AsyncLLM stream are
    mid-flight: each gets the error within seconds, /health turns 503, new work is refused.
    HTTP clients get the failure's error id; the log has the error under it."""
    llm = AsyncLLM(_engine(tiny_llama_dir))
    fail = threading.Event()
    real_step = llm.engine.step

    def faulty_step() -> list:
        if fail.is_set():
            raise RuntimeError("injected fault")
        # Good but slow steps until the test has every request mid-flight (200 tokens take
        # at least 10 s, so none finishes first); never blocking, so adds still get through.
        time.sleep(0.05)
        return real_step()

    llm.engine.step = faulty_step
    app = build_app(llm, ServerSettings(served_model_name="tiny"), EngineMetrics("tiny"))

    async def direct() -> BaseException:
        try:
            async for _ in llm.generate([9] * 8, LONG, "direct"):
                pass
        except EngineDeadError as exc:
            return exc
        raise AssertionError("the stream ended without the engine's error")

    async def main() -> tuple:
        assert (await asgi(app, "GET", "/health"))[0] == 200
        tasks = [
            asyncio.create_task(asgi(app, "POST", "/v1/completions",
                                     {"prompt": "hello", "max_tokens": 200, "ignore_eos": True})),
            asyncio.create_task(asgi(app, "POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 200,
                "ignore_eos": True})),
            asyncio.create_task(asgi(app, "POST", "/v1/completions", {
                "prompt": "stream me", "max_tokens": 200, "ignore_eos": True, "stream": True})),
            asyncio.create_task(direct()),
        ]
        for _ in range(300):  # until all four are inside the engine (bounded: 30 s)
            if llm.engine.get_num_unfinished_requests() == 4:
                break
            await asyncio.sleep(0.1)
        assert llm.engine.get_num_unfinished_requests() == 4
        fail.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=15)
        health = await asgi(app, "GET", "/health")
        after = await asgi(app, "POST", "/v1/completions", {"prompt": "hi", "stream": True})
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate([1, 2], LONG, "late"):
                pass
        return results, health, after

    try:
        (whole1, whole2, stream, direct_exc), health, after = asyncio.run(main())
    finally:
        fail.set()
        llm.shutdown()
    (logged,) = [r for r in caplog.records if r.getMessage().startswith("engine failure ")]
    error_id = logged.getMessage().split()[-1]
    assert "injected fault" in str(logged.exc_info[1])
    for status, body in (whole1, whole2):
        assert status == 503
        err = json.loads(body)["error"]
        assert err["code"] == 503 and f"error id {error_id}" in err["message"]
        assert "injected fault" not in err["message"]
    status, body = stream
    assert status == 200  # headers went out before the failure: the error is an event
    events = [ln[6:] for ln in body.decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert f"error id {error_id}" in json.loads(events[-2])["error"]["message"]
    assert "injected fault" in str(direct_exc)
    assert not llm.is_running and isinstance(llm.dead_error, RuntimeError)
    assert health[0] == 503 and f"error id {error_id}" in json.loads(health[1])["error"]["message"]
    assert after[0] == 503  # a new stream is refused before it starts
