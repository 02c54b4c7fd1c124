"""Error metrics shared by logit validation, tensor compare and KV analysis (spec §0).

Everything here is a pure function of tensors. Computations run in float64 so that the metric
itself never adds noise comparable to the bf16 errors it measures.

Roles (three-way mode): *baseline* = HF fp32 (ground truth), *expected* = HF in the engine's
dtype (the error that dtype alone causes), *target* = ingot. Base errors are expected - baseline,
target errors are target - baseline.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

# k -> (atol, rtol). The order is (atol, rtol) as in the original's logit tol_map.
DEFAULT_TOLERANCE_MAP: dict[str, tuple[float, float]] = {
    "5": (1e-5, 0.011),
    "50": (1e-5, 0.02),
    "1000": (1e-5, 0.03),
    "all": (1e-5, 0.05),
}
# An fp32 engine should agree with fp32 HF far better than bf16 noise (spec §2 test (a)).
FP32_TOLERANCE_MAP: dict[str, tuple[float, float]] = {
    k: (1e-5, 1e-4) for k in DEFAULT_TOLERANCE_MAP
}

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}

BC_BINS = 100
BC_GOOD = 0.99  # >= good, 0.95-0.99 marginal, < 0.95 likely a bug


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64).reshape(-1)


def error_ratio(target_error: float, base_error: float) -> float:
    """target / base, defined where the base error is zero: equal zeros are a ratio of 1 (the
    target is exactly as good as the dtype allows), a non-zero target over a zero base is inf."""
    if math.isnan(target_error) or math.isnan(base_error):
        return math.nan
    if base_error == 0.0:
        return 1.0 if target_error == 0.0 else math.inf
    return target_error / base_error


def linf_rel(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """max|actual - reference| / max|reference| (0 for equal tensors, inf for a zero reference
    with a non-zero difference)."""
    ref, act = _f64(reference), _f64(actual)
    if ref.numel() == 0:
        return 0.0
    return _relative(float((act - ref).abs().max()), float(ref.abs().max()))


def l2_rel(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """||actual - reference||_2 / ||reference||_2."""
    ref, act = _f64(reference), _f64(actual)
    if ref.numel() == 0:
        return 0.0
    return _relative(
        float(torch.linalg.vector_norm(act - ref)), float(torch.linalg.vector_norm(ref))
    )


def _relative(error: float, scale: float) -> float:
    """error / scale; no error is 0 whatever the scale, an error against a zero scale is inf."""
    if math.isnan(error) or math.isnan(scale):
        return math.nan
    if error == 0.0:
        return 0.0
    return math.inf if scale == 0.0 else error / scale


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors; 1.0 when both are zero."""
    x, y = _f64(a), _f64(b)
    nx, ny = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y))
    if nx == 0.0 and ny == 0.0:
        return 1.0
    if nx == 0.0 or ny == 0.0:
        return 0.0
    return float(torch.dot(x, y)) / (nx * ny)


def rms(values: torch.Tensor) -> float:
    v = _f64(values)
    return float(v.pow(2).mean().sqrt()) if v.numel() else 0.0


def sigma_ratio(base_errors: torch.Tensor, target_errors: torch.Tensor) -> float:
    """RMS(target errors) / RMS(base errors), over the pooled errors.

    <= 1.0 means the target is no noisier than the dtype alone. Edge cases (spec): both zero ->
    1.0; zero base with a non-zero target -> inf; NaN anywhere -> nan (which never passes).
    """
    return error_ratio(rms(target_errors), rms(base_errors))


