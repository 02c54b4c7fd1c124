"""KV cache analysis (spec §3): rebuild a request's K and V from the paged cache through its
block table and compare them, layer by layer, with HF's past key values.

ingot's cache per layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; position p
of a request lives in block ``block_ids[p // block_size]`` at offset ``p % block_size``. Like
HF's cache it holds K after RoPE and the un-repeated GQA heads, so the two compare directly.
Only positions both sides have written are compared. There is no pass/fail here: a KV error
that logit validation does not see is still worth reading, and vice versa.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ingot.accuracy.metrics import bhattacharyya, cosine, error_ratio, l2_rel, linf_rel

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [S, num_kv_heads, head_dim]


def gather_paged_kv(
    kv_cache: torch.Tensor, block_ids: list[int], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of one layer for one request, each [seq_len, num_kv_heads, head_dim]."""
    _, _, block_size, heads, dim = kv_cache.shape
    needed = -(-seq_len // block_size)
    if needed > len(block_ids):
        raise ValueError(
            f"{seq_len} positions need {needed} blocks of {block_size}, the block table has "
            f"{len(block_ids)}"
        )
    idx = torch.tensor(block_ids[:needed], dtype=torch.int64, device=kv_cache.device)
    kv = kv_cache[:, idx].reshape(2, needed * block_size, heads, dim)[:, :seq_len]
    return kv[0], kv[1]


def scatter_paged_kv(
    kv_cache: torch.Tensor, block_ids: list[int], k: torch.Tensor, v: torch.Tensor
) -> None:
    """The inverse of :func:`gather_paged_kv` (used to test the gather)."""
    _, _, block_size, heads, dim = kv_cache.shape
    for pos in range(k.shape[0]):
        block, offset = block_ids[pos // block_size], pos % block_size
        kv_cache[0, block, offset] = k[pos]
        kv_cache[1, block, offset] = v[pos]


def snapshot_request_kv(
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    seq_len: int,
    scales: list[tuple[float, float]] | None = None,
) -> KV:
    """Float32 copies of every layer's K/V for one request (they must outlive its blocks).
    ``scales``: per-layer (k_scale, v_scale) of a quantised (FP8) cache, applied on read."""
    out = []
    for i, cache in enumerate(kv_caches):
        k, v = gather_paged_kv(cache, block_ids, seq_len)
        k_scale, v_scale = scales[i] if scales is not None else (1.0, 1.0)
        out.append((k.float().cpu() * k_scale, v.float().cpu() * v_scale))
    return out


def model_kv_scales(model: Any) -> list[tuple[float, float]] | None:
    """Per-layer FP8 KV scales of an ingot Llama-family model (None when it has none)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return None
    scales = [getattr(layer.self_attn, "kv_scales", None) for layer in layers]
    if any(s is None for s in scales):
        return None
    return [(float(s.k_scale), float(s.v_scale)) for s in scales]


@dataclass
class LayerKV:
    layer: int
    positions: int
    k_cos: float
    v_cos: float
    k_max_abs: float
    v_max_abs: float
    k_linf_rel: float
    v_linf_rel: float
    k_l2_rel: float
    v_l2_rel: float
    # three-way (an expected KV from HF in the engine's dtype is given)
    k_l2_ratio: float | None = None
    v_l2_ratio: float | None = None
    k_bc: float | None = None
    v_bc: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_kv(target: KV, baseline: KV, expected: KV | None = None) -> list[LayerKV]:
    """Per-layer K/V metrics of ``target`` (ingot) against ``baseline`` (HF fp32) on the
    positions both hold. Raises ValueError when layers, heads or head dims disagree."""
    if len(target) != len(baseline) or (expected is not None and len(expected) != len(target)):
        raise ValueError(
            f"KV layer counts differ: target {len(target)}, baseline {len(baseline)}"
            + ("" if expected is None else f", expected {len(expected)}")
        )
    out = []
    for i, ((tk, tv), (bk, bv)) in enumerate(zip(target, baseline, strict=True)):
        if tk.shape[1:] != bk.shape[1:]:
            raise ValueError(
                f"layer {i}: KV shapes [S, heads, dim] differ: {list(tk.shape)} vs {list(bk.shape)}"
            )
        n = min(tk.shape[0], bk.shape[0])
        if expected is not None:
            n = min(n, expected[i][0].shape[0])
        tk, tv, bk, bv = tk[:n].double(), tv[:n].double(), bk[:n].double(), bv[:n].double()
        res = LayerKV(
            layer=i,
            positions=n,
            k_cos=cosine(tk, bk),
            v_cos=cosine(tv, bv),
            k_max_abs=float((tk - bk).abs().max()) if n else 0.0,
            v_max_abs=float((tv - bv).abs().max()) if n else 0.0,
            k_linf_rel=linf_rel(bk, tk),
            v_linf_rel=linf_rel(bv, tv),
            k_l2_rel=l2_rel(bk, tk),
            v_l2_rel=l2_rel(bv, tv),
        )
        if expected is not None and n:
            ek, ev = expected[i][0][:n].double(), expected[i][1][:n].double()
            res.k_l2_ratio = error_ratio(res.k_l2_rel, l2_rel(bk, ek))
            res.v_l2_ratio = error_ratio(res.v_l2_rel, l2_rel(bv, ev))
            res.k_bc = bhattacharyya(ek - bk, tk - bk)
            res.v_bc = bhattacharyya(ev - bv, tv - bv)
        out.append(res)
    return out


def ingot_request_kv(runner: Any, prompt_ids: list[int], tokens: list[int]) -> tuple[KV, list[int]]:
    """Run ingot greedily along ``prompt_ids + tokens`` and snapshot its KV before the request
    finishes. Returns (KV, the sequence it holds): prompt + generated tokens[:-1], cut at the
    first token that left ``tokens`` (the context past it is no longer the reference's)."""
    kv_caches = runner.worker.kv_caches
    scales = model_kv_scales(runner.model) if kv_caches[0].dtype == torch.float8_e4m3fn else None

    def snapshot(req_id: str, generated: list[int]) -> tuple[KV, list[int]]:
        seq = list(prompt_ids) + generated[:-1]
        blocks = runner.request_blocks(req_id)
        return snapshot_request_kv(kv_caches, blocks, len(seq), scales), seq

    result = runner.generate(prompt_ids, len(tokens), stop_at=tokens, on_last_step=snapshot)
    if result.kv is None:
        raise RuntimeError("the request finished before its KV cache could be read")
    return result.kv
