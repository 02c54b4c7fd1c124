"""Pooling handlers with vLLM's request and response shapes: /v1/embeddings, /pooling,
/classify, /score (and /v1/score), /rerank (and /v1/rerank). Requests run through the same
engine loop as generation (prefill only); pairing and the two kinds of scorer are
engine/scoring.py's, shared with ``LLM.score``."""

from __future__ import annotations

import base64
import struct
from contextlib import aclosing
from typing import Any

from ingot.engine import scoring
from ingot.engine.outputs import PoolingRequestOutput
from ingot.engine.protocol import EngineClient
from ingot.entrypoints.openai.access_log import record_usage
from ingot.entrypoints.openai.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingInput,
    PoolingRequest,
    RequestValueError,
    RerankRequest,
    ScoreRequest,
    now,
    random_id,
)
from ingot.entrypoints.openai.serving import merge
from ingot.pooling_params import PoolingParams


def encode_vector(vec: list[float], encoding_format: str) -> list[float] | str:
    """base64: the little-endian float32 bytes (what the openai client decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    return vec


def _usage(prompt_tokens: int) -> dict[str, int]:
    record_usage(prompt_tokens, 0)
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}


class OpenAIServingPooling:
    def __init__(self, engine: EngineClient, served_model_name: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.model_config = engine.model_config
        self.tokenizer = engine.tokenizer

    def check_pooling(self, route: str) -> None:
        """A generative model answers the pooling routes with a 400 naming the flag."""
        if not self.model_config.is_pooling:
            raise RequestValueError(
                f"{route} needs a pooling model; this server runs "
                f"{self.model_config.architecture} for generation (start `ingot serve` with "
                "--runner pooling, e.g. with no --model for the default embedder)", "model",
            )

    # ---- inputs ----------------------------------------------------------------------------
    def _prompts(self, value: PoolingInput, add_special_tokens: bool = True) -> list[Any]:
        if isinstance(value, str):
            value = [value]
        elif value and all(isinstance(t, int) for t in value):
            value = [value]
        if not value:
            raise RequestValueError("input is empty; give at least one input", "input")
        prompts: list[Any] = []
        for item in value:
            if not item:
                raise RequestValueError("input holds an empty input", "input")
            if isinstance(item, str) and not add_special_tokens:
                if self.tokenizer is None:
                    raise RequestValueError("the server has no tokenizer; send token ids", "input")
                item = {"prompt": item,
                        "prompt_token_ids": self.tokenizer.encode(item, add_special_tokens=False)}
            prompts.append(item)
        return prompts

    async def _run(
        self, prompts: list[Any], params: PoolingParams, prefix: str
    ) -> list[PoolingRequestOutput]:
        streams = [self.engine.encode(p, params, f"{prefix}-{i}") for i, p in enumerate(prompts)]
        finals: dict[int, PoolingRequestOutput] = {}
        async with aclosing(merge(streams)) as outs:
            async for i, out in outs:
                finals[i] = out
        return [finals[i] for i in range(len(prompts))]

    async def _vectors(
        self, request: EmbeddingRequest | PoolingRequest, params: PoolingParams,
        request_id: str, kind: str, key: str,
    ) -> dict[str, Any]:
        """One pooled vector per input, as /v1/embeddings and /pooling answer."""
        outs = await self._run(self._prompts(request.input, request.add_special_tokens),
                               params, request_id)
        data = [{"index": i, "object": kind, key: encode_vector(o.outputs.data,
                                                                  request.encoding_format)}
                for i, o in enumerate(outs)]
        return self._body(request_id, data, sum(len(o.prompt_token_ids) for o in outs))

    def _body(self, request_id: str, data: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
        return {
            "id": request_id, "object": "list", "created": now(),
            "model": self.served_model_name, "data": data, "usage": _usage(prompt_tokens),
        }

    # ---- routes ----------------------------------------------------------------------------
    async def embeddings(self, request: EmbeddingRequest) -> dict[str, Any]:
        self.check_pooling("/v1/embeddings")
        params = PoolingParams(request.truncate_prompt_tokens, request.dimensions,
                               request.normalize, task="embed")
        request_id = random_id("embd")
        return await self._vectors(request, params, request_id, "embedding", "embedding")

    async def pooling(self, request: PoolingRequest) -> dict[str, Any]:
        self.check_pooling("/pooling")
        params = PoolingParams(request.truncate_prompt_tokens, request.dimensions,
                               request.normalize, request.activation, task="encode")
        request_id = random_id("pool")
        return await self._vectors(request, params, request_id, "pooling", "data")

    async def classify(self, request: ClassificationRequest) -> dict[str, Any]:
        self.check_pooling("/classify")
        params = PoolingParams(request.truncate_prompt_tokens, activation=request.activation,
                               task="classify")
        request_id = random_id("classify")
        outs = await self._run(self._prompts(request.input), params, request_id)
        id2label = getattr(self.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": id2label.get(best, str(best)), "probs": probs,
                         "num_classes": len(probs)})
        return self._body(request_id, data, sum(len(o.prompt_token_ids) for o in outs))

    async def _scores(
        self, text_1: str | list[str], text_2: str | list[str], truncate: int | None, prefix: str
    ) -> tuple[list[float], int]:
        """(one score per pair, prompt tokens used)."""
        scoring.check_can_score(self.model_config)
        pairs = scoring.pair_up(text_1, text_2)
        if scoring.is_cross_encoder(self.model_config):
            prompts = [
                scoring.cross_encoder_prompt(self.tokenizer, a, b, truncate,
                                             self.model_config.max_model_len)
                for a, b in pairs
            ]
            outs = await self._run(prompts, PoolingParams(task="score"), prefix)
            return [o.outputs.data[0] for o in outs], sum(len(o.prompt_token_ids) for o in outs)
        texts = [t for pair in pairs for t in pair]
        outs = await self._run(texts, PoolingParams(truncate, task="embed"), prefix)
        scores = [scoring.cosine(a.outputs.data, b.outputs.data)
                  for a, b in zip(outs[::2], outs[1::2], strict=True)]
        return scores, sum(len(o.prompt_token_ids) for o in outs)

    async def score(self, request: ScoreRequest) -> dict[str, Any]:
        self.check_pooling("/score")
        request_id = random_id("score")
        scores, tokens = await self._scores(request.text_1, request.text_2,
                                            request.truncate_prompt_tokens, request_id)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self._body(request_id, data, tokens)

    async def rerank(self, request: RerankRequest) -> dict[str, Any]:
        self.check_pooling("/rerank")
        if not request.documents:
            raise RequestValueError("documents is empty; give at least one document", "documents")
        request_id = random_id("rerank")
        scores, tokens = await self._scores(request.query, request.documents,
                                            request.truncate_prompt_tokens, request_id)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep order
        if request.top_n:
            order = order[: request.top_n]
        results = [
            {"index": i, "document": {"text": request.documents[i]}, "relevance_score": scores[i]}
            for i in order
        ]
        return {"id": request_id, "model": self.served_model_name,
                "usage": {"total_tokens": _usage(tokens)["total_tokens"]}, "results": results}
