"""A worker owns one device: it loads the model, sizes and allocates the KV cache, and runs
steps through its ModelRunner."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any

import torch

from ingot.config import EngineConfig, ProfilerConfig
from ingot.distributed.layouts import kv_heads_per_rank
from ingot.distributed.parallel_state import tp_collectives
from ingot.model_executor.binding import Bound, attention_heads, bind, select_kernels
from ingot.model_executor.layers.attention_backend import (
    TORCH_ATTENTION,
    AttentionBackend,
    select_attention_backend,
)
from ingot.model_executor.layers.cpu_kernels import bind_openmp_team
from ingot.model_executor.layers.linear import resident_weight_bytes
from ingot.model_executor.loader.model_loader import load_model
from ingot.model_executor.models.llama import head_dim_of
from ingot.platforms import resolve_platform
from ingot.platforms.cpu_threads import start_cpu_threads
from ingot.runner_output import ModelRunnerOutput
from ingot.sched_output import SchedulerOutput
from ingot.utils.hugepages import huge_page_buffer
from ingot.utils.math_utils import cdiv
from ingot.worker.execution.program import StepProgram
from ingot.worker.execution.select import select_step_program
from ingot.worker.kv_budget import (
    cap_fraction_from_env,
    compute_kv_budget,
    min_budget_gib_from_env,
    num_blocks_for_budget,
)
from ingot.worker.model_runner import ModelRunner
from ingot.worker.profiler import StepProfiler

logger = logging.getLogger("ingot")

def rank_kv_heads(config: EngineConfig, hf: Any = None) -> int:
    """KV heads one rank caches: its share under TP (one, replicated, when TP > KV heads)."""
    hf = hf if hf is not None else config.model_config.hf_config
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return kv_heads_per_rank(num_kv_heads, config.parallel_config.tensor_parallel_size)


def _kv_layer_shapes(config: EngineConfig, num_blocks: int) -> list[tuple[int, ...]]:
    """One cache tensor per attention layer on this rank: the target's, then a draft model's
    (speculative decoding: its blocks are the target's block ids, in tensors of its own)."""
    models = [config.model_config.hf_config]
    spec = config.speculative_config
    if spec is not None and spec.draft_model_config is not None:
        models.append(spec.draft_model_config.hf_config)
    shapes = []
    for hf in models:
        shape = (2, num_blocks, config.cache_config.block_size, rank_kv_heads(config, hf),
                 head_dim_of(hf))
        shapes += [shape] * hf.num_hidden_layers
    return shapes


def kv_bytes_per_block(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of one block on one rank (its KV heads, every layer)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) * elem for shape in _kv_layer_shapes(config, 1))


def plan_num_blocks(
    config: EngineConfig, total_bytes: int, weight_bytes: int, dtype: torch.dtype,
    ranks_sharing: int = 1,
) -> int:
    """Block count from the memory budget; ``num_gpu_blocks_override`` wins. Checks that at
    least one request of ``max_model_len`` tokens fits. ``ranks_sharing``: ranks that share
    ``total_bytes`` (TP ranks on one CPU host); each plans with its share, and the budget's
    minimum is shared out the same way."""
    cache, sched = config.cache_config, config.scheduler_config
    per_block = kv_bytes_per_block(config, dtype)
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
        source = "num_gpu_blocks_override"
    else:
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
            source = "kv_cache_memory_bytes"
        else:
            budget = compute_kv_budget(
                total_bytes // ranks_sharing,
                weight_bytes,
                cache.gpu_memory_utilization,
                cap_fraction_from_env(),
                min_budget_gib_from_env() / ranks_sharing,
            )
            source = "gpu_memory_utilization"
        # +1: block 0 is the null block. More than every sequence at full length is never used.
        most_useful = sched.max_num_seqs * cdiv(sched.max_model_len, cache.block_size) + 1
        num_blocks = num_blocks_for_budget(budget, per_block, most_useful)
    usable_tokens = (num_blocks - 1) * cache.block_size
    if usable_tokens < sched.max_model_len:
        raise ValueError(
            f"the KV cache ({num_blocks} blocks of {cache.block_size} tokens, from {source}) "
            f"holds {max(usable_tokens, 0)} tokens, fewer than one request of max_model_len "
            f"({sched.max_model_len}); lower --max-model-len or give the KV cache more memory "
            "(--gpu-memory-utilization, --kv-cache-memory-bytes or --num-gpu-blocks-override)"
        )
    return num_blocks


