"""`ingot bench serve`: load a running OpenAI-compatible server at a fixed concurrency.

Each of ``concurrency`` client threads sends streaming /v1/completions requests back to back
until ``num_requests`` have been sent. Prompts are the shared workloads' seeded token-id lists
(no tokenizer on the client, identical work for any server); ``ignore_eos`` makes every request
generate exactly ``output_len`` tokens. Reports time to first token (TTFT), inter-token latency
(ITL), request throughput and output tokens/s as one RESULT line.

``endpoint="chat"`` sends /v1/chat/completions instead, each prompt written as words (one
common English word per prompt id, about one token each for BPE vocabularies, plus the chat
template's framing). TTFT is the first chunk that carries a choice, as a client counts it: a
server that sent an empty role chunk before prefill would show it here.

Threads with the standard library's http.client, not an async client: ingot's runtime
dependencies carry no HTTP client, and at the concurrencies a 2-core server sustains the
client's own overhead is small beside the server's per-step time.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingot.benchmarks.workloads import prompts_for


@dataclass
class RequestTiming:
    """What one streamed request measured (seconds, from the moment it was sent)."""

    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # one entry per token after the first
    output_tokens: int = 0
    error: str | None = None


# Chat prompts: one of these per prompt id (common words, mostly one BPE token each).
CHAT_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "as", "with", "by", "at", "from",
    "his", "an", "were", "are", "which", "this", "be", "or", "has", "had", "not", "but", "one",
    "its", "new", "after", "first", "also", "they", "who", "two", "her", "she", "been", "other",
    "when", "time", "during", "there", "into", "more", "school", "years", "over", "only",
    "city", "some", "world", "would", "where", "later", "up", "such", "used", "many", "can",
    "state", "about", "national", "out",
)


def parse_sse_line(line: bytes) -> dict[str, Any] | None:
    """The JSON body of one ``data: {...}`` server-sent-event line; None for anything else
    (blank separators, comments, ``data: [DONE]``)."""
    text = line.decode("utf-8", errors="replace").strip()
    if not text.startswith("data:"):
        return None
    payload = text[len("data:"):].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


def chunk_token_count(chunk: dict[str, Any], tokens_so_far: int) -> int | None:
    """New output tokens a chunk carries, from continuous usage stats (cumulative
    completion_tokens); None when the server sends no per-chunk usage."""
    usage = chunk.get("usage")
    if not usage or "completion_tokens" not in usage:
        return None
    return max(int(usage["completion_tokens"]) - tokens_so_far, 0)


def stream_one(
    host: str, port: int, path: str, body: dict[str, Any], timeout: float = 600
) -> RequestTiming:
    """Send one streaming completion and time its chunks."""
    timing = RequestTiming()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    start = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body), headers={
            "Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            timing.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return timing
        last = start
        first_seen = False
        while True:
            line = resp.readline()
            if not line:
                break
            chunk = parse_sse_line(line)
            if chunk is None:
                continue
            if "error" in chunk:
                timing.error = str(chunk["error"])
                break
            now = time.perf_counter()
            new = chunk_token_count(chunk, timing.output_tokens)
            choices = chunk.get("choices", [])
            if choices and not first_seen:
                # What a client counts as its first token: the first chunk with a choice.
                first_seen = True
                timing.ttft = now - start
            has_text = any(
                c.get("text") or (c.get("delta") or {}).get("content") or c.get("finish_reason")
                for c in choices
            )
            if new is None:  # no per-chunk usage: count each chunk with content as one token
                new = 1 if has_text else 0
            if new == 0:
                continue
            if timing.output_tokens == 0:
                # The first chunk may already carry several tokens (detokenizer holdback):
                # they arrived together, so the rest count as zero-gap tokens.
                timing.itl.extend([0.0] * (new - 1))
            else:
                # A chunk carrying k tokens (text held back until it decodes) spreads its gap
                # over them, so ITL stays a per-token figure.
                timing.itl.extend([(now - last) / new] * new)
            timing.output_tokens += new
            last = now
        timing.latency = time.perf_counter() - start
    except OSError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return timing


def percentiles_ms(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[int, float]:
    if not values:
        return {q: float("nan") for q in qs}
    arr = np.asarray(values, dtype=np.float64) * 1e3
    return {q: float(np.percentile(arr, q)) for q in qs}


def summarize(
    timings: list[RequestTiming],
    wall_s: float,
    concurrency: int,
    input_len: int,
    output_len: int,
    engine: str = "ingot",
) -> str:
    """One RESULT line from the successful requests' timings."""
    ok = [t for t in timings if t.error is None and t.output_tokens > 0]
    out_tokens = sum(t.output_tokens for t in ok)
    ttft = percentiles_ms([t.ttft for t in ok])
    itl = percentiles_ms([x for t in ok for x in t.itl])
    fields = [
        "RESULT workload=serve", f"engine={engine}", f"concurrency={concurrency}",
        f"requests={len(timings)}", f"completed={len(ok)}", f"input_len={input_len}",
        f"output_len={output_len}", f"time_s={wall_s:.3f}",
        f"request_s={len(ok) / wall_s:.3f}", f"output_tok_s={out_tokens / wall_s:.1f}",
    ]
    fields += [f"ttft_p{q}_ms={v:.1f}" for q, v in ttft.items()]
    fields += [f"itl_p{q}_ms={v:.1f}" for q, v in itl.items()]
    return " ".join(fields)


