"""Requests in (vLLM's ``Processor``): prompts to token ids, and every check of a prompt and
its parameters against the model, in one place. ``LLMEngine.add_request`` runs them all; the
server calls the same checks to answer a bad prompt with a 400 before a stream starts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ingot.config import ModelConfig
from ingot.engine.prompt_embeds import (
    PROMPT_EMBEDS_PLACEHOLDER,
    check_prompt_embeds,
    content_hash,
)
from ingot.engine.tokenizer import encode_texts
from ingot.errors import PromptTooLongError, TokenIdError
from ingot.pooling_params import PoolingParams
from ingot.sampling_params import SamplingParams

PromptType = str | Mapping[str, Any] | list[int]

EMPTY_PROMPT = "prompt is empty; give at least one token"


@dataclass
class ProcessedPrompt:
    """A generation prompt as the core takes it."""

    text: str | None
    token_ids: list[int]  # placeholders, one per row, for a prompt_embeds prompt
    embeds: Any = None  # the checked [seq_len, hidden] tensor of a prompt_embeds prompt
    cache_salt: bytes = b""  # what roots its prefix-cache hash chain (``prefix_cache_root``)


def prefix_cache_root(embeds_hash: bytes, cache_salt: str | None) -> bytes:
    """What a request's prefix-cache hash chain starts from, so that it is mixed into its
    first block's hash and carried by every later one (``Request.cache_salt``): nothing for a
    plain prompt; an embeds prompt's content hash (its placeholder ids say nothing of it); with
    vLLM's ``cache_salt``, a hash of both, so only requests with the same salt share blocks.
    Fixed-width parts: no salt can be chosen to collide with another request's root."""
    if cache_salt is None:
        return embeds_hash
    h = hashlib.sha256(b"cache_salt")
    h.update(embeds_hash or bytes(32))
    h.update(hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest())
    return h.digest()


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any | None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        #: Every id that ends generation (the tokenizer's, the model's): each sequence stops
        #: on them unless its request sets ``ignore_eos``.
        self.eos_token_ids = self._eos_token_ids()

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        for source in (self.model_config.generation_config, vars(self.model_config.hf_config)):
            value = source.get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
        # An id past the model's vocabulary can never be sampled, and the grammar matcher
        # refuses it as a stop token: only the model's own ids end generation.
        return {i for i in ids if 0 <= i < self.model_config.vocab_size}

    # ---- prompts ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a text, token-id or ``{"prompt"[, "prompt_token_ids"]}``
        prompt; a text prompt is encoded with the tokenizer's special tokens."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(EMPTY_PROMPT)
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def check_vocab(self, field: str, token_ids: Sequence[Any]) -> None:
        """Each id one of the model's: ``0 <= id < vocab_size``, the rows of its embedding
        (ids a tokenizer adds beyond them have no embedding, and the model never samples
        them). ``TokenIdError`` naming ``field`` otherwise."""
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            shown = ", ".join(str(t)[:24] for t in bad[:5]) + (", ..." if len(bad) > 5 else "")
            raise TokenIdError(
                f"{field} must be token ids of the model's vocabulary (0 <= id < {vocab}); "
                f"got {shown}", field,
            )

    def check_token_ids(self, token_ids: Sequence[Any], field: str = "prompt_token_ids") -> None:
        """At least one token, each an id of the model's vocabulary."""
        if not token_ids:
            raise ValueError(EMPTY_PROMPT)
        self.check_vocab(field, token_ids)

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Every token id the parameters carry is one of the model's: an id past the
        vocabulary would otherwise reach the grammar matcher or the sampler inside a step."""
        self.check_vocab("stop_token_ids", params.stop_token_ids)
        constraint = params.structured_outputs
        if constraint is not None and constraint.reasoning_end_token_ids:
            self.check_vocab("structured_outputs.reasoning_end_token_ids",
                             constraint.reasoning_end_token_ids)

    def validate_prompt(self, token_ids: list[int]) -> None:
        """``check_token_ids``, and no longer than max_model_len."""
        self.check_token_ids(token_ids)
        max_len = self.model_config.max_model_len
        if len(token_ids) > max_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len ({max_len}); "
                "shorten the prompt or raise --max-model-len"
            )

    def check_prompt_embeds_enabled(self) -> None:
        if not self.model_config.enable_prompt_embeds:
            raise ValueError(
                "prompt_embeds is off on this engine; start it with --enable-prompt-embeds "
                "(LLM(enable_prompt_embeds=True))"
            )

    def _prompt_embeds(self, prompt: PromptType, params: SamplingParams) -> Any:
        """The checked tensor of a ``{"prompt_embeds": tensor}`` prompt, else None."""
        if not isinstance(prompt, Mapping) or "prompt_embeds" not in prompt:
            return None
        self.check_prompt_embeds_enabled()
        if params.prompt_logprobs is not None or params.repetition_penalty != 1.0:
            raise ValueError(
                "prompt_logprobs and repetition_penalty need the prompt's token ids; a "
                "prompt_embeds request has none"
            )
        mc = self.model_config
        return check_prompt_embeds(prompt["prompt_embeds"], mc.hidden_size, mc.max_model_len)

    def check_generative(self) -> None:
        """A pooling model cannot take generation requests."""
        mc = self.model_config
        if mc.is_pooling:
            raise ValueError(
                f"this engine runs {mc.architecture} as a pooling model "
                "(--runner pooling): it returns embeddings or scores and cannot generate text; "
                "use embed / classify / score, or start a generative model"
            )

    @staticmethod
    def cache_salt(prompt: PromptType) -> str | None:
        """A prompt dict's ``cache_salt`` (vLLM's): a non-empty string, or None."""
        salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(
                "cache_salt must be a non-empty string (requests share cached prefixes only "
                "with requests of the same salt); leave it out to share with every request"
            )
        return salt

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """A generation request's prompt, checked against the model and ``params``."""
        self.check_sampling_params(params)
        salt = self.cache_salt(prompt)
        embeds = self._prompt_embeds(prompt, params)
        if embeds is not None:
            # Scheduling stays in token space: one placeholder id per row.
            return ProcessedPrompt(None, [PROMPT_EMBEDS_PLACEHOLDER] * embeds.shape[0], embeds,
                                   prefix_cache_root(content_hash(embeds), salt))
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        return ProcessedPrompt(text, token_ids, cache_salt=prefix_cache_root(b"", salt))

    # ---- pooling prompts -------------------------------------------------------------------
    def pretokenize(
        self, prompts: Sequence[PromptType], truncate: Sequence[int | None]
    ) -> list[PromptType]:
        """The text prompts that would be encoded one by one (non-empty, no truncation),
        encoded in one batch (``encode_texts``) into ``{"prompt", "prompt_token_ids"}``
        prompts, which give the same ids; every other prompt is returned as it is."""
        out = list(prompts)
        todo = [i for i, (p, k) in enumerate(zip(prompts, truncate, strict=True))
                if isinstance(p, str) and p and k is None]
        if self.tokenizer is None or len(todo) < 2:
            return out
        for i, ids in zip(todo, encode_texts(self.tokenizer, [out[i] for i in todo]), strict=True):
            out[i] = {"prompt": out[i], "prompt_token_ids": ids}
        return out

    def pooling_prompt(
        self, prompt: PromptType, truncate_prompt_tokens: int | None = None
    ) -> tuple[str | None, list[int], list[int]]:
        """(text, token ids, the ids the model gets) of a pooling prompt, truncated to
        ``truncate_prompt_tokens`` (-1: max_model_len): text through the tokenizer (which keeps
        its end token, as sentence-transformers truncates), token ids keep their last tokens (as
        vLLM). A prompt dict may carry ``token_type_ids`` (cross-encoder pairs): the model's ids
        carry them (models/bert.py, ``encode_token_type_ids``)."""
        k = truncate_prompt_tokens
        if k == -1:
            k = self.model_config.max_model_len
        types = prompt.get("token_type_ids") if isinstance(prompt, Mapping) else None
        if isinstance(prompt, str) and k is not None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            if not prompt:
                raise ValueError(EMPTY_PROMPT)
            text, token_ids = prompt, self.tokenizer.encode(prompt, truncation=True, max_length=k)
        else:
            text, token_ids = self.tokenize_prompt(prompt)
            if k is not None and len(token_ids) > k:
                token_ids = token_ids[-k:]
                types = types[-k:] if types is not None else None
        max_len = self.model_config.max_model_len
        if len(token_ids) > max_len:
            raise PromptTooLongError(
                f"the input has {len(token_ids)} tokens, more than max_model_len ({max_len}); "
                "shorten it or pass truncate_prompt_tokens (-1: cut to max_model_len)"
            )
        self.validate_prompt(token_ids)
        if types is None:
            return text, token_ids, token_ids
        if not self.model_config.is_encoder_only:
            raise ValueError("token_type_ids are for BERT-style (encoder-only) models")
        from ingot.model_executor.models.bert import encode_token_type_ids

        types = list(types)
        type_vocab = int(getattr(self.model_config.hf_config, "type_vocab_size", 1))
        if any(not isinstance(t, int) or not 0 <= t < type_vocab for t in types):
            raise ValueError(f"token_type_ids must be integers in [0, {type_vocab})")
        return text, token_ids, encode_token_type_ids(token_ids, types)

    def resolve_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """The request's parameters with the model's defaults filled in; refuses what the model
        cannot do (a task it lacks, ``dimensions`` on a model not trained for them)."""
        mc = self.model_config
        if not mc.is_pooling:
            raise ValueError(
                f"{mc.architecture} is served as a generative model: embeddings, classification "
                "and scores need a pooling model (start it with --runner pooling)"
            )
        pooler = mc.pooler_config
        assert pooler is not None
        params = params.clone()
        native = pooler.task
        if params.task is None or params.task == "encode":
            params.task = native
        allowed = ("embed",) if native == "embed" else ("classify", "score")
        if params.task not in allowed:
            raise ValueError(
                f"task {params.task!r} is not supported by {mc.architecture} (a "
                f"{'n embedding' if native == 'embed' else ' classification'} model); it "
                f"supports {', '.join(allowed)}"
            )
        if params.dimensions is not None:
            if params.task != "embed":
                raise ValueError("dimensions applies to embeddings only")
            hf = mc.hf_config
            listed = getattr(hf, "matryoshka_dimensions", None)
            if not (listed or getattr(hf, "is_matryoshka", False)):
                raise ValueError(
                    f"Model \"{mc.served_model_name}\" does not support matryoshka "
                    "representation, changing output dimensions will lead to poor results; "
                    "drop dimensions"
                )
            if listed and params.dimensions not in listed:
                raise ValueError(f"dimensions must be one of {sorted(listed)}, got {params.dimensions}")
            if params.dimensions > int(hf.hidden_size):
                raise ValueError(f"dimensions must be <= {hf.hidden_size}, got {params.dimensions}")
        if params.normalize is None:
            params.normalize = pooler.normalize and params.task == "embed"
        if params.activation is None:
            params.activation = True
        return params
