"""Engine configuration: the resolved ``EngineConfig`` and its parts, and their checks.

What the user typed (CLI flags / ``LLM(...)`` keywords, vLLM's names) is ``EngineArgs``
(engine/arg_utils.py); ``EngineArgs.create_engine_config()`` resolves it against the model into
the immutable-by-convention ``EngineConfig`` defined here.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ingot.buckets import BucketGrid

logger = logging.getLogger("ingot")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    """None means "auto"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


# ingot options that have no vLLM flag travel in --additional-config (the original's route).
KNOWN_ADDITIONAL_CONFIG = {
    "enable_bucketing",
    "num_batched_tokens_buckets",
    "num_seqs_buckets",
    "decode_context_length_buckets",
    "profiler",
    "calibrate_kv_scales",
    "max_num_prefills_per_step",
    "ep_degree",  # expert-parallel degree (spec §3; validated, not built yet)
    "sequence_parallel_prefill",  # TP prefill in [T/TP, H] layout (spec §1)
}
# Prompts packed into one prefill step by default (eager layers). Chosen by measurement on the
# project's CPU (docs/PERFORMANCE.md, "Packed prefill"); 1 is the original design's rule.
DEFAULT_MAX_PREFILLS_PER_STEP = 8
# An encoder-only model's prefill step holds up to this many tokens by default (and as many
# prompts as fit, up to max_num_seqs): its steps need no KV cache, and at ~540 tokens a step
# (8 short prompts) the embedder ran ~25% slower than at ~4k (fewer per-step and per-op
# overheads, taller GEMMs), while 8k-16k tokens fell back (activations leave the caches).
# Measured on the project's CPU (docs/PERFORMANCE.md, "Embeddings").
ENCODER_STEP_TOKENS = 4096
# Async scheduling when neither --async-scheduling nor --no-async-scheduling is given
# (docs/features.md has the measurement behind the choice).
DEFAULT_ASYNC_SCHEDULING = False
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# "auto" stores KV in the model dtype; fp8 / fp8_e4m3 store float8_e4m3fn with per-layer scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
#: --quantization (vLLM's flag): "gguf" keeps a GGUF's quantized weights as they are (CPU),
#: "none" dequantizes them at load.
QUANTIZATIONS = ("gguf", "none")
# --runner: "auto" takes the architecture's (a BertModel pools, a causal LM generates).
RUNNERS = ("auto", "generate", "pooling")
# --convert: what a pooling runner makes of a model; "auto" is the architecture's own task
# (a causal LM becomes an embedder), "none" refuses any conversion.
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("MEAN", "CLS", "LAST")
POOLER_CONFIG_KEYS = {"pooling_type", "normalize"}
# The default embedder's directory inside its package is plainly "model": serve it by name.
DEFAULT_EMBEDDER_NAME = "all-MiniLM-L6-v2"


@dataclass
class PoolerConfig:
    """How a pooling model turns hidden states into its output (--pooler-config, defaulted
    from the architecture and sentence-transformers' modules.json / 1_Pooling/config.json)."""

    task: str  # the model's output: "embed" (a vector) or "classify" (label scores)
    pooling_type: str  # "MEAN" | "CLS" | "LAST"
    normalize: bool  # embeddings are L2-normalised unless a request says otherwise


@dataclass
class ModelConfig:
    model: str  # resolved local path (HF directory or .gguf file)
    format: str  # "hf" or "gguf"
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    tokenizer: str
    skip_tokenizer_init: bool
    seed: int
    hf_overrides: dict[str, Any]
    served_model_name: str
    generation_config: dict[str, Any] = field(default_factory=dict)
    runner: str = "generate"  # "generate" | "pooling"
    convert: str = "none"  # "none" | "embed" | "classify" (what --convert made of the model)
    pooler_config: PoolerConfig | None = None  # set iff runner == "pooling"
    #: Bidirectional attention (BERT): a prompt runs whole in one step, nothing is cached.
    is_encoder_only: bool = False
    #: Prompts may be given as [seq_len, hidden] tensors (engine/prompt_embeds.py).
    enable_prompt_embeds: bool = False
    #: "gguf": a GGUF's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K linears and embedding stay quantized (CPU, ingot's
    #: quantized kernels); "none": every weight dequantized to ``dtype`` at load.
    quantization: str = "none"

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config.hidden_size)

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]


@dataclass
class CacheConfig:
    block_size: int
    num_gpu_blocks_override: int | None
    kv_cache_memory_bytes: int | None
    kv_cache_dtype: str
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_cache_dtype.startswith("fp8") else model_dtype


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    #: Prompts (or their segments) packed into one prefill step; 1 = one prefill per step.
    max_num_prefills_per_step: int = 1
    #: Schedule step N+1 while step N runs (a batch queue of depth 2).
    async_scheduling: bool = False


