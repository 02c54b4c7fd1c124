"""The attention backend: chosen once per model at start-up, then the only owner of how
attention runs.

A backend is selected for (device, model dtype, KV-cache dtype, compiled or not, the rank's
head shape) by :func:`select_attention_backend`, and bound to every attention layer of a model
by the binding step (:func:`ingot.model_executor.binding.bind`). It owns:

- the metadata builder (:meth:`AttentionBackend.build_metadata`): what its kernels read, built
  once per step;
- the layers' attention (:meth:`AttentionBackend.attend`): rotary, the KV-cache write and the
  attention itself;
- the model's decode program, where it has one (:meth:`AttentionBackend.decode_program`): ingot's
  CPU kernels run a whole decode step of a Llama-family decoder without module dispatch
  (layers/cpu_decode_program.py). Binding builds it; the worker's step program runs it for the
  decode steps it serves (worker/execution/).

Layers and kernels therefore never re-decide per step which kernel applies: the dtypes,
device and compilation that decide it are fixed when the backend is chosen; what remains per
step is the step's kind, which the scheduler put in the metadata.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ingot.model_executor.layers.attention import AttentionMetadata, paged_attention
from ingot.model_executor.layers.cpu_kernels import (
    CpuKernels,
    decode_attention_bf16,
    decode_attention_supported,
    load_cpu_kernels,
    rope_write_kv_bf16,
)

if TYPE_CHECKING:
    from ingot.model_executor.layers.attention import KVScales
    from ingot.model_executor.layers.rotary import RotaryEmbedding

logger = logging.getLogger("ingot")


class DecodeProgram(Protocol):
    """A backend's program for whole decode steps of one model, without module dispatch."""

    def serves(self, meta: AttentionMetadata) -> bool:
        """Whether this step is one the program runs (else the model's modules do)."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states, as the model's forward would return them."""
        ...


class AttentionLayerParams(Protocol):
    """What a backend reads of an attention layer (DecoderAttention is one)."""

    rotary: RotaryEmbedding
    scale: float
    sliding_window: int | None
    kv_scales: KVScales


class AttentionBackend:
    """Plain torch ops: rotary, an indexed cache write, SDPA over the gathered blocks. Serves
    every device, dtype and KV dtype (FP8 included, and its calibration), and compiled layers
    (Dynamo traces these ops; ingot's ctypes kernels are opaque to it)."""

    name = "torch"
    #: Whether decode steps attend through the [rows, keys] mask (else by sequence length).
    decode_mask = True

    def build_metadata(
        self,
        positions: torch.Tensor,
        query_lens: list[int],
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        from_position_zero: bool = False,
        is_decode: bool = False,
        rows_share_sequences: bool = False,
        kernel_rows: int = 0,
    ) -> AttentionMetadata:
        """The step's metadata, with the attention mask only where this backend reads it."""
        with_mask = self.decode_mask or not is_decode
        return AttentionMetadata.build(
            positions, query_lens, slot_mapping, block_table,
            block_size=block_size if with_mask else None, from_position_zero=from_position_zero,
            is_decode=is_decode, rows_share_sequences=rows_share_sequences,
            kernel_rows=kernel_rows,
        )

    def attend(
        self,
        layer: AttentionLayerParams,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D], not yet rotated -> [T, H * D]; the step's
        key/value rows are written into ``kv_cache`` first (padding rows never are)."""
        query, key = layer.rotary(positions, query, key)
        scales = layer.kv_scales
        if scales.calibrating:
            scales.observe(key, value, meta.num_actual_tokens)
        return paged_attention(query, key, value, kv_cache, meta, layer.scale,
                               layer.sliding_window, scales)

    def decode_program(self, model: nn.Module) -> DecodeProgram | None:
        """The program that runs ``model``'s whole decode step, or None (the modules run)."""
        return None


class CpuKernelAttention(AttentionBackend):
    """ingot's bf16 CPU kernels (cpu_kernels.py) over a bf16 cache: decode rotates, writes and
    attends in one call per layer, reading the paged blocks in place; a prefill rotates and
    writes in one call, then attends with SDPA. Chosen only where every one of them applies."""

    name = "cpu-kernels"
    # The decode kernel bounds each row by its sequence length: no mask to build.
    decode_mask = False

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def attend(
        self,
        layer: AttentionLayerParams,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cos_sin = layer.rotary.cos_sin_cache
        if meta.is_decode and not meta.rows_share_sequences:
            return decode_attention_bf16(
                self.kernels, query, key, value, kv_cache, meta.slot_mapping, meta.block_table,
                meta.seq_lens, layer.scale, layer.sliding_window, positions, cos_sin,
            )
        # A prefill, or a verification step (rows of one sequence read each other's keys, so
        # every row is written before any attends).
        query, key = rope_write_kv_bf16(self.kernels, query, key, value, positions, cos_sin,
                                        kv_cache, meta.slot_mapping)
        if meta.is_decode:
            return decode_attention_bf16(
                self.kernels, query, key, value, kv_cache, None, meta.block_table,
                meta.seq_lens, layer.scale, layer.sliding_window,
            )
        return paged_attention(query, key, value, kv_cache, meta, layer.scale,
                               layer.sliding_window, layer.kv_scales, kv_written=True)

    def decode_program(self, model: nn.Module) -> DecodeProgram | None:
        from ingot.model_executor.layers.cpu_decode_program import CpuDecodeProgram

        return CpuDecodeProgram.build(model, self.kernels)


TORCH_ATTENTION = AttentionBackend()


# The binding step's interfaces (model_executor/binding.py) for what a backend is handed to:
# plain base classes rather than ABCs, since they mix into nn.Module.
class AttentionBindable:
    """An attention layer whose attention runs through the model's attention backend."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def bind_attention(self, backend: AttentionBackend) -> None:
        """Run attention through ``backend`` from now on."""
        raise NotImplementedError


def select_attention_backend(
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    compiled: bool,
    heads: tuple[int, int, int],
) -> AttentionBackend:
    """The backend for this (device, model dtype, KV dtype, compilation, heads): ingot's CPU
    kernels for an eager bf16 model over a bf16 cache on a CPU they build for, when their
    fixed buffers take the rank's (query heads, KV heads, head dim); plain torch otherwise."""
    if (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and kv_cache_dtype == torch.bfloat16
        and not compiled
        and decode_attention_supported(*heads)
    ):
        kernels = load_cpu_kernels()
        if kernels is not None:
            return CpuKernelAttention(kernels)
    return TORCH_ATTENTION
