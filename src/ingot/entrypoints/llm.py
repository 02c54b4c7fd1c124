"""The offline ``LLM`` class, vLLM's interface: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from ingot.config import EngineArgs
from ingot.engine.llm_engine import LLMEngine, PromptType
from ingot.engine.outputs import RequestOutput
from ingot.engine.sampling_params import SamplingParams
from ingot.engine.tokenizer import apply_chat_template


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
                ids.append(engine.add_request(None, prompt, params))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
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
