"""A miniature llama.cpp converter: tiny HF models (transformers, random weights) written as GGUF
files the way llama.cpp's converter writes them (q/k rows permuted for llama, some tensors
quantized), with a tiny byte-level BPE vocabulary. Used by the GGUF loader's tests and by engine
tests that need a small GGUF (tensor-parallel quantized weights)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

N_HEADS, N_KV_HEADS, HIDDEN, HEAD_DIM = 4, 2, 64, 16


# ---- a tiny byte-level BPE vocabulary ---------------------------------------------------------


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "i n", "Ġt he", "Ġ in", "1 2"]
MERGED = ["Ġt", "he", "in", "Ġthe", "Ġin", "12"]
TOKENS = SPECIALS + _bytes_to_unicode() + MERGED + ["<think>"]
TOKEN_TYPES = [3] * len(SPECIALS) + [1] * (256 + len(MERGED)) + [4]
VOCAB = len(TOKENS)  # 266
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


# ---- a miniature llama.cpp converter -----------------------------------------------------------

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# How each tensor is stored: a mix of F32, F16 and Q8_0, as in real quantised files.
DEFAULT_QTYPES = {
    "token_embd.weight": QT.Q8_0,
    "output.weight": QT.Q8_0,
    "blk.0.attn_q.weight": QT.Q8_0,
    "blk.1.attn_q.weight": QT.F32,
    "blk.0.attn_k.weight": QT.F32,
    "blk.1.attn_k.weight": QT.Q8_0,
    "blk.0.attn_output.weight": QT.F16,
}
_QUANTISED_SUFFIXES = ("attn_v.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _qtype(gguf_name: str) -> QT:
    if gguf_name in DEFAULT_QTYPES:
        return DEFAULT_QTYPES[gguf_name]
    return QT.Q8_0 if gguf_name.endswith(_QUANTISED_SUFFIXES) else QT.F32


def _roundtrip(w: torch.Tensor, qtype: QT) -> torch.Tensor:
    """What a tensor becomes after being stored as `qtype` (independent of the loader)."""
    a = w.detach().float().numpy()
    if qtype == QT.F32:
        return torch.from_numpy(a.copy())
    if qtype == QT.F16:
        return torch.from_numpy(a.astype(np.float16).astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype))


ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    tied: bool = True,
    pre: str = "smollm",
    tokenizer_model: str = "gpt2",
    extra_kv: Callable[[gguf.GGUFWriter], None] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Write a 2-layer model as llama.cpp would; return the HF tensors the loader should yield."""
    config_class, model_class = ARCHS[arch]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():  # norms start at exactly 1; make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(128)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    if arch == "llama":
        writer.add_rope_dimension_count(HEAD_DIM)
    else:
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    if extra_kv is not None:
        extra_kv(writer)

    expected: dict[str, torch.Tensor] = {}
    for hf_name, tensor in state.items():
        name = _gguf_name(hf_name)
        qtype = _qtype(name)
        data = tensor.detach().float().numpy()
        if arch == "llama" and ".attn_q." in name:
            data = _llama_cpp_permute(data, N_HEADS)
        elif arch == "llama" and ".attn_k." in name:
            data = _llama_cpp_permute(data, N_KV_HEADS)
        if qtype == QT.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == QT.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        # Storing whole rows commutes with permuting rows, so no permutation is needed here.
        expected[hf_name] = _roundtrip(tensor, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
