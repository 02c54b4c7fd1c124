"""The CPU-kernel attention backend's decode program: a whole decode step of a Llama-family
decoder straight through ingot's CPU kernels, without modules (layers/attention_backend.py
builds it when it is chosen; the worker's step program runs it for every decode step it serves,
worker/execution/decode_program.py).

Why: at batch 1 the kernels themselves take ~16 ms of a ~25 ms step on the project machine, and
at batch 64 ~14 ms of an ~81 ms forward is Python: nn.Module dispatch, argument conversion and
output allocation in the kernel wrappers, ~10 calls per layer. This program makes the same kernel
calls in the same order (so its output equals the module path's bit for bit, tested): ingot's
GEMV for a few rows and ingot's GEMM or oneDNN's packed linear above, as the linear layers choose,
with every weight resolved once, per-step arguments converted once, and activations in buffers
reused across layers. A linear whose GGUF weight stays quantized runs ingot's quantized kernel
(one ctypes call into the same buffers, every row count), as its module does. It is built only
for decoders it reproduces exactly (dense MLPs, one rank, every norm on ingot's kernels: Llama's,
or Gemma's 1 + weight, with q/k norms and Gemma's sandwich norms where the layer has them), and
steps aside while a forward hook is installed anywhere (the accuracy toolkit's captures and
replacements hook modules, so they keep the module path).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.cpu_kernels import (
    KERNEL_ACTIVATIONS,
    QUANT_TYPES,
    CpuKernels,
    DecodeLayer,
    DecodeStep,
    QuantKernels,
    attention_scratch,
)
from ingot.model_executor.layers.linear import gemv_applies


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _norm(norm: nn.Module | None) -> tuple[int | None, float]:
    """(what ingot's kernel reads as the norm's weight, its epsilon); (None, 0) for no norm."""
    return (None, 0.0) if norm is None else (norm.kernel_weight().data_ptr(), norm.eps)


def _hook_dicts(modules: list[nn.Module]) -> list[dict]:
    """Every forward hook registry of ``modules`` and torch's global ones: registering or
    removing a hook changes one of these dicts in place, so a step tests them all with one
    ``any`` (a generator over the modules' attributes had cost ~2% of a decode step)."""
    from torch.nn.modules import module as module_lib

    return [module_lib._global_forward_hooks, module_lib._global_forward_pre_hooks,
            *(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks))]