KV_CALIBRATION_TOKENS = 256
# Calibrated scales leave this much headroom above the largest value seen, so that inputs
# slightly larger than the calibration's are represented rather than clamped.
KV_SCALE_MARGIN = 2.0


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> None:
    """One prefill of fixed pseudo-random tokens through a throwaway model-dtype cache,
    recording each layer's largest |K| and |V|: scale = margin * amax / 448."""
    from ingot.model_executor.layers.attention import FP8_E4M3_MAX, AttentionMetadata

    hf = config.model_config.hf_config
    n = min(KV_CALIBRATION_TOKENS, config.model_config.max_model_len)
    bs = config.cache_config.block_size
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.model_config.vocab_size, (n,), generator=gen).to(device)
    positions = torch.arange(n, device=device)
    num_blocks = cdiv(n, bs)
    num_kv_heads = rank_kv_heads(config)
    shape = (2, num_blocks + 1, bs, num_kv_heads, head_dim_of(hf))
    caches = [torch.zeros(shape, dtype=config.model_config.dtype, device=device)
              for _ in range(hf.num_hidden_layers)]
    table = torch.arange(1, num_blocks + 1, device=device).view(1, -1)
    meta = AttentionMetadata.build(positions, [n], positions + bs, table)
    attns = [layer.self_attn for layer in model.model.layers]
    for attn in attns:
        attn.kv_scales.calibrating = True
    try:
        model(tokens, positions, caches, meta)
    finally:
        for attn in attns:
            attn.kv_scales.calibrating = False
    for attn in attns:
        s = attn.kv_scales
        s.k_scale = max(s.k_amax, 1e-6) * KV_SCALE_MARGIN / FP8_E4M3_MAX
        s.v_scale = max(s.v_amax, 1e-6) * KV_SCALE_MARGIN / FP8_E4M3_MAX
    logger.info(
        "FP8 KV cache: calibrated per-layer scales on %d tokens (k %.3g-%.3g, v %.3g-%.3g)",
        n,
        min(a.kv_scales.k_scale for a in attns), max(a.kv_scales.k_scale for a in attns),
        min(a.kv_scales.v_scale for a in attns), max(a.kv_scales.v_scale for a in attns),
    )


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache: masked-out reads must never meet NaN garbage (0 * NaN = NaN).

    On CPU the memory is a fresh anonymous mapping (utils/hugepages.py): zero pages committed
    only when first written, so a 4 GiB cache costs no start-up time and RSS grows only as
    blocks fill up (torch.zeros would touch every page up front); and advised for huge pages,
    since decode attention reads the blocks of 64 sequences x 30 layers scattered over the
    cache, and with 4 KiB pages nearly every block costs a TLB miss (measured: decode
    attention 13% faster on huge pages).
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return huge_page_buffer(nbytes).view(dtype).view(shape)


