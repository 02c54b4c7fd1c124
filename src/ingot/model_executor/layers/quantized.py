"""GGUF weights kept quantized (issue #33): what the loader hands a layer instead of a float
tensor and how a layer's parameter holds it until binding (the embedding looks rows up from the
packed blocks with the quantized kernels' ``quant_dequantize_rows``).

The loader (loader/gguf_loader.py) decides once per tensor which weights stay as the file's
blocks (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K linears and the token embedding / LM head) and yields a
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
    QUANT_TYPES,
    pack_quant_weight,
    quant_block_weights,
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

    def row_slice(self, start: int, count: int, padded: int | None = None) -> QuantizedWeight:
        """Rows ``start .. start + count`` (a tensor-parallel rank's output rows, a vocab
        shard), then zero rows (zero blocks: weights 0) up to ``padded`` rows."""
        raw = self.raw[start:start + count]
        if padded is not None and padded > count:
            raw = torch.cat([raw, raw.new_zeros(padded - count, raw.shape[1])])
        return QuantizedWeight(raw, self.qtype, self.in_features)

    def column_shard(self, index: int, num_shards: int) -> QuantizedWeight:
        """Shard ``index`` of ``num_shards`` equal slices of every row's weights (a row-parallel
        rank's input columns): whole blocks of the file, so each keeps its scales; a split
        inside a block (32 weights, a K-quant's 256) is an error that says what to change."""
        _, block_bytes, _ = QUANT_TYPES[self.qtype]
        per = quant_block_weights(self.qtype)
        width = self.in_features // num_shards
        if self.in_features % num_shards or width % per:
            raise ValueError(
                f"a {self.qtype} weight's rows of {self.in_features} do not split into "
                f"{num_shards} tensor-parallel shards of whole {per}-weight blocks; serve this "
                "model with --quantization none or another --tensor-parallel-size")
        blocks = self.raw.view(self.rows, -1, block_bytes)
        step = width // per
        raw = blocks[:, index * step:(index + 1) * step].reshape(self.rows, -1)
        return QuantizedWeight(raw, self.qtype, width)


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
