"""Issue #31, items 6 and 7, against real components.

Streams: the engine sends each stream only what is new (DELTA outputs concatenate to the
cumulative one), a consumer that falls behind holds one merged output, and a real `ingot
serve` drops a raw-socket client that stops reading (``--stream-idle-timeout``): its request is
aborted and its KV blocks return, while a client that reads with pauses under the limit gets
its whole stream; over two minutes of a stalled client the server's RSS stays flat (slow).

Grammar compiles (a launcher makes schemas titled ``slow:SECONDS:TAG`` hold the only pool
thread, as a slow xgrammar compile would): past ``compile_threads + max_queued_compiles`` a
new grammar gets a 503 with Retry-After while unconstrained requests and /health answer; the
time a request waits for a pool thread counts against ``compile_timeout_s``; and a compile
nobody waits for any more (timed out, or its client left) leaves the queue without running.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
from server_utils import (
    TINY_FLAGS,
    HealthWatch,
    Server,
    assert_client_error,
    assert_recovered,
    greedy_answer,
    metric,
    run_server,
    wait_until,
)

from ingot import SamplingParams
from ingot.engine.arg_utils import EngineArgs
from ingot.engine.async_engine import AsyncLLM
from ingot.engine.llm_engine import LLMEngine
from ingot.engine.outputs import RequestOutput
from ingot.entrypoints.openai.serving import merge
from ingot.sampling_params import RequestOutputKind

E2E = Path(__file__).parent
PROMPT = [5, 6, 7, 8]


def _engine(path: Path) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(path), dtype="float32",
                                                 max_model_len=256))


# ---- deltas in process ---------------------------------------------------------------------
def _run(engine: LLMEngine, params: SamplingParams, rid: str) -> list[RequestOutput]:
    engine.add_request(rid, {"prompt_token_ids": PROMPT}, params)
    outs: list[RequestOutput] = []
    while not (outs and outs[-1].finished):
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_delta_outputs_concatenate_to_the_cumulative_one(tiny_llama_dir):
    """Same request three ways: DELTA outputs carry one step's tokens each and concatenate
    (text held back for a possible stop string included) to the CUMULATIVE output, which
    grows every step; FINAL_ONLY gives one output."""
    engine = _engine(tiny_llama_dir)
    base = dict(temperature=1.0, seed=3, n=2, max_tokens=40, ignore_eos=True, logprobs=2)
    probe = _run(engine, SamplingParams(**base), "probe")[-1].outputs[0].text
    stop = probe[12:14]  # choice 0 will stop on it: deltas must hold its prefixes back
    runs = {kind: _run(engine, SamplingParams(**base, stop=[stop], output_kind=kind), kind.name)
            for kind in RequestOutputKind}
    cumulative, deltas = runs[RequestOutputKind.CUMULATIVE], runs[RequestOutputKind.DELTA]
    (final,) = runs[RequestOutputKind.FINAL_ONLY]
    assert final.finished and len(deltas) == len(cumulative) > 3
    assert cumulative[-1].outputs[0].stop_reason == stop
    for i in range(2):
        whole = cumulative[-1].outputs[i]
        parts = [o.outputs[i] for o in deltas]
        assert "".join(p.text for p in parts) == whole.text == final.outputs[i].text
        assert sum((p.token_ids for p in parts), []) == whole.token_ids == final.outputs[i].token_ids
        # The same entries; values as close as two runs' (the CPU kernels' thread count adapts
        # to load, which changes the sums' order).
        joined = sum((p.logprobs for p in parts), [])
        assert [d.keys() for d in joined] == [d.keys() for d in whole.logprobs]
        assert all(abs(a.logprob - w[t].logprob) < 1e-3
                   for d, w in zip(joined, whole.logprobs, strict=True) for t, a in d.items())
        assert parts[-1].finish_reason == whole.finish_reason
        assert max(len(p.token_ids) for p in parts) == 1  # one step's token, never the history
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0]
    assert not engine.has_unfinished_requests()


def test_a_consumer_that_falls_behind_gets_one_merged_output(tiny_llama_dir):
    llm = AsyncLLM(_engine(tiny_llama_dir))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def main() -> tuple[RequestOutput, RequestOutput, list[RequestOutput]]:
        async with aclosing(llm.generate(PROMPT, params, "ref")) as whole:
            ref = [o async for o in whole][-1]
        delta = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                               output_kind=RequestOutputKind.DELTA)
        async with aclosing(llm.generate(PROMPT, delta, "slow")) as outs:
            first = await anext(outs)
            # The consumer stops reading until the engine has finished the request.
            while await llm.call(llm.engine.get_num_unfinished_requests):
                await asyncio.sleep(0.01)
            rest = [o async for o in outs]
        return ref, first, rest

    try:
        ref, first, rest = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        llm.shutdown()
    assert len(rest) == 1 and rest[0].finished  # everything it missed, merged into one
    assert first.outputs[0].token_ids + rest[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert first.outputs[0].text + rest[0].outputs[0].text == ref.outputs[0].text


def test_merge_runs_no_further_ahead_than_its_consumer():
    produced = 0

    async def source() -> Any:
        nonlocal produced
        for i in range(1000):
            produced += 1
            yield i

    async def main() -> int:
        async with aclosing(merge([source(), source()])) as merged:
            await anext(merged)
            await asyncio.sleep(0.05)  # the pumps run while the consumer does not
            return produced

    # One item per stream queued, one held by each blocked pump, the one read: not 2000.
    assert asyncio.run(main()) <= 6


def test_closing_a_merge_aborts_a_stream_whose_pump_waits_on_it(tiny_llama_dir):
    """A consumer that stops reading leaves its pump blocked on the queue, outside the stream;
    closing the merge must still abort the request at once (not when the stream is collected:
    here the test holds it)."""
    engine = _engine(tiny_llama_dir)
    real_step = engine.step

    def slow_step() -> list:
        time.sleep(0.01)  # 240 tokens take >= 2.4 s: it cannot finish by itself in the test
        return real_step()

    engine.step = slow_step
    llm = AsyncLLM(engine)
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def main() -> tuple[int, int]:
        stream = llm.generate(PROMPT, params, "held")  # referenced: never collected early
        merged = merge([stream])
        await anext(merged)
        await asyncio.sleep(0.3)  # the pump fills the queue and waits on it
        running = await llm.call(llm.engine.get_num_unfinished_requests)
        await merged.aclose()
        await asyncio.sleep(0.3)
        return running, await llm.call(llm.engine.get_num_unfinished_requests)

    try:
        assert asyncio.run(asyncio.wait_for(main(), 30)) == (1, 0)
    finally:
        llm.shutdown()


# ---- slow readers over HTTP ------------------------------------------------------------------
IDLE_S = 2.0
LONG_CONTEXT = 16384


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The tiny random Llama with room for long outputs (the stream must outlast the test)."""
    from tiny import make_byte_tokenizer, make_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama-long")
    make_tiny_model("llama", path, vocab_size=259, max_position_embeddings=LONG_CONTEXT)
    make_byte_tokenizer(path)
    return path


