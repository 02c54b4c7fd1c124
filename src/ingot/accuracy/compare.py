"""Tensor compare: align ingot captures with HF captures module by module (spec §5).

Rows are aligned by absolute position. The HF reference is captured as one forward over the
whole reference sequence (every position at once), so an ingot prefill row or decode row at
position p compares with HF's row p. Only positions whose whole context agrees with the
reference are compared: from the first position where ingot was fed a different token (after a
divergence in its own generation) nothing is comparable any more.

Three-way (an ``expected`` capture, HF in the engine's dtype): per module and phase, errors of
ingot and of HF-in-dtype against HF fp32, their ratios and BC; a module fails when its L2 ratio
reaches ``max_l2_ratio`` (3.0) or the shapes disagree. Two-way: a module fails when its
relative L2 error against fp32 exceeds ``max_l2_rel``. The first failing module in execution
order is where the error enters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ingot.accuracy.capture import Capture, load_capture
from ingot.accuracy.jsonio import write_json
from ingot.accuracy.metrics import ErrorStats, bhattacharyya, error_ratio, error_stats

MAX_L2_RATIO = 3.0
MAX_L2_REL_TWO_WAY = 1e-2  # "full model ~0.01" static threshold


@dataclass
class PhaseComparison:
    phase: str
    num_rows: int
    shapes_match: bool
    target_shape: list[int]
    reference_shape: list[int]
    target: ErrorStats | None
    base: ErrorStats | None
    linf_ratio: float | None
    l2_ratio: float | None
    bc: float | None
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["target"] = self.target.to_dict() if self.target else None
        d["base"] = self.base.to_dict() if self.base else None
        return d


@dataclass
class ModuleComparison:
    name: str
    phases: dict[str, PhaseComparison] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "phases": {k: v.to_dict() for k, v in self.phases.items()},
        }


@dataclass
class CompareReport:
    mode: str  # "three-way" | "two-way"
    modules: list[ModuleComparison]
    request_id: str
    compared_positions: int
    first_mismatch_position: int | None  # where ingot's fed tokens leave the reference
    only_in_target: list[str]
    only_in_reference: list[str]
    thresholds: dict[str, float]

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.modules)

    @property
    def first_failure(self) -> ModuleComparison | None:
        return next((m for m in self.modules if not m.passed), None)

    def module(self, name: str) -> ModuleComparison:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_failure
        return {
            "mode": self.mode,
            "passed": self.passed,
            "first_failure": first.name if first else None,
            "first_failure_phases": [p for p, c in first.phases.items() if not c.passed]
            if first
            else [],
            "request_id": self.request_id,
            "compared_positions": self.compared_positions,
            "first_mismatch_position": self.first_mismatch_position,
            "only_in_target": self.only_in_target,
            "only_in_reference": self.only_in_reference,
            "thresholds": self.thresholds,
            "modules": [m.to_dict() for m in self.modules],
        }

    def write_json(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    def table(self, only_failures_after_first: bool = False, max_rows: int | None = None) -> str:
        """A markdown table, one row per module and phase."""
        three = self.mode == "three-way"
        head = ["module", "phase", "rows", "tgt l2", "tgt linf"]
        head += ["base l2", "l2 ratio", "linf ratio", "BC"] if three else []
        head.append("verdict")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        first = self.first_failure
        rows = 0
        for m in self.modules:
            for phase, c in m.phases.items():
                cells = [m.name, phase, str(c.num_rows)]
                if not c.shapes_match:
                    cells += ["shape " + str(c.target_shape) + " vs " + str(c.reference_shape)]
                    cells += [""] * (len(head) - 5)
                else:
                    cells += [_fmt(c.target.l2_rel), _fmt(c.target.linf_rel)]  # type: ignore[union-attr]
                    if three:
                        cells += [
                            _fmt(c.base.l2_rel),  # type: ignore[union-attr]
                            _fmt(c.l2_ratio),
                            _fmt(c.linf_ratio),
                            _fmt(c.bc),
                        ]
                verdict = "ok" if c.passed else "FAIL"
                if first is m and not c.passed:
                    verdict = "FAIL (first)"
                cells.append(verdict)
                lines.append("| " + " | ".join(cells) + " |")
                rows += 1
            if max_rows is not None and rows >= max_rows:
                lines.append(f"| ... {len(self.modules)} modules in all | |")
                break
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3g}"


def _rows_by_position(
    cap: Capture, request_id: str | None
) -> dict[str, dict[int, tuple[int, int]]]:
    """phase -> position -> (step index in cap.steps, row) for one request."""
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for si, step in enumerate(cap.steps):
        req_ids = step.meta.get("req_ids") or []
        for row, pos in enumerate(step.positions):
            if request_id is not None and req_ids and req_ids[row] != request_id:
                continue
            out.setdefault(step.phase, {})[pos] = (si, row)
    return out


def _tokens_by_position(cap: Capture, request_id: str | None) -> dict[int, int]:
    tokens: dict[int, int] = {}
    for step in cap.steps:
        req_ids = step.meta.get("req_ids") or []
        for row, pos in enumerate(step.positions):
            if request_id is not None and req_ids and req_ids[row] != request_id:
                continue
            tokens[pos] = step.meta["input_ids"][row]
    return tokens


class _Loader:
    """Caches loaded tensors (a step file is read once even when many rows come from it)."""

    def __init__(self, cap: Capture) -> None:
        self.cap = cap
        self.cache: dict[tuple[int, str], torch.Tensor] = {}

    def rows(self, name: str, where: list[tuple[int, int]]) -> torch.Tensor | None:
        out = []
        for si, row in where:
            key = (si, name)
            if key not in self.cache:
                step = self.cap.steps[si]
                if name not in step.meta["modules"]:
                    return None
                self.cache[key] = step.tensor(name).float()
            out.append(self.cache[key][row])
        return torch.stack(out) if out else None


def compare_captures(
    baseline: str | Path | Capture,
    target: str | Path | Capture,
    expected: str | Path | Capture | None = None,
    request_id: str | None = None,
    max_l2_ratio: float = MAX_L2_RATIO,
    max_l2_rel: float = MAX_L2_REL_TWO_WAY,
    modules: list[str] | None = None,
) -> CompareReport:
    """Compare a target (ingot) capture with a baseline (HF fp32) capture, and an optional
    expected (HF in the engine dtype) capture for three-way mode."""
    base_cap = baseline if isinstance(baseline, Capture) else load_capture(baseline)
    tgt_cap = target if isinstance(target, Capture) else load_capture(target)
    exp_cap = None
    if expected is not None:
        exp_cap = expected if isinstance(expected, Capture) else load_capture(expected)
    if request_id is None:
        first = next((s for s in tgt_cap.steps if s.meta.get("req_ids")), None)
        request_id = first.meta["req_ids"][0] if first else "?"

    ref_tokens = _tokens_by_position(base_cap, None)
    tgt_tokens = _tokens_by_position(tgt_cap, request_id)
    mismatch = next((p for p in sorted(tgt_tokens) if ref_tokens.get(p) != tgt_tokens[p]), None)
    tgt_rows = _rows_by_position(tgt_cap, request_id)
    ref_rows = {}
    for rows in _rows_by_position(base_cap, None).values():
        ref_rows.update(rows)
    exp_rows: dict[int, tuple[int, int]] = {}
    if exp_cap is not None:
        for rows in _rows_by_position(exp_cap, None).values():
            exp_rows.update(rows)

    tgt_names = modules or tgt_cap.modules
    ref_names = set(base_cap.modules)
    names = [n for n in tgt_names if n in ref_names and (exp_cap is None or n in exp_cap.modules)]
    only_t = [n for n in tgt_names if n not in ref_names]
    only_r = [n for n in base_cap.modules if n not in set(tgt_names)]

    base_l, tgt_l = _Loader(base_cap), _Loader(tgt_cap)
    exp_l = _Loader(exp_cap) if exp_cap is not None else None
    compared: set[int] = set()
    results: list[ModuleComparison] = []
    for name in names:
        mc = ModuleComparison(name)
        for phase in ("prefill", "decode"):
            by_pos = tgt_rows.get(phase, {})
            positions = [
                p for p in sorted(by_pos)
                if (mismatch is None or p < mismatch) and p in ref_rows
                and (exp_cap is None or p in exp_rows)
            ]  # fmt: skip
            if not positions:
                continue
            t = tgt_l.rows(name, [by_pos[p] for p in positions])
            b = base_l.rows(name, [ref_rows[p] for p in positions])
            e = exp_l.rows(name, [exp_rows[p] for p in positions]) if exp_l else None
            if t is None or b is None or (exp_l is not None and e is None):
                continue  # the module was not captured in these steps
            compared.update(positions)
            mc.phases[phase] = _compare_rows(phase, t, b, e, max_l2_ratio, max_l2_rel)
        if mc.phases:
            results.append(mc)
    return CompareReport(
        mode="three-way" if exp_cap is not None else "two-way",
        modules=results,
        request_id=request_id,
        compared_positions=len(compared),
        first_mismatch_position=mismatch,
        only_in_target=only_t,
        only_in_reference=only_r,
        thresholds={"max_l2_ratio": max_l2_ratio, "max_l2_rel_two_way": max_l2_rel},
    )


def _compare_rows(
    phase: str,
    target: torch.Tensor,
    baseline: torch.Tensor,
    expected: torch.Tensor | None,
    max_l2_ratio: float,
    max_l2_rel: float,
) -> PhaseComparison:
    shapes = [list(target.shape), list(baseline.shape)]
    same = target.shape == baseline.shape and (expected is None or expected.shape == baseline.shape)
    if not same:
        return PhaseComparison(
            phase, target.shape[0], False, shapes[0], shapes[1], None, None, None, None, None, False
        )
    tgt = error_stats(baseline, target)
    if expected is None:
        passed = tgt.l2_rel <= max_l2_rel
        return PhaseComparison(
            phase, target.shape[0], True, shapes[0], shapes[1], tgt, None, None, None, None, passed
        )
    base = error_stats(baseline, expected)
    l2_ratio = error_ratio(tgt.l2_rel, base.l2_rel)
    linf_ratio = error_ratio(tgt.linf_rel, base.linf_rel)
    bc = bhattacharyya(expected.double() - baseline.double(), target.double() - baseline.double())
    passed = l2_ratio < max_l2_ratio
    return PhaseComparison(
        phase, target.shape[0], True, shapes[0], shapes[1], tgt, base, linf_ratio, l2_ratio, bc,
        passed,
    )  # fmt: skip
