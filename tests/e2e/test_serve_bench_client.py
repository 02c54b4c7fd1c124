"""`ingot bench serve` against a real `ingot serve` on the tiny model: every request completes
with exactly output_len tokens and the RESULT line carries the latency percentiles."""

from __future__ import annotations

import math

import pytest
from server_utils import TINY_FLAGS, run_server

from ingot.benchmarks.serve import run_serve_bench
from ingot.cli.main import main


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with run_server([str(tiny_llama_dir), *TINY_FLAGS], tmp_path_factory.mktemp("logs")) as s:
        yield s


def _fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split()[1:])


def test_serve_bench_against_real_server(server):
    # 259-token byte vocabulary: the shared prompts' ids are folded into it.
    line = run_serve_bench(server.base, concurrency=2, num_requests=4, input_len=16,
                           output_len=8, vocab_size=259)
    f = _fields(line)
    assert f["workload"] == "serve" and f["engine"] == "ingot"
    assert (f["concurrency"], f["requests"], f["completed"]) == ("2", "4", "4")
    # ignore_eos: exactly 4 x 8 tokens, counted from the server's per-chunk usage.
    assert _tokens(f) == pytest.approx(32, abs=_rounding(f))
    for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        assert math.isfinite(float(f[key])) and float(f[key]) >= 0
    assert float(f["ttft_p50_ms"]) <= float(f["ttft_p99_ms"])


def test_cli_bench_serve(server, capsys):
    rc = main(["bench", "serve", "--base-url", server.base, "--concurrency", "1",
               "--num-requests", "1", "--input-len", "4", "--output-len", "3",
               "--vocab-size", "259"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "RESULT workload=serve engine=ingot concurrency=1 requests=1 completed=1" in out


def test_unreachable_server_is_a_clear_error(capsys):
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-requests", "1"])
    assert rc == 2
    assert "warmup request to http://127.0.0.1:9 failed" in capsys.readouterr().err


def _tokens(f: dict) -> float:
    return float(f["output_tok_s"]) * float(f["time_s"])


def _rounding(f: dict) -> float:
    """How far tokens = rate x time can be off when time_s is printed to 1 ms (a short run
    on a fast machine takes a few tens of ms, so 1% would not hold) and the rate to 0.1."""
    return float(f["output_tok_s"]) * 0.0005 + float(f["time_s"]) * 0.05 + 0.01


def test_serve_bench_chat_endpoint(server):
    line = run_serve_bench(server.base, concurrency=2, num_requests=4, input_len=8,
                           output_len=6, endpoint="chat")
    f = _fields(line)
    assert f["endpoint"] == "chat" and f["completed"] == "4"
    # ignore_eos reaches the chat route too: exactly 4 x 6 tokens.
    assert _tokens(f) == pytest.approx(24, abs=_rounding(f))
    assert math.isfinite(float(f["ttft_p50_ms"])) and float(f["ttft_p50_ms"]) > 0
    with pytest.raises(ValueError, match="--endpoint"):
        run_serve_bench(server.base, endpoint="embeddings")
