"""The kernels the binding step (model_executor/binding.py) hands a model's layers, and the
interface through which they take them.

A layer with a path through ingot's CPU kernels subclasses :class:`KernelBindable`; ``bind``
finds it by type, once, after loading, so its forwards test nothing about which kernel applies.
(The attention side, :class:`~ingot.model_executor.layers.attention_backend.AttentionBindable`
and the backends' ``DecodeProgram``, lives beside the backends.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from ingot.model_executor.layers.cpu_kernels import (
    CpuKernels,
    F32Kernels,
    QuantKernels,
    load_cpu_kernels,
    load_f32_kernels,
    load_quant_kernels,
)


@dataclass(frozen=True)
class Kernels:
    """ingot's CPU kernels for one model, as chosen once after loading
    (:func:`ingot.model_executor.binding.select_kernels`). Each :class:`KernelBindable` layer
    gets this record and takes what applies to its weights; the default (not on a CPU, nothing
    packed) leaves every layer on torch ops."""

    #: Whether the model runs on the CPU (ingot's libraries exist nowhere else).
    cpu: bool = False
    #: How linears re-lay their weights: "bf16" (ingot's GEMV/GEMM layouts where its bf16
    #: library loads, oneDNN's packed bf16 linear where the CPU has it and ingot's GEMM does not
    #: serve), "f32" (oneDNN's packed float32 linear), None (plain weights).
    pack: Literal["bf16", "f32"] | None = None
    #: Keep the plain weights beside the packed copies (compiled layers run on them).
    keep_plain: bool = False
    #: Quantized linears (GGUF blocks kept) of this many rows or more dequantize their weight
    #: per call and run oneDNN's bf16 linear (AMX: several times the integer dots at prefill
    #: buckets' row counts); 0: ingot's quantized kernel at every row count.
    quant_dense_rows: int = 0

    # The libraries load the first time a layer asks, so that a model without such layers
    # never builds them (each loader caches its library per process).
    @cached_property
    def bf16(self) -> CpuKernels | None:
        """The bf16 library (the widest build this CPU runs): MoE experts take it for bf16 and
        float32 weights."""
        return load_cpu_kernels() if self.cpu else None

    @property
    def dense_bf16(self) -> CpuKernels | None:
        """The bf16 library for a decoder's dense path (linears' GEMV/GEMM, RMSNorm,
        SiLU-and-multiply): only beside bf16-packed linears, since the GEMV reads the layout
        packing makes (INGOT_DISABLE_PACKED_LINEAR leaves the whole path to torch)."""
        return self.bf16 if self.pack == "bf16" else None

    @cached_property
    def f32(self) -> F32Kernels | None:
        """The float32 library (AVX-512 or AVX2 + FMA): encoders' fused epilogues."""
        return load_f32_kernels() if self.cpu else None

    @cached_property
    def quant(self) -> QuantKernels | None:
        """The GGUF-quantized library: linears whose weights the loader kept quantized."""
        return load_quant_kernels() if self.cpu else None


#: No kernels: every layer on torch ops and plain weights.
NO_KERNELS = Kernels()


# Plain base classes rather than ABCs: they mix into nn.Module, whose metaclass stays ``type``.
class KernelBindable:
    """A layer with a path through ingot's CPU kernels, chosen once at binding."""

    #: Attributes holding the weight copies its kernels stream once per decode step (made by
    #: ``bind_kernels``; None where not made): the binding step moves them into one huge-page
    #: buffer, in the order the layers bind (binding.place_streamed_weights).
    streamed_weights: tuple[str, ...] = ()

    def bind_kernels(self, kernels: Kernels) -> bool:
        """Take what of ``kernels`` applies to this layer's weights (re-laying them out where
        the kernels read another layout); returns whether it runs any of ingot's kernels."""
        raise NotImplementedError
