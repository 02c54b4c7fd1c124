"""A bounded load test on the default model: 64 concurrent streaming clients, 20 of which hang
up after a few chunks. The other 44 finish untouched, the 20 are aborted (visible in /metrics),
and every KV block comes back."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from server_utils import metric, run_server, wait_until

CLIENTS = 64
DISCONNECTS = 20
MAX_TOKENS = 24
CHUNKS_BEFORE_HANGUP = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # No --model: the embedded default model.
    with run_server(["--max-model-len", "512"], tmp_path_factory.mktemp("logs"),
                    startup_timeout=120) as s:
        yield s


async def _client(client: openai.AsyncOpenAI, model: str, i: int, hang_up: bool) -> dict:
    stream = await client.completions.create(
        model=model, prompt=f"Story number {i}: once upon a time", max_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks, text, finish, usage = 0, "", None, None
    try:
        async for chunk in stream:
            chunks += 1
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
            if hang_up and chunks >= CHUNKS_BEFORE_HANGUP:
                break
    finally:
        await stream.close()  # for the hang-ups: closes the connection mid-stream
    return {"chunks": chunks, "text": text, "finish": finish, "usage": usage}


@pytest.mark.slow
def test_64_streams_with_20_hangups(server):
    idle = server.metrics()
    with openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused") as sync_client:
        model = sync_client.models.list().data[0].id

    async def main() -> list[dict]:
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        try:
            jobs = [_client(client, model, i, hang_up=i % 3 == 0 and i < 3 * DISCONNECTS)
                    for i in range(CLIENTS)]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=150)
        finally:
            await client.close()

    start = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - start
    hung_up = [r for i, r in enumerate(results) if i % 3 == 0 and i < 3 * DISCONNECTS]
    finished = [r for i, r in enumerate(results) if not (i % 3 == 0 and i < 3 * DISCONNECTS)]
    assert len(hung_up) == DISCONNECTS and len(finished) == CLIENTS - DISCONNECTS
    for r in finished:  # untouched by the hang-ups
        assert r["finish"] == "length", r
        assert r["usage"].completion_tokens == MAX_TOKENS
        assert r["text"]
    assert all(r["chunks"] == CHUNKS_BEFORE_HANGUP and r["finish"] is None for r in hung_up)

    def settled() -> bool:
        m = server.metrics()
        return (
            metric(m, "ingot:num_requests_running") == 0
            and metric(m, "ingot:num_requests_waiting") == 0
            and metric(m, "ingot:kv_cache_free_blocks") == metric(idle, "ingot:kv_cache_free_blocks")
        )

    assert wait_until(settled, timeout=30), server.metrics_text()
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(idle, name, **labels)

    assert delta("ingot:request_success_total", finished_reason="abort") == DISCONNECTS
    assert delta("ingot:request_success_total", finished_reason="length") == CLIENTS - DISCONNECTS
    # The hang-ups stopped generating: fewer than 24 tokens each.
    generated = delta("ingot:generation_tokens_total")
    assert (CLIENTS - DISCONNECTS) * MAX_TOKENS <= generated < CLIENTS * MAX_TOKENS
    assert metric(after, "ingot:kv_cache_usage_perc") == 0
    assert server.request("GET", "/health")[0] == 200
    print(f"64 streams in {elapsed:.1f}s")
