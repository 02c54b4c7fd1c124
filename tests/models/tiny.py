"""Tiny random-weight HF models built in-process (fixed seed), saved as HF directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}

# MoE defaults (4 experts, top 2): Qwen3-MoE with a dense last layer (mlp_only_layers), and
# expert MLPs narrower than the dense one.
MOE_DEFAULTS = {
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
}
# Gemma 3: a local layer whose window (8) the test prompts outgrow, then a global one; each
# with its own rope base, and a score scale that is not the head dim's.
ARCH_DEFAULTS = {
    **MOE_DEFAULTS,
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10.0},
                                    "full_attention": {"rope_type": "default",
                                                       "rope_theta": 10000.0}}),
}

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_model(arch: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    kwargs = {**BASE, **ARCH_DEFAULTS.get(arch, {}), **overrides}
    if arch == "qwen3":
        kwargs.setdefault("head_dim", 16)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    # HF inits some weights to ones/zeros; randomise norms and biases too so every
    # parameter is checked.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                # A sharper router than HF's init: tokens pick distinct experts, so a
                # routing bug shows in the logits.
                p.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_model(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_byte_tokenizer(path: Path) -> Any:
    """A byte-level tokenizer (ids 0-2 special, then the 256 byte symbols, no merges): every
    UTF-8 byte is its own token, so multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i, symbol in enumerate(sorted(alphabet)):
        vocab[symbol] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)
    return fast


# ---- BERT (pooling models) ----------------------------------------------------------------------

BERT_WORDS = "the cat sat on a mat dog ran far away big small red blue green house tree".split()


def bert_config(**overrides: Any) -> transformers.BertConfig:
    kwargs = dict(vocab_size=5 + len(BERT_WORDS), hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
                  type_vocab_size=2)
    kwargs.update(overrides)
    return transformers.BertConfig(**kwargs)


def randomise(model: torch.nn.Module) -> None:
    """HF inits LayerNorms to ones/zeros and biases to zero: perturb them so they are checked."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)


def save_bert_tokenizer(path: Path) -> None:
    """A WordPiece tokenizer over BERT_WORDS (ids 0-4 the specials [PAD] [UNK] [CLS] [SEP])."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(path)


def make_tiny_cross_encoder(path: Path, seed: int = 1) -> tuple[Path, Any]:
    """A one-label BertForSequenceClassification (a reranker) with its tokenizer. Larger
    weights than HF's default init: the logit must vary with the input (segment B's token type
    included), or a broken variant could pass a gate."""
    torch.manual_seed(seed)
    config = bert_config(num_labels=1, initializer_range=0.3)
    hf = transformers.BertForSequenceClassification(config).eval()
    randomise(hf)
    hf.save_pretrained(path, safe_serialization=True)
    save_bert_tokenizer(path)
    return path, hf
