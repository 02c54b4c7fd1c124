"""From a model argument to what the engine config needs: the local path and format, the HF
config (read from config.json or the GGUF header), the auto dtype, HF overrides, and the draft
or EAGLE3 model of speculative decoding. No downloads: ingot only reads local files."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ingot.config import DTYPES, ModelConfig, SpeculativeConfig
from ingot.errors import ModelNotFoundError
from ingot.platforms.interface import DtypeChoice


def resolve_model_path(model: str | None, default_embedder: bool = False) -> tuple[str, str]:
    """(local path, format). No downloads: a path that does not exist is an error. No model:
    the default chat model, or with ``default_embedder`` the default embedding model."""
    if model is None and default_embedder:
        from ingot.model_executor.loader.packaged_models import default_embedder_path

        return default_embedder_path(), "hf"
    if model is None:
        from ingot.model_executor.loader.gguf_loader import default_model_path

        return default_model_path(), "gguf"
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {model!r} does not exist; pass a local Hugging Face model directory or "
            "a .gguf file (ingot never downloads models)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"model file {model!r} is not a .gguf file")
        return str(path), "gguf"
    if (path / "config.json").exists():
        return str(path), "hf"
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return str(ggufs[0]), "gguf"
    raise ModelNotFoundError(
        f"model directory {model!r} has no config.json (and not exactly one .gguf file)"
    )


def load_hf_config(path: str, fmt: str) -> tuple[Any, dict[str, Any]]:
    if fmt == "gguf":
        from ingot.model_executor.loader.gguf_loader import load_gguf

        gguf_model = load_gguf(path)
        return gguf_model.config, dict(gguf_model.generation_config)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelNotFoundError(f"cannot read {path}/config.json: {exc}") from exc
    gen: dict[str, Any] = {}
    gen_path = Path(path) / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
    return config, gen


def auto_dtype(hf_config: Any, platform: Any, prefill_only: bool = False,
               bf16_kernels: Callable[[], str | None] = lambda: None) -> DtypeChoice:
    """The dtype ``auto`` picks, with why. ``prefill_only`` (an encoder): the platform's dtype
    for compute-bound models when that is float32 (a CPU without AMX: float32 computes faster
    there, and a half checkpoint widens exactly). Otherwise the platform's rule for a model
    that decodes (``Platform.auto_dtype``: vLLM's on CUDA, the fastest dtype the CPU computes
    on CPU). ``bf16_kernels`` gives the ISA of ingot's vector bf16 CPU kernels serving here
    (None: none does); asked only where the rule needs it, since the first ask builds them."""
    if prefill_only and platform.prefill_only_dtype() == torch.float32:
        where = " (a CPU without AMX)" if platform.device_type == "cpu" else ""
        return DtypeChoice(torch.float32, "an encoder only prefills (compute-bound), and float32 "
                           f"computes that fastest here{where}")
    declared = getattr(hf_config, "dtype", None)
    if isinstance(declared, str):
        declared = DTYPES.get(declared)
    return platform.auto_dtype(declared, bf16_kernels())


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any]) -> None:
    """Set config attributes; rope settings also go into ``rope_parameters`` (transformers 5
    reads them from there, so a bare ``rope_theta`` attribute alone would be ignored)."""
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(current, dict) and isinstance(value, dict):
            value = {**current, **value}
        setattr(hf_config, key, value)
        rope = getattr(hf_config, "rope_parameters", None)
        if isinstance(rope, dict):
            if key == "rope_theta":
                rope["rope_theta"] = value
            elif key == "rope_scaling" and isinstance(value, dict):
                rope.update(value)


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft model of ``draft_model`` speculation: the target's dtype and length, and its
    vocabulary (a draft token is a target token id)."""
    assert spec.model is not None
    if spec.method == "eagle3":
        return eagle3_model_config(spec, target)
    path, fmt = resolve_model_path(spec.model)
    hf_config, _ = load_hf_config(path, fmt)
    if int(hf_config.vocab_size) != target.vocab_size:
        raise ValueError(
            f"the draft model {spec.model!r} has a vocabulary of {hf_config.vocab_size} tokens "
            f"and the target {target.vocab_size}; a draft must share the target's tokenizer"
        )
    from ingot.model_executor.models.registry import resolve_model_class

    model_cls = resolve_model_class(hf_config)
    if getattr(model_cls, "pooling_task", None):
        raise ValueError(f"the draft model {spec.model!r} is a pooling model; use a causal LM")
    return ModelConfig(
        model=path, format=fmt, hf_config=hf_config, dtype=target.dtype,
        max_model_len=target.max_model_len, tokenizer=path, skip_tokenizer_init=True,
        seed=target.seed, hf_overrides={}, served_model_name=default_served_name(path),
    )


def eagle3_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """An EAGLE3 head: one decoder layer over the target's embedding space and hidden
    states; also fixes the target layers it reads (``spec.aux_layer_ids``)."""
    from ingot.model_executor.models.eagle3 import default_aux_layers, eagle3_config

    assert spec.model is not None
    path = str(Path(spec.model).expanduser())
    if not (Path(path) / "config.json").exists():
        raise ModelNotFoundError(
            f"EAGLE3 head {spec.model!r} is not a directory with a config.json (ingot never "
            "downloads models)"
        )
    hf_config = eagle3_config(path)
    layers = int(getattr(hf_config, "num_hidden_layers", 1))
    if layers != 1:
        raise ValueError(f"an EAGLE3 head has exactly one decoder layer; {spec.model!r} has "
                         f"{layers}")
    if int(hf_config.vocab_size) != target.vocab_size:
        raise ValueError(
            f"the EAGLE3 head {spec.model!r} embeds {hf_config.vocab_size} tokens and the "
            f"target has {target.vocab_size}; it must be trained for the target"
        )
    target_hidden = int(getattr(hf_config, "target_hidden_size", None) or hf_config.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"the EAGLE3 head {spec.model!r} reads hidden states of width {target_hidden} and "
            f"the target's are {target.hidden_size}; it must be trained for the target"
        )
    n = int(target.hf_config.num_hidden_layers)
    ids = tuple(getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or
                default_aux_layers(n))
    if len(ids) != 3 or any(not 0 <= i < n for i in ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {list(ids)} must be three layer indices of the "
            f"target's {n} layers"
        )
    spec.aux_layer_ids = ids
    return ModelConfig(
        model=path, format="hf", hf_config=hf_config, dtype=target.dtype,
        max_model_len=target.max_model_len, tokenizer=path, skip_tokenizer_init=True,
        seed=target.seed, hf_overrides={}, served_model_name=default_served_name(path),
    )


def st_config(path: str) -> Any:
    from ingot.model_executor.loader.st_config import SentenceTransformersConfig, read_st_config

    return read_st_config(path) or SentenceTransformersConfig()


def default_served_name(path: str) -> str:
    name = os.path.basename(path.rstrip("/"))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name
