"""Engine configuration: one place that resolves and validates every knob.

``EngineArgs`` holds what the user typed (CLI flags / ``LLM(...)`` keywords, vLLM's names);
``EngineArgs.create_engine_config()`` resolves defaults against the model and validates, giving
an immutable-by-convention ``EngineConfig``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ingot.buckets import BucketGrid
from ingot.distributed.sequence_parallel import sequence_parallel_prefill
from ingot.errors import ModelNotFoundError

logger = logging.getLogger("ingot")

_DTYPES = {
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
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


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
        _positive("cache_size", config.cache_size)
        _positive("compile_threads", config.compile_threads)
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
            _positive("disable_by_batch_size", cap)
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


def resolve_model_path(model: str | None, default_embedder: bool = False) -> tuple[str, str]:
    """(local path, format). No downloads: a path that does not exist is an error. No model:
    the default chat model, or with ``default_embedder`` the default embedding model."""
    if model is None and default_embedder:
        from ingot.model_executor.loader.packaged_models import default_embedder_path

        return default_embedder_path(), "hf"
    if model is None:
        from ingot.model_executor.loader.gguf_loader import default_model_path

        return default_model_path(), "gguf"
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {model!r} does not exist; pass a local Hugging Face model directory or "
            "a .gguf file (ingot never downloads models)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"model file {model!r} is not a .gguf file")
        return str(path), "gguf"
    if (path / "config.json").exists():
        return str(path), "hf"
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return str(ggufs[0]), "gguf"
    raise ModelNotFoundError(
        f"model directory {model!r} has no config.json (and not exactly one .gguf file)"
    )


def _load_hf_config(path: str, fmt: str) -> tuple[Any, dict[str, Any]]:
    if fmt == "gguf":
        from ingot.model_executor.loader.gguf_loader import load_gguf

        gguf_model = load_gguf(path)
        return gguf_model.config, dict(gguf_model.generation_config)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelNotFoundError(f"cannot read {path}/config.json: {exc}") from exc
    gen: dict[str, Any] = {}
    gen_path = Path(path) / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
    return config, gen


def _auto_dtype(hf_config: Any, fmt: str, platform: Any, prefill_only: bool = False) -> torch.dtype:
    """vLLM's rule: keep bf16/fp16 checkpoints, cast fp32 checkpoints down to half precision;
    on platforms without that dtype fall back to the platform default. ``prefill_only`` (an
    encoder): the platform's dtype for compute-bound models when that is float32 (a CPU
    without AMX: float32 computes faster there, and a half checkpoint widens exactly)."""
    if prefill_only and platform.prefill_only_dtype() == torch.float32:
        return torch.float32
    declared = getattr(hf_config, "dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared)
    preferred = platform.default_dtype()
    if declared in (torch.bfloat16, torch.float16) and declared in platform.supported_dtypes:
        return declared
    return preferred


# ---- command-line flags ------------------------------------------------------------------
# Every EngineArgs field declares its `ingot` flag in its metadata, next to its type and
# default, so a new knob is declared once; engine/arg_utils.py derives the argparse arguments
# (as vLLM's EngineArgs.add_cli_args does). Field order is the flags' order in --help.
CLI_METADATA_KEY = "cli"
ENGINE_GROUP = "engine"
PARALLEL_GROUP = "parallelism (docs/parallelism.md)"
POOLING_GROUP = "pooling (docs/configuration.md)"
CPU_THREADS_GROUP = "CPU threads (docs/configuration.md)"
COMPILATION_GROUP = "compilation"


@dataclass(frozen=True)
class CliFlag:
    """How one EngineArgs field appears on the command line. Unset facts are derived: the flag
    ``--field-name``; the value type from the annotation (int, float, else the string as typed:
    JSON fields stay strings that ``create_engine_config`` parses with its own error message);
    a bool defaulting to False is ``store_true``, any other bool ``--x/--no-x``."""

    help: str | None = None
    group: str = ENGINE_GROUP
    flag: str | None = None  # the long flag, when it is not --field-name
    aliases: tuple[str, ...] = ()  # vLLM's short forms (-tp), listed before the long flag
    choices: tuple[str, ...] | None = None
    type: Callable[[str], Any] | None = None  # parse hook, for values int/float/str do not cover
    action: Any = None  # an argparse action, when the bool rule above is not the one wanted


def cli(help: str | None = None, **facts: Any) -> dict[str, Any]:
    """``field(metadata=cli(...))``: the field's flag (see ``CliFlag``)."""
    return {CLI_METADATA_KEY: CliFlag(help, **facts)}


# ``field(metadata=NOT_A_FLAG)``: a field deliberately left off the command line.
NOT_A_FLAG: dict[str, Any] = {CLI_METADATA_KEY: None}


