"""The compile cache key (spec section 8): what makes two compiled graphs interchangeable.

The key is an MD5 (32 hex chars; a content address, not a security boundary) over a canonical
JSON document holding the graph code, each input's shape/dtype/stride, the compiler options, the
platform target, the parallel layout and the versions of the toolchain that produced the
artifact. Device *indices* are normalised (``cuda:1`` -> ``cuda:0``) so that every rank of a
tensor-parallel group shares one entry; device *types* are kept.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

#: Bumped when the key document changes shape, so old entries stop matching.
KEY_FORMAT = 1

_INDEXED_DEVICE = re.compile(r"\b([a-z][a-z0-9_]*):\d+\b")
_DEVICE_REPR = re.compile(r"(device\(type='[a-z0-9_]+', index=)\d+\)")
_DEVICE_TYPES = (
    "cpu", "cuda", "xpu", "mps", "meta", "hpu", "npu", "xla", "neuron", "privateuseone", "mtia",
)


def normalize_device_indices(text: str) -> str:
    """``cuda:3`` -> ``cuda:0`` and ``device(type='cuda', index=3)`` -> ``index=0``."""
    text = _DEVICE_REPR.sub(r"\g<1>0)", text)
    return _INDEXED_DEVICE.sub(
        lambda m: f"{m.group(1)}:0" if m.group(1) in _DEVICE_TYPES else m.group(0), text)


def _canonical(value: Any) -> Any:
    """A JSON-able, order-independent form of an option value."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, PurePath):
        return str(value)
    return repr(value)  # torch.device, torch.dtype, enums: their repr is stable


def _dtype_name(dtype: Any) -> str:
    name = str(dtype)
    return name if name.startswith("torch.") else f"torch.{name}"


def _input_meta(spec: Any) -> list[Any]:
    """``[shape, dtype, stride, device_type]`` of a tensor or a ``(shape, dtype, stride)``."""
    if hasattr(spec, "shape") and hasattr(spec, "stride") and hasattr(spec, "dtype"):
        return [list(spec.shape), _dtype_name(spec.dtype), list(spec.stride()),
                spec.device.type]
    if isinstance(spec, (int, float, bool)):  # a scalar input specialised into the graph
        return ["scalar", repr(spec)]
    shape, dtype, stride = spec[:3]
    device = str(spec[3]).split(":")[0] if len(spec) > 3 else None
    return [list(shape), _dtype_name(dtype), list(stride), device]


def toolchain_versions() -> dict[str, str]:
    """Versions whose change invalidates compiled artifacts."""
    import torch

    import ingot.version

    return {
        "torch": torch.__version__,
        "ingot": ingot.version.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def compute_cache_key(
    graph_code: str,
    inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    platform: str = "cpu",
    parallel_layout: Mapping[str, Any] | None = None,
) -> str:
    """The 32-hex MD5 cache key of a graph compiled for one bucket.

    Args:
        graph_code: the graph's Python code (``gm.code`` after the FX passes). Weights must be
            graph inputs (Dynamo lifts them), not constants baked into the code.
        inputs: example tensors, or ``(shape, dtype, stride[, device])`` tuples, in input order.
        options: compiler options (order-independent; values are canonicalised).
        platform: the compile target, e.g. ``"cpu"`` or ``"cuda:sm90"``.
        parallel_layout: tensor-parallel degree, rank groups, ... (ranks are kept as they are).
    """
    document = {
        "format": KEY_FORMAT,
        "graph": graph_code,
        "inputs": [_input_meta(i) for i in inputs],
        "options": _canonical(options or {}),
        "platform": platform,
        "parallel_layout": _canonical(parallel_layout or {}),
        "versions": toolchain_versions(),
    }
    text = normalize_device_indices(json.dumps(document, sort_keys=True))
    return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()