def rank_thread_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config global rank ``rank`` plans its CPU threads from. With several ranks on one
    host (TP x the local data-parallel replicas), a
    ``|``-separated bind list (vLLM's VLLM_CPU_OMP_THREADS_BIND form, or --cpu-threads-bind)
    gives rank i its i-th part; without any thread setting each rank takes its share of the
    CPUs, so the ranks do not oversubscribe them."""
    parallel = config.parallel_config
    world = parallel.host_ranks  # the ranks of every replica on this host
    if world == 1:
        return config
    from ingot.platforms.cpu_threads import BIND_ENV, detect_cpu_budget, rank_bind_lists

    threads = config.cpu_threads
    bind = threads.bind if threads.bind is not None else os.environ.get(BIND_ENV, "").strip()
    if bind and "|" in bind:
        what = "--cpu-threads-bind" if threads.bind is not None else BIND_ENV
        parts = rank_bind_lists(bind, world, what)
        threads = dataclasses.replace(threads, bind=parts[parallel.host_index(rank)])
    elif threads.threads is None and not bind and not os.environ.get("OMP_NUM_THREADS"):
        threads = dataclasses.replace(threads, threads=max(1, detect_cpu_budget().usable // world))
    return dataclasses.replace(config, cpu_threads=threads)


class Worker:
    """Lifecycle, driven by an executor: ``determine_num_blocks`` (load the model, plan the KV
    cache from the memory budget), then ``initialize_cache(num_blocks)`` with the count the
    executor agreed on (the minimum over workers), which allocates the cache, chooses how steps
    run (the step program, worker/execution/) and warms it up; then ``execute_model`` per
    step."""

    def __init__(self, config: EngineConfig, rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank  # in this replica's TP group
        parallel = config.parallel_config
        # Ranks of all data-parallel replicas share the host: the CPU and GPU plans use this.
        self.global_rank = parallel.global_rank(rank)
        self.platform = resolve_platform(config.device)
        self.device = self.platform.device()
        if self.device.type == "cuda" and parallel.world_size > 1:  # one GPU per rank
            self.device = torch.device("cuda", parallel.host_index(self.global_rank)
                                       % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(self.device)
        if parallel.replicas_synchronise:
            from ingot.distributed.parallel_state import init_distributed

            # EP across the replicas: one world of every replica's ranks, TP and DP groups.
            assert parallel.distributed_init_method is not None
            init_distributed(parallel.world_size, self.global_rank,
                             parallel.distributed_init_method, parallel.tensor_parallel_size,
                             self.device, ep_size=parallel.ep_degree)
        elif parallel.tensor_parallel_size > 1:
            from ingot.distributed.parallel_state import init_distributed

            if distributed_init_method is None:
                raise ValueError("a worker of several ranks needs distributed_init_method")
            # The model's layers size their shards from the TP group built here. Without
            # expert parallelism the replicas never communicate: each TP group is a world.
            init_distributed(parallel.tensor_parallel_size, rank, distributed_init_method,
                             parallel.tensor_parallel_size, self.device,
                             ep_size=parallel.ep_degree,
                             sequence_parallel=parallel.sequence_parallel_prefill,
                             node_rank=parallel.node_rank)
        # CPU compute threads: count, binding, adaptivity (platforms/cpu_threads.py).
        self.cpu_threads = (start_cpu_threads(rank_thread_config(config, self.global_rank),
                                              team_binder=bind_openmp_team)
                            if self.device.type == "cpu" else None)
        torch.manual_seed(config.model_config.seed)
        self.kv_dtype = config.cache_config.torch_dtype(config.model_config.dtype)
        start = time.perf_counter()
        self.model = load_model(config.model_config, self.device)
        # Compiled layers run on their plain weights: packing keeps them beside the copies.
        self.attn_backend, self.bound, self.kernel_builds = self._bind(
            self.model, config.model_config.dtype, keep_plain=config.compilation.enabled)
        # Speculative decoding's draft model, beside the target (its heads may differ).
        spec = config.speculative_config
        self.draft_model = None
        self.draft_bound: Bound | None = None
        if spec is not None and spec.draft_model_config is not None:
            self.draft_model = load_model(spec.draft_model_config, self.device)
            _, self.draft_bound, _ = self._bind(self.draft_model,
                                                spec.draft_model_config.dtype, keep_plain=False)
        self.load_seconds = time.perf_counter() - start  # loading and binding (packing)
        # What the weights occupy, the kernels' derived layouts included (the KV budget is
        # what memory they leave).
        self.load_bytes = resident_weight_bytes(self.model) + (
            resident_weight_bytes(self.draft_model) if self.draft_model is not None else 0
        )
        self.profiler = StepProfiler(
            ProfilerConfig.from_dict(config.additional_config.get("profiler")),
            rank=self.global_rank,
            device_type=self.device.type,
        )
        self.num_blocks = 0
        self.kv_caches: list[torch.Tensor] = []
        self.model_runner: ModelRunner | None = None
        #: How the model's steps run (chosen in initialize_cache).
        self.program: StepProgram | None = None
        self.compile_seconds = 0.0
        self.warmup_seconds = 0.0

    def _bind(self, model: torch.nn.Module, dtype: torch.dtype,
              keep_plain: bool) -> tuple[AttentionBackend, Bound, dict[str, str]]:
        """The one binding step of a loaded model: its kernels and its attention backend,
        each chosen once here, handed to its layers by ``bind``. Returns the backend, what
        binding built (the backend's decode program for the model) and the builds of ingot's
        CPU libraries its layers run (``{"bf16": "avx2"}``)."""
        kernels = select_kernels(model, dtype, self.device, keep_plain)
        heads = attention_heads(model)
        # An encoder's attention is not over a KV cache: no backend to choose.
        backend = TORCH_ATTENTION if heads is None else select_attention_backend(
            self.device, dtype, self.kv_dtype, self.config.compilation.enabled, heads)
        bound = bind(model, backend, kernels)
        # The libraries the layers asked for (each loads on a layer's first ask, into
        # Kernels' cached properties): read them, never load one here.
        # (the quantized library's avx512 build says "+amx" where its many-row steps run on
        # AMX tiles)
        builds = {name: lib.isa + ("+amx" if getattr(lib, "amx", False) else "")
                  for name in ("bf16", "f32", "quant")
                  if bound.kernel_layers and (lib := vars(kernels).get(name)) is not None}
        logger.info("bound %s: %.1f MB resident (derived kernel layouts included), %d layers "
                    "on ingot's CPU kernels%s", type(model).__name__,
                    resident_weight_bytes(model) / 2**20, bound.kernel_layers,
                    f" ({', '.join(f'{lib}: {isa}' for lib, isa in builds.items())})"
                    if builds else "")
        if heads is not None:
            logger.info("attention backend: %s (%s, KV cache %s%s)%s", backend.name,
                        str(dtype).removeprefix("torch."),
                        str(self.kv_dtype).removeprefix("torch."),
                        ", compiled" if self.config.compilation.enabled else "",
                        "; decode steps run its decode program"
                        if bound.decode_program is not None else "")
        return backend, bound, builds

    def determine_num_blocks(self) -> int:
        # Memory still free now, plus what the weights took: the total before loading.
        total = self.platform.available_memory_bytes(self.device) + self.load_bytes
        # On CPU the ranks share the host's memory (a GPU is each rank's own).
        sharing = self.config.parallel_config.host_ranks if self.device.type == "cpu" else 1
        return plan_num_blocks(self.config, total, self.load_bytes, self.kv_dtype, sharing)

    def initialize_cache(self, num_blocks: int) -> None:
        config = self.config
        self.num_blocks = num_blocks
        caches = [allocate_kv_cache(shape, self.kv_dtype, self.device)
                  for shape in _kv_layer_shapes(config, num_blocks)]
        num_layers = config.model_config.hf_config.num_hidden_layers
        self.kv_caches, draft_caches = caches[:num_layers], caches[num_layers:]
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MB)",
            num_blocks,
            config.cache_config.block_size,
            num_blocks * kv_bytes_per_block(config, self.kv_dtype) / 2**20,
        )
        if self.kv_dtype == torch.float8_e4m3fn:
            self._set_fp8_scales()
        draft = (self.draft_model, draft_caches) if self.draft_model is not None else None
        self.program = select_step_program(config, self.model, self.device,
                                           self.bound.decode_program, self.draft_model)
        draft_program = None  # a draft model's (an EAGLE3 head runs inside its proposer)
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and self.draft_bound is not None:
            draft_program = select_step_program(config, self.draft_model, self.device,
                                                self.draft_bound.decode_program, drafter=True)
        self.model_runner = ModelRunner(config, self.model, self.kv_caches, self.device, draft,
                                        self.attn_backend, self.program, draft_program)
        # Compile, capture or warm up every bucket before the engine reports ready (nothing
        # compiles while serving).
        times = self.program.warm_up(self.model_runner)
        self.compile_seconds, self.warmup_seconds = times.compile_seconds, times.warmup_seconds

    def startup_stats(self) -> dict[str, Any]:
        """Load, compile and warmup figures (plain numbers)."""
        return {
            "load_seconds": self.load_seconds,
            "load_bytes": self.load_bytes,
            "compile_seconds": self.compile_seconds,
            "warmup_seconds": self.warmup_seconds,
            "num_blocks": self.num_blocks,
            # The builds of ingot's CPU libraries the model's layers run ({} for none).
            "cpu_kernels": self.kernel_builds,
            "pid": os.getpid(),
            "node_rank": self.config.parallel_config.node_rank,  # TP across nodes: its node
            # MoE: the first MoE layer's experts here, (first, count) (None: a dense model).
            "local_experts": next(((m.expert_start, m.num_local_experts)
                                   for m in self.model.modules() if hasattr(m, "expert_start")),
                                  None),
            # TP: what carries the collectives ("shm", "gloo", "nccl"; None with one rank)
            # and whether prefill runs sequence-parallel.
            "tp_collectives": tp_collectives(),
            "sequence_parallel_prefill": bool(getattr(getattr(self.model, "model", None),
                                                      "sequence_parallel", False)),
        }

    def runtime_stats(self) -> dict[str, Any]:
        """What changes while serving: compilation counters and the CPU compute threads in
        use (None without a CPU thread policy)."""
        threads = self.cpu_threads.current if self.cpu_threads is not None else None
        runner = self.model_runner
        return {
            "compilation": self.compile_stats(),
            "cpu_compute_threads": threads,
            "async_steps": runner.async_steps if runner is not None else 0,
            "sync_fallback_steps": runner.sync_fallback_steps if runner is not None else 0,
            # Requests the runner holds state for (0 once every finished id has reached it).
            "num_runner_requests": len(runner.requests) if runner is not None else 0,
        }

    def compile_stats(self) -> dict[str, Any]:
        """Compilation counters (plain numbers; all zero when running eagerly)."""
        compiler = self.program.compiler if self.program is not None else None
        if compiler is None:
            return {"enabled": False, "graphs": 0, "compilations": 0, "cache_hits": 0,
                    "backend_calls": 0, "calls_after_warmup": 0, "compilations_after_warmup": 0,
                    "compile_seconds": 0.0}
        s = compiler.backend.stats
        return {
            "enabled": True,
            "graphs": len(compiler.shapes),
            "compilations": s.compilations,
            "cache_hits": s.cache_hits,
            "backend_calls": s.backend_calls,
            "calls_after_warmup": s.calls_after_warmup,
            "compilations_after_warmup": s.compilations_after_warmup,
            "compile_seconds": s.total_compile_seconds,
            "compile_seconds_per_bucket": dict(s.compile_seconds),
        }

    def compile_summary(self) -> str:
        """One line: graphs, hits, misses, seconds and the cache directory."""
        compiler = self.program.compiler if self.program is not None else None
        assert compiler is not None and compiler.summary is not None
        return f"{compiler.summary.line()}; cache {compiler.cache.dir}"

    def _set_fp8_scales(self) -> None:
        """Per-layer FP8 scales: from the checkpoint, else calibrated once now, else 1.0."""
        if getattr(self.model, "kv_scales_from_checkpoint", False):
            logger.info("FP8 KV cache: per-layer scales from the checkpoint")
            return
        if not self.config.additional_config.get("calibrate_kv_scales", True):
            logger.warning("FP8 KV cache without checkpoint scales or calibration: scales are 1.0")
            return
        calibrate_kv_scales(self.model, self.config, self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model_runner is not None, "initialize_cache() first"
        if self.cpu_threads is not None:
            output = self.cpu_threads.execute(self.model_runner.execute_model, scheduler_output)
        else:
            output = self.model_runner.execute_model(scheduler_output)
        if not scheduler_output.is_empty:
            self.profiler.step()
        output.runtime_stats = self.runtime_stats()
        return output

    def dp_has_unfinished(self, local: bool) -> bool:
        """Whether any replica has work (a DP all-reduce; EP across replicas only)."""
        from ingot.distributed.data_parallel import has_global_unfinished_reqs
        from ingot.distributed.parallel_state import get_dp_group

        return has_global_unfinished_reqs(local, get_dp_group(),
                                          self.config.parallel_config.replicas_synchronise)

    def execute_dummy_batch(self) -> None:
        """An idle replica's step (EP across replicas): model_runner.execute_dummy_batch."""
        assert self.model_runner is not None
        self.model_runner.execute_dummy_batch()

    def profile(self, is_start: bool) -> str | None:
        if is_start:
            self.profiler.start()
            return None
        path = self.profiler.stop()
        return None if path is None else str(path)