@dataclass
class ParallelConfig:
    #: "uni": the worker runs in the engine's process; "mp": in child process(es).
    distributed_executor_backend: str = "uni"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    #: Expert-parallel degree of the MoE layers (1: experts split by TP; spec §3).
    ep_degree: int = 1
    #: Prefill steps in sequence-parallel layout (additional_config.sequence_parallel_prefill;
    #: distributed/sequence_parallel.py). Only with TP > 1.
    sequence_parallel_prefill: bool = False
    #: Which replica this engine core is (set in each data-parallel engine process).
    data_parallel_rank: int = 0
    #: The rendezvous of one torch.distributed world over every replica's ranks, when expert
    #: parallelism spans the replicas (set by the data-parallel front end).
    distributed_init_method: str | None = None
    #: Multi-node DP (vLLM's flags): the replicas this node runs, the first one's rank, and
    #: where the API server's node listens for the other nodes' replicas.
    data_parallel_size_local: int | None = None  # None: all of them
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    #: TP across nodes (vLLM's --nnodes/--node-rank/--master-addr/--master-port): node r runs
    #: ranks [r * TP / nnodes, (r + 1) * TP / nnodes); node 0 the engine. The ranks join
    #: torch.distributed at tcp://master_addr:master_port, and node 0's executor listens for
    #: the other nodes' workers on the ports after it (multiproc_executor.py).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    #: Multi-node (either kind): a file holding the secret every node shares (None: the
    #: INGOT_RPC_SECRET env var); distributed/wire.py authenticates every frame with it.
    rpc_secret_file: str | None = None

    @property
    def tp_ranks_local(self) -> int:
        """TP ranks on this node: all of them, or TP / nnodes."""
        return self.tensor_parallel_size // self.nnodes

    @property
    def host_ranks(self) -> int:
        """Ranks on this host (its TP ranks x the local replicas): they share its CPUs and
        memory."""
        return self.tp_ranks_local * self.local_replicas

    @property
    def local_replicas(self) -> int:
        local = self.data_parallel_size_local
        return self.data_parallel_size if local is None else local

    def host_index(self, global_rank: int) -> int:
        """A global rank's index among this host's ranks (a bind list has one part each)."""
        return (global_rank - self.data_parallel_start_rank * self.tensor_parallel_size
                - self.node_rank * self.tp_ranks_local)

    @property
    def replicas_synchronise(self) -> bool:
        """EP across data-parallel replicas: their MoE layers exchange tokens, so they step in
        lockstep (DP padding, dummy batches; distributed/data_parallel.py)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def world_size(self) -> int:
        """Worker processes (ranks) of all replicas: TP x DP (rank = dp_rank * TP + tp_rank);
        those of one host (``host_ranks``) share its CPUs and memory."""
        return self.tensor_parallel_size * self.data_parallel_size

    def global_rank(self, tp_rank: int) -> int:
        """The global rank of this replica's TP rank ``tp_rank`` (spec §0)."""
        return self.data_parallel_rank * self.tensor_parallel_size + tp_rank


@dataclass
class ProfilerConfig:
    output_dir: str = "./ingot_profiles"
    delay_iterations: int = 0
    max_iterations: int = 0
    record_shapes: bool = False
    with_stack: bool = False
    ranks: list[int] | None = None  # None: rank 0 only
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, value: Any) -> ProfilerConfig:
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"additional_config.profiler must be an object, got {value!r}")
        known = {"output_dir", "delay_iterations", "max_iterations", "record_shapes", "with_stack", "ranks"}
        unknown = set(value) - known
        if unknown:
            raise ValueError(
                f"unknown profiler option(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        config = cls(**value)
        for name in ("delay_iterations", "max_iterations"):
            v = getattr(config, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"profiler.{name} must be an integer >= 0, got {v!r}")
        if not isinstance(config.output_dir, str) or not config.output_dir:
            raise ValueError(
                f"profiler.output_dir must be a non-empty path string, got {config.output_dir!r}"
            )
        for name in ("record_shapes", "with_stack"):
            if not isinstance(getattr(config, name), bool):
                raise ValueError(
                    f"profiler.{name} must be true or false, got {getattr(config, name)!r}"
                )
        ranks = config.ranks
        if ranks is not None and (
            not isinstance(ranks, list)
            or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks)
        ):
            raise ValueError(
                f"profiler.ranks must be a list of rank numbers (integers >= 0) or null "
                f"(rank 0 only), got {ranks!r}"
            )
        return config


@dataclass
class CompilationConfig:
    """Whether and how the decoder layers are compiled (torch.compile, one graph per bucket)."""

    enabled: bool = False
    enable_fx_passes: bool = True
    #: Root of the compile cache (None: $INGOT_CACHE_ROOT, else ~/.cache/ingot).
    cache_root: str | None = None
    #: Hit-only (a miss raises CompileCacheMissError); None: $INGOT_DISABLE_WARMUP_COMPILE=1.
    hit_only: bool | None = None
    #: Capture every decode bucket's forward as a CUDA graph (CUDA, bucketing on, not eager).
    cuda_graphs: bool = False


@dataclass
class CpuThreadsConfig:
    """CPU compute threads (--cpu-threads, --cpu-threads-bind, --cpu-adaptive-threads); the
    policy and the environment variables it also reads are in platforms/cpu_threads.py."""

    threads: int | None = None
    bind: str | None = None
    adaptive: bool = True


