"""The validate report: ``validation.json`` (everything), ``summary.md`` (for people) and
``logit_errors.png`` (per-position errors of every prompt), plus the short console table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingot.accuracy.compare import CompareReport
from ingot.accuracy.jsonio import write_json
from ingot.accuracy.kv_analysis import LayerKV
from ingot.accuracy.logit_validation import ValidationResult
from ingot.accuracy.metrics import BC_GOOD
from ingot.accuracy.reference import ReferenceRun

Prompt = str | list[int]


@dataclass
class ValidateReport:
    model: str
    dtype: str
    hf_overrides: dict[str, Any]
    prompts: list[Prompt]
    max_tokens: int
    validation: ValidationResult
    references: list[ReferenceRun] = field(repr=False)
    kv: list[LayerKV] | None = None
    compare: CompareReport | None = None
    compare_prompt: int | None = None
    report_dir: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.validation.passed

    @property
    def first_diverging_module(self) -> str | None:
        first = self.compare.first_failure if self.compare else None
        return first.name if first else None

    def to_dict(self) -> dict[str, Any]:
        v = self.validation
        return {
            "passed": self.passed,
            "model": self.model,
            "dtype": self.dtype,
            "hf_overrides": self.hf_overrides,
            "max_tokens": self.max_tokens,
            "prompts": [p if isinstance(p, str) else {"prompt_token_ids": p} for p in self.prompts],
            "validation": v.to_dict(),
            "first_diverging_module": self.first_diverging_module,
            "compare_prompt": self.compare_prompt,
            "tensor_compare": None
            if self.compare is None
            else {k: val for k, val in self.compare.to_dict().items() if k != "modules"},
            "kv_analysis": None if self.kv is None else [layer.to_dict() for layer in self.kv],
            "timings_s": self.timings,
        }


def _f(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return f"{x:.{digits}g}"


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "no")


def verdict_table(report: ValidateReport) -> str:
    """The short console summary: one line per prompt, the criteria and the verdict."""
    v = report.validation
    lines = [
        f"ingot validate: {Path(report.model).name} ({report.dtype}), {len(report.prompts)} "
        f"prompts x {report.max_tokens} tokens, {v.mode}"
        + (f", hf_overrides {report.hf_overrides}" if report.hf_overrides else ""),
        "",
        f"{'prompt':>6} {'tokens':>6} {'diverged@':>9} {'calls':>5} {'tgt l2':>9} "
        f"{'base l2':>9} {'l2 ratio':>9} {'BC min':>7} {'two-way':>7}",
    ]
    for i, p in enumerate(v.prompts):
        tgt = max((t.target.l2_rel for t in p.tokens), default=None)
        base = max((t.base.l2_rel for t in p.tokens if t.base), default=None)
        ratio = max((t.l2_ratio for t in p.tokens if t.l2_ratio is not None), default=None)
        bc = min((t.bc for t in p.tokens if t.bc is not None), default=None)
        div = p.divergence_index
        lines.append(
            f"{i:>6} {len(p.tokens):>6} {'-' if div is None else div:>9} {p.calls:>5} "
            f"{_f(tgt):>9} {_f(base):>9} {_f(ratio):>9} {_f(bc):>7} {_yes(p.passed_two_way):>7}"
        )
    lines.append("")
    crit = v.criteria
    worst = v.diagnostics.get("worst_topk", {})
    lines.append(
        "two-way static thresholds: "
        + _yes(crit.get("two_way"))
        + " (worst "
        + ", ".join(f"K{k}={_f(e)}" for k, e in worst.items())
        + ")"
    )
    if v.mode == "three-way":
        lines.append(f"sigma-ratio {_f(v.sigma_ratio)} (<= 1.0: {_yes(crit.get('sigma'))})")
        lines.append(
            f"BC min over indices {_f(v.bc_min, 4)} (>= {BC_GOOD}: {_yes(crit.get('bc'))})"
        )
    lines.append(f"triage: {v.triage}")
    if report.compare is not None:
        first = report.compare.first_failure
        if first is None:
            lines.append("tensor compare: every module within its threshold")
        else:
            detail = ", ".join(
                f"{ph} l2 ratio {_f(c.l2_ratio)}"
                if c.l2_ratio is not None
                else f"{ph} l2 {_f(c.target.l2_rel) if c.target else 'shape mismatch'}"
                for ph, c in first.phases.items()
                if not c.passed
            )
            lines.append(f"first diverging module: {first.name} ({detail})")
    lines.append(f"VERDICT: {'PASS' if report.passed else 'FAIL'}")
    if report.report_dir is not None:
        lines.append(f"report: {report.report_dir}")
    return "\n".join(lines)


def write_report(report: ValidateReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "validation.json", report.to_dict())
    plot = out / "logit_errors.png"
    plot_errors(report, plot)
    (out / "summary.md").write_text(_markdown(report, plot.name))


def plot_errors(report: ValidateReport, path: Path) -> None:
    """Two panels over the generation index. Left: relative L2 error of the logits against
    fp32, ingot per prompt (thin) and its mean (bold), HF in the engine dtype dashed; failing
    tokens crossed. Right: the gating statistic per index (three-way: BC with its 0.99 line;
    two-way: worst top-k error over its tolerance, 1 = the limit)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must come before pyplot is imported
    import matplotlib.pyplot as plt

    v = report.validation
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    longest = max((len(p.tokens) for p in v.prompts), default=0)
    idx = list(range(longest))

    def mean_at(values: list[list[float]]) -> list[float]:
        out = []
        for i in idx:
            col = [row[i] for row in values if i < len(row) and math.isfinite(row[i])]
            out.append(sum(col) / len(col) if col else math.nan)
        return out

    tgt_rows, base_rows = [], []
    for p in v.prompts:
        tgt = [t.target.l2_rel if math.isfinite(t.target.l2_rel) else 1.0 for t in p.tokens]
        tgt_rows.append(tgt)
        ax.plot([t.index for t in p.tokens], tgt, color="tab:blue", alpha=0.25, linewidth=0.8)
        if all(t.base is not None for t in p.tokens):
            base_rows.append([t.base.l2_rel for t in p.tokens])  # type: ignore[union-attr]
        bad = [(t.index, y) for t, y in zip(p.tokens, tgt, strict=True) if not t.passed]
        if bad:
            ax.scatter(*zip(*bad, strict=True), marker="x", color="red", s=18, zorder=3)
    ax.plot(idx, mean_at(tgt_rows), color="tab:blue", linewidth=2.2, label="ingot (mean)")
    if base_rows:
        ax.plot(
            idx, mean_at(base_rows), color="tab:orange", linestyle="--", linewidth=2.2,
            label=f"HF {report.dtype} (mean)",
        )  # fmt: skip
    ax.scatter([], [], marker="x", color="red", s=18, label="token fails static checks")
    ax.set_yscale("log")
    ax.set_xlabel("generation index")
    ax.set_ylabel("relative L2 error of logits vs HF fp32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    if v.mode == "three-way":
        ax2.plot(idx[: len(v.bc_per_index)], v.bc_per_index, marker="o", color="tab:green")
        ax2.axhline(BC_GOOD, color="red", linestyle=":", label=f"pass line {BC_GOOD}")
        ax2.set_ylabel("BC of |errors| (ingot vs HF dtype), all prompts")
        ax2.set_title(f"sigma-ratio {_f(v.sigma_ratio)}, BC min {_f(v.bc_min, 4)}", fontsize=10)
    else:
        worst = []
        for i in idx:
            ratios = [
                r["error"] / r["rtol"]
                for p in v.prompts
                if i < len(p.tokens)
                for r in p.tokens[i].topk.values()
            ]
            worst.append(max(ratios) if ratios else math.nan)
        ax2.plot(idx, worst, marker="o", color="tab:green")
        ax2.axhline(1.0, color="red", linestyle=":", label="tolerance")
        ax2.set_ylabel("worst top-k error / tolerance")
    ax2.set_xlabel("generation index")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    status = "PASS" if report.passed else "FAIL"
    overrides = f", hf_overrides {report.hf_overrides}" if report.hf_overrides else ""
    fig.suptitle(f"{Path(report.model).name} {report.dtype}{overrides}: {status}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _markdown(report: ValidateReport, plot_name: str) -> str:
    v = report.validation
    lines = [
        f"# ingot validate: {'PASS' if report.passed else 'FAIL'}",
        "",
        f"- model: `{report.model}`",
        f"- dtype: {report.dtype}; mode: {v.mode}",
        f"- hf_overrides (ingot only, never the reference): `{report.hf_overrides or {}}`",
        f"- {len(report.prompts)} prompts x {report.max_tokens} tokens",
        "",
        "## Verdict",
        "",
        "```",
        verdict_table(report),
        "```",
        "",
        "Pass rule: all tokens pass the static two-way thresholds (K5 < 0.011, K50 < 0.02, "
        "K1000 < 0.03, all < 0.05, divergences only within 1 ULP), OR sigma-ratio <= 1.0, OR "
        "BC >= 0.99 at every generation index. NaN always fails.",
        "",
        f"![per-position logit errors]({plot_name})",
        "",
        "## Per token",
        "",
        "| prompt | index | phase | ref | ingot | status | tgt l2 | base l2 | l2 ratio | BC | K5 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(v.prompts):
        for t in p.tokens:
            k5 = t.topk.get("5", {}).get("error")
            lines.append(
                f"| {i} | {t.index} | {t.phase} | {t.reference_token} | {t.target_token} | "
                f"{t.status.value} | {_f(t.target.l2_rel)} | "
                f"{_f(t.base.l2_rel) if t.base else '-'} | {_f(t.l2_ratio)} | {_f(t.bc, 4)} | "
                f"{_f(k5)} |"
            )
    if report.kv is not None:
        lines += [
            "",
            "## KV cache (prompt 0; informative, no pass/fail)",
            "",
            "| layer | positions | K cos | V cos | K max abs | V max abs | K l2 | V l2 "
            "| K l2 ratio | V l2 ratio | K BC | V BC |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for layer in report.kv:
            lines.append(
                f"| {layer.layer} | {layer.positions} | {layer.k_cos:.6f} | {layer.v_cos:.6f} | "
                f"{_f(layer.k_max_abs)} | {_f(layer.v_max_abs)} | {_f(layer.k_l2_rel)} | "
                f"{_f(layer.v_l2_rel)} | {_f(layer.k_l2_ratio)} | {_f(layer.v_l2_ratio)} | "
                f"{_f(layer.k_bc, 4)} | {_f(layer.v_bc, 4)} |"
            )
    if report.compare is not None:
        c = report.compare
        first = c.first_failure
        lines += [
            "",
            f"## Tensor compare (prompt {report.compare_prompt}, {c.mode})",
            "",
            f"First diverging module: **{first.name if first else 'none'}**. "
            f"{c.compared_positions} positions compared"
            + (
                f" (ingot left the reference sequence at position {c.first_mismatch_position})"
                if c.first_mismatch_position is not None
                else ""
            )
            + ". Full table: `tensor_compare/table.md`, data: `tensor_compare/comparison.json`.",
            "",
            c.table(max_rows=40),
        ]
    return "\n".join(lines) + "\n"