def _served_model(host: str, port: int) -> str | None:
    """The first model a server lists (vLLM's server requires ``model``; ingot's does not)."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        data = json.loads(resp.read()) if resp.status == 200 else {}
        models = data.get("data") or []
        return models[0]["id"] if models else None
    except (OSError, ValueError, KeyError):
        return None
    finally:
        conn.close()


def run_serve_bench(
    base_url: str = "http://127.0.0.1:8000",
    concurrency: int = 4,
    num_requests: int = 16,
    input_len: int = 128,
    output_len: int = 128,
    model: str | None = None,
    engine: str = "ingot",
    warmup: bool = True,
    vocab_size: int | None = None,
    endpoint: str = "completions",
) -> str:
    """Drive the server at ``base_url`` and return (and print) its RESULT line.

    ``vocab_size``: for models whose vocabulary is below the shared prompts' ids (< 40000), the
    ids are taken modulo it (prompts are unchanged for larger vocabularies).
    """
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"--endpoint must be completions or chat, got {endpoint!r}")
    if concurrency < 1 or num_requests < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--concurrency, --num-requests, --input-len and --output-len must be >= 1")
    url = urllib.parse.urlsplit(base_url)
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"--base-url must be http://HOST[:PORT][/prefix], got {base_url!r}")
    host, port = url.hostname, url.port or 80
    path = url.path.rstrip("/")
    path = (path if path.endswith("/v1") else path + "/v1") + (
        "/chat/completions" if endpoint == "chat" else "/completions"
    )
    model = model or _served_model(host, port)

    def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
        if endpoint == "chat":
            text = " ".join(CHAT_WORDS[t % len(CHAT_WORDS)] for t in prompt)
            request: dict[str, Any] = {"messages": [{"role": "user", "content": text}]}
        else:
            request = {"prompt": prompt}
        b: dict[str, Any] = {
            **request, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True,
            # Per-chunk usage lets ITL count tokens that arrive together in one chunk.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if model:
            b["model"] = model
        return b

    if warmup:
        w = stream_one(host, port, path, body([1, 2, 3], 4))
        if w.error:
            raise ValueError(f"warmup request to {base_url} failed: {w.error}")

    prompts = prompts_for(num_requests, input_len)
    if vocab_size:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    timings: list[RequestTiming | None] = [None] * num_requests
    next_index = 0
    lock = threading.Lock()

    def worker() -> None:
        nonlocal next_index
        while True:
            with lock:
                i = next_index
                next_index += 1
            if i >= num_requests:
                return
            timings[i] = stream_one(host, port, path, body(prompts[i], output_len))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [t for t in timings if t is not None]
    errors = [t.error for t in done if t.error]
    if len(errors) == len(done):
        raise ValueError(f"every request failed; first error: {errors[0]}")
    line = summarize(done, wall, concurrency, input_len, output_len, engine)
    if endpoint == "chat":
        line += " endpoint=chat"
    print(line, flush=True)
    return line
