"""The decode-program step: decode steps that the attention backend's decode program serves
run it (a whole decode step without module dispatch, e.g. ingot's CPU kernels:
model_executor/layers/cpu_decode_program.py); every other step runs the program it wraps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.attention_backend import DecodeProgram
from ingot.worker.execution.program import StepProgram, WrappedProgram


class BackendDecodeProgram(WrappedProgram):
    """``program`` where ``program.serves(meta)`` (a decode step, verification included, with
    no forward hook installed that the program would bypass); ``inner`` otherwise. A prefill,
    and so a step with prompt embeddings, never reaches it."""

    def __init__(self, inner: StepProgram, program: DecodeProgram) -> None:
        super().__init__(inner)
        self.program = program

    @property
    def decode_program(self) -> DecodeProgram:
        return self.program

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                embeds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        if not embeds and self.program.serves(meta):
            return self.program.forward(input_ids, positions, kv_caches, meta)
        return self.inner.forward(input_ids, positions, kv_caches, meta, embeds)
