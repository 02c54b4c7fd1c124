"""Linear layers whose parameters know how to load their own checkpoint shards.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` attribute, as in
vLLM, so fused projections (QKV, gate-up) take the separate checkpoint tensors without the model
loader knowing about the fusion.

Tensor parallelism (spec §1): the ``*ParallelLinear`` layers size their weights from their TP
group and their loaders take the rank's shard of the full checkpoint tensor. Column-parallel
layers split the output dim and need no collective; row-parallel layers split the input dim and
all-reduce their partial sums. In a group of one rank they are the plain layers: same shapes,
same packed kernels, no collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ingot.distributed.group import GroupCoordinator
from ingot.distributed.layouts import kv_head_start, kv_heads_per_rank
from ingot.distributed.parallel_state import get_tp_group
from ingot.distributed.sequence_parallel import reduce_partial
from ingot.model_executor.layers.bindable import KernelBindable, Kernels
from ingot.model_executor.layers.cpu_kernels import (
    GEMV_MAX_ROWS,
    GEMV_MAX_ROWS_BESIDE_GEMM,
    CpuKernels,
    QuantKernels,
    gemm_bf16,
    gemm_preferred,
    gemv_bf16,
    pack_gemm_weight,
    pack_gemv_weight,
    quant_dequantize,
    quant_matmul,
)
from ingot.model_executor.layers.quantized import (
    QuantizedWeight,
    keep_quantized,
    packed_weight,
    quantized_parts,
)


def default_weight_loader(param: nn.Parameter,
                          loaded_weight: torch.Tensor | QuantizedWeight) -> None:
    if isinstance(loaded_weight, QuantizedWeight):  # GGUF blocks kept as they are
        keep_quantized(param, loaded_weight)
        return
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def _set_loader(param: nn.Parameter | None, loader) -> None:  # noqa: ANN001
    if param is not None:
        param.weight_loader = loader


def cpu_packed_linear_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN's pre-packed bf16 linear exists on this CPU (AVX512-BF16 / AMX)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class LinearBase(KernelBindable, nn.Module):
    streamed_weights = ("quant_weight", "gemv_weight")

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        # Derived copies of ``weight`` (never saved or loaded), made at binding: ingot's
        # GEMV layout for a few rows, and for more rows either ingot's GEMM layout (CPUs
        # without AMX) or oneDNN's blocked one.
        self.cpu_kernels: CpuKernels | None = None
        self.gemv_weight: torch.Tensor | None = None
        self.gemm_weight: torch.Tensor | None = None
        self.packed_weight: torch.Tensor | None = None
        self.bias_f32: torch.Tensor | None = None
        # A GGUF weight kept quantized (layers/quantized.py), packed at binding for ingot's
        # quantized kernels, which then serve every row count; its type ("Q4_1", ...).
        self.quant_kernels: QuantKernels | None = None
        self.quant_weight: torch.Tensor | None = None
        self.quant_type: str | None = None
        #: Rows from which the quantized weight runs dense (Kernels.quant_dense_rows; 0 never).
        self.quant_dense_rows = 0

    def bind_kernels(self, kernels: Kernels) -> bool:
        """A weight the loader kept quantized packs for ingot's quantized kernels (whatever
        ``kernels.pack`` says); else pack the weight as ``kernels.pack`` says (``pack_weight``,
        with ingot's layouts where its bf16 library loaded and the weight is contiguous;
        ``pack_f32_weight`` for float32 weights); returns whether ingot's kernels serve this
        linear."""
        parts = quantized_parts(self.weight)
        if parts is not None:
            if kernels.quant is None:
                raise RuntimeError(
                    "this model's weights were kept quantized but ingot's quantized CPU kernels "
                    "are not available here (see the log); load it with --quantization none")
            self.quant_kernels = kernels.quant
            self.quant_weight, self.quant_type = packed_weight(parts)
            self.quant_dense_rows = kernels.quant_dense_rows
            self.bias_f32 = self.bias.detach().float() if self.bias is not None else None
            return True
        if kernels.pack == "bf16":
            self.pack_weight(kernels.dense_bf16 if self.weight.is_contiguous() else None,
                             kernels.keep_plain)
        elif kernels.pack == "f32" and self.weight.dtype == torch.float32:
            self.pack_f32_weight()
        return self.cpu_kernels is not None

    def pack_weight(self, kernels: CpuKernels | None = None, keep_plain: bool = False) -> None:
        """Re-lay the weight out once, after loading. Without ingot's kernels: oneDNN's packed
        linear (measured on an AMX machine: bf16 GEMV 1.5x faster than ``F.linear`` on the
        plain weight, up to 2x on the 49152-row LM head). With them: a few rows (decode; see
        ``gemv_applies``) go to ingot's GEMV on its blocked copy, and more rows to ingot's
        GEMM where ``gemm_preferred()`` (1.5-2x oneDNN's bf16 GEMM on this project's non-AMX
        CPU at every prefill and batch size), else to oneDNN: two copies either way.

        Then the plain weight is released (its parameter keeps the name and dtype, with no
        elements): forward never reads it again, so holding it would only cost memory.
        ``keep_plain`` keeps it for layers that will run on it (compiled layers, which drop
        the packed copies instead), and a weight shared with another module (a tied LM head
        is the embedding's table) is always kept."""
        weight = self.weight.detach()
        self.cpu_kernels = kernels
        self.gemv_weight = pack_gemv_weight(weight) if kernels is not None else None
        if kernels is not None and gemm_preferred() and self.input_size % 2 == 0:
            self.gemm_weight = pack_gemm_weight(kernels, weight)
        elif cpu_packed_linear_supported(weight.dtype, weight.device):
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        else:
            # No oneDNN bf16 on this CPU (AVX2) and no GEMM layout (odd K, INGOT_CPU_GEMM=0):
            # more rows than the GEMV serves run F.linear on the plain weight.
            keep_plain = True
        self.bias_f32 = self.bias.detach().float() if self.bias is not None else None
        if not keep_plain and not getattr(self.weight, "shared", False):
            self.weight.data = weight.new_empty(0)

    def pack_f32_weight(self) -> None:
        """oneDNN's packed copy of a float32 weight, in the plain weight's place (forward and
        ``matmul`` run it at every row count); see ``binding.select_kernels``."""
        weight = self.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        if not getattr(self.weight, "shared", False):
            self.weight.data = weight.new_empty(0)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` without the bias, for a caller that applies the bias in a fused
        epilogue: oneDNN's packed kernel where the layer holds one, else ``torch.mm`` (MKL)."""
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        return torch.mm(x, self.weight.t())

    def forward(self, x: torch.Tensor, kernel_rows: int = 0) -> torch.Tensor:
        """``kernel_rows``: the rows to choose the kernel by (the step's
        ``AttentionMetadata.kernel_rows``; 0: ``x``'s own). A quantized weight runs ingot's
        quantized kernel (faster than the bf16 GEMV and GEMM at decode and prefill alike,
        docs/features.md, and a row's bits do not depend on the batch), activations and output
        in the model's dtype; from ``quant_dense_rows`` rows (AMX: every prefill step, see
        ``cpu_kernels.QUANT_DENSE_MIN_ROWS``) its weight dequantized for the call, on oneDNN."""
        if self.quant_weight is not None:
            if self.quant_dense_rows and (
                    kernel_rows or x.numel() // self.input_size) >= self.quant_dense_rows:
                # A prefill step's rows on AMX: the dequantized weight (this call's only) on
                # oneDNN's bf16 linear beats the integer dots several times over.
                weight = quant_dequantize(self.quant_kernels, self.quant_weight, self.quant_type,
                                          self.output_size, x.dtype)
                return F.linear(x, weight, self.bias)
            return quant_matmul(self.quant_kernels, x, self.quant_weight, self.quant_type,
                                self.output_size, self.bias_f32)
        if self.cpu_kernels is not None and self.gemv_weight is not None:
            rows = x.numel() // self.input_size
            if gemv_applies(kernel_rows or rows, self.gemm_weight is not None):
                y = gemv_bf16(self.cpu_kernels, x.reshape(rows, -1), self.gemv_weight,
                              self.output_size, self.bias_f32)
                return y.view(*x.shape[:-1], self.output_size)
            if self.gemm_weight is not None:
                y = gemm_bf16(self.cpu_kernels, x.reshape(rows, -1), self.gemm_weight,
                              self.output_size, self.bias_f32)
                return y.view(*x.shape[:-1], self.output_size)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)


def load_into(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor,
              stacked: Sequence[tuple[str, str, str | int]], owner: str = "the model") -> str:
    """Give one checkpoint tensor to its parameter's ``weight_loader``: through a fused
    parameter when ``name`` holds one of ``stacked``'s (checkpoint part, fused part, shard id)
    entries, else by name. Returns the parameter's name; a tensor with no place is an error."""
    for ckpt_part, fused_part, shard_id in stacked:
        if ckpt_part in name:
            target = name.replace(ckpt_part, fused_part)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {owner}")
            params[target].weight_loader(params[target], tensor, shard_id)
            return target
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {owner}")
    params[name].weight_loader(params[name], tensor)
    return name


def gemv_applies(rows: int, beside_gemm: bool) -> bool:
    """ingot's GEMV kernel serves a bf16 linear of ``rows`` rows (else ingot's GEMM where the
    linear holds its layout, ``beside_gemm``, or oneDNN). A verification step of speculative
    decoding passes the rows of a plain decode of its requests (``AttentionMetadata.
    kernel_rows``), so that its greedy tokens are decoding's bit for bit (ingot's GEMV gives
    every row the same result whatever the row count; oneDNN's kernels differ from it)."""
    limit = GEMV_MAX_ROWS_BESIDE_GEMM if beside_gemm else GEMV_MAX_ROWS
    return rows <= limit


def runs_onednn_linears(model: nn.Module) -> bool:
    """Whether any linear of ``model`` runs oneDNN's packed bf16 kernels, which oneDNN builds
    (just in time) for each new input shape on first use: the eager warmup exists for them.
    Quantized linears that run dense at prefill (``quant_dense_rows``) run them too.
    ingot's GEMV/GEMM and MKL's float32 GEMM (plain weights) build nothing per shape, and
    oneDNN's float32 kernels little: its first call at a new row count took 0.5-1.5 ms more
    than the next per linear shape on an AMD EPYC (Zen 3, AVX2), ~8 ms a row count for the
    default model, where warming its 18 shapes up took 74 s (a busy machine)."""
    return any(isinstance(m, LinearBase) and (m.quant_dense_rows > 0 or (
        m.packed_weight is not None and m.packed_weight.dtype != torch.float32))
        for m in model.modules())


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)
        _set_loader(self.weight, default_weight_loader)
        _set_loader(self.bias, default_weight_loader)


class MergedLinear(LinearBase):
    """Several projections of one input fused on the output dim: shard ``i`` -> rows of part i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        _set_loader(self.weight, self._load_shard)
        _set_loader(self.bias, self._load_shard)

    def _shard_index(self, shard_id: int | str) -> int:
        return int(shard_id)

    def _load_shard(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor
            default_weight_loader(param, loaded_weight)
            return
        i = self._shard_index(shard_id)
        if isinstance(loaded_weight, QuantizedWeight):
            keep_quantized(param, loaded_weight, self.shard_offsets[i])
            return
        rows = param.data.narrow(0, self.shard_offsets[i], self.output_sizes[i])
        default_weight_loader(rows, loaded_weight)


class QKVLinear(MergedLinear):
    """q, k and v projections fused; shard ids are ``"q"``, ``"k"``, ``"v"``."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)

    def _shard_index(self, shard_id: int | str) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else int(shard_id)


# ---- tensor parallelism ------------------------------------------------------------------------


def shard_of(loaded: torch.Tensor | QuantizedWeight, dim: int, index: int,
             num_shards: int) -> torch.Tensor | QuantizedWeight:
    """Shard ``index`` of ``num_shards`` equal slices of ``loaded`` along ``dim`` (a view; GGUF
    blocks kept quantized: their rows, or whole blocks of every row's weights)."""
    if isinstance(loaded, QuantizedWeight):
        if num_shards == 1:
            return loaded
        if dim == 1:
            return loaded.column_shard(index, num_shards)
        if loaded.rows % num_shards:
            raise ValueError(f"a {loaded.qtype} checkpoint tensor of {loaded.rows} rows does "
                             f"not split into {num_shards} equal shards")
        step = loaded.rows // num_shards
        return loaded.row_slice(index * step, step)
    size = loaded.shape[dim]
    if size % num_shards:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}: dim {dim} does not "
                         f"split into {num_shards} equal shards")
    step = size // num_shards
    return loaded.narrow(dim, index * step, step)


def sharding_weight_loader(shard_dim: int, rank: int, num_shards: int):  # noqa: ANN201
    """A loader that copies shard ``rank`` of the checkpoint tensor along ``shard_dim``."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, shard_of(loaded_weight, shard_dim, rank, num_shards))

    load.shard_dim, load.rank, load.num_shards = shard_dim, rank, num_shards
    return load


def _tp(group: GroupCoordinator | None) -> GroupCoordinator:
    return group if group is not None else get_tp_group()


class ColumnParallelLinear(LinearBase):
    """Output dim split over the TP group: rank r holds rows [r*O/TP, (r+1)*O/TP) of the
    weight (and bias); its output is its slice of the full output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_group: GroupCoordinator | None = None) -> None:
        self.tp_group = _tp(tp_group)
        tp = self.tp_group.world_size
        if output_size % tp:
            raise ValueError(f"output size {output_size} does not split over {tp} TP ranks")
        super().__init__(input_size, output_size // tp, bias)
        loader = sharding_weight_loader(0, self.tp_group.rank_in_group, tp)
        _set_loader(self.weight, loader)
        _set_loader(self.bias, loader)


class RowParallelLinear(LinearBase):
    """Input dim split over the TP group: rank r holds columns [r*I/TP, (r+1)*I/TP) and
    multiplies its slice of the input; the partial sums are all-reduced. The bias lives on
    rank 0 only (zeros elsewhere), so the sum holds it once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_group: GroupCoordinator | None = None) -> None:
        self.tp_group = _tp(tp_group)
        tp = self.tp_group.world_size
        if input_size % tp:
            raise ValueError(f"input size {input_size} does not split over {tp} TP ranks")
        super().__init__(input_size // tp, output_size, bias)
        self.tp_size = tp
        _set_loader(self.weight, sharding_weight_loader(1, self.tp_group.rank_in_group, tp))
        _set_loader(self.bias, self._load_bias)

    def _load_bias(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_group.rank_in_group == 0:
            default_weight_loader(param, loaded_weight)
        else:
            default_weight_loader(param, torch.zeros_like(loaded_weight))

    def forward(self, x: torch.Tensor, kernel_rows: int = 0) -> torch.Tensor:
        # All-reduced; in a sequence-parallel prefill reduce-scattered to this rank's rows.
        return reduce_partial(super().forward(x, kernel_rows), self.tp_group)


class MergedColumnParallelLinear(MergedLinear):
    """Several column-parallel projections of one input fused on the output dim (gate-up):
    each part is split over the TP group and the rank's slices lie end to end."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_group: GroupCoordinator | None = None) -> None:
        self.tp_group = _tp(tp_group)
        tp = self.tp_group.world_size
        for size in output_sizes:
            if size % tp:
                raise ValueError(f"output size {size} does not split over {tp} TP ranks")
        self.full_output_sizes = list(output_sizes)
        super().__init__(input_size, [s // tp for s in output_sizes], bias)

    def _source_shard(self, i: int) -> tuple[int, int]:
        """(shard index, shard count) of part ``i`` of the checkpoint tensor for this rank."""
        return self.tp_group.rank_in_group, self.tp_group.world_size

    def _load_shard(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor: its parts one by one
            if loaded_weight.shape[0] != sum(self.full_output_sizes):
                raise ValueError(
                    f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, the fused "
                    f"projection expects {sum(self.full_output_sizes)} rows"
                )
            for i, part in enumerate(loaded_weight.split(self.full_output_sizes, dim=0)):
                self._load_shard(param, part, i)
            return
        i = self._shard_index(shard_id)
        index, count = self._source_shard(i)
        if isinstance(loaded_weight, QuantizedWeight):
            keep_quantized(param, shard_of(loaded_weight, 0, index, count), self.shard_offsets[i])
            return
        rows = param.data.narrow(0, self.shard_offsets[i], self.output_sizes[i])
        default_weight_loader(rows, shard_of(loaded_weight, 0, index, count))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v fused and split by heads: rank r holds num_heads/TP query heads and
    max(1, num_kv_heads/TP) KV heads; with TP > num_kv_heads each KV head is replicated on
    TP/num_kv_heads consecutive ranks. Shard ids ``"q"``, ``"k"``, ``"v"``."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_group: GroupCoordinator | None = None) -> None:
        group = _tp(tp_group)
        tp = group.world_size
        if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
            raise ValueError(f"{num_heads} query / {num_kv_heads} KV heads do not split over "
                             f"{tp} TP ranks")
        self.num_heads = num_heads // tp
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        self.total_num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        kv_full = num_kv_heads * head_dim
        # The parts' full sizes; a KV part's per-rank size is kv_size, not kv_full / TP, when
        # the heads are replicated, so the sizes are set here rather than by the base class.
        super().__init__(hidden_size, [num_heads * head_dim, kv_full, kv_full], bias, group)
        self.output_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.shard_offsets = [0, self.q_size, self.q_size + self.kv_size]
        self.output_size = sum(self.output_sizes)
        self.weight.data = self.weight.data.new_empty(self.output_size, hidden_size)
        if self.bias is not None:
            self.bias.data = self.bias.data.new_empty(self.output_size)

    def _shard_index(self, shard_id: int | str) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else int(shard_id)

    def _source_shard(self, i: int) -> tuple[int, int]:
        rank, tp = self.tp_group.rank_in_group, self.tp_group.world_size
        if i == 0:
            return rank, tp
        # In units of this rank's KV heads: shard index = first head / heads per rank.
        start = kv_head_start(self.total_num_kv_heads, tp, rank)
        return start // self.num_kv_heads, self.total_num_kv_heads // self.num_kv_heads


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy in memory: every parameter plus the derived layouts
    the kernels read (oneDNN-packed, GEMV-blocked, float32 biases, quantized blocks: a tied
    embedding's and LM head's once), each tensor's own bytes once (the streamed weights share
    one buffer, binding.place_streamed_weights)."""
    storages: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is None or not t.numel():
            return
        nbytes = t.numel() * t.element_size()
        if t.is_mkldnn:  # oneDNN's opaque packed tensors have no address to share
            storages[id(t)] = nbytes
        else:
            storages[t.data_ptr()] = max(storages.get(t.data_ptr(), 0), nbytes)

    for p in model.parameters():
        add(p)
    for module in model.modules():
        if isinstance(module, LinearBase):
            add(module.packed_weight)
            add(module.gemv_weight)
            add(module.gemm_weight)
            add(module.bias_f32)
        add(getattr(module, "quant_weight", None))  # quantized linears' and embeddings' blocks
        for t in getattr(module, "kernel_weights", None) or ():  # FusedMoE's packed experts
            add(t)
    return sum(storages.values())
