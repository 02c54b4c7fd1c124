"""Build a Hugging Face fast tokenizer from the tokenizer stored in GGUF metadata.

A GGUF carries no tokenizer.json: llama.cpp keeps the vocabulary, merges, token types and special
ids as metadata keys (`tokenizer.ggml.*`), and names the pre-tokenizer only by a short id
(`tokenizer.ggml.pre`). For byte-level BPE ("gpt2") we rebuild the `tokenizers` pipeline that id
stands for. SentencePiece vocabularies ("llama": Llama 2, Mistral, Gemma) store no merges;
transformers' GGUF converter recovers them (per architecture: Gemma's from the tokens' order) and
builds the slow tokenizer's fast twin, so we take its pipeline rather than restate it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger("ingot")

# llama.cpp's `llama_token_type` values (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Split regexes of the pre-tokenizers llama.cpp recognises by name, as in the original
# tokenizer.json files. "smollm" and the GPT-2 default use ByteLevel's built-in regex instead.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Llama 3's tokenizer.json sets `ignore_merges`: a word already in the vocab is taken whole.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe"}
# Pre-tokenizer ids that mean plain GPT-2 byte-level splitting.
_GPT2_DEFAULT = {None, "default", "gpt2", "gpt-2"}


def _byte_level(use_regex: bool) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer the vocabulary's merges were learned with."""
    if pre == "smollm":
        # SmolLM2's tokenizer.json: every digit is its own word, then GPT-2 byte-level splitting.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), _byte_level(use_regex=True)]
        )
    if pre in _SPLIT_REGEX:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated", invert=False),
                _byte_level(use_regex=False),
            ]
        )
    if pre not in _GPT2_DEFAULT:
        logger.warning(
            "GGUF pre-tokenizer %r is not known to ingot; falling back to GPT-2 byte-level "
            "splitting, so some texts may tokenize differently from the original model",
            pre,
        )
    return _byte_level(use_regex=True)


def _token_at(tokens: list[str], metadata: Mapping[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    if token_id is None or not 0 <= token_id < len(tokens):
        return None
    return tokens[token_id]


def build_gguf_tokenizer(
    metadata: Mapping[str, Any], model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` equivalent to the tokenizer described by GGUF `metadata`.

    `metadata` maps GGUF keys to decoded values (string arrays as lists of str).
    """
    model = metadata.get("tokenizer.ggml.model")
    if model == "llama":
        backend = _sentencepiece_backend(metadata)
    elif model == "gpt2":
        backend = _byte_level_backend(metadata)
    else:
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level "
            "BPE, 'llama' SentencePiece); pass --tokenizer with a Hugging Face tokenizer directory"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", model == "llama")

    kwargs: dict[str, Any] = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_token_at(tokens, metadata, "bos_token_id"),
        eos_token=_token_at(tokens, metadata, "eos_token_id"),
        pad_token=_token_at(tokens, metadata, "padding_token_id"),
        unk_token=_token_at(tokens, metadata, "unknown_token_id"),
        # Passing both explicitly makes transformers build the matching post-processor.
        add_bos_token=bool(add_bos),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
        **kwargs,
    )
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def _sentencepiece_backend(metadata: Mapping[str, Any]) -> Tokenizer:
    """The `tokenizers` pipeline of a SentencePiece GGUF vocabulary, from transformers' GGUF
    converter (control and user-defined tokens added as ours are)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = {name: metadata[f"tokenizer.{key}"]
              for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in metadata}
    backend, _ = convert_gguf_tokenizer(str(metadata.get("general.architecture")), fields)
    return backend


def _byte_level_backend(metadata: Mapping[str, Any]) -> Tokenizer:
    """Byte-level BPE ("gpt2"): the vocabulary, merges and the pre-tokenizer its id names."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    token_types = list(metadata.get("tokenizer.ggml.token_type", []))
    pre = metadata.get("tokenizer.ggml.pre")

    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        logger.warning("GGUF vocabulary has %d duplicate tokens", len(tokens) - len(vocab))
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in _IGNORE_MERGES,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)

    # Control tokens (<|im_start|>, ...) are special; user-defined ones (<think>, ...) are matched
    # whole in the text but stay visible on decode. Both already have their ids in `vocab`.
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind == TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(token_types)
        if kind == TOKEN_TYPE_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)
    return backend