class CpuDecodeProgram:
    """Built by :meth:`build` for a loaded, packed model (None when any layer cannot take it)."""

    def __init__(self, model: nn.Module, kernels: CpuKernels,
                 quant: QuantKernels | None) -> None:
        self.model = model
        # Listed once: walking the module tree every step had cost ~4% of a decode step.
        self.modules = list(model.modules())
        self._hooks = _hook_dicts(self.modules)
        self.k = kernels
        self.qk = quant
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
        # Per layer, beside it: (q, k, attention-output, MLP-output) norms as _norm gives
        # them, the activation's kernel id and the rotary table.
        self.extras: list[tuple[Any, ...]] = []
        self.zero_centred = bool(decoder.norm.zero_centred)
        for layer in decoder.layers:
            a, m = layer.self_attn, layer.mlp
            before_attn, before_mlp, attn_out, mlp_out = layer.norms()
            self.layers.append((
                *_norm(before_attn),
                _ptr(a.qkv_proj.gemv_weight), _ptr(a.qkv_proj.bias_f32),
                _ptr(a.o_proj.gemv_weight), _ptr(a.o_proj.bias_f32),
                *_norm(before_mlp),
                _ptr(m.gate_up_proj.gemv_weight), _ptr(m.gate_up_proj.bias_f32),
                _ptr(m.down_proj.gemv_weight), _ptr(m.down_proj.bias_f32),
                a.sliding_window or 0, a.scale,
            ))
            self.extras.append((tuple(_norm(n) for n in (a.q_norm, a.k_norm, attn_out, mlp_out)),
                                KERNEL_ACTIVATIONS[m.act], a.rotary.cos_sin_cache))
        # The same four linears for batches above what the GEMV serves: ingot's GEMM weights
        # (called as the GEMV is, into the same buffers), or else the modules, whose forward
        # runs oneDNN for those rows.
        self.linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj) for layer in decoder.layers]
        self.gemm = any(lin.gemm_weight is not None  # as every unquantized linear
                        for linears in self.linears for lin in linears)
        self.gemm_weights = [tuple(_ptr(lin.gemm_weight) for lin in linears)
                             for linears in self.linears]
        # (GGML type id, packed weight) of each quantized linear, None for the others.
        self.quant_weights = [tuple(
            (QUANT_TYPES[lin.quant_type][0], lin.quant_weight.data_ptr())
            if lin.quant_weight is not None else None for lin in linears)
            for linears in self.linears]
        self.norm = decoder.norm
        self._buffers: dict[int, tuple[torch.Tensor, ...]] = {}
        # The same loop in C (CpuKernels.decode_layers) wherever every linear is ingot's kernel:
        # the layers' arguments resolved once here, the caches' addresses when they change.
        self.native = True  # tests turn it off to compare the two loops
        self.all_quant = all(q is not None for quants in self.quant_weights for q in quants)
        self.c_layers = (DecodeLayer * len(self.layers))()
        for c, layer, extras, gemm_w, quants in zip(self.c_layers, self.layers, self.extras,
                                                    self.gemm_weights, self.quant_weights,
                                                    strict=True):
            (in_w, in_eps, qkv_w, qkv_b, o_w, o_b, post_w, post_eps, gu_w, gu_b, down_w, down_b,
             window, scale) = layer
            ((q_w, qk_eps), (k_w, _), (attn_out_w, attn_out_eps), (mlp_out_w, mlp_out_eps)), \
                act, cos_sin = extras
            c.in_w, c.post_w, c.in_eps, c.post_eps = in_w, post_w, in_eps, post_eps
            c.q_w, c.k_w, c.qk_eps = q_w, k_w, qk_eps
            c.attn_out_w, c.attn_out_eps, c.mlp_out_w, c.mlp_out_eps = (
                attn_out_w, attn_out_eps, mlp_out_w, mlp_out_eps)
            c.zero_centred, c.act, c.cos_sin = int(self.zero_centred), act, cos_sin.data_ptr()
            c.window, c.scale = window, scale
            for j, (w, b) in enumerate(((qkv_w, qkv_b), (o_w, o_b), (gu_w, gu_b),
                                        (down_w, down_b))):
                c.gemv_w[j], c.gemm_w[j], c.bias[j] = w, gemm_w[j], b
                if quants[j] is not None:
                    c.qtype[j], c.quant_w[j] = quants[j]
        self._cache_ptrs: tuple[int, ...] = ()

    def _activations(self, rows: int) -> tuple[torch.Tensor, ...]:
        """x, h, residual, qkv, attn, gate_up, act for ``rows`` sequences, reused by every layer
        and step of that batch size (none of them leaves forward())."""
        if rows not in self._buffers:
            sizes = (self.hidden, self.hidden, self.hidden, self.qkv_size,
                     self.num_heads * self.head_dim, 2 * self.inter, self.inter)
            self._buffers[rows] = tuple(torch.empty(rows, n, dtype=torch.bfloat16) for n in sizes)
        return self._buffers[rows]

    @classmethod
    def build(cls, model: nn.Module, kernels: CpuKernels) -> CpuDecodeProgram | None:
        """``kernels``: the bf16 library; the quantized linears' own library comes from them."""
        from ingot.distributed.parallel_state import get_tp_group

        if get_tp_group().world_size > 1:
            return None  # its kernel sequence has no all-reduce between the layers' halves
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        if not layers or getattr(decoder, "norm", None) is None:
            return None
        gemm_kinds, quant = set(), None
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, getattr(a, "o_proj", None), getattr(m, "gate_up_proj", None),
                       getattr(m, "down_proj", None))
            if any(lin is None for lin in linears):
                return None  # not a dense MLP (MoE)
            for lin in linears:
                if lin.quant_weight is not None:
                    quant = lin.quant_kernels
                    continue
                if lin.gemv_weight is None or (lin.packed_weight is None
                                               and lin.gemm_weight is None):
                    return None  # unpacked
                gemm_kinds.add(lin.gemm_weight is not None)
            if len(gemm_kinds) > 1:
                return None  # ingot's GEMM for some linears, oneDNN for others
            norms = [n for n in (*layer.norms(), a.q_norm, a.k_norm, decoder.norm)
                     if n is not None]
            if any(n.cpu_kernels is None for n in norms) or m.cpu_kernels is None:
                return None
            if any(n.zero_centred != decoder.norm.zero_centred for n in norms):
                return None  # one kind of norm a model (the C loop takes one flag)
        return cls(model, kernels, quant)

    def serves(self, meta: AttentionMetadata) -> bool:
        """A decode step, with no hook anywhere that the program would bypass."""
        return meta.is_decode and not any(self._hooks)

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
        rows = input_ids.numel()
        hidden, inter, qkv_size = self.hidden, self.inter, self.qkv_size
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        x, h, res, qkv, attn, gate_up, act = self._activations(rows)
        xp, rp, attnp, actp = x.data_ptr(), res.data_ptr(), attn.data_ptr(), act.data_ptr()
        q_bytes, kv_bytes = heads * head_dim * 2, kv_heads * head_dim * 2
        use_gemv = gemv_applies(meta.kernel_rows or rows, self.gemm)  # as LinearBase.forward
        # Verification rows of one sequence read each other's keys: rotate and write every
        # row's key/value first (the same rotation as the fused kernel), then attend.
        write_first = meta.rows_share_sequences

        table = meta.block_table.to(torch.int64).contiguous()
        seq_lens = meta.seq_lens.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        block_size = kv_caches[0].shape[2]
        width = table.shape[1]
        scratch, per_thread = attention_scratch(heads, width * block_size, threads)
        tail_args = (0 if write_first else slots.data_ptr(), table.data_ptr(),
                     seq_lens.data_ptr(), attnp, rows, heads, kv_heads, head_dim, block_size,
                     width)
        q_rot = k_rot = None
        if write_first:
            q_rot = torch.empty(rows, heads * head_dim, dtype=torch.bfloat16)
            k_rot = torch.empty(rows, kv_heads * head_dim, dtype=torch.bfloat16)

        value_offset = kv_caches[0][0].numel() * 2  # bytes from a cache's keys to its values
        embedded = self.model.model.embed_tokens(input_ids.view(rows))
        if self.model.model.embed_scale is not None:  # as DecoderModel.forward
            embedded = embedded * torch.tensor(self.model.model.embed_scale,
                                               dtype=embedded.dtype)
        rms = k.rms_norm_zc if self.zero_centred else k.rms_norm
        gemv, attend = k.gemv, k.decode_attention
        # ingot's kernels write into the step's buffers; without its GEMM, rows the GEMV does
        # not serve go through the modules, whose forward (oneDNN) returns fresh tensors.
        matmul = gemv if use_gemv else k.gemm if self.gemm else None

        def project(module: Any, weight: int | None, quant: tuple[int, int] | None,
                    src: torch.Tensor, bias: int, out: torch.Tensor, n_out: int,
                    n_in: int) -> torch.Tensor:
            if quant is not None:  # bf16 in and out, every row count (as LinearBase.forward)
                status = self.qk.linear(quant[0], src.data_ptr(), 1, quant[1], bias,
                                        out.data_ptr(), 1, rows, n_out, n_in, threads)
                if status:
                    raise MemoryError("quantized linear: no memory for its activation blocks")
                return out
            if matmul is None:
                return module(src)
            # (the GEMM returns nonzero when it could not get its row buffers)
            if matmul(src.data_ptr(), weight, bias, out.data_ptr(), rows, n_out, n_in, threads):
                raise MemoryError("GEMM kernel: no memory for its row buffers")
            return out

        aux_layers = self.model.model.aux_hidden_state_layers
        if self.native and not aux_layers and (matmul is not None or self.all_quant):
            self._native_layers(kv_caches, value_offset, embedded, rows, use_gemv, x, h, res,
                                qkv, attn, gate_up, act, q_rot, k_rot, positions, slots, table,
                                block_size, width, seq_lens, scratch, per_thread, threads)
            return self.norm(h, res)[0]  # a fresh tensor: the buffers are reused next step
        residual_in = embedded.data_ptr()  # layer 0: residual = the embedding, no add
        aux = []
        for i, (cache, layer, extras, linears) in enumerate(zip(
                kv_caches, self.layers, self.extras, self.linears, strict=True)):
            (in_w, in_eps, qkv_w, qkv_b, o_w, o_b, post_w, post_eps, gu_w, gu_b, down_w, down_b,
             window, scale) = layer
            ((q_w, qk_eps), (k_w, _), (attn_out_w, attn_out_eps), (mlp_out_w, mlp_out_eps)), \
                act_id, cos_sin = extras
            step_args = (0, 0) if write_first else (positions.data_ptr(), cos_sin.data_ptr())
            if residual_in == rp:
                rms(h.data_ptr(), rp, in_w, xp, rp, rows, hidden, in_eps, threads)
            else:
                rms(residual_in, None, in_w, xp, None, rows, hidden, in_eps, threads)
            if i in aux_layers:  # EAGLE3: the layer's input, the residual stream
                aux.append((res if residual_in == rp else embedded).clone())
            weights = (qkv_w, o_w, gu_w, down_w) if use_gemv else self.gemm_weights[i]
            quants = self.quant_weights[i]
            qkv = project(linears[0], weights[0], quants[0], x, qkv_b, qkv, qkv_size, hidden)
            qkvp = qkv.data_ptr()
            if q_w is not None:  # per head, in place, row by row (as the C loop)
                for m in range(rows):
                    row = qkvp + m * qkv_size * 2
                    rms(row, None, q_w, row, None, heads, head_dim, qk_eps, threads)
                    rms(row + q_bytes, None, k_w, row + q_bytes, None, kv_heads, head_dim,
                        qk_eps, threads)
            kc = cache.data_ptr()
            vc = kc + value_offset
            if write_first:
                k.rope_write_kv(qkvp, qkv_size, qkvp + q_bytes, qkv_size,
                                qkvp + q_bytes + kv_bytes, qkv_size, positions.data_ptr(),
                                cos_sin.data_ptr(), q_rot.data_ptr(), k_rot.data_ptr(),
                                kc, vc, slots.data_ptr(), rows, heads, kv_heads, head_dim,
                                threads)
                attend(q_rot.data_ptr(), heads * head_dim, 0, 0, 0, 0, *step_args, kc, vc,
                       *tail_args, window, scale, scratch.data_ptr(), per_thread, threads)
            else:
                attend(qkvp, qkv_size, qkvp + q_bytes, qkv_size, qkvp + q_bytes + kv_bytes,
                       qkv_size, *step_args, kc, vc, *tail_args, window, scale,
                       scratch.data_ptr(), per_thread, threads)
            h = project(linears[1], weights[1], quants[1], attn, o_b, h, hidden,
                        heads * head_dim)
            if attn_out_w is not None:
                rms(h.data_ptr(), None, attn_out_w, h.data_ptr(), None, rows, hidden,
                    attn_out_eps, threads)
            rms(h.data_ptr(), residual_in, post_w, xp, rp, rows, hidden, post_eps, threads)
            residual_in = rp
            gate_up = project(linears[2], weights[2], quants[2], x, gu_b, gate_up, 2 * inter,
                              hidden)
            k.act_mul[act_id](gate_up.data_ptr(), actp, rows, inter, threads)
            h = project(linears[3], weights[3], quants[3], act, down_b, h, hidden, inter)
            if mlp_out_w is not None:
                rms(h.data_ptr(), None, mlp_out_w, h.data_ptr(), None, rows, hidden, mlp_out_eps,
                    threads)
        out, _ = self.norm(h, res)  # a fresh tensor: the buffers are reused next step
        if aux:
            self.model.model.aux_hidden_states = torch.cat(aux, dim=-1)
        return out

    def _native_layers(self, kv_caches: list[torch.Tensor], value_offset: int,
                       embedded: torch.Tensor, rows: int, use_gemv: bool,
                       *tensors_and_sizes: Any) -> None:
        """The layer loop of forward() in one call into the kernels' library (same calls, same
        order, same buffers)."""
        (x, h, res, qkv, attn, gate_up, act, q_rot, k_rot, positions, slots, table, block_size,
         width, seq_lens, scratch, per_thread, threads) = tensors_and_sizes
        ptrs = tuple(cache.data_ptr() for cache in kv_caches)
        if ptrs != self._cache_ptrs:
            for c, kc in zip(self.c_layers, ptrs, strict=True):
                c.kc, c.vc = kc, kc + value_offset
            self._cache_ptrs = ptrs
        step = DecodeStep(
            rows, self.hidden, self.inter, self.qkv_size, self.num_heads, self.num_kv_heads,
            self.head_dim, block_size, width, embedded.data_ptr(),
            x.data_ptr(), h.data_ptr(), res.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
            gate_up.data_ptr(), act.data_ptr(), _ptr(q_rot), _ptr(k_rot), positions.data_ptr(),
            slots.data_ptr(), table.data_ptr(), seq_lens.data_ptr(), scratch.data_ptr(),
            per_thread, self.qk.linear_address if self.qk is not None else None,
            int(use_gemv), threads)
        if self.k.decode_layers(self.c_layers, len(self.c_layers), step):
            raise MemoryError("decode program: a kernel could not get its work buffers")
