"""Build the model for a config and fill it from its checkpoint (HF directory or GGUF)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import torch
from torch import nn

from ingot.config import ModelConfig
from ingot.model_executor.layers.cpu_kernels import bind_cpu_kernels, onednn_f32_preferred
from ingot.model_executor.layers.linear import (
    cpu_packed_linear_supported,
    pack_f32_linears,
    pack_linear_weights,
    resident_weight_bytes,
)
from ingot.model_executor.models.registry import resolve_model_class
from ingot.utils.progress import progress

logger = logging.getLogger("ingot")


def iter_checkpoint(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if model_config.format == "gguf":
        from ingot.model_executor.loader.gguf_loader import load_gguf

        gguf = load_gguf(model_config.model)
        return progress(gguf.weights(model_config.dtype), "loading weights",
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


def load_model(
    model_config: ModelConfig, device: torch.device, keep_plain_weights: bool = False
) -> nn.Module:
    """Build and load the model; on CPUs with oneDNN bf16, pack its linears (and release
    their plain weights unless ``keep_plain_weights``: compiled layers run on those)."""
    start = time.perf_counter()
    model = build_model(model_config, device)
    model.load_weights(
        (name, t.to(device=device, dtype=model_config.dtype) if t.is_floating_point() else t)
        for name, t in iter_checkpoint(model_config)
    )
    model.eval()
    packing = not os.environ.get("INGOT_DISABLE_PACKED_LINEAR")
    if packing and cpu_packed_linear_supported(model_config.dtype, device):
        pack_linear_weights(model, keep_plain=keep_plain_weights)
    elif (packing and device.type == "cpu" and model_config.dtype == torch.float32
          and not keep_plain_weights and getattr(model, "packs_f32_linears", False)
          and onednn_f32_preferred()):
        pack_f32_linears(model)
    if device.type == "cpu":
        bind_cpu_kernels(model)  # layers with a path through ingot's C kernels choose it once
    nbytes = resident_weight_bytes(model)
    logger.info(
        "loaded %s (%s, %.1f MB resident, derived kernel layouts included) in %.2fs",
        model_config.architecture,
        str(model_config.dtype).removeprefix("torch."),
        nbytes / 2**20,
        time.perf_counter() - start,
    )
    return model
