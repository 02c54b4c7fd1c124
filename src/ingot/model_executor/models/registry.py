"""Architecture name (HF ``config.architectures[0]``) -> model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from ingot.model_executor.models import bert, eagle3, gemma3, llama, moe
from ingot.model_executor.models.adapters import as_classification_model

_MODELS: dict[str, type[nn.Module]] = {
    "BertModel": bert.BertModel,
    "BertForSequenceClassification": bert.BertForSequenceClassification,
    "Gemma3ForCausalLM": gemma3.Gemma3ForCausalLM,
    "LlamaForCausalLM": llama.LlamaForCausalLM,
    "MistralForCausalLM": llama.MistralForCausalLM,
    "MixtralForCausalLM": moe.MixtralForCausalLM,
    "Qwen2ForCausalLM": llama.Qwen2ForCausalLM,
    "Qwen3ForCausalLM": llama.Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": moe.Qwen3MoeForCausalLM,
}
for _name in eagle3.EAGLE3_ARCHITECTURES:  # draft heads (speculative_config method eagle3)
    _MODELS[_name] = eagle3.Eagle3LlamaForCausalLM
for _name in ("Llama", "Mistral", "Qwen2", "Qwen3"):
    _MODELS[f"{_name}ForSequenceClassification"] = as_classification_model(
        _MODELS[f"{_name}ForCausalLM"]
    )


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def register_model(architecture: str, model_cls: type[nn.Module]) -> None:
    _MODELS[architecture] = model_cls


def resolve_model_class(config: Any, convert: str = "none") -> type[nn.Module]:
    """``convert="classify"``: a causal LM's class wrapped as a classifier (models/adapters.py)."""
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in _MODELS:
            if convert == "classify" and getattr(_MODELS[arch], "pooling_task", None) is None:
                return as_classification_model(_MODELS[arch])
            return _MODELS[arch]
    raise ValueError(
        f"model architecture {architectures or '(none given)'} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )
