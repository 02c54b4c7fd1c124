"""Teacher-forced logit validation (spec §2), two-way and three-way.

The fp32 HF reference picks the tokens. The target generates greedily from the prompt; at the
first token where it picks differently, that token is still validated, then the target is
re-prompted with the prompt plus the *reference* tokens so far and continues from there. So
every validated position sees exactly the reference context, and a near-tie flip early on does
not cascade into garbage comparisons later.

Per token: shift removal, top-k tolerance checks against fp32, a divergence check in ULPs of the
target dtype, and (three-way) the errors of HF-in-dtype against fp32 as the noise yardstick.
Verdict over all prompts: PASS if all tokens pass the static two-way checks, OR the sigma-ratio
is <= 1.0, OR the per-index Bhattacharyya coefficient is >= 0.99 at every generation index. A
NaN in the target logits always fails.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from ingot.accuracy.metrics import (
    BC_GOOD,
    DEFAULT_TOLERANCE_MAP,
    ErrorStats,
    bhattacharyya,
    error_ratio,
    error_stats,
    remove_shift,
    sigma_ratio,
    topk_errors,
    ulp_tolerance,
)

logger = logging.getLogger("ingot")

# (input_ids, num_tokens) -> (logits [n, V] for the n <= num_tokens positions after input_ids,
# the n tokens the target chose, or None for the argmax of the logits)
GenerateFn = Callable[[list[int], int], tuple[torch.Tensor, list[int] | None]]

DIAGNOSTIC_RATIO = 1.5  # L-inf / L2 ratio above this is reported, never gating


class TokenStatus(StrEnum):
    MATCHED = "matched"
    ACCEPTABLE_DIVERGENCE = "acceptable_divergence"  # a flip within n ULPs: a near-tie
    DIVERGED = "diverged"
    NAN = "nan"


@dataclass
class TokenResult:
    index: int  # generation index (0 = first generated token)
    phase: str  # "prefill" (first token of a run) or "decode"
    reference_token: int
    target_token: int
    status: TokenStatus
    topk: dict[str, dict[str, Any]]
    passed: bool  # two-way: matched or acceptable, and no top-k error
    target: ErrorStats  # target vs fp32
    base: ErrorStats | None = None  # expected (HF in dtype) vs fp32
    linf_ratio: float | None = None
    l2_ratio: float | None = None
    bc: float | None = None
    divergence_gap: float | None = None  # |t[t_top1] - t[ref]| when the argmaxes differ
    divergence_tol: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "reference_token": self.reference_token,
            "target_token": self.target_token,
            "status": self.status.value,
            "passed": self.passed,
            "topk": self.topk,
            "target": self.target.to_dict(),
            "base": self.base.to_dict() if self.base else None,
            "linf_ratio": self.linf_ratio,
            "l2_ratio": self.l2_ratio,
            "bc": self.bc,
            "divergence_gap": self.divergence_gap,
            "divergence_tol": self.divergence_tol,
        }


@dataclass
class PromptResult:
    prompt_ids: list[int]
    reference_tokens: list[int]
    tokens: list[TokenResult]
    calls: int  # generate_fn calls: 1 + number of re-prompts
    run_starts: list[int]  # generation index each call started at
    nan: bool = False
    # Raw errors per token (float32 [V]), kept for cross-prompt aggregation, not serialised.
    target_errors: list[torch.Tensor] = field(default_factory=list, repr=False)
    base_errors: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def passed_two_way(self) -> bool:
        return (
            not self.nan
            and len(self.tokens) == len(self.reference_tokens)
            and all(t.passed for t in self.tokens)
        )

    @property
    def divergence_index(self) -> int | None:
        """First generation index where the target picked a different token than fp32."""
        return next((t.index for t in self.tokens if t.status != TokenStatus.MATCHED), None)

    @property
    def target_tokens(self) -> list[int]:
        return [t.target_token for t in self.tokens]

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids,
            "reference_tokens": self.reference_tokens,
            "target_tokens": self.target_tokens,
            "divergence_index": self.divergence_index,
            "calls": self.calls,
            "run_starts": self.run_starts,
            "nan": self.nan,
            "passed_two_way": self.passed_two_way,
            "tokens": [t.to_dict() for t in self.tokens],
        }


def check_token(
    target_logits: torch.Tensor,
    baseline_logits: torch.Tensor,
    reference_token: int,
    target_token: int | None = None,
    expected_logits: torch.Tensor | None = None,
    tol_map: dict[str, tuple[float, float]] | None = None,
    mantissa_bits: int = 7,
    n_ulps: int = 1,
    index: int = 0,
    phase: str = "decode",
) -> tuple[TokenResult, torch.Tensor, torch.Tensor | None]:
    """Validate one position. Returns the result and the raw errors (target - fp32, and
    expected - fp32 in three-way mode) for aggregation."""
    tgt = target_logits.detach().float().cpu().reshape(-1)
    base = baseline_logits.detach().float().cpu().reshape(-1)
    if target_token is None:
        target_token = int(tgt.argmax()) if not torch.isnan(tgt).any() else -1
    if torch.isnan(tgt).any():
        nan_stats = ErrorStats(math.nan, math.nan, math.nan)
        res = TokenResult(
            index, phase, reference_token, target_token, TokenStatus.NAN, {}, False, nan_stats
        )
        return res, torch.full_like(base, math.nan), None

    # Divergence check on the raw target logits: a flip is acceptable when the two candidates
    # are within n ULPs of the target dtype at their magnitude (a tie the dtype cannot break).
    gap = tol = None
    if target_token == reference_token:
        status = TokenStatus.MATCHED
    else:
        a, b = float(tgt[target_token]), float(tgt[reference_token])
        gap = abs(a - b)
        tol = ulp_tolerance(max(abs(a), abs(b)), mantissa_bits, n_ulps)
        status = TokenStatus.ACCEPTABLE_DIVERGENCE if gap <= tol else TokenStatus.DIVERGED

    shifted = remove_shift(tgt, base)
    topk = topk_errors(shifted, base, tol_map or DEFAULT_TOLERANCE_MAP)
    passed = status != TokenStatus.DIVERGED and all(v["passed"] for v in topk.values())

    # Every error below is measured after removing the shift, on both sides: a uniform logit
    # offset changes no probability, and in bf16 it is most of the raw error (the final norm's
    # rounding moves all logits together), which would drown the signal of real bugs.
    base = base.double()
    finite = torch.isfinite(shifted) & torch.isfinite(base)
    tgt_err = torch.where(finite, shifted - base, torch.zeros_like(base)).float()
    res = TokenResult(
        index, phase, reference_token, target_token, status, topk, passed,
        target=error_stats(base[finite], shifted[finite]), divergence_gap=gap, divergence_tol=tol,
    )  # fmt: skip
    base_err = None
    if expected_logits is not None:
        exp = remove_shift(expected_logits.detach().float().cpu().reshape(-1), base)
        finite_e = finite & torch.isfinite(exp)
        base_err = torch.where(finite_e, exp - base, torch.zeros_like(base)).float()
        res.base = error_stats(base[finite_e], exp[finite_e])
        res.linf_ratio = error_ratio(res.target.linf_rel, res.base.linf_rel)
        res.l2_ratio = error_ratio(res.target.l2_rel, res.base.l2_rel)
        res.bc = bhattacharyya(base_err[finite_e], tgt_err[finite_e])
    return res, tgt_err, base_err


def validate_prompt(
    prompt_ids: Sequence[int],
    generate_fn: GenerateFn,
    baseline_logits: torch.Tensor,
    reference_tokens: Sequence[int] | None = None,
    expected_logits: torch.Tensor | None = None,
    tol_map: dict[str, tuple[float, float]] | None = None,
    mantissa_bits: int = 7,
    n_ulps: int = 1,
) -> PromptResult:
    """The teacher-forcing loop for one prompt over the T positions of ``baseline_logits``."""
    num = baseline_logits.shape[0]
    ref = (
        list(reference_tokens)
        if reference_tokens is not None
        else baseline_logits.argmax(-1).tolist()
    )
    if len(ref) != num:
        raise ValueError(f"{len(ref)} reference tokens for {num} baseline logits rows")
    if expected_logits is not None and expected_logits.shape != baseline_logits.shape:
        raise ValueError(
            f"expected logits {tuple(expected_logits.shape)} and baseline logits "
            f"{tuple(baseline_logits.shape)} differ in shape"
        )
    result = PromptResult(list(prompt_ids), ref, [], 0, [])
    start = 0
    while start < num:
        input_ids = list(prompt_ids) + ref[:start]
        logits, tokens = generate_fn(input_ids, num - start)
        result.calls += 1
        result.run_starts.append(start)
        n = logits.shape[0]
        if n == 0:
            raise RuntimeError(
                f"generate_fn returned no logits for input of {len(input_ids)} tokens"
            )
        if tokens is None:
            tokens = logits.float().argmax(-1).tolist()
        end = min(start + n, num)
        for i in range(start, end):
            token_result, tgt_err, base_err = check_token(
                logits[i - start],
                baseline_logits[i],
                ref[i],
                tokens[i - start],
                None if expected_logits is None else expected_logits[i],
                tol_map,
                mantissa_bits,
                n_ulps,
                index=i,
                phase="prefill" if i == start else "decode",
            )
            result.tokens.append(token_result)
            result.target_errors.append(tgt_err)
            if base_err is not None:
                result.base_errors.append(base_err)
            if token_result.status == TokenStatus.NAN:
                result.nan = True
                logger.warning("NaN in the target logits at generation index %d: stopping", i)
                return result
            if token_result.status != TokenStatus.MATCHED:
                # Validated up to and including the divergence; re-prompt after it.
                end = i + 1
                break
        start = end
    return result


@dataclass
class ValidationResult:
    mode: str  # "three-way" or "two-way"
    prompts: list[PromptResult]
    passed: bool
    criteria: dict[str, bool]  # which of the pass criteria held
    sigma_ratio: float | None
    bc_per_index: list[float]
    diagnostics: dict[str, Any]
    triage: str

    @property
    def bc_min(self) -> float | None:
        return min(self.bc_per_index) if self.bc_per_index else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "passed": self.passed,
            "criteria": self.criteria,
            "sigma_ratio": self.sigma_ratio,
            "bc_min": self.bc_min,
            "bc_per_index": self.bc_per_index,
            "diagnostics": self.diagnostics,
            "triage": self.triage,
            "prompts": [p.to_dict() for p in self.prompts],
        }


def aggregate(prompts: list[PromptResult], three_way: bool) -> ValidationResult:
    """The cross-prompt verdict (spec §2.4)."""
    nan = any(p.nan for p in prompts)
    two_way = all(p.passed_two_way for p in prompts)
    criteria = {"two_way": two_way}
    sigma: float | None = None
    bc_per_index: list[float] = []
    if three_way and not nan:
        tgt_all = torch.cat([e for p in prompts for e in p.target_errors])
        base_all = torch.cat([e for p in prompts for e in p.base_errors])
        sigma = sigma_ratio(base_all, tgt_all)
        longest = max(len(p.tokens) for p in prompts)
        for i in range(longest):
            tgt = [p.target_errors[i] for p in prompts if i < len(p.target_errors)]
            base = [p.base_errors[i] for p in prompts if i < len(p.base_errors)]
            bc_per_index.append(bhattacharyya(torch.cat(base), torch.cat(tgt)))
        criteria["sigma"] = sigma <= 1.0
        criteria["bc"] = min(bc_per_index) >= BC_GOOD
    passed = not nan and any(criteria.values())

    tokens = [t for p in prompts for t in p.tokens]
    worst_linf = max((t.linf_ratio for t in tokens if t.linf_ratio is not None), default=None)
    worst_l2 = max((t.l2_ratio for t in tokens if t.l2_ratio is not None), default=None)
    diagnostics = {
        "worst_linf_ratio": worst_linf,
        "worst_l2_ratio": worst_l2,
        "ratio_limit": DIAGNOSTIC_RATIO,
        "ratios_ok": None
        if worst_l2 is None
        else bool(worst_l2 < DIAGNOSTIC_RATIO and worst_linf < DIAGNOSTIC_RATIO),
        "worst_target_linf_rel": max((t.target.linf_rel for t in tokens), default=None),
        "worst_target_l2_rel": max((t.target.l2_rel for t in tokens), default=None),
        "worst_topk": _worst_topk(tokens),
        "num_tokens": len(tokens),
        "num_failed_tokens": sum(not t.passed for t in tokens),
        "divergence_indices": [p.divergence_index for p in prompts],
    }
    return ValidationResult(
        mode="three-way" if three_way else "two-way",
        prompts=prompts,
        passed=passed,
        criteria=criteria,
        sigma_ratio=sigma,
        bc_per_index=bc_per_index,
        diagnostics=diagnostics,
        triage=_triage(prompts, passed, nan, worst_l2),
    )


def _worst_topk(tokens: list[TokenResult]) -> dict[str, float]:
    worst: dict[str, float] = {}
    for t in tokens:
        for k, v in t.topk.items():
            worst[k] = max(worst.get(k, -math.inf), v["error"])
    return worst


def _triage(prompts: list[PromptResult], passed: bool, nan: bool, worst_l2: float | None) -> str:
    """The spec's triage rules, in words."""
    if nan:
        return "NaN in the target logits: fix that first"
    failed = [t for p in prompts for t in p.tokens if not t.passed]
    if passed and not failed:
        return "all tokens pass the static thresholds"
    if passed:
        return "failures are within the noise of the dtype (sigma-ratio or BC criterion)"
    first_tokens = [t for t in failed if t.index == 0]
    decode_only = failed and all(t.phase == "decode" for t in failed)
    if first_tokens:
        hint = "token 0 fails: a prefill (or model) bug"
    elif decode_only:
        hint = "only decode-step tokens fail: a decode or KV-write bug"
    else:
        hint = "later prefill tokens fail: a position-dependent bug (RoPE, masking, long context)"
    if worst_l2 is not None and worst_l2 > 3.0:
        hint += "; error ratio >> 1: a real bug, run tensor compare to find the first bad module"
    return hint


