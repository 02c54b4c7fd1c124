"""Step programs: the one answer to how a step's batch runs, what runs before the engine
reports ready, and in which autograd-free mode steps run.

:class:`EagerProgram` runs the model's modules; :class:`~.compiled.CompiledProgram` the same
modules with compiled decoder layers. Wrappers (:class:`WrappedProgram`: CUDA graphs, the
attention backend's decode program) serve the steps they can and hand every other step to the
program they wrap, so combinations (compiled layers inside captured graphs) are compositions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.attention_backend import DecodeProgram
from ingot.worker.warmup import DummySteps, WarmupShape

if TYPE_CHECKING:
    from ingot.worker.execution.cuda_graphs import DecodeGraphs
    from ingot.worker.execution.model_compiler import ModelCompiler

logger = logging.getLogger("ingot")

GradMode = Callable[[], AbstractContextManager[Any]]


class StepForward(Protocol):
    """A program's forward: the step's hidden states."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                 embeds: Sequence[torch.Tensor] = ()) -> torch.Tensor: ...


@dataclass
class WarmupTimes:
    """What a warm-up took, as the worker's ``startup_stats`` reports it."""

    compile_seconds: float = 0.0
    warmup_seconds: float = 0.0


class StepProgram:
    """How one model's steps run. Accessors name the parts a program holds (None where it
    holds none); a wrapper answers for the program it wraps as well."""

    model: nn.Module

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                embeds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The step's hidden states. ``embeds``: (inputs_embeds, is_token_ids) of a prefill
        with prompt embeddings, passed to the model's forward."""
        raise NotImplementedError

    def warm_up(self, steps: DummySteps, run: StepForward | None = None) -> WarmupTimes:
        """Everything that must happen before the first request (dummy steps through
        ``steps``); ``run``: the forward serving will call (the outermost program's)."""
        return WarmupTimes()

    @property
    def grad_mode(self) -> GradMode:
        """The autograd-free mode every step and warm-up runs in."""
        return torch.inference_mode

    @property
    def compiler(self) -> ModelCompiler | None:
        return None

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return None

    @property
    def decode_program(self) -> DecodeProgram | None:
        return None


@dataclass(frozen=True)
class EagerWarmup:
    """The eager warm-up of a CPU engine: one dummy step per row count of ``shapes`` when
    ``needed`` (some linear runs oneDNN's packed kernels, which are built per shape), else
    skipped and logged as skipped. ``decodes``: False for a pooling runner (it never decodes)."""

    shapes: list[WarmupShape]
    needed: bool
    decodes: bool = True


class EagerProgram(StepProgram):
    """The model's modules, every step. ``warmup``: None where eager steps need none."""

    def __init__(self, model: nn.Module, warmup: EagerWarmup | None = None) -> None:
        self.model = model
        self.warmup = warmup

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                embeds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, *embeds)

    def warm_up(self, steps: DummySteps, run: StepForward | None = None) -> WarmupTimes:
        if self.warmup is None:
            return WarmupTimes()
        if not self.warmup.needed:  # the default model on CPUs without AMX: ~8 s saved
            logger.info("warmup: skipped (no linear runs oneDNN's packed bf16 kernels, which "
                        "are built per shape; ingot's kernels, MKL's and oneDNN's float32 ones "
                        "need no warmup)")
            return WarmupTimes()
        seconds = self._warm_up_rows(steps, run or self.forward)
        logger.info("warmup: one dummy step per bucket's row count, %.1f s", seconds)
        return WarmupTimes(warmup_seconds=seconds)

    def _warm_up_rows(self, steps: DummySteps, run: StepForward) -> float:
        """One dummy step per row count the linear layers will see (each prefill bucket from
        position 0, each decode batch bucket at its narrowest context), so that oneDNN's
        just-in-time kernels for those shapes, and the first touch of the activations' memory,
        happen before the engine reports ready instead of in the first requests of each size.
        Returns the seconds it took."""
        from ingot.utils.progress import progress

        assert self.warmup is not None
        start = time.perf_counter()
        seen: set[tuple[str, int]] = set()
        shapes = self.warmup.shapes
        with self.grad_mode():
            for shape in progress(shapes, "warmup", total=len(shapes), unit="shape"):
                rows = (shape.kind, shape.num_tokens)
                if rows in seen or (shape.kind == "prefill" and shape.start_position > 0):
                    continue
                if shape.kind == "decode" and not self.warmup.decodes:
                    continue
                seen.add(rows)
                ids, positions, meta = steps.dummy_step(shape)
                run(ids, positions, steps.kv_caches, meta)
            steps.forget_dummy_steps()
        return time.perf_counter() - start


class WrappedProgram(StepProgram):
    """Serves some steps itself; every other step, the warm-up and the accessors it does not
    answer go to ``inner``."""

    def __init__(self, inner: StepProgram) -> None:
        self.inner = inner
        self.model = inner.model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                embeds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        return self.inner.forward(input_ids, positions, kv_caches, meta, embeds)

    def warm_up(self, steps: DummySteps, run: StepForward | None = None) -> WarmupTimes:
        return self.inner.warm_up(steps, run or self.forward)

    @property
    def grad_mode(self) -> GradMode:
        return self.inner.grad_mode

    @property
    def compiler(self) -> ModelCompiler | None:
        return self.inner.compiler

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return self.inner.decode_graphs

    @property
    def decode_program(self) -> DecodeProgram | None:
        return self.inner.decode_program
