"""Prometheus metrics with vLLM's names under the ``ingot:`` prefix, plus the design's own
(padding per bucket, executions per bucket, start-up, load and compile figures).

The engine runs on a thread of the server process, so one registry per server is exact; no
multiprocess mode is needed. Every bucket's label children are created at zero at start-up.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ingot.buckets import BucketCounter, BucketStats
from ingot.engine.llm_engine import LLMEngine
from ingot.engine.outputs import IterationStats

PREFIX = "ingot:"
METRICS_NAME_PREFIXES = ("ingot", "vllm")
# Metrics with a vLLM counterpart of the same meaning, name (after the prefix) and labels
# (model_name; request_success also finished_reason). ``--metrics-name-prefix vllm`` exposes
# these as ``vllm:...``, so dashboards built for vLLM read them unchanged; the rest (padding,
# buckets, start-up, compile figures) have no vLLM counterpart and keep ``ingot:``.
VLLM_COUNTERPARTS = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
    "generation_tokens", "request_success", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "prefix_cache_queries", "prefix_cache_hits",
})


def metric_name(base: str, prefix: str = "ingot") -> str:
    """The exposed name of a metric (before prometheus_client adds ``_total`` to counters)."""
    if prefix not in METRICS_NAME_PREFIXES:
        raise ValueError(
            f"metrics name prefix must be one of {', '.join(METRICS_NAME_PREFIXES)}, got {prefix!r}"
        )
    return f"vllm:{base}" if prefix == "vllm" and base in VLLM_COUNTERPARTS else f"{PREFIX}{base}"
FINISH_REASONS = ("stop", "length", "abort")
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0,
)
SEQS_PADDING_BUCKETS = tuple(float(2**i) for i in range(8))  # 1 ... 128
TOKENS_PADDING_BUCKETS = tuple(float(2**i) for i in range(5, 15))  # 32 ... 16384


def prefill_label(bucket: int) -> str:
    return f"prefill_s{bucket}"


def decode_label(bucket: int, ctx: int | None = None) -> str:
    return f"decode_b{bucket}" if ctx is None else f"decode_b{bucket}_ctx{ctx}"


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 prefix: str = "ingot") -> None:
        self.registry = registry or CollectorRegistry()
        r, m = self.registry, ["model_name"]
        metric_name("", prefix)  # an unknown prefix fails here, before any metric exists
        self.model_name = model_name
        self.running = Gauge(metric_name("num_requests_running", prefix), "Requests running", m, registry=r)
        self.waiting = Gauge(metric_name("num_requests_waiting", prefix), "Requests waiting", m, registry=r)
        self.kv_usage = Gauge(metric_name("kv_cache_usage_perc", prefix), "KV cache usage (0-1)", m, registry=r)
        self.kv_blocks_free = Gauge(metric_name("kv_cache_free_blocks", prefix), "Free KV blocks", m, registry=r)
        self.cpu_threads = Gauge(metric_name("cpu_compute_threads", prefix),
                                 "CPU compute threads in use (fewer while contended)", m, registry=r)
        self.prompt_tokens = Counter(metric_name("prompt_tokens", prefix), "Prefilled prompt tokens", m, registry=r)
        self.generation_tokens = Counter(
            metric_name("generation_tokens", prefix), "Generated tokens", m, registry=r
        )
        self.request_success = Counter(
            metric_name("request_success", prefix), "Finished requests by finish reason",
            [*m, "finished_reason"], registry=r,
        )
        self.ttft = Histogram(
            metric_name("time_to_first_token_seconds", prefix), "Time to first token", m,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            metric_name("inter_token_latency_seconds", prefix), "Time between output tokens", m,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            metric_name("e2e_request_latency_seconds", prefix), "Arrival to finish", m,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            metric_name("request_queue_time_seconds", prefix), "Arrival to first scheduled", m,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        b = [*m, "bucket_name"]
        self.seqs_padding = Histogram(
            metric_name("num_seqs_padding", prefix), "Dummy decode rows per execution", b,
            buckets=SEQS_PADDING_BUCKETS, registry=r,
        )
        self.tokens_padding = Histogram(
            metric_name("num_batched_tokens_padding", prefix), "Padded prefill tokens per execution", b,
            buckets=TOKENS_PADDING_BUCKETS, registry=r,
        )
        self.executions = Counter(
            metric_name("bucket_execution_count", prefix), "Model executions per bucket", b, registry=r
        )
        self.startup = Gauge(metric_name("startup_time_seconds", prefix), "Start to ready", m, registry=r)
        self.model_load = Gauge(metric_name("model_load_time_seconds", prefix), "Model load time", m, registry=r)
        self.model_bytes = Gauge(metric_name("model_load_size_bytes", prefix), "Weight bytes", m, registry=r)
        self.compilation = Gauge(
            metric_name("compilation_time_seconds", prefix), "Graph compilation time", m, registry=r
        )
        self.prefix_queries = Counter(
            metric_name("prefix_cache_queries", prefix), "Prompt tokens looked up in the prefix cache", m,
            registry=r,
        )
        self.prefix_hits = Counter(
            metric_name("prefix_cache_hits", prefix), "Prompt tokens served from the prefix cache", m,
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            metric_name("prefix_cache_hit_rate", prefix), "Prefix cache hits / queries (tokens)", m, registry=r
        )
        self._prefix_seen = (0, 0)
        # Speculative decoding, vLLM's names (a draft = one request's drafts in one step).
        self.spec_drafts = Counter(
            metric_name("spec_decode_num_drafts", prefix), "Requests verified with drafts", m,
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            metric_name("spec_decode_num_draft_tokens", prefix), "Draft tokens verified", m,
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            metric_name("spec_decode_num_accepted_tokens", prefix), "Draft tokens accepted", m,
            registry=r,
        )
        self.spec_accepted_per_pos = Counter(
            metric_name("spec_decode_num_accepted_tokens_per_pos", prefix),
            "Draft tokens accepted, by position in the draft", [*m, "position"], registry=r,
        )
        # Real Inductor compiles (start-up warmup included): must not move while serving.
        self.compilations = Counter(
            metric_name("compilations", prefix), "Graphs compiled (compile cache misses)", m, registry=r
        )
        self.compile_cache_hits = Counter(
            metric_name("compile_cache_hits", prefix), "Graphs loaded from the compile cache", m, registry=r
        )
        # Async scheduling: decode steps fed by the previous step's sampled tokens, and those
        # that had to build their inputs from the host's token lists.
        self.async_steps = Counter(
            metric_name("async_steps", prefix),
            "Decode steps whose input ids were the previous step's sampled tokens", m, registry=r
        )
        self.sync_fallback_steps = Counter(
            metric_name("sync_fallback_steps", prefix),
            "Async-scheduled decode steps that fell back to host token lists", m, registry=r
        )
        # Data parallelism: each replica's queue, labelled by its rank (engine/dp_client.py).
        d = [*m, "dp_rank"]
        self.dp_running = Gauge(metric_name("dp_num_requests_running", prefix),
                                "Requests running, per data-parallel rank", d, registry=r)
        self.dp_waiting = Gauge(metric_name("dp_num_requests_waiting", prefix),
                                "Requests waiting, per data-parallel rank", d, registry=r)
        self.dp_routed = Counter(metric_name("dp_requests_routed", prefix),
                                 "Requests sent to each data-parallel rank", d, registry=r)
        # Worker totals already turned into counter increments, per stats key.
        self._totals_seen: dict[str, float] = {}
        # Every child at zero from the start: a scraper sees the series (and rate() works)
        # before the first request, and a test can tell "zero" from "never exported".
        for metric in (
            self.running, self.waiting, self.kv_usage, self.kv_blocks_free, self.prompt_tokens,
            self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue_time, self.startup,
            self.model_load, self.model_bytes, self.compilation, self.prefix_queries,
            self.prefix_hits, self.prefix_hit_rate, self.compilations, self.compile_cache_hits,
            self.async_steps, self.sync_fallback_steps, self.spec_drafts, self.spec_draft_tokens,
            self.spec_accepted_tokens,
        ):
            self.labels(metric)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name=model_name, finished_reason=reason)
        self._last_buckets: dict[tuple[str, int], BucketCounter] = {}
        self._last_ctx: dict[int, int] = {}
        self._ctx_labels = False

    def labels(self, metric: Counter | Gauge | Histogram) -> Any:
        return metric.labels(model_name=self.model_name)

    def init_buckets(self, stats: BucketStats) -> None:
        """Create every bucket child at zero, so the grid is visible before traffic."""
        for bucket in stats.prefill:
            self._bucket_children(prefill_label(bucket), prefill=True)
        for bucket in stats.decode:
            self._bucket_children(decode_label(bucket), prefill=False)
        # Context buckets configured: decode executions are labelled per (batch, context) pair.
        self._ctx_labels = len(stats.decode_ctx) > 1
        if self._ctx_labels:
            for ctx in stats.decode_ctx:
                for bucket in stats.decode:
                    self.executions.labels(
                        model_name=self.model_name, bucket_name=decode_label(bucket, ctx)
                    )
        self._snapshot(stats)

    def _bucket_children(self, label: str, prefill: bool) -> None:
        self.executions.labels(model_name=self.model_name, bucket_name=label)
        hist = self.tokens_padding if prefill else self.seqs_padding
        hist.labels(model_name=self.model_name, bucket_name=label)

    def _snapshot(self, stats: BucketStats) -> None:
        for kind, table in (("prefill", stats.prefill), ("decode", stats.decode)):
            for bucket, c in table.items():
                self._last_buckets[(kind, bucket)] = BucketCounter(c.executions, c.actual, c.padded)
        self._last_ctx = dict(stats.decode_ctx)

    def record_startup(self, startup_s: float, load_s: float, load_bytes: int, compile_s: float) -> None:
        self.labels(self.startup).set(startup_s)
        self.labels(self.model_load).set(load_s)
        self.labels(self.model_bytes).set(load_bytes)
        self.labels(self.compilation).set(compile_s)

    def record_gauges(self, engine: LLMEngine) -> None:
        """Scheduler and KV cache gauges, from the engine's stats (on the engine thread)."""
        self._record_gauges(engine.get_stats())

    def _record_gauges(self, stats: dict[str, Any]) -> None:
        self.labels(self.running).set(stats["num_running"])
        self.labels(self.waiting).set(stats["num_waiting"])
        self.labels(self.kv_usage).set(stats["kv_usage"])
        self.labels(self.kv_blocks_free).set(stats["kv_blocks_free"])
        queries, hits = self._prefix_seen
        if stats["prefix_cache_queries"] > queries:
            self.labels(self.prefix_queries).inc(stats["prefix_cache_queries"] - queries)
            self.labels(self.prefix_hits).inc(stats["prefix_cache_hits"] - hits)
            self._prefix_seen = (stats["prefix_cache_queries"], stats["prefix_cache_hits"])
            self.labels(self.prefix_hit_rate).set(stats["prefix_cache_hit_rate"])
        if stats.get("cpu_compute_threads") is not None:
            self.labels(self.cpu_threads).set(stats["cpu_compute_threads"])
        compile_stats = stats.get("compilation", {})
        self._count_total(self.compilations, "compilations", compile_stats.get("compilations", 0))
        self._count_total(self.compile_cache_hits, "cache_hits", compile_stats.get("cache_hits", 0))
        spec = stats.get("spec_decode")
        if spec is not None:
            self._count_total(self.spec_drafts, "spec_drafts", spec.num_drafts)
            self._count_total(self.spec_draft_tokens, "spec_draft_tokens", spec.num_draft_tokens)
            self._count_total(self.spec_accepted_tokens, "spec_accepted", spec.num_accepted_tokens)
            for pos, total in enumerate(spec.num_accepted_tokens_per_pos):
                self._count_total(self.spec_accepted_per_pos, f"spec_accepted_{pos}", total,
                                  position=str(pos))
        for rank_stats in stats.get("dp_ranks", ()):
            rank = str(rank_stats["dp_rank"])
            self.dp_running.labels(model_name=self.model_name, dp_rank=rank).set(
                rank_stats["num_running"])
            self.dp_waiting.labels(model_name=self.model_name, dp_rank=rank).set(
                rank_stats["num_waiting"])
            self._count_total(self.dp_routed, f"dp_routed_{rank}", rank_stats["requests_routed"],
                              dp_rank=rank)
        self._count_total(self.async_steps, "async_steps", stats.get("async_steps", 0))
        self._count_total(self.sync_fallback_steps, "sync_fallback_steps",
                          stats.get("sync_fallback_steps", 0))

    def _count_total(self, counter: Counter, key: str, total: float, **labels: str) -> None:
        """Advance ``counter`` (its child with ``labels``, besides the model name) to a running
        total the engine reports (never backwards)."""
        seen = self._totals_seen.get(key, 0)
        if total > seen:
            counter.labels(model_name=self.model_name, **labels).inc(total - seen)
            self._totals_seen[key] = total

    def record_abort(self, engine: LLMEngine, request_id: str, num_seqs: int = 1) -> None:
        """An aborted request: one ``abort`` finish per sequence (as finished requests count one
        per choice), and the gauges at once, since an abort frees blocks without a step."""
        self.request_success.labels(model_name=self.model_name, finished_reason="abort").inc(
            num_seqs
        )
        self.record_gauges(engine)

    def _record_buckets(self, stats: BucketStats) -> None:
        changed_ctx = [c for c, n in stats.decode_ctx.items() if n != self._last_ctx.get(c, 0)]
        for kind, table in (("prefill", stats.prefill), ("decode", stats.decode)):
            for bucket, c in table.items():
                last = self._last_buckets.get((kind, bucket), BucketCounter())
                runs = c.executions - last.executions
                if runs <= 0:
                    continue
                pad_each = (c.padding - last.padding) / runs
                if kind == "prefill":
                    label = prefill_label(bucket)
                    self.tokens_padding.labels(model_name=self.model_name, bucket_name=label).observe(pad_each)
                else:
                    label = decode_label(bucket)
                    self.seqs_padding.labels(model_name=self.model_name, bucket_name=label).observe(pad_each)
                    if changed_ctx and self._ctx_labels:
                        label = decode_label(bucket, changed_ctx[0])
                self.executions.labels(model_name=self.model_name, bucket_name=label).inc(runs)
        self._snapshot(stats)

    def record_step(self, engine: LLMEngine, stats: IterationStats, step_s: float) -> None:
        """One engine step: the gauges, bucket counters and the step's request stats
        (``LLMEngine.iteration_stats``, the same whatever output kind requests asked for)."""
        engine_stats = engine.get_stats()
        self._record_gauges(engine_stats)
        self._record_buckets(engine_stats["buckets"])
        if stats.num_prompt_tokens:
            self.labels(self.prompt_tokens).inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.labels(self.generation_tokens).inc(stats.num_generation_tokens)
        for histogram, values in ((self.ttft, stats.time_to_first_tokens),
                                  (self.queue_time, stats.queue_times),
                                  (self.itl, stats.inter_token_latencies),
                                  (self.e2e, stats.e2e_latencies)):
            for value in values:
                self.labels(histogram).observe(value)
        for reason in stats.finish_reasons:
            self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()