def _long_flags(path: Path) -> list[str]:
    return [str(path), "--dtype", "float32", "--max-model-len", str(LONG_CONTEXT)]


@pytest.fixture(scope="module")
def stream_server(long_model_dir, tmp_path_factory):
    with run_server([*_long_flags(long_model_dir), "--stream-idle-timeout", str(IDLE_S)],
                    tmp_path_factory.mktemp("logs")) as s:
        yield s


def _open_stream(server: Server, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """A raw client: sends the request and reads nothing (the test decides when)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def _read_available(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the socket has now, and whether the server closed it."""
    sock.setblocking(False)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
        return data, True
    except BlockingIOError:
        return data, False
    finally:
        sock.setblocking(True)


def _running(server: Server) -> float:
    return metric(server.metrics(), "ingot:num_requests_running")


def _kv(server: Server) -> tuple[float, float]:
    m = server.metrics()
    return metric(m, "ingot:kv_cache_usage_perc"), metric(m, "ingot:kv_cache_free_blocks")


def _aborted(server: Server) -> float:
    return metric(server.metrics(), "ingot:request_success_total", finished_reason="abort")


def test_a_client_that_stops_reading_is_dropped_and_its_blocks_return(stream_server):
    server = stream_server
    baseline = greedy_answer(server)
    idle_kv = _kv(server)
    aborted = _aborted(server)
    body = {"prompt": "hello", "max_tokens": LONG_CONTEXT - 100, "n": 4, "logprobs": 20,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with HealthWatch(server) as watch:
        sock = _open_stream(server, body, rcvbuf=4096)  # and never reads
        try:
            assert wait_until(lambda: _running(server) == 4, timeout=10)  # n=4 sequences
            # The buffers fill within a few hundred KB of output, then the idle limit runs.
            assert wait_until(lambda: _running(server) == 0, timeout=IDLE_S + 20), \
                "the stalled stream was never dropped"
            m = server.metrics()
            assert metric(m, "ingot:generation_tokens_total") < 4 * (LONG_CONTEXT - 100) / 2
            assert _aborted(server) == aborted + 4  # aborted (n=4), not finished
            assert wait_until(lambda: _kv(server) == idle_kv, timeout=5), (_kv(server), idle_kv)
            assert "dropped a streaming client" in server.log()
            # The server closed the connection: what it had sent drains, then EOF, no [DONE].
            data, closed = b"", False
            deadline = time.monotonic() + 10
            while not closed and time.monotonic() < deadline:
                more, closed = _read_available(sock)
                data += more
                time.sleep(0.05)
            assert closed and b"data: {" in data and b"[DONE]" not in data
        finally:
            sock.close()
    watch.assert_healthy()
    assert_recovered(server, baseline)


def test_a_reader_that_pauses_under_the_limit_gets_its_whole_stream(stream_server):
    """The at-limit twin of the stalled client (the same small receive buffer): far more output
    than the buffers hold, read in bursts with pauses; the stream completes and nothing is
    aborted. A send waits until the connection's write buffer drains to its low-water mark
    (tens of KB), which a 4 KB receive buffer passes on a few KB per read: the reader must
    take those within the limit, so it pauses a twentieth of it (pauses of half the limit, one
    4 KB gulp a second, were sometimes dropped on a loaded machine)."""
    server = stream_server
    aborted = _aborted(server)
    body = {"prompt": "hello", "max_tokens": 400, "n": 4, "logprobs": 20, "ignore_eos": True,
            "temperature": 0, "stream": True}
    sock = _open_stream(server, body, rcvbuf=4096)  # as the stalled client's
    data, closed, bursts = b"", False, 0
    deadline = time.monotonic() + 90
    try:
        while b"data: [DONE]" not in data and not closed:
            assert time.monotonic() < deadline, "the stream did not finish"
            time.sleep(IDLE_S / 20)
            more, closed = _read_available(sock)
            data += more
            bursts += bool(more)
    finally:
        sock.close()
    assert b"data: [DONE]" in data
    # More than the buffers hold (a few hundred KB), taken in three or more bursts: the sends
    # did wait for the reader.
    assert len(data) > 500_000 and bursts >= 3, (len(data), bursts)
    assert data.count(b'"finish_reason": "length"') == 4
    assert _aborted(server) == aborted
    assert wait_until(lambda: _running(server) == 0, timeout=10)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_rss_stays_flat_while_a_client_stalls_for_two_minutes(long_model_dir, tmp_path):
    """The limit set past the test: a client stalls for two minutes while its request keeps
    producing (each step slowed by 40 ms, so its 4000 tokens cannot finish), and the server's
    RSS stays within 50 MB. Before deltas, each step queued a copy of the whole output so far:
    this test's setup grew the old server by 182 MB in the two minutes (this one: 20 MB). The
    context stays at 4096: the engine's own decode temporaries grow with the context bucket (at
    16k context a client that reads grows RSS by about 40 MB too), not what this measures."""
    launcher = [sys.executable, str(E2E / "slow_step_cli.py")]
    env = {**os.environ, "INGOT_TEST_STEP_DELAY": "0.04"}
    context = 4096
    # Every chunk carries the model's name: a 2000-character one pads each to ~2 KB, so the
    # kernel's buffers fill within seconds (after them, the old server queued O(T^2) bytes)
    # while the engine's and the stream's own state stay small.
    with run_server([str(long_model_dir), "--dtype", "float32", "--max-model-len", str(context),
                     "--served-model-name", "m" * 2000, "--stream-idle-timeout", "600"],
                    tmp_path, launcher=launcher, env=env) as server:
        baseline = greedy_answer(server)
        # n=8 choices, no logprobs: what it has not read (held for it, as a whole response
        # would be) stays small.
        body = {"prompt": "hello", "max_tokens": context - 100, "n": 8,
                "ignore_eos": True, "temperature": 0, "stream": True}
        sock = _open_stream(server, body, rcvbuf=4096)
        try:
            assert wait_until(lambda: metric(server.metrics(),
                                             "ingot:generation_tokens_total") > 500, timeout=60)
            generated = metric(server.metrics(), "ingot:generation_tokens_total")
            samples = []
            end = time.monotonic() + 120
            while time.monotonic() < end:
                samples.append(_rss_bytes(server.proc.pid))
                time.sleep(5)
            m = server.metrics()
            # It produced throughout, for a client that read nothing.
            assert metric(m, "ingot:num_requests_running") == 8
            assert metric(m, "ingot:generation_tokens_total") - generated > 2000
            growth = max(samples) - min(samples)
            print(f"RSS {min(samples) / 2**20:.0f}-{max(samples) / 2**20:.0f} MB "
                  f"over 120 s ({len(samples)} samples)")
            assert growth < 50 * 2**20, f"RSS grew {growth / 2**20:.0f} MB"
        finally:
            sock.close()  # the disconnect aborts the request
        assert wait_until(lambda: metric(server.metrics(), "ingot:num_requests_running") == 0,
                          timeout=15)
        assert_recovered(server, baseline)


# ---- grammar compiles ------------------------------------------------------------------------
TIMEOUT_S = 3
COMPILES = {"compile_threads": 1, "max_queued_compiles": 1, "compile_timeout_s": TIMEOUT_S}


@pytest.fixture(scope="module")
def compile_server(tiny_llama_dir, tmp_path_factory):
    launcher = [sys.executable, str(E2E / "slow_compile_cli.py")]
    with run_server([str(tiny_llama_dir), *TINY_FLAGS, "--structured-outputs-config",
                     json.dumps(COMPILES)], tmp_path_factory.mktemp("logs"),
                    launcher=launcher) as s:
        yield s


def _constrained(title: str, stream: bool = False) -> dict:
    """A request whose schema compiles as its title says (slow_compile_cli.py)."""
    schema = {"title": title, "type": "object",
              "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["x"], "additionalProperties": False}
    return {"prompt": "x", "max_tokens": 20, "temperature": 0, "stream": stream,
            "structured_outputs": {"json": schema, "disable_any_whitespace": True}}


def _post(server: Server, body: dict) -> tuple[int, dict, bytes, float]:
    start = time.monotonic()
    status, headers, raw = server.request("POST", "/v1/completions", body, timeout=30)
    return status, headers, raw, time.monotonic() - start


def _started(server: Server, tag: str) -> bool:
    return f"compile started: {tag}\n" in server.log()


def _ok(result: tuple[int, dict, bytes, float]) -> dict:
    status, _, raw, _ = result
    assert status == 200, raw[:500]
    return json.loads(raw)


def test_a_full_compile_queue_is_a_503_while_the_rest_serves(compile_server):
    server = compile_server
    baseline = greedy_answer(server)
    with HealthWatch(server) as watch, ThreadPoolExecutor(4) as pool:
        running = pool.submit(_post, server, _constrained("slow:2:a1"))  # the only thread
        assert wait_until(lambda: _started(server, "a1"), timeout=10)
        # At the limit: admitted, it waits for the thread (and fits its timeout).
        queued = pool.submit(_post, server, _constrained("slow:0:a2"))
        time.sleep(0.5)  # it reaches the engine thread in milliseconds
        status, headers, raw, elapsed = _post(server, _constrained("slow:0:a3"))
        assert status == 503 and elapsed < 10, (status, raw[:300])
        err = json.loads(raw)["error"]
        assert err["type"] == "server_error" and err["code"] == 503
        assert "max_queued_compiles" in err["message"] and "Traceback" not in raw.decode()
        assert headers["retry-after"] == str(TIMEOUT_S)
        # The same grammar as the running compile adds nothing to the queue: admitted.
        joined = pool.submit(_post, server, _constrained("slow:2:a1"))
        # Unconstrained requests are not held up.
        free = _post(server, {"prompt": "hi", "max_tokens": 4})
        assert free[0] == 200 and free[3] < 10
        for result in (running, queued, joined):
            assert json.loads(_ok(result.result())["choices"][0]["text"])["x"] in range(10)
    watch.assert_healthy()
    assert not _started(server, "a3")
    assert_recovered(server, baseline)


def test_the_wait_for_a_pool_thread_counts_against_compile_timeout(compile_server):
    server = compile_server
    baseline = greedy_answer(server)
    with HealthWatch(server) as watch, ThreadPoolExecutor(4) as pool:
        running = pool.submit(_post, server, _constrained("slow:4:b1"))  # outlives the timeout
        assert wait_until(lambda: _started(server, "b1"), timeout=10)
        # Its own compile is instant, but it waits for the thread past compile_timeout_s.
        status, _, raw, elapsed = _post(server, _constrained("slow:0:b2"))
        err = assert_client_error(status, raw, f"did not compile within {TIMEOUT_S} s",
                                  "compile_timeout_s")
        assert err["param"] == "structured_outputs" and TIMEOUT_S - 0.5 < elapsed < 10
        # Nobody waits for b2's compile any more: it left the queue, so a new grammar is
        # admitted (not a 503) while b1 still holds the thread, and compiles after it.
        after = pool.submit(_post, server, _constrained("slow:0:b3"))
        assert running.result()[0] == 400  # b1 itself timed out (its compile ran on)
        assert _ok(after.result())["choices"][0]["finish_reason"] == "stop"
    watch.assert_healthy()
    assert wait_until(lambda: "compile finished: b1\n" in server.log(), timeout=10)
    assert not _started(server, "b2")  # withdrawn before it ran
    assert_recovered(server, baseline)


def test_a_client_that_leaves_while_its_compile_waits_withdraws_it(compile_server):
    server = compile_server
    baseline = greedy_answer(server)
    with HealthWatch(server) as watch, ThreadPoolExecutor(4) as pool:
        running = pool.submit(_post, server, _constrained("slow:2:c1"))
        assert wait_until(lambda: _started(server, "c1"), timeout=10)
        sock = _open_stream(server, _constrained("slow:0:c2", stream=True))
        time.sleep(0.5)  # c2's compile is queued; its stream has not started
        sock.close()  # the client leaves
        time.sleep(0.5)
        # c2 left the queue: the next new grammar is admitted (a 503 if c2 still held it).
        after = _post(server, _constrained("slow:0:c3"))
        assert after[0] == 200, after[2][:300]
        _ok(running.result())
    watch.assert_healthy()
    assert not _started(server, "c2")
    assert_recovered(server, baseline)