def bhattacharyya(
    base_errors: torch.Tensor | np.ndarray,
    target_errors: torch.Tensor | np.ndarray,
    bins: int = BC_BINS,
) -> float:
    """Bhattacharyya coefficient of the histograms of |base errors| and |target errors|.

    ``bins`` bins over the shared [min, max] range of both, each histogram normalised to sum 1,
    BC = sum sqrt(p_i q_i), clipped to [0, 1]. 1.0 = same error distribution.

    Edge cases: when every value of both arrays is equal (all-zero errors included) the range is
    empty and np.histogram cannot bin it: both distributions are the same point mass, BC = 1.
    A NaN or inf error cannot look like noise: BC = 0.
    """
    a = np.abs(np.asarray(_as_numpy(base_errors), dtype=np.float64).reshape(-1))
    b = np.abs(np.asarray(_as_numpy(target_errors), dtype=np.float64).reshape(-1))
    if a.size == 0 or b.size == 0:
        raise ValueError("bhattacharyya needs at least one error value on each side")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return 0.0
    lo = min(a.min(), b.min())
    hi = max(a.max(), b.max())
    if hi <= lo:
        return 1.0
    p, _ = np.histogram(a, bins=bins, range=(lo, hi))
    q, _ = np.histogram(b, bins=bins, range=(lo, hi))
    bc = float(np.sum(np.sqrt((p / a.size) * (q / b.size))))
    return min(max(bc, 0.0), 1.0)


def _as_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64).numpy()
    return x


def remove_shift(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Subtract the constant offset of a least-squares fit actual ~ slope * expected + shift.

    Logits are defined up to a constant (softmax is shift invariant), so a uniform offset is
    not an error; only the shift is removed, never the slope. Only finite entries enter the fit.
    """
    act, exp = actual.detach().double().cpu(), expected.detach().double().cpu()
    mask = torch.isfinite(act) & torch.isfinite(exp)
    if not bool(mask.any()):
        return act
    x, y = exp[mask], act[mask]
    var = float(((x - x.mean()) ** 2).mean())
    if var == 0.0:
        shift = float((y - x).mean())  # no slope to fit against a constant: align the means
    else:
        slope = float(((x - x.mean()) * (y - y.mean())).mean()) / var
        shift = float(y.mean()) - slope * float(x.mean())
    return act - shift


def allclose_error(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> float:
    """Neuron-style allclose error: max((|a - e| - atol) / max|e|); pass when <= rtol.

    The denominator is the global max of the expected values, not each element's magnitude.
    """
    act, exp = _f64(actual), _f64(expected)
    if exp.numel() == 0:
        return -math.inf
    denom = float(exp.abs().max())
    excess = float(((act - exp).abs() - atol).max())
    if denom == 0.0:
        return -math.inf if excess <= 0 else math.inf
    return excess / denom


def topk_errors(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol_map: dict[str, tuple[float, float]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per k of ``tol_map``: allclose error of ``actual`` on the top-k indices of ``expected``.

    ``actual`` should already have its shift removed. -inf (masked) entries on either side are
    dropped first. Returns {k: {"error", "atol", "rtol", "passed"}}.
    """
    tol_map = tol_map or DEFAULT_TOLERANCE_MAP
    act, exp = (
        actual.detach().double().cpu().reshape(-1),
        expected.detach().double().cpu().reshape(-1),
    )
    keep = torch.isfinite(act) & torch.isfinite(exp)
    act, exp = act[keep], exp[keep]
    out: dict[str, dict[str, Any]] = {}
    for key, (atol, rtol) in tol_map.items():
        if key == "all":
            idx = torch.arange(exp.numel())
        else:
            idx = torch.topk(exp, min(int(key), exp.numel())).indices
        err = allclose_error(act[idx], exp[idx], atol)
        out[key] = {"error": err, "atol": atol, "rtol": rtol, "passed": bool(err <= rtol)}
    return out


def ulp_tolerance(magnitude: float, mantissa_bits: int, n_ulps: int = 1) -> float:
    """n_ulps units in the last place at ``magnitude``: n * 2^(floor(log2 |m|) - mantissa_bits).

    One bf16 step at a logit of 19 is 2^(4-7) = 0.125.
    """
    magnitude = abs(magnitude)
    if magnitude == 0.0 or not math.isfinite(magnitude):
        return 0.0 if magnitude == 0.0 else math.inf
    return n_ulps * 2.0 ** (math.floor(math.log2(magnitude)) - mantissa_bits)


def mantissa_bits_of(dtype: torch.dtype) -> int:
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"no mantissa width known for {dtype}; use float32, bfloat16 or float16")
    return MANTISSA_BITS[dtype]


