"""The binding step: after loading, one walk over the model gives each layer its kernels and
every attention layer the attention backend, so that no forward decides again which kernel
applies.

What is chosen stays where it is chosen: :func:`select_kernels` decides how the linears are
packed and on which CPU ingot's libraries are offered (each library picks its own ISA when it
loads, a packed linear GEMV or GEMM by its row count), :func:`~ingot.model_executor.layers.
attention_backend.select_attention_backend` picks the backend. :func:`bind` only hands the
results out, through typed interfaces: ``KernelBindable`` (layers/bindable.py) and
``AttentionBindable`` (layers/attention_backend.py), and builds the backend's decode program for
the bound model, which it returns for the worker to choose how steps run (worker/execution/).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ingot.model_executor.layers.attention_backend import (
    AttentionBackend,
    AttentionBindable,
    DecodeProgram,
)
from ingot.model_executor.layers.bindable import KernelBindable, Kernels
from ingot.model_executor.layers.cpu_kernels import (
    QUANT_DENSE_MIN_ROWS,
    load_cpu_kernels,
    onednn_f32_preferred,
    quant_dense_preferred,
)
from ingot.model_executor.layers.linear import cpu_packed_linear_supported
from ingot.model_executor.layers.quantized import quantized_parts
from ingot.utils.hugepages import huge_page_buffer


def select_kernels(model: nn.Module, dtype: torch.dtype, device: torch.device,
                   keep_plain: bool = False) -> Kernels:
    """ingot's CPU kernels for ``model`` (loaded in ``dtype`` on ``device``). bf16 linears pack
    for ingot's GEMV/GEMM wherever a build of its bf16 library runs (AVX2 + FMA and up: bf16
    weights widened to float32 in registers where the CPU has no bf16 arithmetic), and for
    oneDNN's bf16 linear beside them where this CPU has it. float32 linears, an encoder's and a
    decoder's, pack for oneDNN's float32 linear at every row count where it beats MKL's sgemm
    (``onednn_f32_preferred``: CPUs not made by Intel), never beside plain weights kept for
    compilation. Quantized linears of a bf16 model run oneDNN's bf16 linear on their weight
    dequantized per call at prefill row counts where ``quant_dense_preferred`` (AMX).
    ``INGOT_DISABLE_PACKED_LINEAR`` keeps every linear plain. ``keep_plain``: the
    layers will be compiled and run on their plain weights."""
    if device.type != "cpu":
        return Kernels()
    packing = not os.environ.get("INGOT_DISABLE_PACKED_LINEAR")
    pack = None
    if packing and dtype == torch.bfloat16 and (cpu_packed_linear_supported(dtype, device)
                                                or load_cpu_kernels() is not None):
        pack = "bf16"
    elif packing and dtype == torch.float32 and not keep_plain and onednn_f32_preferred():
        # One kernel at every row count, no plain copy beside it: a row's output through
        # oneDNN's float32 linear does not depend on the rows beside it, bit for bit (MKL's
        # does), so a decode row's linears equal its verification row's and its batched
        # self's. Faster at every row count on both cores (onednn_f32_preferred).
        pack = "f32"
    dense_rows = QUANT_DENSE_MIN_ROWS if dtype == torch.bfloat16 and quant_dense_preferred() else 0
    return Kernels(cpu=True, pack=pack, keep_plain=keep_plain, quant_dense_rows=dense_rows)


@dataclass
class Bound:
    """What :func:`bind` did."""

    #: Layers that run any of ingot's kernels.
    kernel_layers: int
    #: The backend's decode program for the model (None: it has none for this model).
    decode_program: DecodeProgram | None


def _post_order(module: nn.Module, seen: set[int] | None = None) -> Iterator[nn.Module]:
    # A block binds after its parts: its choice may read how they packed their weights. Each
    # module once, as ``modules()`` gives them (a module may have several parents).
    seen = set() if seen is None else seen
    seen.add(id(module))
    for child in module.children():
        if id(child) not in seen:
            yield from _post_order(child, seen)
    yield module


def _mark_shared_parameters(model: nn.Module) -> None:
    # A parameter another module also holds (a tied LM head is the embedding's table) must keep
    # its plain values when its linear packs.
    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                param.shared = True
            seen.add(id(param))


def bind(model: nn.Module, backend: AttentionBackend, kernels: Kernels) -> Bound:
    """Give every layer of ``model`` its share of ``kernels`` (linears pack their weights for
    them) and every attention layer ``backend``; then build the backend's decode program from
    the bound layers (returned, not set on the model). Once per model, after loading."""
    if kernels.pack is not None:
        _mark_shared_parameters(model)
    taken = 0
    for module in _post_order(model):
        if isinstance(module, KernelBindable):
            taken += bool(module.bind_kernels(kernels))
        if isinstance(module, AttentionBindable):
            module.bind_attention(backend)
    if kernels.cpu:
        place_streamed_weights(model)
    return Bound(taken, backend.decode_program(model))


#: Each weight in the streamed buffer starts on a cache line, as torch's allocator aligns.
_ALIGN = 64


def place_streamed_weights(model: nn.Module) -> int:
    """Move the weights ``model``'s kernels stream per step (``streamed_weights`` of each bound
    layer) into one huge-page buffer (utils/hugepages.py), each once (a tied embedding's and LM
    head's one copy, where the LM head reads it), in the order the layers bind, which for a
    decoder is the order a step reads them. Each is copied and its old memory released before
    the next, so loading peaks at one weight over the buffer. Before the decode program takes
    the weights' addresses. Returns the bytes moved."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in _post_order(model):
        for attr in getattr(module, "streamed_weights", ()):
            t = getattr(module, attr, None)
            if t is None or t.device.type != "cpu" or t.is_mkldnn or not t.is_contiguous():
                continue
            # A second holder moves the weight to its place (the tied LM head's, after the
            # layers).
            holders[id(t)] = holders.pop(id(t), []) + [(module, attr)]
    if not holders:
        return 0
    # A quantized parameter's parts keep the packed tensor for a later binding of a tied twin.
    parts = [q for p in model.parameters() if (q := quantized_parts(p)) is not None]
    sizes = [(t := getattr(*owners[0])).numel() * t.element_size() for owners in holders.values()]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // _ALIGN) * _ALIGN)
    buffer = huge_page_buffer(starts[-1])
    for owners, start, nbytes in zip(holders.values(), starts, sizes, strict=False):
        old = getattr(*owners[0])
        new = buffer[start:start + nbytes].view(old.dtype).view(old.shape)
        new.copy_(old)
        for module, attr in owners:
            setattr(module, attr, new)
        for q in parts:
            if q.packed is old:
                q.packed = new
        del old
    return starts[-1]


def attention_heads(model: nn.Module) -> tuple[int, int, int] | None:
    """(query heads, KV heads, head dim) of ``model``'s attention layers on this rank; None for
    a model without an attention layer that a backend runs (an encoder)."""
    for module in model.modules():
        if isinstance(module, AttentionBindable):
            return module.num_heads, module.num_kv_heads, module.head_dim
    return None