def logit_validation(
    prompts_ids: Sequence[Sequence[int]],
    generate_fn: Callable[[int], GenerateFn] | GenerateFn,
    baseline_logits: Sequence[torch.Tensor],
    reference_tokens: Sequence[Sequence[int]] | None = None,
    expected_logits: Sequence[torch.Tensor] | None = None,
    tol_map: dict[str, tuple[float, float]] | None = None,
    mantissa_bits: int = 7,
    n_ulps: int = 1,
    per_prompt_fn: bool = False,
    progress: bool = False,
) -> ValidationResult:
    """Validate several prompts and aggregate. Three-way when ``expected_logits`` is given.

    ``generate_fn`` is a GenerateFn, or with ``per_prompt_fn=True`` a factory
    ``prompt_index -> GenerateFn`` (so a target can stop early at the prompt's reference).
    """
    from tqdm.auto import tqdm

    results = []
    for i in tqdm(range(len(prompts_ids)), desc="validating prompts", disable=not progress):
        fn = generate_fn(i) if per_prompt_fn else generate_fn  # type: ignore[call-arg]
        results.append(
            validate_prompt(
                prompts_ids[i],
                fn,  # type: ignore[arg-type]
                baseline_logits[i],
                None if reference_tokens is None else reference_tokens[i],
                None if expected_logits is None else expected_logits[i],
                tol_map,
                mantissa_bits,
                n_ulps,
            )
        )
    return aggregate(results, three_way=expected_logits is not None)
