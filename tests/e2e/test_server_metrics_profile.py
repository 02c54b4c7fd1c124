"""/metrics moves by the expected amounts for a known workload, and /start_profile +
/stop_profile write a Chrome trace of the model forward (profiler set by --additional-config)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from safetensors import safe_open
from server_utils import TINY_FLAGS, metric, run_server, wait_until

PREFILL_BUCKETS = [128, 256]  # powers of two from 128 up to min(2048, max_model_len=256)
DECODE_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]  # up to max_num_seqs (256)


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, profile_dir):
    profiler = {"profiler": {"output_dir": str(profile_dir)}}
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--additional-config", json.dumps(profiler),
            "--enable-admin-routes"]
    with run_server(args, tmp_path_factory.mktemp("logs")) as s:
        yield s


def test_bucket_children_and_startup_gauges_before_traffic(server, tiny_llama_dir):
    """Runs first: the grid's children exist at zero before any request."""
    m = server.metrics()
    for b in PREFILL_BUCKETS:
        label = f"prefill_s{b}"
        assert metric(m, "ingot:bucket_execution_count_total", bucket_name=label) == 0
        assert metric(m, "ingot:num_batched_tokens_padding_count", bucket_name=label) == 0
    for b in DECODE_BUCKETS:
        label = f"decode_b{b}"
        assert metric(m, "ingot:bucket_execution_count_total", bucket_name=label) == 0
        assert metric(m, "ingot:num_seqs_padding_count", bucket_name=label) == 0
    assert metric(m, "ingot:generation_tokens_total") == 0
    assert metric(m, "ingot:num_requests_running") == 0
    assert metric(m, "ingot:kv_cache_usage_perc") == 0
    assert metric(m, "ingot:kv_cache_free_blocks") > 0  # the idle value, not an unset zero
    assert metric(m, "ingot:startup_time_seconds") > 0
    assert metric(m, "ingot:model_load_time_seconds") > 0
    # This server runs eagerly (compilation is opt-in): nothing compiled, so exactly zero. The
    # compiled path's figure is asserted > 0 in test_compilation.py.
    assert metric(m, "ingot:compilation_time_seconds") == 0
    with safe_open(str(tiny_llama_dir / "model.safetensors"), "pt") as f:
        weight_bytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())  # float32
    assert metric(m, "ingot:model_load_size_bytes") == weight_bytes


def test_counters_move_by_the_workload(server):
    prompt_lens, k = [10, 20, 30], 5
    before = server.metrics()
    for i, n in enumerate(prompt_lens):
        # One at a time, so each request is one prefill at bucket 128 then k-1 decodes at 1.
        code, body = server.json("POST", "/v1/completions", {
            "prompt": [40 + i] * n, "max_tokens": k, "ignore_eos": True, "temperature": 0,
        })
        assert code == 200 and body["usage"]["completion_tokens"] == k
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    nreq = len(prompt_lens)
    assert delta("ingot:generation_tokens_total") == nreq * k
    assert delta("ingot:prompt_tokens_total") == sum(prompt_lens)
    assert delta("ingot:request_success_total", finished_reason="length") == nreq
    assert delta("ingot:bucket_execution_count_total", bucket_name="prefill_s128") == nreq
    assert delta("ingot:bucket_execution_count_total", bucket_name="decode_b1") == nreq * (k - 1)
    assert delta("ingot:bucket_execution_count_total", bucket_name="decode_b2") == 0
    assert delta("ingot:bucket_execution_count_total", bucket_name="prefill_s256") == 0
    # Prefill padding: each prompt padded up to 128 tokens.
    assert delta("ingot:num_batched_tokens_padding_count", bucket_name="prefill_s128") == nreq
    assert delta("ingot:num_batched_tokens_padding_sum", bucket_name="prefill_s128") == sum(
        128 - n for n in prompt_lens
    )
    # Decode alone in a batch of 1: no dummy rows.
    assert delta("ingot:num_seqs_padding_count", bucket_name="decode_b1") == nreq * (k - 1)
    assert delta("ingot:num_seqs_padding_sum", bucket_name="decode_b1") == 0
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta(f"ingot:{hist}_count") == nreq
        # Each request waited from its arrival to its first scheduling step at least a little.
        assert delta(f"ingot:{hist}_sum") > 0
    assert delta("ingot:inter_token_latency_seconds_count") == nreq * (k - 1)
    # Idle again: nothing running, every block back.
    assert metric(after, "ingot:num_requests_running") == 0
    assert metric(after, "ingot:num_requests_waiting") == 0
    assert metric(after, "ingot:kv_cache_free_blocks") == metric(before, "ingot:kv_cache_free_blocks")
    assert metric(after, "ingot:kv_cache_usage_perc") == 0