@dataclass
class ErrorStats:
    linf_rel: float
    l2_rel: float
    max_abs: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def error_stats(reference: torch.Tensor, actual: torch.Tensor) -> ErrorStats:
    ref, act = _f64(reference), _f64(actual)
    max_abs = float((act - ref).abs().max()) if ref.numel() else 0.0
    return ErrorStats(linf_rel(ref, act), l2_rel(ref, act), max_abs)


@dataclass
class ThreeWay:
    """Target and base errors against the fp32 baseline, their ratios, BC and sigma-ratio."""

    target: ErrorStats
    base: ErrorStats
    linf_ratio: float
    l2_ratio: float
    bc: float
    sigma_ratio: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return d


def three_way(baseline: torch.Tensor, expected: torch.Tensor, target: torch.Tensor) -> ThreeWay:
    base_err = _f64(expected) - _f64(baseline)
    tgt_err = _f64(target) - _f64(baseline)
    tgt = error_stats(baseline, target)
    base = error_stats(baseline, expected)
    return ThreeWay(
        target=tgt,
        base=base,
        linf_ratio=error_ratio(tgt.linf_rel, base.linf_rel),
        l2_ratio=error_ratio(tgt.l2_rel, base.l2_rel),
        bc=bhattacharyya(base_err, tgt_err),
        sigma_ratio=sigma_ratio(base_err, tgt_err),
    )


@dataclass
class GateResult:
    """Module-test verdict (spec §7): PASS if (BC >= bc_threshold OR sigma <= 1) AND worst
    L-inf ratio < max_linf_ratio AND worst L2 ratio < max_l2_ratio."""

    passed: bool
    bc: float
    sigma_ratio: float
    worst_linf_ratio: float
    worst_l2_ratio: float
    two_way_max_error: float  # logged, never gating

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def module_gate(
    baselines: list[torch.Tensor] | torch.Tensor,
    expecteds: list[torch.Tensor] | torch.Tensor,
    targets: list[torch.Tensor] | torch.Tensor,
    bc_threshold: float = BC_GOOD,
    max_linf_ratio: float = 5.0,
    max_l2_ratio: float = 3.0,
) -> GateResult:
    """Three-way gate for a module test; lists (one tensor per seeded input) are pooled for BC
    and sigma, and the worst ratio over the inputs gates."""
    if isinstance(baselines, torch.Tensor):
        baselines, expecteds, targets = [baselines], [expecteds], [targets]  # type: ignore[list-item]
    if not (len(baselines) == len(expecteds) == len(targets)) or not baselines:
        raise ValueError("module_gate needs the same non-zero number of baseline/expected/target")
    base_err = torch.cat([_f64(e) - _f64(b) for b, e in zip(baselines, expecteds, strict=True)])
    tgt_err = torch.cat([_f64(t) - _f64(b) for b, t in zip(baselines, targets, strict=True)])
    per_input = [three_way(b, e, t) for b, e, t in zip(baselines, expecteds, targets, strict=True)]
    worst_linf = max(r.linf_ratio for r in per_input)
    worst_l2 = max(r.l2_ratio for r in per_input)
    bc = bhattacharyya(base_err, tgt_err)
    sigma = sigma_ratio(base_err, tgt_err)
    two_way = max(allclose_error(t, b, 1e-2) for b, t in zip(baselines, targets, strict=True))
    passed = (
        (bc >= bc_threshold or sigma <= 1.0)
        and worst_linf < max_linf_ratio
        and worst_l2 < max_l2_ratio
    )
    return GateResult(bool(passed), bc, sigma, worst_linf, worst_l2, two_way)
