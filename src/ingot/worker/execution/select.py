"""The one choice of how a model's steps run (vLLM v1's ``CudagraphDispatcher`` decides it
once too), from the platform, compilation, CUDA graphs and the attention backend's decode
program."""

from __future__ import annotations

import torch
from torch import nn

from ingot.config import EngineConfig
from ingot.model_executor.layers.attention_backend import DecodeProgram
from ingot.model_executor.layers.linear import runs_onednn_linears
from ingot.worker.execution.compiled import CompiledProgram
from ingot.worker.execution.cuda_graph_program import CudaGraphProgram
from ingot.worker.execution.decode_program import BackendDecodeProgram
from ingot.worker.execution.program import EagerProgram, EagerWarmup, StepProgram
from ingot.worker.warmup import warmup_shapes


def select_step_program(
    config: EngineConfig,
    model: nn.Module,
    device: torch.device,
    decode_program: DecodeProgram | None,
    draft_model: nn.Module | None = None,
    drafter: bool = False,
) -> StepProgram:
    """How ``model``'s steps run, innermost first:

    1. its layers: compiled (``config.compilation.enabled``: compiling every bucket is the
       warm-up) or eager (on a CPU, warmed up one dummy step per row count where some linear of
       the model or of ``draft_model`` runs oneDNN's packed kernels, else skipped);
    2. the attention backend's ``decode_program`` (from binding), for the decode steps it
       serves;
    3. CUDA graphs (``config.compilation.cuda_graphs``), captured per decode bucket after the
       layers' warm-up and replayed for plain decode steps.

    ``drafter``: ``model`` is a draft model: eager, never captured nor warmed up, its decode
    program where it has one.
    """
    cc = config.compilation
    program: StepProgram
    if drafter:
        program = EagerProgram(model)
    elif cc.enabled:
        program = CompiledProgram(config, model, device)
    else:
        warmup = None
        if device.type == "cpu":
            models = [model] + ([draft_model] if draft_model is not None else [])
            warmup = EagerWarmup(warmup_shapes(config),
                                 needed=any(runs_onednn_linears(m) for m in models),
                                 decodes=not config.model_config.pooler_config)
        program = EagerProgram(model, warmup)
    if decode_program is not None:
        program = BackendDecodeProgram(program, decode_program)
    if cc.cuda_graphs and not drafter:
        spec = config.speculative_config
        program = CudaGraphProgram(program, config,
                                   leaves_aux_states=spec is not None and spec.method == "eagle3")
    return program
