"""Tokenizer loading (HF directory or GGUF metadata) and chat templates."""

from __future__ import annotations

from typing import Any

from ingot.config import ModelConfig


def load_tokenizer(model_config: ModelConfig) -> Any | None:
    if model_config.skip_tokenizer_init:
        return None
    source = model_config.tokenizer
    if source.endswith(".gguf"):
        from ingot.model_executor.loader.gguf_loader import load_gguf

        return load_gguf(source).tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(
            f"cannot load a tokenizer from {source!r} ({exc}); pass --tokenizer PATH, or "
            "skip_tokenizer_init=True and token-id prompts"
        ) from exc


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """``[tokenizer.encode(t, add_special_tokens=True) for t in texts]``, in one call where the
    tokenizer is a fast (Rust) one: its backend encodes the batch on every core and skips the
    per-text Python of ``encode`` and the offsets nobody reads (measured on MiniLM and 8-128
    token sentences: 0.21 against 0.35 ms a sentence on one core)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode_batch = getattr(backend, "encode_batch_fast", None)
    if encode_batch is None:
        return [tokenizer.encode(t, add_special_tokens=True) for t in texts]
    # ``encode`` clears what an earlier truncating call left configured; so does this.
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    return [e.ids for e in encode_batch(texts, add_special_tokens=True)]


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **kwargs: Any,
) -> str:
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; the engine was started with skip_tokenizer_init")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "the model has no chat template; pass chat_template=... or use generate() with a "
            "plain prompt"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
    return tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
