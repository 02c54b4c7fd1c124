"""EngineMetrics: label strings, histogram edges, children at zero before traffic, and what one
step adds (driven with a stand-in engine: the metrics read only a few attributes; the step's
request stats come from the real OutputProcessor fed the core's outputs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ingot.buckets import BucketGrid, BucketStats
from ingot.core.kv_cache_manager import BlockPool, PrefixCacheStats
from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import RequestStatus
from ingot.engine.output_processor import OutputProcessor
from ingot.engine.outputs import IterationStats
from ingot.metrics.prometheus import (
    SEQS_PADDING_BUCKETS,
    TOKENS_PADDING_BUCKETS,
    EngineMetrics,
    decode_label,
    prefill_label,
)
from ingot.sampling_params import RequestOutputKind, SamplingParams


def _stats(ctx: list[int] | None = None) -> BucketStats:
    config = {"decode_context_length_buckets": ctx}  # None: context bucketing off
    grid = BucketGrid.from_config(config, max_num_batched_tokens=512, max_num_seqs=8,
                                  max_model_len=512, block_size=32)
    return BucketStats.for_grid(grid)


def _samples(metrics: EngineMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            assert s.labels["model_name"] == "m"
            out[(s.name, labels)] = s.value
    return out


def _engine(
    stats: BucketStats, pool: BlockPool, running: int = 0, waiting: int = 0,
    prefix: PrefixCacheStats | None = None, cpu_threads: int | None = None,
):
    """An engine stand-in whose get_stats() reads the given objects at each call, as
    LLMEngine.get_stats() does."""
    prefix = prefix or PrefixCacheStats()

    def get_stats() -> dict:
        return {
            "num_running": running, "num_waiting": waiting, "kv_usage": pool.usage(),
            "kv_blocks_free": pool.num_free_blocks, "prefix_cache_queries": prefix.queries,
            "prefix_cache_hits": prefix.hits, "prefix_cache_hit_rate": prefix.hit_rate,
            "buckets": stats, "compilation": {}, "cpu_compute_threads": cpu_threads,
        }

    return SimpleNamespace(get_stats=get_stats)


class _Front:
    """The real OutputProcessor: requests added, then fed the core's outputs step by step;
    each step's IterationStats are what the server hands record_step."""

    def __init__(self, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.proc = OutputProcessor(None, set())
        self.kind = kind

    def add(self, rid: str, prompt_len: int, n: int = 1, arrival: float = 1.0) -> None:
        params = SamplingParams(n=n, max_tokens=100, detokenize=False, output_kind=self.kind)
        prompt = list(range(prompt_len))
        self.proc.add_request(rid, None, prompt, self.proc.fan_out(rid, prompt, params, arrival))

    def step(self, *outs: EngineCoreOutput) -> IterationStats:
        return self.proc.process_outputs(list(outs)).stats


def test_label_strings():
    assert prefill_label(1024) == "prefill_s1024"
    assert decode_label(4) == "decode_b4"
    assert decode_label(4, 2048) == "decode_b4_ctx2048"


def test_histogram_edges():
    assert SEQS_PADDING_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128)
    assert TOKENS_PADDING_BUCKETS == (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    m = EngineMetrics("m", CollectorRegistry())
    m.init_buckets(_stats())
    s = _samples(m)
    les = sorted(
        float(dict(labels)["le"]) for (name, labels) in s
        if name == "ingot:num_batched_tokens_padding_bucket"
        and dict(labels)["bucket_name"] == "prefill_s128"
    )
    assert les == [*TOKENS_PADDING_BUCKETS, float("inf")]


def test_children_exist_at_zero_before_traffic():
    m = EngineMetrics("m", CollectorRegistry())
    m.init_buckets(_stats())
    s = _samples(m)
    for b in (128, 256, 512):
        assert s[("ingot:bucket_execution_count_total", (("bucket_name", f"prefill_s{b}"),))] == 0
        assert s[("ingot:num_batched_tokens_padding_count",
                  (("bucket_name", f"prefill_s{b}"),))] == 0
    for b in (1, 2, 4, 8):
        assert s[("ingot:bucket_execution_count_total", (("bucket_name", f"decode_b{b}"),))] == 0
        assert s[("ingot:num_seqs_padding_count", (("bucket_name", f"decode_b{b}"),))] == 0
    for reason in ("stop", "length", "abort"):
        assert s[("ingot:request_success_total", (("finished_reason", reason),))] == 0
    for name in ("ingot:prompt_tokens_total", "ingot:generation_tokens_total",
                 "ingot:time_to_first_token_seconds_count", "ingot:e2e_request_latency_seconds_count",
                 "ingot:inter_token_latency_seconds_count", "ingot:request_queue_time_seconds_count",
                 "ingot:num_requests_running", "ingot:kv_cache_usage_perc",
                 "ingot:startup_time_seconds", "ingot:model_load_size_bytes"):
        assert s[(name, ())] == 0, name
    # Context bucketing off: no _ctx children.
    assert not any("_ctx" in dict(labels).get("bucket_name", "") for _, labels in s)


def test_context_bucket_children_and_counting():
    stats = _stats(ctx=[128, 256])
    m = EngineMetrics("m", CollectorRegistry())
    m.init_buckets(stats)
    s = _samples(m)
    for ctx in (128, 256, 512):
        for b in (1, 2, 4, 8):
            key = ("ingot:bucket_execution_count_total", (("bucket_name", f"decode_b{b}_ctx{ctx}"),))
            assert s[key] == 0
    stats.record_decode(4, 3, 256)
    m.record_step(_engine(stats, BlockPool(10)), IterationStats(), 0.01)
    s = _samples(m)
    assert s[("ingot:bucket_execution_count_total", (("bucket_name", "decode_b4_ctx256"),))] == 1
    assert s[("ingot:bucket_execution_count_total", (("bucket_name", "decode_b4_ctx128"),))] == 0
    assert s[("ingot:num_seqs_padding_sum", (("bucket_name", "decode_b4"),))] == 1


@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda k: k.name)
def test_step_outputs_move_counters_once(kind):
    """The same counts whatever the output kind (the stats come from the core's outputs)."""
    front = _Front(kind)
    front.add("a", 20)
    stats = _stats()
    pool = BlockPool(11)
    m = EngineMetrics("m", CollectorRegistry())
    m.init_buckets(stats)
    m.record_gauges(_engine(stats, pool))
    assert _samples(m)[("ingot:kv_cache_free_blocks", ())] == 10

    # Step 1: a prefill of 20 tokens padded to 128 gives the first token.
    stats.record_prefill(128, 20)
    held = pool.allocate(3)
    m.record_step(_engine(stats, pool, running=1),
                  front.step(EngineCoreOutput("a", [7], first_scheduled_time=1.5)), 0.01)
    # Step 2 and 3: decodes in a batch bucket of 2 with one real row; then it finishes.
    stats.record_decode(2, 1, None)
    m.record_step(_engine(stats, pool, running=1), front.step(EngineCoreOutput("a", [8])), 0.01)
    stats.record_decode(2, 1, None)
    pool.free(held)
    m.record_step(_engine(stats, pool), front.step(
        EngineCoreOutput("a", [9], finish_status=RequestStatus.FINISHED_LENGTH)), 0.01)
    s = _samples(m)
    assert s[("ingot:prompt_tokens_total", ())] == 20  # counted once, not per step
    assert s[("ingot:generation_tokens_total", ())] == 3
    assert s[("ingot:time_to_first_token_seconds_count", ())] == 1
    assert s[("ingot:request_queue_time_seconds_sum", ())] == 0.5
    assert s[("ingot:inter_token_latency_seconds_count", ())] == 2
    assert s[("ingot:e2e_request_latency_seconds_count", ())] == 1
    assert s[("ingot:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("ingot:bucket_execution_count_total", (("bucket_name", "prefill_s128"),))] == 1
    assert s[("ingot:num_batched_tokens_padding_sum", (("bucket_name", "prefill_s128"),))] == 108
    assert s[("ingot:bucket_execution_count_total", (("bucket_name", "decode_b2"),))] == 2
    assert s[("ingot:num_seqs_padding_sum", (("bucket_name", "decode_b2"),))] == 2
    assert s[("ingot:kv_cache_free_blocks", ())] == 10
    assert s[("ingot:num_requests_running", ())] == 0


def test_n2_finish_and_abort_count_per_sequence():
    stats = _stats()
    pool = BlockPool(11)
    m = EngineMetrics("m", CollectorRegistry())
    m.init_buckets(stats)
    front = _Front()
    front.add("b", 4, n=2)
    front.add("c", 4, n=2)
    m.record_step(_engine(stats, pool), front.step(
        EngineCoreOutput("0_b", [1, 2], finish_status=RequestStatus.FINISHED_STOPPED),
        EngineCoreOutput("1_b", [3], finish_status=RequestStatus.FINISHED_LENGTH)), 0.01)
    held = pool.allocate(4)
    m.record_step(_engine(stats, pool, running=2),
                  front.step(EngineCoreOutput("0_c", [1]), EngineCoreOutput("1_c", [2])), 0.01)
    assert _samples(m)[("ingot:kv_cache_free_blocks", ())] == 6
    pool.free(held)  # the engine freed the aborted request's blocks: the gauge follows at once
    m.record_abort(_engine(stats, pool), "c", num_seqs=2)
    s = _samples(m)
    assert s[("ingot:request_success_total", (("finished_reason", "stop"),))] == 1
    assert s[("ingot:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("ingot:request_success_total", (("finished_reason", "abort"),))] == 2
    assert s[("ingot:generation_tokens_total", ())] == 5
    assert s[("ingot:kv_cache_free_blocks", ())] == 10


def test_prefix_cache_counters_follow_the_kv_manager():
    m = EngineMetrics("m")
    stats = BucketStats()
    prefix = PrefixCacheStats()
    engine = _engine(stats, BlockPool(8), prefix=prefix)
    m.record_gauges(engine)
    prefix.queries, prefix.hits = 100, 64
    m.record_gauges(engine)
    prefix.queries, prefix.hits = 150, 96
    m.record_gauges(engine)
    text = generate_latest(m.registry).decode()
    assert 'ingot:prefix_cache_queries_total{model_name="m"} 150.0' in text
    assert 'ingot:prefix_cache_hits_total{model_name="m"} 96.0' in text
    assert 'ingot:prefix_cache_hit_rate{model_name="m"} 0.64' in text


def test_metric_names_under_the_vllm_prefix():
    from ingot.metrics.prometheus import metric_name

    assert metric_name("num_requests_running") == "ingot:num_requests_running"
    assert metric_name("num_requests_running", "vllm") == "vllm:num_requests_running"
    # No vLLM counterpart: the ingot name stays, whatever the prefix.
    assert metric_name("num_seqs_padding", "vllm") == "ingot:num_seqs_padding"
    with pytest.raises(ValueError, match="ingot, vllm"):
        metric_name("num_requests_running", "sglang")


def test_cpu_compute_threads_gauge_follows_the_worker():
    m = EngineMetrics("m")
    m.record_gauges(_engine(BucketStats(), BlockPool(8)))  # no CPU thread policy (CUDA)
    assert "ingot:cpu_compute_threads{" not in generate_latest(m.registry).decode()
    m.record_gauges(_engine(BucketStats(), BlockPool(8), cpu_threads=2))
    m.record_gauges(_engine(BucketStats(), BlockPool(8), cpu_threads=1))
    assert 'ingot:cpu_compute_threads{model_name="m"} 1.0' in generate_latest(m.registry).decode()


def test_async_step_counters_follow_the_worker_totals():
    m = EngineMetrics("m")
    text = generate_latest(m.registry).decode()
    assert 'ingot:async_steps_total{model_name="m"} 0.0' in text  # exported from the start
    base = _engine(BucketStats(), BlockPool(8)).get_stats()
    for async_steps, fallbacks in ((0, 1), (7, 1), (7, 1), (12, 2)):
        stats = {**base, "async_steps": async_steps, "sync_fallback_steps": fallbacks}
        m._record_gauges(stats)
    text = generate_latest(m.registry).decode()
    assert 'ingot:async_steps_total{model_name="m"} 12.0' in text
    assert 'ingot:sync_fallback_steps_total{model_name="m"} 2.0' in text
