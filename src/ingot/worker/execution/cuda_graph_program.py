"""The CUDA-graph program: decode steps replay their bucket's captured forward
(cuda_graphs.py); every other step runs the program it wraps."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ingot.config import EngineConfig
from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.worker.execution.cuda_graphs import CaptureFn, DecodeGraphs
from ingot.worker.execution.program import StepForward, StepProgram, WarmupTimes, WrappedProgram
from ingot.worker.warmup import DummySteps, warmup_shapes

logger = logging.getLogger("ingot")


class CudaGraphProgram(WrappedProgram):
    """Captures every decode bucket of the grid at warm-up, after ``inner``'s own warm-up
    (compiled or eager layers alike are captured). A decode step replays its bucket's graph,
    except a verification step (its rows share sequences, a shape no graph was captured for)
    and any step of a target whose EAGLE3 head reads the auxiliary hidden states
    (``leaves_aux_states``: a replay leaves none); those, prefills and shapes without a graph
    run ``inner``.

    Args:
        capture: how to record a graph (default: real CUDA graphs; tests pass a stand-in).
    """

    def __init__(self, inner: StepProgram, config: EngineConfig, leaves_aux_states: bool = False,
                 capture: CaptureFn | None = None) -> None:
        super().__init__(inner)
        self.shapes = [s for s in warmup_shapes(config) if s.kind == "decode"]
        self.leaves_aux_states = leaves_aux_states
        self._capture = capture
        self.graphs: DecodeGraphs | None = None

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return self.graphs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                embeds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        if (self.graphs is not None and meta.is_decode and not meta.rows_share_sequences
                and not self.leaves_aux_states):
            hidden = self.graphs.replay(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        return self.inner.forward(input_ids, positions, kv_caches, meta, embeds)

    def warm_up(self, steps: DummySteps, run: StepForward | None = None) -> WarmupTimes:
        times = self.inner.warm_up(steps, run or self.forward)
        self.capture(steps)
        return times

    def capture(self, steps: DummySteps) -> DecodeGraphs:
        """Capture every decode bucket (largest first, as the later, smaller graphs then fit in
        the memory pool the first ones grew); decode steps replay them from now on."""
        inner, kv_caches = self.inner, steps.kv_caches
        graphs = DecodeGraphs(lambda ids, pos, meta: inner.forward(ids, pos, kv_caches, meta),
                              self._capture)
        with self.grad_mode():
            for shape in sorted(self.shapes, key=lambda s: (-s.num_reqs, -s.width)):
                graphs.capture(*steps.dummy_step(shape))
            steps.forget_dummy_steps()
        self.graphs = graphs
        logger.info("CUDA graphs: %d decode buckets captured in %.1f s", len(graphs.graphs),
                    graphs.capture_seconds)
        return graphs
