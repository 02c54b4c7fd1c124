"""Accuracy toolkit: logit validation against HF transformers, tensor capture / compare /
replacement, KV cache analysis, and ``ingot validate``. See docs/accuracy.md."""

from ingot.accuracy.capture import (
    DEFAULT_PATTERNS,
    Capture,
    TensorCapture,
    capture_hf,
    capture_ingot,
    expand_patterns,
    load_capture,
)
from ingot.accuracy.compare import CompareReport, compare_captures
from ingot.accuracy.ingot_runner import IngotRunner
from ingot.accuracy.kv_analysis import compare_kv, gather_paged_kv, ingot_request_kv
from ingot.accuracy.logit_validation import (
    TokenStatus,
    ValidationResult,
    check_token,
    logit_validation,
    validate_prompt,
)
from ingot.accuracy.metrics import (
    DEFAULT_TOLERANCE_MAP,
    bhattacharyya,
    l2_rel,
    linf_rel,
    module_gate,
    sigma_ratio,
    three_way,
)
from ingot.accuracy.reference import HFReference, load_hf_model
from ingot.accuracy.replace import TensorReplacer, replace_modules
from ingot.accuracy.validate import ValidateReport, run_validation

__all__ = [
    "DEFAULT_PATTERNS",
    "DEFAULT_TOLERANCE_MAP",
    "Capture",
    "CompareReport",
    "HFReference",
    "IngotRunner",
    "TensorCapture",
    "TensorReplacer",
    "TokenStatus",
    "ValidateReport",
    "ValidationResult",
    "bhattacharyya",
    "capture_hf",
    "capture_ingot",
    "check_token",
    "compare_captures",
    "compare_kv",
    "expand_patterns",
    "gather_paged_kv",
    "ingot_request_kv",
    "l2_rel",
    "linf_rel",
    "load_capture",
    "load_hf_model",
    "logit_validation",
    "module_gate",
    "replace_modules",
    "run_validation",
    "sigma_ratio",
    "three_way",
    "validate_prompt",
]
