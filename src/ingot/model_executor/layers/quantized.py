"""GGUF weights kept quantized (issue #33): what the loader hands a layer instead of a float
tensor, how a layer's parameter holds it until binding, and the embedding lookup from the packed
blocks.

The loader (loader/gguf_loader.py) decides once per tensor which weights stay as the file's
blocks (Q4_0 / Q4_1 / Q8_0 linears and the token embedding / LM head) and yields a
:class:`QuantizedWeight` for each; the layers' weight loaders park it on their parameter
(:func:`keep_quantized`, the plain values are released at once) and the binding step packs it
for the quantized kernels (:func:`packed_weight`, cpu_kernels.py's ``pack_quant_weight``). A
merged linear (qkv, gate_up) gets one shard per checkpoint tensor; packing concatenates their
rows in the layer's order, so any shard row count works (only the last group of 8 rows is
padded). A tied embedding and LM head share one parameter, so they share one packed copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ingot.model_executor.layers.cpu_kernels import (
    QUANT_GROUP_ROWS,
    QUANT_TYPES,
    pack_quant_weight,
)


@dataclass(eq=False)
class QuantizedWeight:
    """One GGUF tensor as the file stores it: ``raw`` [N, K/32 * block bytes] uint8, rows in
    the file's order (llama.cpp's q/k permutation already undone), of type ``qtype`` (one of
    cpu_kernels.QUANT_TYPES) and ``in_features`` (K) weights per row."""

    raw: torch.Tensor
    qtype: str
    in_features: int

    @property
    def rows(self) -> int:
        return self.raw.shape[0]


@dataclass(eq=False)
class _Parts:
    """A parameter's quantized shards by first row, until binding packs them once."""

    rows: int
    in_features: int
    shards: dict[int, QuantizedWeight] = field(default_factory=dict)
    packed: torch.Tensor | None = None
    qtype: str | None = None


def keep_quantized(param: nn.Parameter, loaded: QuantizedWeight, first_row: int = 0) -> None:
    """Park ``loaded`` as rows ``first_row ..`` of ``param`` (an [N, K] weight) and release the
    parameter's plain values: forward never reads them once binding has packed the blocks."""
    parts = quantized_parts(param)
    if parts is None:
        parts = param.quantized = _Parts(*param.shape)
    if loaded.in_features != parts.in_features or first_row + loaded.rows > parts.rows:
        raise ValueError(f"a {loaded.qtype} checkpoint tensor of {loaded.rows} rows x "
                         f"{loaded.in_features} does not fit rows {first_row}.. of a "
                         f"[{parts.rows}, {parts.in_features}] weight")
    parts.shards[first_row] = loaded
    param.data = param.data.new_empty(0)


def quantized_parts(param: nn.Parameter) -> _Parts | None:
    """The quantized shards parked on ``param`` by :func:`keep_quantized`, or None."""
    return getattr(param, "quantized", None)


def packed_weight(parts: _Parts) -> tuple[torch.Tensor, str]:
    """(the weight packed for the quantized kernels, its type): the shards' rows concatenated
    in order and packed once (a second caller, the tied LM head or embedding, gets the same
    tensor); the file's blocks are released."""
    if parts.packed is None:
        starts = sorted(parts.shards)
        shards = [parts.shards[s] for s in starts]
        qtypes = {s.qtype for s in shards}
        ends = [s + parts.shards[s].rows for s in starts]
        if len(qtypes) != 1 or starts[0] != 0 or ends[-1] != parts.rows or starts[1:] != ends[:-1]:
            raise ValueError(f"quantized shards {list(zip(starts, ends, strict=True))} of types "
                             f"{sorted(qtypes)} do not tile the weight's {parts.rows} rows with "
                             "one type")
        qtype = qtypes.pop()
        raw = torch.cat([s.raw for s in shards]) if len(shards) > 1 else shards[0].raw
        parts.packed = pack_quant_weight(raw, qtype, parts.rows, parts.in_features)
        parts.qtype = qtype
        parts.shards.clear()
    return parts.packed, parts.qtype


def dequantize_packed_rows(packed: torch.Tensor, qtype: str, ids: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a weight packed by ``pack_quant_weight``, dequantized to ``dtype``: the
    embedding lookup of a quantized table, which reads only the looked-up rows' blocks (the
    dequantized table is never built). ids [...] -> [..., K]; the values are the ``gguf``
    package's dequantization (d * q, Q4_0 d * (q - 8), Q4_1 d * q + m) rounded once to
    ``dtype``."""
    flat = ids.reshape(-1).to(torch.int64)
    lane = flat % QUANT_GROUP_ROWS
    groups = packed[flat // QUANT_GROUP_ROWS]  # [T, nb, group bytes]
    t, nb, _ = groups.shape
    arange = torch.arange(t)

    def f16_lanes(start: int) -> torch.Tensor:  # [T, nb] float32: each row's f16 in the group
        halves = groups[..., start:start + 2 * QUANT_GROUP_ROWS].reshape(t, nb, QUANT_GROUP_ROWS, 2)
        return halves[arange, :, lane].contiguous().view(torch.float16)[..., 0].float()

    d = f16_lanes(0)
    if qtype == "Q8_0":  # weight 4c + j of row r at chunk c, lane r, byte j
        qs = groups[..., 16:].reshape(t, nb, 8, QUANT_GROUP_ROWS, 4)[arange, :, :, lane]
        values = qs.reshape(t, nb, 32).view(torch.int8).float() * d[..., None]
    elif qtype in ("Q4_0", "Q4_1"):
        first = 32 if qtype == "Q4_1" else 16
        # weight 8c + 4h + j of row r at chunk c, lane r, byte j, low nibble (h 0) or high
        nibbles = groups[..., first:].reshape(t, nb, 4, QUANT_GROUP_ROWS, 4)[arange, :, :, lane]
        q = torch.stack([nibbles & 15, nibbles >> 4], dim=-2).reshape(t, nb, 32).float()
        if qtype == "Q4_0":
            values = (q - 8) * d[..., None]
        else:
            values = q * d[..., None] + f16_lanes(16)[..., None]
    else:
        raise ValueError(f"no quantized lookup for {qtype}; one of {list(QUANT_TYPES)}")
    return values.reshape(*ids.shape, nb * 32).to(dtype)
