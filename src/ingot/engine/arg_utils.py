"""``EngineArgs``: what the user typed (CLI flags / ``LLM(...)`` keywords, vLLM's names), and
``EngineArgs.create_engine_config()``, which resolves it against the model into an
``EngineConfig`` (config.py), validating every knob (vLLM's ``vllm/engine/arg_utils.py``).

Each ``EngineArgs`` field declares its flag in ``field(metadata=cli(...))``: help, choices,
aliases, group. ``add_engine_args`` turns those into argparse arguments and ``engine_args_from``
a parsed namespace back into ``EngineArgs``, for every command that runs an engine (``ingot
serve``, ``generate``, ``chat``, ``bench``, ``compile``, ``validate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import logging
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ingot.buckets import BucketGrid
from ingot.config import (
    CONVERTS,
    DEFAULT_ASYNC_SCHEDULING,
    DEFAULT_EMBEDDER_NAME,
    DEFAULT_MAX_PREFILLS_PER_STEP,
    ENCODER_STEP_TOKENS,
    EXECUTOR_BACKENDS,
    KNOWN_ADDITIONAL_CONFIG,
    KV_CACHE_DTYPES,
    POOLER_CONFIG_KEYS,
    POOLING_TYPES,
    QUANTIZATIONS,
    RUNNERS,
    CacheConfig,
    CompilationConfig,
    CpuThreadsConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    ProfilerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    check_positive,
    parse_dtype,
)
from ingot.distributed.sequence_parallel import sequence_parallel_prefill
from ingot.engine.model_resolution import (
    apply_hf_overrides,
    auto_dtype,
    default_served_name,
    draft_model_config,
    load_hf_config,
    resolve_model_path,
    st_config,
)
from ingot.platforms.interface import dtype_name

logger = logging.getLogger("ingot")


def _bf16_kernel_isa(platform: Any) -> str | None:
    """The ISA of ingot's vector bf16 CPU kernels serving here (None: none, or not a CPU), for
    the platform's dtype rules. The engine asks and passes the answer down because platforms/
    sits below model_executor/ (the layer contract); loading here builds the library once per
    machine, and the worker then loads the same build."""
    if platform.device_type != "cpu":
        return None
    from ingot.model_executor.layers.cpu_kernels import bf16_kernel_isa

    return bf16_kernel_isa()


def _quant_kernels_load() -> bool:
    """Whether ingot's GGUF-quantized CPU kernels load here (built once per machine; the
    worker then loads the same build). Asked by the engine for the reason above."""
    from ingot.model_executor.layers.cpu_kernels import load_quant_kernels

    return load_quant_kernels() is not None


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
    rpc_secret_file: str | None = field(default=None, metadata=cli(
        "multi-node (--nnodes > 1, or replicas on other nodes): a file holding the secret "
        "every node shares, which authenticates the traffic between them (default: the "
        "INGOT_RPC_SECRET env var; docs/serving.md, Security)", group=PARALLEL_GROUP))
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
    # vLLM's flag. None: "gguf" for a .gguf model generating on CPU where ingot's quantized
    # kernels serve it, else "none".
    quantization: str | None = field(default=None, metadata=cli(
        "gguf: keep a GGUF model's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights quantized (CPU; "
        "the default for "
        "a .gguf model there); none: dequantize every weight at load (docs/configuration.md)",
        choices=QUANTIZATIONS))
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
    # Another way to set additional_config.profiler.output_dir (one config field); setting it
    # turns the server's /start_profile and /stop_profile on.
    profiler_dir: str | None = field(default=None, metadata=cli(
        "enable profiling (/start_profile, /stop_profile) with traces in this directory "
        "(default: $VLLM_TORCH_PROFILER_DIR, else off unless --additional-config sets "
        "profiler)"))

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

    def _dtype(self, hf_config: Any, platform: Any, encoder_only: bool) -> torch.dtype:
        """The model's dtype: ``auto`` by the platform's rule (logged with why), else the one
        given (with a warning where this CPU only emulates it)."""
        kernels = functools.partial(_bf16_kernel_isa, platform)
        dtype = parse_dtype(self.dtype)
        if dtype is None:
            dtype, reason = auto_dtype(hf_config, platform, encoder_only, kernels)
            logger.info("dtype auto -> %s: %s", dtype_name(dtype), reason)
        elif dtype in (torch.bfloat16, torch.float16) and \
                (warning := platform.dtype_warning(dtype, kernels())):
            logger.warning("%s", warning)
        return platform.check_dtype(dtype)

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
        hf_config, generation_config = load_hf_config(path, fmt)
        hf_overrides = self._json_arg("hf_overrides", self.hf_overrides)
        apply_hf_overrides(hf_config, hf_overrides)
        from ingot.model_executor.models.registry import resolve_model_class

        model_cls = resolve_model_class(hf_config)  # fail early with the supported list
        runner, convert, pooler = self._pooling(model_cls, path, hf_config)
        encoder_only = bool(getattr(model_cls, "is_encoder_only", False))

        dtype = self._dtype(hf_config, platform, encoder_only)

        derived_max = int(getattr(hf_config, "max_position_embeddings", 2048))
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = derived_max
            st_len = st_config(path).max_seq_length if runner == "pooling" else None
            if st_len is not None:  # sentence-transformers truncates there: embed as it does
                max_model_len = min(max_model_len, st_len)
        check_positive("max_model_len", max_model_len)
        if max_model_len > derived_max:
            raise ValueError(
                f"max_model_len {max_model_len} is larger than the model's "
                f"max_position_embeddings ({derived_max}); lower --max-model-len"
            )
        check_positive("max_num_seqs", self.max_num_seqs)
        check_positive("block_size", self.block_size)
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
        check_positive("max_num_batched_tokens", max_batched)
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
            check_positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        if self.kv_cache_memory_bytes is not None:
            check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
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
        additional_config = self._with_profiler_dir(additional_config)
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
        quantization = self._quantization(path, fmt, platform, dtype, compilation.enabled,
                                          runner)
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
                DEFAULT_EMBEDDER_NAME if default_embedder else default_served_name(path)
            ),
            generation_config=generation_config,
            runner=runner,
            convert=convert,
            pooler_config=pooler,
            is_encoder_only=encoder_only,
            enable_prompt_embeds=bool(self.enable_prompt_embeds),
            quantization=quantization,
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
            speculative.draft_model_config = draft_model_config(speculative, model_config)
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
                rpc_secret_file=self.rpc_secret_file,
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

    def _quantization(self, path: str, fmt: str, platform: Any, dtype: torch.dtype,
                      compiled: bool, runner: str) -> str:
        """--quantization resolved: "gguf" (a GGUF's quantized weights stay quantized) where
        ingot's quantized kernels can serve the model, else "none"; asking for "gguf" where
        they cannot is an error that says why."""
        asked = self.quantization
        if asked is not None and asked not in QUANTIZATIONS:
            raise ValueError(f"quantization {asked!r} is not supported; use "
                             f"{' or '.join(QUANTIZATIONS)}")
        if asked == "none" or (asked is None and (fmt != "gguf" or runner == "pooling")):
            return "none"
        if fmt != "gguf":
            raise ValueError(f"--quantization gguf keeps a GGUF file's quantized weights; "
                             f"{path} is not a .gguf model (drop --quantization)")
        why_not = None
        if platform.device_type != "cpu":
            why_not = (f"ingot's quantized kernels run on CPU only ({platform.name} dequantizes "
                       "GGUF weights at load)")
        elif compiled:
            why_not = "compiled layers run on dequantized weights"
        elif dtype not in (torch.bfloat16, torch.float32):
            why_not = (f"the quantized kernels take float32 or bf16 activations, not "
                       f"{dtype_name(dtype)}")
        elif not _quant_kernels_load():
            why_not = ("ingot's quantized CPU kernels are unavailable here (no C compiler, or "
                       "INGOT_CPU_KERNELS=0)")
        if why_not is None:
            return "gguf"
        if asked == "gguf":
            raise ValueError(f"--quantization gguf: {why_not}; use --quantization none")
        logger.info("GGUF weights are dequantized at load: %s", why_not)
        return "none"

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
        check_positive("max_num_prefills_per_step", value)
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
        st = st_config(path)
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

    def _with_profiler_dir(self, additional_config: dict[str, Any]) -> dict[str, Any]:
        """``additional_config`` with --profiler-dir (or $VLLM_TORCH_PROFILER_DIR) as its
        profiler.output_dir: the one field every way of enabling profiling sets."""
        directory = self.profiler_dir or os.environ.get("VLLM_TORCH_PROFILER_DIR") or None
        profiler = additional_config.get("profiler")
        if directory is None or not (profiler is None or isinstance(profiler, dict)):
            return additional_config  # nothing to add (a bad profiler value is reported)
        given = (profiler or {}).get("output_dir")
        if given is not None:
            if self.profiler_dir and given != self.profiler_dir:
                raise ValueError(
                    f"--profiler-dir {self.profiler_dir!r} and additional_config "
                    f"profiler.output_dir {given!r} disagree; give one"
                )
            return additional_config  # the explicit config wins over the environment
        return {**additional_config, "profiler": {**(profiler or {}), "output_dir": directory}}

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}



def cli_fields(cls: type = EngineArgs) -> list[tuple[dataclasses.Field, CliFlag]]:
    """The fields of ``cls`` that are flags, in declaration order. A field without CLI
    metadata is an error: each knob decides once whether it is a flag (``NOT_A_FLAG``)."""
    flagged = []
    for f in dataclasses.fields(cls):
        if CLI_METADATA_KEY not in f.metadata:
            raise TypeError(
                f"{cls.__name__}.{f.name} declares no command-line flag: give it "
                "field(metadata=cli(...)), or metadata=NOT_A_FLAG to keep it off the CLI"
            )
        spec = f.metadata[CLI_METADATA_KEY]
        if spec is not None:
            flagged.append((f, spec))
    return flagged


def _value_type(name: str, annotation: Any) -> type | None:
    """argparse's ``type`` from a field's annotation, ``None`` meaning "the string as typed"
    (str fields, and JSON fields that also accept a dict from Python)."""
    members = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) \
        else {annotation}
    members.discard(type(None))
    if str in members:
        return None
    if members in ({int}, {float}, {bool}):
        return members.pop()
    raise TypeError(f"EngineArgs.{name}: no flag type for {annotation!r}; declare cli(type=...)")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of ``cls``, declared as ``EngineArgs``' are (the server's own
    settings use it too)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}  # title -> argument group, created on first use
    for f, spec in cli_fields(cls):
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": spec.help}
        value_type = spec.type or _value_type(f.name, hints[f.name])
        if spec.action is not None:
            kwargs["action"] = spec.action
        elif value_type is bool:
            # An off switch is enough for a flag that defaults off; the others get --no-x too.
            kwargs["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        elif value_type is not None:
            kwargs["type"] = value_type
        if spec.choices is not None:
            kwargs["choices"] = list(spec.choices)
        flag = spec.flag or "--" + f.name.replace("_", "-")
        groups[spec.group].add_argument(*spec.aliases, flag, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineArgs`` field (vLLM's names), as its metadata declares."""
    add_dataclass_args(parser, EngineArgs)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` in a parsed namespace (its other attributes are the command's own)."""
    names = EngineArgs.field_names()
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})


# ---- one-shot sizing ---------------------------------------------------------------------
# `generate`, `chat`, `validate` and single-request `bench` runs know their workload: one
# prompt (times --n) at a time. The engine's defaults are sized for a server (256 sequences:
# a KV cache of several GB, a warmup step per decode batch bucket up to 256 and per prefill
# bucket up to 2048), which made `ingot generate` spend most of a minute before its first
# token. These commands set the existing knobs to what they will run instead; a flag the user
# typed always wins. `serve` keeps the full grid and its warmup.
ONE_SHOT_MIN_TOKENS = 128  # the smallest prefill bucket (buckets.py)
ONE_SHOT_MAX_TOKENS = 2048  # the engine's default token budget: never raised above it


def prefill_budget_for(num_tokens: int) -> int:
    """The smallest power-of-two token budget (>= 128) that prefills ``num_tokens`` at once."""
    budget = ONE_SHOT_MIN_TOKENS
    while budget < min(num_tokens, ONE_SHOT_MAX_TOKENS):
        budget *= 2
    return budget


def size_one_shot(ns: argparse.Namespace, num_seqs: int, prompt_tokens: int | None) -> None:
    """Set max_num_seqs to the sequences the command runs at once and the token budget (hence
    the prefill buckets) to the longest prompt it expects, unless the user gave them. The KV
    cache follows: the worker never allocates more than max_num_seqs full-length sequences."""
    given: set[str] = getattr(ns, "given_flags", set())
    chosen = []
    if "max_num_seqs" not in given:
        ns.max_num_seqs = num_seqs
        chosen.append(f"max_num_seqs={num_seqs}")
    try:
        extra = EngineArgs._json_arg("additional_config", ns.additional_config)
    except ValueError:
        extra = {}  # reported by the engine config with its own message
    if (prompt_tokens is not None and "max_num_batched_tokens" not in given
            and ns.enable_chunked_prefill  # without chunking the budget must cover max_model_len
            and "num_batched_tokens_buckets" not in extra):
        ns.max_num_batched_tokens = max(prefill_budget_for(prompt_tokens), ns.max_num_seqs)
        chosen.append(f"max_num_batched_tokens={ns.max_num_batched_tokens}")
    if chosen:
        logger.info("sized for this command: %s (flags given on the command line win)",
                    ", ".join(chosen))