@dataclass
class EngineArgs:
    model: str | None = field(default=None, metadata=cli(
        "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct GGUF)"))
    tokenizer: str | None = field(default=None, metadata=cli(
        "tokenizer path (default: the model's)"))
    # Python only (LLM(skip_tokenizer_init=True)): token-id prompts, no detokenization.
    skip_tokenizer_init: bool = field(default=False, metadata=NOT_A_FLAG)
    dtype: str = field(default="auto", metadata=cli(
        "auto | float32 | bfloat16 | float16 (default: %(default)s)"))
    device: str = field(default="auto", metadata=cli(
        "auto | cpu | cuda | a plugin platform name"))
    seed: int = field(default=0, metadata=cli())
    max_model_len: int | None = field(default=None, metadata=cli(
        "context length (default: the model's max_position_embeddings)"))
    max_num_seqs: int = field(default=256, metadata=cli())
    max_num_batched_tokens: int | None = field(default=None, metadata=cli(
        "token budget per step (default 2048 with chunked prefill)"))
    enable_chunked_prefill: bool = field(default=True, metadata=cli())
    block_size: int = field(default=32, metadata=cli())
    num_gpu_blocks_override: int | None = field(default=None, metadata=cli(
        "exact number of KV cache blocks (overrides the memory budget)"))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=cli(
        "KV cache memory budget in bytes"))
    kv_cache_dtype: str = field(default="auto", metadata=cli())
    gpu_memory_utilization: float = field(default=0.9, metadata=cli(
        "fraction of device memory (host memory on CPU) ingot may use; the KV cache gets what "
        "the weights leave, capped (default: %(default)s)"))
    enable_prefix_caching: bool = field(default=True, metadata=cli(
        "reuse the KV of shared prompt prefixes (default: on)"))
    hf_overrides: dict[str, Any] | str | None = field(default=None, metadata=cli(
        "JSON object applied to the HF config"))
    additional_config: dict[str, Any] | str | None = field(default=None, metadata=cli(
        "JSON object of ingot options"))
    served_model_name: str | None = field(default=None, metadata=cli())
    # vLLM's --structured-outputs-config (JSON): {"backend": "xgrammar", ...}.
    structured_outputs_config: dict[str, Any] | str | None = field(default=None, metadata=cli(
        'JSON object, e.g. \'{"backend": "xgrammar", "compile_timeout_s": 10}\' '
        "(docs/configuration.md)"))
    # vLLM's --speculative-config (JSON): {"method": "ngram", "num_speculative_tokens": 3, ...}.
    speculative_config: dict[str, Any] | str | None = field(default=None, metadata=cli(
        'JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
        "(docs/configuration.md)"))
    # vLLM's names. None: "uni" for one worker, "mp" for several.
    distributed_executor_backend: str | None = field(default=None, metadata=cli(
        "uni: the worker runs in the engine's process (default for one worker); mp: in child "
        "processes, one per rank (default for several); ray: in Ray actors "
        "(pip install 'ingot[ray]')", choices=EXECUTOR_BACKENDS))
    # Parallelism (vLLM's names; docs/parallelism.md). PP is validated and then refused as
    # not built yet.
    tensor_parallel_size: int = field(default=1, metadata=cli(
        "ranks that split each layer (one worker process each)",
        group=PARALLEL_GROUP, aliases=("-tp",)))
    data_parallel_size: int = field(default=1, metadata=cli(
        "independent replicas, one engine-core process each, behind one front end",
        group=PARALLEL_GROUP, aliases=("-dp",)))
    # Multi-node data parallelism (vLLM's flags). None: every replica on this node.
    data_parallel_size_local: int | None = field(default=None, metadata=cli(
        "replicas on this node (default: all); the others run on other nodes under "
        "ingot serve --headless", group=PARALLEL_GROUP))
    data_parallel_start_rank: int = field(default=0, metadata=cli(
        "the first replica's rank on a --headless node (default: 0)", group=PARALLEL_GROUP))
    data_parallel_address: str | None = field(default=None, metadata=cli(
        "the API server node's address, where other nodes' replicas connect "
        "(default: 127.0.0.1)", group=PARALLEL_GROUP))
    data_parallel_rpc_port: int = field(default=29550, metadata=cli(
        "the first of the ports (one plus one per replica) at that address "
        "(default: %(default)s)", group=PARALLEL_GROUP))
    # TP across nodes (vLLM's names): node 0 runs the engine, nodes 1.. only their worker ranks
    # (ingot serve --headless). master_addr: node 0's address (required with nnodes > 1).
    nnodes: int = field(default=1, metadata=cli(
        "nodes one TP group spans (mp executor): each runs tensor-parallel-size / nnodes ranks "
        "(default: %(default)s)", group=PARALLEL_GROUP))
    node_rank: int = field(default=0, metadata=cli(
        "this node's index; node 0 runs the engine, the others only their ranks, under "
        "ingot serve --headless (default: %(default)s)", group=PARALLEL_GROUP))
    master_addr: str | None = field(default=None, metadata=cli(
        "node 0's address, where every node's ranks meet (required with --nnodes > 1)",
        group=PARALLEL_GROUP))
    master_port: int = field(default=29501, metadata=cli(
        "torch.distributed's port at --master-addr; node 0's executor listens on the next "
        "tensor-parallel-size ports (default: %(default)s)", group=PARALLEL_GROUP))
    pipeline_parallel_size: int = field(default=1, metadata=cli(
        "(not supported: only 1)", group=PARALLEL_GROUP, aliases=("-pp",)))
    enable_expert_parallel: bool = field(default=False, metadata=cli(
        "whole experts per rank, for MoE models (over every replica with -dp)",
        group=PARALLEL_GROUP))
    # None = DEFAULT_ASYNC_SCHEDULING; True/False force it.
    async_scheduling: bool | None = field(default=None, metadata=cli(
        "schedule the next step while the current one runs (default: docs/configuration.md)"))
    # Pooling (vLLM's names): --runner, --convert, --pooler-config JSON.
    runner: str = field(default="auto", metadata=cli(
        "generate text, or pool (embeddings, classification, scores); auto: from the "
        "architecture. --runner pooling with no --model serves the default embedder "
        "(all-MiniLM-L6-v2)", group=POOLING_GROUP, choices=RUNNERS))
    convert: str = field(default="auto", metadata=cli(
        "what a pooling runner makes of a generative model (auto: embed)",
        group=POOLING_GROUP, choices=CONVERTS))
    pooler_config: dict[str, Any] | str | None = field(default=None, metadata=cli(
        'JSON, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' (default: from the '
        "architecture and sentence-transformers' modules.json)", group=POOLING_GROUP))
    # vLLM's flag: accept prompt_embeds tensors (off: a request with embeds is an error).
    enable_prompt_embeds: bool = field(default=False, metadata=cli(
        "accept prompts given as embeddings (prompt_embeds; docs/serving.md)"))
    # CPU compute threads: None = from the affinity mask, cgroup quota and OMP_NUM_THREADS /
    # VLLM_CPU_OMP_THREADS_BIND (platforms/cpu_threads.py); adaptive: fewer while contended.
    cpu_threads: int | None = field(default=None, metadata=cli(
        "compute threads (default: OMP_NUM_THREADS, else one per CPU the affinity mask and "
        "cgroup quota allow)", group=CPU_THREADS_GROUP))
    cpu_threads_bind: str | None = field(default=None, metadata=cli(
        "CPU list, one compute thread each (0-1, 0,2), or auto | nobind "
        "(default: $VLLM_CPU_OMP_THREADS_BIND, else auto: unbound)", group=CPU_THREADS_GROUP))
    cpu_adaptive_threads: bool = field(default=True, metadata=cli(
        "run fewer compute threads while other processes use the CPUs (default: on)",
        group=CPU_THREADS_GROUP))
    # vLLM's flag: never compile, run every step eagerly.
    enforce_eager: bool = field(default=False, metadata=cli(
        "never compile; run every step eagerly", group=COMPILATION_GROUP))
    # None = the platform default (on for CUDA; off for CPU, where the cold compile costs
    # tens of seconds at start-up; see bench/compile_vs_eager.py); True/False force it.
    compile: bool | None = field(default=None, metadata=cli(
        "compile the decoder layers per bucket (default: on for CUDA, off for CPU)",
        group=COMPILATION_GROUP))
    enable_fx_passes: bool = field(default=True, metadata=cli(
        "run ingot's FX passes before Inductor", group=COMPILATION_GROUP))
    cache_dir: str | None = field(default=None, metadata=cli(
        "compile cache root (default: $INGOT_CACHE_ROOT, else ~/.cache/ingot)",
        group=COMPILATION_GROUP))

    @staticmethod
    def _json_arg(name: str, value: dict[str, Any] | str | None) -> dict[str, Any]:
        if value is None:
            return {}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{name} is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
        return value

    def create_engine_config(self) -> EngineConfig:
        from ingot.platforms import resolve_platform

        platform = resolve_platform(self.device)
        if self.runner not in RUNNERS:
            raise ValueError(f"runner {self.runner!r} is not supported; use {', '.join(RUNNERS)}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert {self.convert!r} is not supported; use {', '.join(CONVERTS)}")
        # No model: the default embedder for a pooling runner, unless a conversion asks for
        # the default chat model to be turned into one.
        default_embedder = self.model is None and self.runner == "pooling" and \
            self.convert in ("auto", "none")
        path, fmt = resolve_model_path(self.model, default_embedder)
        hf_config, generation_config = _load_hf_config(path, fmt)
        hf_overrides = self._json_arg("hf_overrides", self.hf_overrides)
        apply_hf_overrides(hf_config, hf_overrides)
        from ingot.model_executor.models.registry import resolve_model_class

        model_cls = resolve_model_class(hf_config)  # fail early with the supported list
        runner, convert, pooler = self._pooling(model_cls, path, hf_config)
        encoder_only = bool(getattr(model_cls, "is_encoder_only", False))

        dtype = parse_dtype(self.dtype) or _auto_dtype(hf_config, fmt, platform, encoder_only)
        platform.check_dtype(dtype)

        derived_max = int(getattr(hf_config, "max_position_embeddings", 2048))
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = derived_max
            st_len = _st_config(path).max_seq_length if runner == "pooling" else None
            if st_len is not None:  # sentence-transformers truncates there: embed as it does
                max_model_len = min(max_model_len, st_len)
        _positive("max_model_len", max_model_len)
        if max_model_len > derived_max:
            raise ValueError(
                f"max_model_len {max_model_len} is larger than the model's "
                f"max_position_embeddings ({derived_max}); lower --max-model-len"
            )
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        chunked = self.enable_chunked_prefill
        if encoder_only and chunked:
            # Bidirectional attention needs the whole prompt in one step (as in vLLM).
            logger.info("%s is encoder-only: chunked prefill is off", model_cls.__name__)
            chunked = False
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            step_tokens = ENCODER_STEP_TOKENS if encoder_only else 2048
            max_batched = 2048 if chunked else max(max_model_len, step_tokens)
        _positive("max_num_batched_tokens", max_batched)
        if not chunked and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill off: a long prompt could never run; "
                "raise --max-num-batched-tokens or enable chunked prefill"
            )
        if max_batched < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )
        if self.num_gpu_blocks_override is not None:
            _positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not isinstance(self.gpu_memory_utilization, int | float) or not (
            0.0 < self.gpu_memory_utilization <= 1.0
        ):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; accepted: "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if runner == "pooling" and self.kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported with --runner pooling "
                "(embeddings would carry the quantisation error); use auto"
            )
        # Pooling reads every prompt token's hidden state (mean pooling, the classifier's
        # [CLS]): a cached prefix would skip them. Off, whatever the default said.
        prefix_caching = bool(self.enable_prefix_caching) and runner != "pooling"

        additional_config = self._json_arg("additional_config", self.additional_config)
        unknown = set(additional_config) - KNOWN_ADDITIONAL_CONFIG
        if unknown:
            raise ValueError(
                f"unknown additional_config key(s): {', '.join(sorted(unknown))}; "
                f"known: {', '.join(sorted(KNOWN_ADDITIONAL_CONFIG))}"
            )
        ProfilerConfig.from_dict(additional_config.get("profiler"))  # validate now
        buckets = BucketGrid.from_config(
            additional_config, max_batched, self.max_num_seqs, max_model_len, self.block_size,
            # An encoder always runs eagerly: padding to a bucket would only add work, and the
            # largest bucket (max_model_len) would cap a packed step's tokens.
            default_enabled=not encoder_only,
        )
        if self.enable_prompt_embeds and runner == "pooling":
            raise ValueError("enable_prompt_embeds is for generation; drop it with --runner pooling")
        tp = self._parallel_sizes(hf_config, additional_config, model_cls, runner)
        speculative = self._speculative_config(runner)
        compilation = self._compilation_config(platform.name, buckets, runner, encoder_only,
                                               speculative is not None, tp,
                                               getattr(model_cls, "eager_only", None))
        prefills = self._max_prefills(additional_config, compilation,
                                      self.max_num_seqs if encoder_only else None)
        backend = self.distributed_executor_backend or ("mp" if tp > 1 else "uni")
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend {backend!r} is not supported; use "
                f"{' or '.join(EXECUTOR_BACKENDS)}"
            )
        if tp > 1 and backend == "uni":
            raise ValueError(
                f"tensor_parallel_size {tp} runs one worker process per rank: use "
                "--distributed-executor-backend mp (the default with several ranks) or ray"
            )
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "distributed_executor_backend ray needs Ray, which is not installed: "
                "pip install 'ingot[ray]' (or use --distributed-executor-backend mp)"
            )
        if backend == "ray" and self.data_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend ray is not supported with data_parallel_size > 1 "
                "yet; use --distributed-executor-backend mp"
            )
        self._check_nodes(tp, backend)
        structured_outputs = StructuredOutputsConfig.from_dict(
            self._json_arg("structured_outputs_config", self.structured_outputs_config)
        )
        cpu_threads = CpuThreadsConfig(self.cpu_threads, self.cpu_threads_bind,
                                       bool(self.cpu_adaptive_threads))
        if platform.name == "cpu":  # bad thread settings fail here, before the model loads
            from ingot.platforms.cpu_threads import (
                BIND_ENV,
                detect_cpu_budget,
                plan_threads,
                rank_bind_lists,
            )

            bind = self.cpu_threads_bind or os.environ.get(BIND_ENV, "")
            local = self._data_parallel_local()
            world = tp // self.nnodes * local  # the ranks on this node
            if world > 1 and "|" in bind:  # one list per rank (worker.rank_thread_config)
                what = "--cpu-threads-bind" if self.cpu_threads_bind else BIND_ENV
                for part in rank_bind_lists(bind, world, what):
                    plan_threads(detect_cpu_budget(), {}, self.cpu_threads, part)
            else:
                plan_threads(detect_cpu_budget(), os.environ, self.cpu_threads,
                             self.cpu_threads_bind)
        model_config = ModelConfig(
            model=path,
            format=fmt,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            tokenizer=self.tokenizer or path,
            skip_tokenizer_init=self.skip_tokenizer_init,
            seed=self.seed,
            hf_overrides=hf_overrides,
            served_model_name=self.served_model_name or (
                DEFAULT_EMBEDDER_NAME if default_embedder else _default_served_name(path)
            ),
            generation_config=generation_config,
            runner=runner,
            convert=convert,
            pooler_config=pooler,
            is_encoder_only=encoder_only,
            enable_prompt_embeds=bool(self.enable_prompt_embeds),
        )
        if speculative is not None and self._replicas_synchronise():
            raise ValueError(
                "speculative_config is not supported with --enable-expert-parallel and "
                "data_parallel_size > 1 yet (a verification step's rows would need padding "
                "across the replicas); drop one"
            )
        if speculative is not None and speculative.method in ("draft_model", "eagle3"):
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    f"speculative method {speculative.method} is not supported with "
                    "tensor_parallel_size > 1 yet; use ngram, or --tensor-parallel-size 1"
                )
            speculative.draft_model_config = _draft_model_config(speculative, model_config)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                kv_cache_dtype=self.kv_cache_dtype,
                gpu_memory_utilization=float(self.gpu_memory_utilization),
                enable_prefix_caching=prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=chunked,
                max_num_prefills_per_step=prefills,
                async_scheduling=self._async_scheduling(runner, speculative,
                                                        self._replicas_synchronise()),
            ),
            parallel_config=ParallelConfig(
                distributed_executor_backend=backend, tensor_parallel_size=tp,
                data_parallel_size=self.data_parallel_size,
                data_parallel_size_local=self._data_parallel_local(),
                data_parallel_start_rank=self.data_parallel_start_rank,
                data_parallel_address=self.data_parallel_address or "127.0.0.1",
                data_parallel_rpc_port=self.data_parallel_rpc_port,
                nnodes=self.nnodes, node_rank=self.node_rank,
                master_addr=self.master_addr or "127.0.0.1", master_port=self.master_port,
                enable_expert_parallel=bool(self.enable_expert_parallel),
                # Default ep_degree: the world (TP x DP).
                ep_degree=(additional_config.get("ep_degree") or tp * self.data_parallel_size)
                if self.enable_expert_parallel else 1,
                sequence_parallel_prefill=sequence_parallel_prefill(
                    additional_config, tp, buckets,
                    bool(self.enable_expert_parallel) and self.data_parallel_size > 1)),
            device=platform.name,
            additional_config=additional_config,
            buckets=buckets,
            compilation=compilation,
            cpu_threads=cpu_threads,
            structured_outputs=structured_outputs,
            speculative_config=speculative,
        )

    def _speculative_config(self, runner: str) -> SpeculativeConfig | None:
        value = self._json_arg("speculative_config", self.speculative_config)
        if not value:
            return None
        config = SpeculativeConfig.from_dict(value)
        if runner == "pooling":
            raise ValueError(
                "speculative_config is for generation; a pooling model never decodes: drop it "
                "with --runner pooling"
            )
        return config

    def _data_parallel_local(self) -> int:
        """The replicas this node runs, checked with the other multi-node flags."""
        dp = self.data_parallel_size
        local = dp if self.data_parallel_size_local is None else self.data_parallel_size_local
        if isinstance(local, bool) or not isinstance(local, int) or not 1 <= local <= dp:
            raise ValueError(f"data_parallel_size_local must be from 1 to data_parallel_size "
                             f"({dp}), got {local!r}")
        start = self.data_parallel_start_rank
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= dp - local:
            raise ValueError(
                f"data_parallel_start_rank must be from 0 to data_parallel_size - "
                f"data_parallel_size_local ({dp - local}), got {start!r}"
            )
        port = self.data_parallel_rpc_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535 - dp:
            raise ValueError(f"data_parallel_rpc_port must be from 1024 to {65535 - dp} (it "
                             f"and the next {dp - 1} ports are used), got {port!r}")
        if local < dp and self.enable_expert_parallel:
            raise ValueError(
                "--enable-expert-parallel with replicas on several nodes is not supported yet; "
                "run every replica on one node (--data-parallel-size-local "
                f"{dp}) or drop --enable-expert-parallel"
            )
        return local

    def _check_nodes(self, tp: int, backend: str) -> None:
        """TP across nodes (--nnodes, --node-rank, --master-addr, --master-port)."""
        nnodes, node = self.nnodes, self.node_rank
        if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
            raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}")
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nnodes:
            raise ValueError(f"node_rank must be from 0 to nnodes - 1 ({nnodes - 1}), got "
                             f"{node!r}")
        if nnodes == 1:
            return
        if tp % nnodes:
            raise ValueError(
                f"tensor_parallel_size {tp} must be a multiple of nnodes {nnodes} (each node "
                "runs tensor_parallel_size / nnodes ranks): change --tensor-parallel-size or "
                "--nnodes"
            )
        if self.data_parallel_size > 1:
            raise ValueError(
                "--nnodes splits one TP group over nodes; with data_parallel_size > 1 place "
                "whole replicas on nodes instead (--data-parallel-size-local, "
                "--data-parallel-start-rank, --headless), or use --data-parallel-size 1"
            )
        if backend != "mp":
            raise ValueError(
                f"--nnodes is for the mp executor (distributed_executor_backend is {backend!r}): "
                "use --distributed-executor-backend mp, or drop --nnodes (Ray places its "
                "workers over its own cluster)"
            )
        if not self.master_addr:
            raise ValueError(
                "--nnodes > 1 needs --master-addr: node 0's address, which every node can "
                "reach (its ranks meet there)"
            )
        port = self.master_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535 - tp:
            raise ValueError(f"master_port must be from 1024 to {65535 - tp} (it and the next "
                             f"{tp} ports are used), got {port!r}")

    def _replicas_synchronise(self) -> bool:
        return bool(self.enable_expert_parallel) and self.data_parallel_size > 1

    def _async_scheduling(self, runner: str, speculative: SpeculativeConfig | None = None,
                          lockstep: bool = False) -> bool:
        """A pooling runner schedules synchronously: its requests end with their prompt, and
        the step after their last segment must not see them (integration-b §4). Speculation
        does too: the next step's drafts come from this step's accepted tokens. So do
        data-parallel replicas in lockstep (EP across them): each turn runs exactly one
        forward per replica, a real or a dummy one."""
        if lockstep:
            if self.async_scheduling:
                raise ValueError(
                    "async_scheduling is not supported with --enable-expert-parallel and "
                    "data_parallel_size > 1 (the replicas step in lockstep); drop "
                    "--async-scheduling"
                )
            return False
        if runner == "pooling":
            if self.async_scheduling:
                raise ValueError("async_scheduling is not supported with --runner pooling; drop it")
            return False
        if speculative is not None:
            if self.async_scheduling:
                raise ValueError(
                    "async_scheduling cannot be combined with speculative_config (the drafts "
                    "of a step come from the previous step's accepted tokens); drop "
                    "--async-scheduling or the speculative config"
                )
            if self.async_scheduling is None and DEFAULT_ASYNC_SCHEDULING:
                logger.info("speculative decoding: async scheduling turned off")
            return False
        if self.async_scheduling is None:
            return DEFAULT_ASYNC_SCHEDULING
        return bool(self.async_scheduling)

    @staticmethod
    def _max_prefills(additional_config: dict[str, Any], compilation: CompilationConfig,
                      encoder_default: int | None = None) -> int:
        """Packed prefills per step. Compiled layers keep one: a packed step's attention
        layout (requests x longest segment) would vary inside one token bucket and recompile.
        An encoder (``encoder_default``: its max_num_seqs) packs as many prompts as its token
        budget holds."""
        value = additional_config.get("max_num_prefills_per_step")
        if value is None:
            if compilation.enabled:
                return 1
            return encoder_default or DEFAULT_MAX_PREFILLS_PER_STEP
        _positive("max_num_prefills_per_step", value)
        if value > 1 and compilation.enabled:
            raise ValueError(
                f"max_num_prefills_per_step {value} needs eager layers: compiled graphs run one "
                "prefill per step; set it to 1 or pass --enforce-eager / --no-compile"
            )
        return value

    def _parallel_sizes(self, hf_config: Any, additional_config: dict[str, Any],
                        model_cls: type, runner: str) -> int:
        """Validate the parallel flags (distributed/layouts.py has the §1-3 rules); returns
        the tensor-parallel size (each data-parallel replica's)."""
        from ingot.distributed.layouts import ParallelSizes, validate_parallel_sizes

        sizes = ParallelSizes(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            enable_expert_parallel=bool(self.enable_expert_parallel),
            ep_degree=additional_config.get("ep_degree"),
        )
        validate_parallel_sizes(sizes, hf_config)
        tp = sizes.tensor_parallel_size
        if tp > 1:
            if runner == "pooling":
                raise ValueError(
                    "tensor_parallel_size > 1 is not supported yet with --runner pooling; "
                    "use --tensor-parallel-size 1"
                )
            if not getattr(model_cls, "supports_tensor_parallel", False):
                raise ValueError(
                    f"tensor_parallel_size > 1 is not supported yet for {model_cls.__name__}; "
                    "use --tensor-parallel-size 1"
                )
        return tp

    def _compilation_config(
        self, platform_name: str, buckets: BucketGrid, runner: str = "generate",
        encoder_only: bool = False, speculative: bool = False, tp: int = 1,
        model_eager_only: str | None = None,
    ) -> CompilationConfig:
        """``model_eager_only``: why the model's layers cannot be compiled (None: they can)."""
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true, false or None, got {self.compile!r}")
        if self.enforce_eager and self.compile:
            raise ValueError("enforce_eager and compile=True contradict each other; drop one")
        if encoder_only and self.compile:
            raise ValueError(
                "compile=True is not supported for encoder-only models (BERT runs eagerly); "
                "drop --compile"
            )
        if self.enable_prompt_embeds and self.compile:
            raise ValueError(
                "compile=True is not supported with enable_prompt_embeds yet (the embeds run "
                "eagerly); drop one"
            )
        if speculative and self.compile:
            raise ValueError(
                "compile=True is not supported with speculative_config yet (verification steps "
                "run eagerly); drop --compile"
            )
        if tp > 1 and self.compile:
            raise ValueError(
                "compile=True is not supported with tensor_parallel_size > 1 yet (the ranks "
                "run eagerly); drop --compile"
            )
        if model_eager_only and self.compile:
            raise ValueError(f"compile=True is not supported for this model yet "
                             f"({model_eager_only}); drop --compile")
        eager_only = (encoder_only or bool(self.enable_prompt_embeds) or speculative or tp > 1
                      or bool(model_eager_only))
        enabled = not self.enforce_eager and not eager_only and (
            self.compile if self.compile is not None else platform_name == "cuda"
        )
        if enabled and not buckets.enabled:
            if self.compile:
                raise ValueError(
                    "compilation needs static shapes: enable_bucketing must be on (or pass "
                    "--enforce-eager)"
                )
            logger.info("bucketing is off: running eagerly (compiled graphs need fixed shapes)")
            enabled = False
        return CompilationConfig(
            enabled=enabled,
            enable_fx_passes=bool(self.enable_fx_passes),
            cache_root=self.cache_dir,
            # As vLLM: graphs unless --enforce-eager, whether or not the layers are compiled.
            # Decode graphs only: a pooling runner never decodes.
            cuda_graphs=platform_name == "cuda" and not self.enforce_eager and buckets.enabled
            and runner != "pooling" and tp == 1 and not model_eager_only,  # (host syncs)
        )

    def _pooling(
        self, model_cls: type, path: str, hf_config: Any
    ) -> tuple[str, str, PoolerConfig | None]:
        """(runner, convert, pooler config) from the flags and the architecture."""
        native = getattr(model_cls, "pooling_task", None)  # "embed" | "classify" | None
        arch = model_cls.__name__
        runner = self.runner if self.runner != "auto" else ("pooling" if native else "generate")
        if runner == "generate":
            if native:
                raise ValueError(
                    f"{arch} is a pooling model (it returns {'embeddings' if native == 'embed' else 'label scores'}, "
                    "it cannot generate text); pass --runner pooling"
                )
            if self.convert not in ("auto", "none") or self.pooler_config is not None:
                raise ValueError("--convert and --pooler-config need --runner pooling")
            return runner, "none", None
        if native:
            if self.convert not in ("auto", "none", native):
                raise ValueError(
                    f"{arch} is a{'n embedding' if native == 'embed' else ' classification'} model; "
                    f"--convert {self.convert} is not supported for it (use --convert auto)"
                )
            task, convert = native, "none"
        else:
            if self.convert == "none":
                raise ValueError(
                    f"{arch} generates text; with --runner pooling it needs --convert embed "
                    "(or auto)"
                )
            convert = "embed" if self.convert == "auto" else self.convert
            task = convert
        st = _st_config(path)
        default_type = st.pooling_type or (
            getattr(model_cls, "default_pooling_type", None) if native else "LAST"
        )
        default_normalize = task == "embed" and (st.normalize if st.normalize is not None else True)
        overrides = self._json_arg("pooler_config", self.pooler_config)
        unknown = set(overrides) - POOLER_CONFIG_KEYS
        if unknown:
            raise ValueError(
                f"unknown pooler_config key(s): {', '.join(sorted(unknown))}; known: "
                f"{', '.join(sorted(POOLER_CONFIG_KEYS))}"
            )
        pooling_type = overrides.get("pooling_type", default_type)
        if isinstance(pooling_type, str):
            pooling_type = pooling_type.upper()
        if pooling_type not in POOLING_TYPES:
            where = "pooler_config" if "pooling_type" in overrides else f"{path} (1_Pooling/config.json)"
            raise ValueError(
                f"pooling_type {pooling_type!r} from {where} is not supported; use one of "
                f"{', '.join(POOLING_TYPES)} (--pooler-config '{{\"pooling_type\": \"MEAN\"}}')"
            )
        normalize = overrides.get("normalize", default_normalize)
        if not isinstance(normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {normalize!r}")
        return runner, convert, PoolerConfig(task, pooling_type, normalize)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any]) -> None:
    """Set config attributes; rope settings also go into ``rope_parameters`` (transformers 5
    reads them from there, so a bare ``rope_theta`` attribute alone would be ignored)."""
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(current, dict) and isinstance(value, dict):
            value = {**current, **value}
        setattr(hf_config, key, value)
        rope = getattr(hf_config, "rope_parameters", None)
        if isinstance(rope, dict):
            if key == "rope_theta":
                rope["rope_theta"] = value
            elif key == "rope_scaling" and isinstance(value, dict):
                rope.update(value)


