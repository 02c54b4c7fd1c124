"""The compiled program: the model's modules with their decoder layers compiled per bucket
(model_compiler.py); its warm-up compiles, or loads, every bucket's graph."""

from __future__ import annotations

import torch
from torch import nn

from ingot.config import EngineConfig
from ingot.worker.execution.model_compiler import ModelCompiler
from ingot.worker.execution.program import EagerProgram, GradMode, StepForward, WarmupTimes
from ingot.worker.warmup import DummySteps


class CompiledProgram(EagerProgram):
    """Steps run the modules as an eager program's do; the layers' own forwards are the
    compiled ones, installed when this program is built (before any step)."""

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device,
                 progress: bool = True) -> None:
        super().__init__(model)
        self._compiler = ModelCompiler(config, model.model.layers, device, progress)

    @property
    def compiler(self) -> ModelCompiler:
        return self._compiler

    @property
    def grad_mode(self) -> GradMode:
        # Precompiled layers serve without inference mode (the compiler decides).
        return self._compiler.grad_mode

    def warm_up(self, steps: DummySteps, run: StepForward | None = None) -> WarmupTimes:
        # Compilation traces the modules themselves, whatever program serves around them.
        summary = self._compiler.compile_and_warmup(steps, self.forward)
        return WarmupTimes(compile_seconds=summary.seconds)
