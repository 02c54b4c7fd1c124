"""Single-sequence decode of the Llama-family model straight through ingot's CPU kernels.

Why: at batch 1 the kernels themselves take ~16 ms of a ~25 ms step on the project machine;
most of the rest is Python: nn.Module dispatch, argument conversion and output allocation in
the kernel wrappers, ~10 calls per layer. This path makes the same kernel calls in the same
order (so its output equals the module path's bit for bit, tested) with every weight pointer
resolved once, per-step arguments converted once, and activations in buffers reused across
layers. It serves only what the module path would send to the same kernels: one decode token,
bf16 weights and cache, no q/k norm, no FP8 calibration, and no forward hooks anywhere (the
accuracy toolkit's captures and replacements hook modules, so they keep the module path).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.cpu_kernels import CpuKernels, attention_scratch


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _has_hooks(module: nn.Module) -> bool:
    from torch.nn.modules import module as module_lib

    if module_lib._global_forward_hooks or module_lib._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


class LlamaCpuDecode:
    """Built by :meth:`build` for a loaded, packed model (None when any layer cannot take it)."""

    def __init__(self, model: nn.Module, kernels: CpuKernels) -> None:
        self.model = model
        self.k = kernels
        decoder = model.model
        first = decoder.layers[0]
        attn = first.self_attn
        self.hidden = first.input_layernorm.weight.shape[0]
        self.num_heads, self.num_kv_heads, self.head_dim = (
            attn.num_heads, attn.num_kv_heads, attn.head_dim,
        )
        self.qkv_size = attn.qkv_proj.output_size
        self.inter = first.mlp.down_proj.input_size
        self.layers: list[tuple[Any, ...]] = []
        for layer in decoder.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight.data_ptr(), layer.input_layernorm.eps,
                a.qkv_proj.gemv_weight.data_ptr(), _ptr(a.qkv_proj.bias_f32),
                a.o_proj.gemv_weight.data_ptr(), _ptr(a.o_proj.bias_f32),
                layer.post_attention_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.eps,
                m.gate_up_proj.gemv_weight.data_ptr(), _ptr(m.gate_up_proj.bias_f32),
                m.down_proj.gemv_weight.data_ptr(), _ptr(m.down_proj.bias_f32),
                a.sliding_window or 0, a.scale, a.kv_scales,
            ))
        self.cos_sin = first.self_attn.rotary.cos_sin_cache
        self.norm = decoder.norm
        bf16 = torch.bfloat16
        # Activations, reused by every layer and step (none of them leaves forward()).
        self.x = torch.empty(1, self.hidden, dtype=bf16)
        self.h = torch.empty(1, self.hidden, dtype=bf16)
        self.residual = torch.empty(1, self.hidden, dtype=bf16)
        self.qkv = torch.empty(1, self.qkv_size, dtype=bf16)
        self.attn = torch.empty(1, self.num_heads * self.head_dim, dtype=bf16)
        self.gate_up = torch.empty(1, 2 * self.inter, dtype=bf16)
        self.act = torch.empty(1, self.inter, dtype=bf16)

    @classmethod
    def build(cls, model: nn.Module) -> LlamaCpuDecode | None:
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        if not layers:
            return None
        kernels = None
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            parts = (layer.input_layernorm, layer.post_attention_layernorm, a, m)
            linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if any(p.cpu_kernels is None for p in parts + linears):
                return None
            if any(lin.gemv_weight is None for lin in linears) or a.q_norm is not None:
                return None
            if a.rotary.cos_sin_cache.dtype != torch.bfloat16:
                return None
            kernels = a.cpu_kernels
        if decoder.norm.cpu_kernels is None:
            return None
        return cls(model, kernels)

    def applies(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> bool:
        return (
            input_ids.numel() == 1
            and meta.seq_lens is not None
            and meta.num_reqs == 1
            and input_ids.device.type == "cpu"
            and kv_caches[0].dtype == torch.bfloat16
            and not any(layer[-1].calibrating for layer in self.layers)
            and not _has_hooks(self.model)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k = self.k
        threads = torch.get_num_threads()
        hidden, inter, qkv_size = self.hidden, self.inter, self.qkv_size
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        x, h, res, qkv, attn = self.x, self.h, self.residual, self.qkv, self.attn
        gate_up, act = self.gate_up, self.act
        xp, hp, rp = x.data_ptr(), h.data_ptr(), res.data_ptr()
        qkvp, attnp, gup, actp = qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), act.data_ptr()
        q_bytes, kv_bytes = heads * head_dim * 2, kv_heads * head_dim * 2

        table = meta.block_table.to(torch.int64).contiguous()
        seq_lens = meta.seq_lens.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        block_size = kv_caches[0].shape[2]
        width = table.shape[1]
        scratch, per_thread = attention_scratch(heads, width * block_size, threads)
        step_args = (positions.data_ptr(), self.cos_sin.data_ptr())
        tail_args = (slots.data_ptr(), table.data_ptr(), seq_lens.data_ptr(), attnp, 1, heads,
                     kv_heads, head_dim, block_size, width)

        value_offset = kv_caches[0][0].numel() * 2  # bytes from a cache's keys to its values
        embedded = self.model.model.embed_tokens(input_ids.view(1))
        rms, gemv, attend, silu = k.rms_norm, k.gemv, k.decode_attention, k.silu_mul
        residual_in = embedded.data_ptr()  # layer 0: residual = the embedding, no add
        for cache, layer in zip(kv_caches, self.layers, strict=True):
            (in_w, in_eps, qkv_w, qkv_b, o_w, o_b, post_w, post_eps, gu_w, gu_b, down_w, down_b,
             window, scale, _) = layer
            if residual_in == rp:
                rms(hp, rp, in_w, xp, rp, 1, hidden, in_eps, threads)
            else:
                rms(residual_in, None, in_w, xp, None, 1, hidden, in_eps, threads)
            gemv(xp, qkv_w, qkv_b, qkvp, 1, qkv_size, hidden, threads)
            kc = cache.data_ptr()
            vc = kc + value_offset
            attend(qkvp, qkv_size, qkvp + q_bytes, qkv_size, qkvp + q_bytes + kv_bytes, qkv_size,
                   *step_args, kc, vc, *tail_args, window, scale, scratch.data_ptr(), per_thread,
                   threads)
            gemv(attnp, o_w, o_b, hp, 1, hidden, heads * head_dim, threads)
            rms(hp, residual_in, post_w, xp, rp, 1, hidden, post_eps, threads)
            residual_in = rp
            gemv(xp, gu_w, gu_b, gup, 1, 2 * inter, hidden, threads)
            silu(gup, actp, 1, inter, threads)
            gemv(actp, down_w, down_b, hp, 1, hidden, inter, threads)
        out, _ = self.norm(h, res)  # a fresh tensor: the buffers are reused next step
        return out
