"""Build the model for a config and fill it from its checkpoint (HF directory or GGUF)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
from torch import nn

from ingot.config import ModelConfig
from ingot.model_executor.models.registry import resolve_model_class
from ingot.utils.progress import progress

logger = logging.getLogger("ingot")


def iter_checkpoint(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs; with ``quantization == "gguf"`` a GGUF's quantized linears and
    embedding come as their file blocks (layers/quantized.py's ``QuantizedWeight``)."""
    if model_config.format == "gguf":
        from ingot.model_executor.loader.gguf_loader import load_gguf

        gguf = load_gguf(model_config.model)
        weights = gguf.weights(model_config.dtype,
                               keep_quantized=model_config.quantization == "gguf")
        return progress(weights, "loading weights",
                        total=len(gguf.tensors), unit="tensor")
    from ingot.model_executor.loader.safetensors_loader import iter_safetensors

    return progress(iter_safetensors(model_config.model, model_config.dtype), "loading weights",
                    unit="tensor")


def build_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    model_cls = resolve_model_class(model_config.hf_config, model_config.convert)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = model_cls(model_config.hf_config)
    finally:
        torch.set_default_dtype(previous)
    return model


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """Build and load the model. Its kernels (and the packed weight layouts they read) and
    its attention backend come after, from the binding step (model_executor/binding.py)."""
    start = time.perf_counter()
    model = build_model(model_config, device)
    model.load_weights(
        (name, t.to(device=device, dtype=model_config.dtype)
         if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        for name, t in iter_checkpoint(model_config)
    )
    model.eval()
    logger.info(
        "loaded %s (%s) in %.2fs",
        model_config.architecture,
        str(model_config.dtype).removeprefix("torch."),
        time.perf_counter() - start,
    )
    return model
