"""sentence-transformers' own configuration of an embedding model directory: which modules run
after the transformer (``modules.json``: Pooling, Normalize), the pooling mode
(``1_Pooling/config.json``) and the truncation length (``sentence_bert_config.json``). ingot takes
its pooler defaults from them, so a model embeds as sentence-transformers embeds it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# 1_Pooling/config.json flag -> ingot pooling type (None: a mode ingot does not implement)
_MODE_FLAGS = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


@dataclass
class SentenceTransformersConfig:
    #: "CLS" | "MEAN" | "LAST", or the name of a mode ingot lacks (rejected by the config).
    pooling_type: str | None = None
    normalize: bool | None = None  # a Normalize module follows the pooling
    max_seq_length: int | None = None


def _read_json(path: Path) -> object | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_st_config(model_dir: str) -> SentenceTransformersConfig | None:
    """None when the directory is not a sentence-transformers model (no modules.json)."""
    root = Path(model_dir)
    if not root.is_dir():
        return None
    modules = _read_json(root / "modules.json")
    if not isinstance(modules, list):
        return None
    config = SentenceTransformersConfig(normalize=False)
    for module in modules:
        if not isinstance(module, dict):
            continue
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            config.normalize = True
        elif kind.endswith(".Pooling"):
            pooling = _read_json(root / str(module.get("path", "")) / "config.json")
            if isinstance(pooling, dict):
                config.pooling_type = _pooling_type(pooling)
    bert_config = _read_json(root / "sentence_bert_config.json")
    if isinstance(bert_config, dict) and isinstance(bert_config.get("max_seq_length"), int):
        config.max_seq_length = bert_config["max_seq_length"]
    return config


def _pooling_type(pooling: dict) -> str | None:
    mode = pooling.get("pooling_mode")
    if isinstance(mode, str):  # newer releases name the mode directly
        return {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}.get(mode, mode)
    enabled = [flag for flag in _MODE_FLAGS if pooling.get(flag)]
    if len(enabled) != 1:
        return "+".join(enabled) or None
    return _MODE_FLAGS[enabled[0]] or enabled[0]
