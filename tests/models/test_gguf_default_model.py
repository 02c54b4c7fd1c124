"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers' own GGUF support.

transformers reads GGUF independently of us (its own tokenizer builder, name map, q/k
un-permutation and dequantisation), so agreement here checks our loader end to end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ingot.model_executor.loader.gguf_loader import (
    convert_gguf_to_hf,
    load_gguf,
)

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "12345",
    "The year 2024 had 366 days; pi is 3.14159.",
    "a   b    c\t\td\n\n\ne",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "café naïve résumé Ærøskøbing",
    "日本語のテキストと中文",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing   ",
    "x<|im_end|>y<|endoftext|>z",
    "don't won't I'm we'll they've",
    "",
]

SMOLLM2_CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def gguf_path(default_gguf_path: str) -> Path:
    return Path(default_gguf_path)


@pytest.fixture(scope="session")
def converted_dir(default_hf_dir: Path) -> Path:
    return default_hf_dir


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


class _NameMapView:
    """What transformers' GGUF name mapping reads from a model: config and parameter names.

    Handing it the real model works too, but its mapping then recurses into every submodule
    and rebuilds gguf's tensor-name table ~400 times (about 5 s for nothing).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self._state = model.state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def named_children(self) -> list:
        return []


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> tuple[dict[str, Any], LlamaForCausalLM]:
    """(config dict, fp32 model) from transformers' GGUF loader (no `accelerate` needed)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The name map only needs parameter names; a meta-device model built from our config
    # provides them (the config itself is checked against transformers' in a test below).
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(load_gguf(gguf_path).config)
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=_NameMapView(skeleton)
    )
    config = LlamaConfig(**parsed["config"])
    model = LlamaForCausalLM(config).to(torch.float32)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    model.tie_weights()
    return parsed["config"], model.eval()


def test_config_matches_transformers(gguf_path: Path, reference: tuple[dict, Any]) -> None:
    ref, _ = reference
    ours = load_gguf(gguf_path).config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert getattr(ours, key) == ref[key], key
    assert ours.rms_norm_eps == pytest.approx(ref["rms_norm_eps"])
    assert ours.rope_parameters["rope_theta"] == ref["rope_theta"]
    assert ours.architectures == ["LlamaForCausalLM"]


def test_tokenizer_matches_transformers(
    gguf_path: Path, converted_dir: Path, reference_tokenizer: Any
) -> None:
    ours = load_gguf(gguf_path).tokenizer
    reloaded = AutoTokenizer.from_pretrained(converted_dir)
    for text in TEXTS:
        expected = reference_tokenizer.encode(text)
        assert ours.encode(text) == expected, text
        assert reloaded.encode(text) == expected, text
        assert ours.decode(expected) == reference_tokenizer.decode(expected) == text
    # specials are single ids; SmolLM2 adds no BOS
    assert ours.encode("<|im_start|>") == [1]
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)


def test_chat_template(gguf_path: Path, converted_dir: Path) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for tok in (load_gguf(gguf_path).tokenizer, AutoTokenizer.from_pretrained(converted_dir)):
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == SMOLLM2_CHAT


def test_converted_model_matches_transformers(
    converted_dir: Path, reference: tuple[dict, Any], reference_tokenizer: Any
) -> None:
    _converted_matches_transformers(converted_dir, reference, reference_tokenizer)


def test_gguf_twin_one_tensor_dequantised_wrong_fails(
    gguf_path: Path, tmp_path: Path, reference: tuple[dict, Any], reference_tokenizer: Any
) -> None:
    """Broken twin: one tensor of the GGUF file dequantised wrong as ingot reads it."""
    from faults import fails, injected

    with injected("gguf_dequant_wrong"):
        broken = convert_gguf_to_hf(gguf_path, tmp_path, dtype=torch.float32)
    with fails():
        _converted_matches_transformers(broken, reference, reference_tokenizer)


def _converted_matches_transformers(
    converted_dir: Path, reference: tuple[dict, Any], reference_tokenizer: Any
) -> None:
    _, ref_model = reference
    model = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.dtype == torch.float32

    ref_state = ref_model.state_dict()
    mismatched = [n for n, t in model.state_dict().items() if not torch.equal(t, ref_state[n])]
    assert mismatched == []

    # Short prompt: a 135M forward in fp32 costs ~50 ms a token on two CPU cores.
    ids = torch.tensor([reference_tokenizer.encode(CHAT_PROMPT)])
    with torch.no_grad():
        ours = model(ids).logits
        expected = ref_model(ids).logits
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0)
    assert torch.isfinite(ours).all()
