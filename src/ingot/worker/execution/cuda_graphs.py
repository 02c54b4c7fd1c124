"""CUDA graphs for decode buckets: the whole model forward captured once per bucket, replayed.

A decode step on a GPU is launch-bound: a few hundred small kernels whose launch costs more than
their work. The bucket grid makes every decode step one of a fixed set of shapes (batch bucket x
context width), so each shape is captured once at start-up, after compilation, and a step of
that shape copies its inputs into the graph's static buffers and replays it: one launch for the
whole forward, compiled or eager layers alike. Prefill steps run as before.

What makes a captured forward valid for later steps: the weights and KV caches never move; the
step's inputs (token ids, positions and the attention metadata's tensors) are copied into the
buffers the graph was captured with; the metadata's plain fields are fixed by the bucket (checked
on every replay). The output lives in the graphs' shared memory pool and is valid until the next
replay, which is how the runner uses it (logits are gathered from it at once).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ingot.model_executor.layers.attention import AttentionMetadata

logger = logging.getLogger("ingot")

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class Replayable(Protocol):
    def replay(self) -> None: ...


#: Captures ``run()`` and returns (something to replay it, the output tensor it writes).
CaptureFn = Callable[[Callable[[], torch.Tensor]], tuple[Replayable, torch.Tensor]]


def cuda_graph_capture(pool: Any = None) -> CaptureFn:
    """A :data:`CaptureFn` recording real CUDA graphs, all in one memory pool (replays run one
    at a time, so the graphs can share their intermediate buffers)."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(run: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        run()  # once outside the capture: lazy library init, Dynamo guards, autotuning
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = run()
        return graph, output

    return capture


def decode_key(input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[int, int] | None:
    """(batch rows, block-table width) of a decode step; None for anything else."""
    if not meta.is_decode:
        return None
    return (input_ids.shape[0], meta.block_table.shape[1])


def _clone_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(meta, **{
        f.name: getattr(meta, f.name).clone() for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)})


def _copy_meta(dst: AttentionMetadata, src: AttentionMetadata) -> None:
    for f in dataclasses.fields(src):
        new, static = getattr(src, f.name), getattr(dst, f.name)
        if isinstance(new, torch.Tensor):
            static.copy_(new)
        elif new != static:
            raise ValueError(f"decode step differs from its captured bucket in {f.name}: "
                             f"{new!r} != {static!r}")


@dataclasses.dataclass
class _Captured:
    graph: Replayable
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    output: torch.Tensor


class DecodeGraphs:
    """One captured forward per decode bucket.

    Args:
        forward: ``forward(input_ids, positions, meta) -> hidden`` (the model over its caches).
        capture: how to record a graph (default: real CUDA graphs; tests pass a stand-in).
    """

    def __init__(self, forward: Forward, capture: CaptureFn | None = None) -> None:
        self.forward = forward
        self._capture = capture
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.replays = 0
        self.capture_seconds = 0.0

    def capture(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> None:
        """Record the forward of this decode step's bucket (its inputs are only examples)."""
        key = decode_key(input_ids, meta)
        if key is None:
            raise ValueError("only decode steps (one token per request) are captured")
        if self._capture is None:
            self._capture = cuda_graph_capture()
        start = time.perf_counter()
        ids, pos, static_meta = input_ids.clone(), positions.clone(), _clone_meta(meta)
        graph, output = self._capture(lambda: self.forward(ids, pos, static_meta))
        self.graphs[key] = _Captured(graph, ids, pos, static_meta, output)
        self.capture_seconds += time.perf_counter() - start

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states from its bucket's graph, or None (not a captured shape)."""
        key = decode_key(input_ids, meta)
        captured = self.graphs.get(key) if key is not None else None
        if captured is None:
            return None
        captured.input_ids.copy_(input_ids)
        captured.positions.copy_(positions)
        _copy_meta(captured.meta, meta)
        captured.graph.replay()
        self.replays += 1
        return captured.output
