"""The offline ``LLM`` class, vLLM's interface: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from ingot.engine import scoring
from ingot.engine.arg_utils import EngineArgs
from ingot.engine.llm_engine import LLMEngine
from ingot.engine.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    request_error,
)
from ingot.engine.processor import PromptType
from ingot.engine.tokenizer import apply_chat_template
from ingot.pooling_params import PoolingParams
from ingot.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(
                f"unknown LLM argument(s): {', '.join(sorted(unknown))}; "
                f"accepted: {', '.join(sorted(EngineArgs.field_names()))}"
            )
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one token-id prompt
        return prompts

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts; "
                    "pass one, or one per prompt"
                )
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                # Only the final outputs are returned: the engine builds nothing before (as
                # vLLM's LLM); a copy, so the caller's params are left as given.
                params = copy.copy(params)
                params.output_kind = RequestOutputKind.FINAL_ONLY
                ids.append(engine.add_request(None, prompt, params))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    # ---- pooling models (LLM(runner="pooling")) ---------------------------------------------
    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = False,
        truncate_prompt_tokens: int | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """The model's own pooled output per prompt (an embedding, or label scores)."""
        prompt_list = self._as_prompt_list(prompts)
        if isinstance(pooling_params, SamplingParams) or (
            isinstance(pooling_params, list | tuple)
            and any(isinstance(p, SamplingParams) for p in pooling_params)
        ):
            raise ValueError(
                "sampling parameters do not apply to a pooling request (it returns vectors or "
                "scores); pass PoolingParams"
            )
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            base = pooling_params.clone() if pooling_params is not None else PoolingParams()
            params_list = [base] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} pooling params for {len(prompt_list)} prompts; "
                    "pass one, or one per prompt"
                )
        resolved = []
        for p in params_list:
            p = p.clone()
            if truncate_prompt_tokens is not None:
                p.truncate_prompt_tokens = truncate_prompt_tokens
            if pooling_task is not None:
                p.task = pooling_task
            resolved.append(p)
        engine = self.llm_engine
        prompt_list = engine.processor.pretokenize(prompt_list, [p.truncate_prompt_tokens for p in resolved])
        ids: list[str] = []
        try:
            for prompt, params in zip(prompt_list, resolved, strict=True):
                ids.append(engine.add_request(None, prompt, params))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, "embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, "classify")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoringRequestOutput]:
        """One score per pair (engine/scoring.py): a cross-encoder's sigmoid, or the cosine of
        an embedding model's two vectors. One data_1 is scored against every data_2."""
        config = self.llm_engine.model_config
        scoring.check_can_score(config)
        pairs = scoring.pair_up(data_1, data_2)
        params = pooling_params.clone() if pooling_params is not None else PoolingParams()
        if scoring.is_cross_encoder(config):
            prompts: list[PromptType] = [
                scoring.cross_encoder_prompt(self.llm_engine.tokenizer, a, b,
                                             truncate_prompt_tokens, config.max_model_len)
                for a, b in pairs
            ]
            params.truncate_prompt_tokens = None  # applied to the pair by the tokenizer
            outs = self.encode(prompts, params, use_tqdm, pooling_task="score")
            return [
                ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.outputs.data[0]))
                for o in outs
            ]
        texts = [t for pair in pairs for t in pair]
        outs = self.encode(texts, params, use_tqdm, truncate_prompt_tokens, "embed")
        return [
            ScoringRequestOutput(
                a.request_id, a.prompt_token_ids + b.prompt_token_ids,
                ScoringOutput(scoring.cosine(a.outputs.data, b.outputs.data)),
            )
            for a, b in zip(outs[::2], outs[1::2], strict=True)
        ]

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        engine = self.llm_engine
        pending = set(ids)
        finished: dict[str, Any] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        error = request_error(out)
                        if error is not None:
                            raise error  # as if add_request had refused it
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages is empty; give at least one message")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = apply_chat_template(
                self.llm_engine.tokenizer,
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            # The template already holds BOS and special tokens: do not add them twice.
            ids = self.llm_engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