def test_histogram_edges_in_exposition(server):
    text = server.metrics_text()
    seqs = [ln for ln in text.splitlines()
            if ln.startswith('ingot:num_seqs_padding_bucket{') and 'decode_b4"' in ln]
    edges = [ln.split('le="')[1].split('"')[0] for ln in seqs]
    assert edges == [f"{2.0**i}" for i in range(8)] + ["+Inf"]


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    before = server.metrics()
    body = json.dumps({"prompt": f"abc {stream}", "max_tokens": 200, "ignore_eos": True,
                       "stream": stream}).encode()
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    if stream:
        # The headers go out before the engine has the request: wait for the first token.
        received = b""
        for _ in range(100):
            if b"data: " in received:
                break
            received += conn.recv(4096)
        assert received.startswith(b"HTTP/1.1 200") and b"data: " in received
    else:
        assert wait_until(lambda: metric(server.metrics(), "ingot:num_requests_running") == 1,
                          timeout=10)
    conn.close()  # the client goes away mid-generation

    def aborted() -> bool:
        m = server.metrics()
        return (
            metric(m, "ingot:request_success_total", finished_reason="abort")
            - metric(before, "ingot:request_success_total", finished_reason="abort") == 1
            and metric(m, "ingot:num_requests_running") == 0
        )

    assert wait_until(aborted, timeout=15)
    after = server.metrics()
    assert metric(after, "ingot:kv_cache_free_blocks") == metric(before, "ingot:kv_cache_free_blocks")
    assert metric(after, "ingot:request_success_total", finished_reason="length") == metric(
        before, "ingot:request_success_total", finished_reason="length")
    # Aborted long before its 200 tokens.
    assert metric(after, "ingot:generation_tokens_total") - metric(
        before, "ingot:generation_tokens_total") < 200


def _trace_names(path: Path) -> set[str]:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e.get("name", "") for e in events}


def test_profile_cycle_writes_a_chrome_trace(server, profile_dir):
    status, body = server.json("POST", "/stop_profile")
    assert status == 200 and body["trace"] is None  # nothing started, nothing written
    traces = []
    for _ in range(2):
        status, body = server.json("POST", "/start_profile")
        assert status == 200
        status, again = server.json("POST", "/start_profile")
        assert status == 400 and "already running" in again["error"]["message"]
        code, _ = server.json("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert code == 200
        status, body = server.json("POST", "/stop_profile")
        # Named relative to the profiler's directory: no server path in the response.
        assert status == 200 and body["trace"] and not Path(body["trace"]).is_absolute()
        traces.append(profile_dir / body["trace"])
    for trace in traces:
        assert trace.is_file() and trace.name == "rank0.trace.json"
        assert trace.parent.parent == profile_dir
        names = _trace_names(trace)
        # The model forward ran inside the profiled steps: its matmuls (MKL's, or oneDNN's
        # packed float32 linear on CPUs not made by Intel) and embedding lookup.
        matmuls = ("aten::linear", "aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")
        assert any(n in names for n in matmuls), names
        assert "aten::embedding" in names
    assert traces[0].parent != traces[1].parent  # one directory per cycle


def test_prefix_cache_metrics_and_reset_route(server):
    """Same 40-token prompt twice: the second reuses 32 cached tokens (block 32 -> 1 block),
    the metrics count it, and /reset_prefix_cache empties the cache."""
    prompt = list(range(100, 140))  # inside the tiny vocabulary (259)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    before = server.metrics()
    assert server.json("POST", "/v1/completions", body)[0] == 200
    assert server.json("POST", "/v1/completions", body)[0] == 200
    after = server.metrics()
    queries = metric(after, "ingot:prefix_cache_queries_total") - metric(
        before, "ingot:prefix_cache_queries_total"
    )
    hits = metric(after, "ingot:prefix_cache_hits_total") - metric(
        before, "ingot:prefix_cache_hits_total"
    )
    assert (queries, hits) == (80, 32)
    assert 0 < metric(after, "ingot:prefix_cache_hit_rate") <= 1
    assert server.json("POST", "/reset_prefix_cache", {}) == (200, {"status": "reset"})
    mid = server.metrics()
    assert server.json("POST", "/v1/completions", body)[0] == 200
    final = server.metrics()
    hits_total = "ingot:prefix_cache_hits_total"
    assert metric(final, hits_total) == metric(mid, hits_total)  # nothing left to hit
