"""ingot's own ``torch.compile`` backend: FX passes, then Inductor (spec sections 7 and 10).

Dynamo hands the backend one graph per bucket shape (``dynamic=False`` semantics: every bucket
dimension is specialised). The backend runs the FX pass manager (device rewrite, aliasing-output
rewrite, in-place -> out-of-place, then the in-graph copy-back so the KV cache is still updated
in place by Inductor) and lowers the result with ``compile_fx``. CUDA graphs are not Inductor's
business here: its cudagraph trees refuse graphs that mutate an input (the KV cache), so the
worker captures the whole decode forward per bucket itself (worker/execution/cuda_graphs.py).

What counts as a *compilation* is a real Inductor compile: ``compile_fx`` that was not served by
Inductor's FX graph cache (its ``fxgraph_cache_miss``/``fxgraph_cache_bypass`` counters move).
A backend call answered from the cache is a *hit*: Dynamo still traces, but nothing is lowered
or built, which is what a warm start and serving after warmup must show.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule

from ingot.compilation.cache import CompileCacheMissError
from ingot.compilation.passes import CopyBackInGraph, FXPassManager, default_passes

logger = logging.getLogger("ingot")


@dataclass
class CompileStats:
    """What the backend did, per bucket label (``prefill_t128_w4``, ``decode_b8_w64``, ...)."""

    backend_calls: int = 0
    compilations: int = 0  # real Inductor compiles (FX graph cache miss or bypass)
    cache_hits: int = 0  # graphs served from a cache (Inductor's FX graph cache, precompiled)
    compile_seconds: dict[str, float] = field(default_factory=dict)
    #: Backend calls after warmup finished: each one is a bucket the warmup missed.
    calls_after_warmup: int = 0
    compilations_after_warmup: int = 0

    @property
    def total_compile_seconds(self) -> float:
        return sum(self.compile_seconds.values())


def _inductor_counts() -> tuple[int, int, int]:
    """(misses + bypasses, hits) of Inductor's FX graph cache, and AOTAutograd cache misses,
    process-wide. Dynamo's precompile (``aot_compile``) skips the FX graph cache and always
    misses the AOTAutograd one (it lowers afresh to bundle the result): only the latter moves."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return (c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"], c["fxgraph_cache_hit"],
            counters["aot_autograd"]["autograd_cache_miss"])


class IngotBackend:
    """``torch.compile(fn, backend=IngotBackend(...))``.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``; the FX passes retarget devices to it.
        enable_fx_passes: run the FX pass pipeline before lowering (off = lower Dynamo's graph
            as it is; a switch for ruling the passes out when debugging).
        hit_only: raise :class:`CompileCacheMissError` when a graph was not in Inductor's cache.
        lower: the lowering function (default Inductor's ``compile_fx``); tests swap it.
    """

    def __init__(
        self,
        device_type: str = "cpu",
        enable_fx_passes: bool = True,
        hit_only: bool = False,
        lower: Callable[..., Any] | None = None,
    ) -> None:
        self.device_type = device_type
        self.hit_only = hit_only
        self.pass_manager = FXPassManager(
            [*default_passes(device_type), CopyBackInGraph()], enable_fx_passes=enable_fx_passes
        )
        self._lower = lower
        self.stats = CompileStats()
        #: Set by the warmup to name the bucket being compiled; "serving" after warmup.
        self.label = "unlabelled"
        self.warmed_up = False

    @property
    def enable_fx_passes(self) -> bool:
        return self.pass_manager.enable_fx_passes

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        label = self.label
        self.stats.backend_calls += 1
        if self.warmed_up:
            # Dynamo traced a new shape after warmup: a bucket is missing from the grid.
            self.stats.calls_after_warmup += 1
            logger.warning("graph traced after warmup (input shapes %s): a bucket is missing "
                           "from the warmup grid", _shapes(example_inputs))
        start = time.perf_counter()
        gm = self.pass_manager.run_passes(gm)
        misses0, hits0, lowered0 = _inductor_counts()
        lower = self._lower or compile_fx
        compiled = lower(gm, list(example_inputs))
        misses1, hits1, lowered1 = _inductor_counts()
        elapsed = time.perf_counter() - start
        # A cold compile moves both caches' misses; count it once.
        compiled_now = max(misses1 - misses0, lowered1 - lowered0)
        if self._lower is not None and misses1 == misses0 and hits1 == hits0:
            compiled_now = 1  # a custom lowering outside Inductor's cache always compiles
        self.stats.compilations += compiled_now
        self.stats.cache_hits += hits1 - hits0
        self.stats.compile_seconds[label] = self.stats.compile_seconds.get(label, 0.0) + elapsed
        if self.warmed_up:
            self.stats.compilations_after_warmup += compiled_now
        logger.debug("backend: %s %s in %.2f s (fx passes %s)", label,
                     "compiled" if compiled_now else "served from the inductor cache", elapsed,
                     {k: round(v * 1e3, 2) for k, v in self.pass_manager.last_timings.items()})
        if compiled_now and self.hit_only:
            raise CompileCacheMissError(
                f"graph for {label} was not in the compile cache and INGOT_DISABLE_WARMUP_COMPILE"
                "=1 forbids compiling; run `ingot compile` with the same model and engine flags "
                "into this cache first")
        return compiled


def _shapes(example_inputs: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)][:6]