STRUCTURED_OUTPUT_BACKENDS = ("xgrammar", "auto")  # auto = xgrammar, the only backend


@dataclass
class StructuredOutputsConfig:
    """--structured-outputs-config: how constraints compile (structured_output/manager.py)."""

    backend: str = "xgrammar"
    #: A grammar whose compile takes longer fails its request (a 400), not the engine.
    compile_timeout_s: float = 10.0
    #: Longest run of whitespace a JSON constraint allows between tokens (None: unbounded), so
    #: a model cannot loop on newlines until max_tokens (a known vLLM complaint).
    max_json_whitespace: int | None = 16
    #: Compiled grammars kept, keyed by (kind, spec text, options).
    cache_size: int = 256
    #: Threads of the compile pool: grammars compile there, off the engine thread, while
    #: their requests wait (WAITING_FOR_FSM) and running requests keep decoding.
    compile_threads: int = 2
    #: Compiles that may wait for a pool thread: a server request with a new grammar past
    #: compile_threads + this many pending compiles gets a 503 (offline requests queue).
    max_queued_compiles: int = 16

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputsConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown structured_outputs_config key(s): {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}"
            )
        config = cls(**value)
        if config.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(
                f"structured outputs backend {config.backend!r} is not supported; use xgrammar "
                "(or auto, which means xgrammar)"
            )
        config.backend = "xgrammar"
        timeout = config.compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"compile_timeout_s must be a number > 0, got {timeout!r}")
        ws = config.max_json_whitespace
        if ws is not None and (isinstance(ws, bool) or not isinstance(ws, int) or ws < 1):
            raise ValueError(f"max_json_whitespace must be an integer >= 1 or null, got {ws!r}")
        check_positive("cache_size", config.cache_size)
        check_positive("compile_threads", config.compile_threads)
        queued = config.max_queued_compiles
        if isinstance(queued, bool) or not isinstance(queued, int) or queued < 0:
            raise ValueError(f"max_queued_compiles must be an integer >= 0, got {queued!r}")
        return config


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")
#: Drafts per step are capped: a verification step runs 1 + k rows per request.
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """--speculative-config JSON (vLLM's field names); the mechanism is in spec_decode/."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_tensor_parallel_size: int | None = None
    #: vLLM's knob: no speculation in a step with more running requests than this (None: no
    #: fixed cap; the adaptive rule below still applies).
    disable_by_batch_size: int | None = None
    #: Stop speculating (per step) when measured verification steps yield fewer tokens per
    #: second than plain decode steps of the same batch bucket (core/spec_policy.py).
    adaptive: bool = True
    #: draft_model / eagle3: the draft's resolved config (set by EngineArgs, not a user key).
    draft_model_config: ModelConfig | None = None
    #: eagle3: the target layers whose inputs the head reads (from the head's config, else
    #: the original's default (2, N // 2, N - 3); set by EngineArgs).
    aux_layer_ids: tuple[int, ...] = ()

    @property
    def lookahead_slots(self) -> int:
        """KV positions past a step's tokens that the proposer writes after it: a draft model
        computes the token the step sampled and its first k - 1 drafts (n-gram lookup writes
        nothing)."""
        return self.num_speculative_tokens if self.method in ("draft_model", "eagle3") else 0

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in dataclasses.fields(cls)} - {"draft_model_config", "aux_layer_ids"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s): {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}"
            )
        method = value.get("method")
        if method is None and value.get("model") is None:
            raise ValueError(
                "speculative_config needs a method: one of " + ", ".join(SPECULATIVE_METHODS)
                + ' (e.g. {"method": "ngram", "num_speculative_tokens": 3})'
            )
        if method is None:
            method = "draft_model"
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {method!r} is not supported; use one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = value.get("num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config needs num_speculative_tokens (e.g. 3)")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
        config = cls(**{**value, "method": method})
        if method == "ngram":
            # vLLM's defaults: both unset -> 5 and 5; one set -> the other equals it.
            lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(
                    f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
                )
            config.prompt_lookup_min, config.prompt_lookup_max = lo, hi
            if config.model is not None:
                raise ValueError("speculative method ngram takes no model; drop \"model\"")
        if method in ("draft_model", "eagle3") and not config.model:
            what = ("an EAGLE3 head's local directory" if method == "eagle3" else
                    "a local directory or .gguf file of a small model with the target's "
                    "tokenizer")
            raise ValueError(f'speculative method {method} needs "model": {what}')
        tp = config.draft_tensor_parallel_size
        if tp is not None and tp != 1:
            raise ValueError(
                f"draft_tensor_parallel_size {tp!r} is not supported; the draft runs with the "
                "target on one rank: use 1 (or leave it out)"
            )
        cap = config.disable_by_batch_size
        if cap is not None:
            check_positive("disable_by_batch_size", cap)
        if not isinstance(config.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {config.adaptive!r}")
        return config


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str
    additional_config: dict[str, Any]
    buckets: BucketGrid
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    cpu_threads: CpuThreadsConfig = field(default_factory=CpuThreadsConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    #: Speculative decoding (None: off).
    speculative_config: SpeculativeConfig | None = None


def check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
