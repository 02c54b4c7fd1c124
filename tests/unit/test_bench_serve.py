"""The serve benchmark's pure parts: SSE parsing, per-chunk token counts, the RESULT line."""

from __future__ import annotations

import pytest

from ingot.benchmarks.serve import (
    RequestTiming,
    chunk_token_count,
    parse_sse_line,
    percentiles_ms,
    summarize,
)


def test_parse_sse_line():
    assert parse_sse_line(b'data: {"choices": []}\n') == {"choices": []}
    assert parse_sse_line(b"data: [DONE]\n") is None
    assert parse_sse_line(b"\n") is None
    assert parse_sse_line(b": keep-alive\n") is None


def test_chunk_token_count_from_continuous_usage():
    assert chunk_token_count({"usage": {"completion_tokens": 3}}, 1) == 2
    assert chunk_token_count({"usage": None}, 1) is None
    assert chunk_token_count({}, 0) is None


def test_percentiles_ms():
    p = percentiles_ms([0.001 * i for i in range(1, 101)])
    assert p[50] == pytest.approx(50.5)
    assert p[99] == pytest.approx(99.01)
    assert all(v != v for v in percentiles_ms([]).values())  # NaN when nothing completed


def test_summarize_counts_only_successful_requests():
    ok = RequestTiming(ttft=0.1, latency=1.0, itl=[0.02] * 9, output_tokens=10)
    bad = RequestTiming(error="HTTP 500")
    line = summarize([ok, ok, bad], wall_s=2.0, concurrency=2, input_len=128, output_len=10)
    assert line.startswith(
        "RESULT workload=serve engine=ingot concurrency=2 requests=3 completed=2 input_len=128 "
        "output_len=10 time_s=2.000 request_s=1.000 output_tok_s=10.0 "
    )
    assert "ttft_p50_ms=100.0" in line and "itl_p99_ms=20.0" in line