def _draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft model of ``draft_model`` speculation: the target's dtype and length, and its
    vocabulary (a draft token is a target token id)."""
    assert spec.model is not None
    if spec.method == "eagle3":
        return _eagle3_config(spec, target)
    path, fmt = resolve_model_path(spec.model)
    hf_config, _ = _load_hf_config(path, fmt)
    if int(hf_config.vocab_size) != target.vocab_size:
        raise ValueError(
            f"the draft model {spec.model!r} has a vocabulary of {hf_config.vocab_size} tokens "
            f"and the target {target.vocab_size}; a draft must share the target's tokenizer"
        )
    from ingot.model_executor.models.registry import resolve_model_class

    model_cls = resolve_model_class(hf_config)
    if getattr(model_cls, "pooling_task", None):
        raise ValueError(f"the draft model {spec.model!r} is a pooling model; use a causal LM")
    return ModelConfig(
        model=path, format=fmt, hf_config=hf_config, dtype=target.dtype,
        max_model_len=target.max_model_len, tokenizer=path, skip_tokenizer_init=True,
        seed=target.seed, hf_overrides={}, served_model_name=_default_served_name(path),
    )


def _eagle3_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """An EAGLE3 head: one decoder layer over the target's embedding space and hidden
    states; also fixes the target layers it reads (``spec.aux_layer_ids``)."""
    from ingot.model_executor.models.eagle3 import default_aux_layers, eagle3_config

    assert spec.model is not None
    path = str(Path(spec.model).expanduser())
    if not (Path(path) / "config.json").exists():
        raise ModelNotFoundError(
            f"EAGLE3 head {spec.model!r} is not a directory with a config.json (ingot never "
            "downloads models)"
        )
    hf_config = eagle3_config(path)
    layers = int(getattr(hf_config, "num_hidden_layers", 1))
    if layers != 1:
        raise ValueError(f"an EAGLE3 head has exactly one decoder layer; {spec.model!r} has "
                         f"{layers}")
    if int(hf_config.vocab_size) != target.vocab_size:
        raise ValueError(
            f"the EAGLE3 head {spec.model!r} embeds {hf_config.vocab_size} tokens and the "
            f"target has {target.vocab_size}; it must be trained for the target"
        )
    target_hidden = int(getattr(hf_config, "target_hidden_size", None) or hf_config.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"the EAGLE3 head {spec.model!r} reads hidden states of width {target_hidden} and "
            f"the target's are {target.hidden_size}; it must be trained for the target"
        )
    n = int(target.hf_config.num_hidden_layers)
    ids = tuple(getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or
                default_aux_layers(n))
    if len(ids) != 3 or any(not 0 <= i < n for i in ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {list(ids)} must be three layer indices of the "
            f"target's {n} layers"
        )
    spec.aux_layer_ids = ids
    return ModelConfig(
        model=path, format="hf", hf_config=hf_config, dtype=target.dtype,
        max_model_len=target.max_model_len, tokenizer=path, skip_tokenizer_init=True,
        seed=target.seed, hf_overrides={}, served_model_name=_default_served_name(path),
    )


def _st_config(path: str) -> Any:
    from ingot.model_executor.loader.st_config import SentenceTransformersConfig, read_st_config

    return read_st_config(path) or SentenceTransformersConfig()


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _default_served_name(path: str) -> str:
    name = os.path.basename(path.rstrip("/"))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name
