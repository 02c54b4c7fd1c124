"""``ingot validate``: logit validation of an engine config against the HF reference, and on
failure tensor capture + compare to name the first module where the error enters.

The pieces run in this order:

1. load ingot with the user's engine args (``--hf-overrides`` included) and the HF reference
   from the checkpoint alone (fp32, plus a copy in the engine's dtype for three-way mode);
2. per prompt: fp32 greedy reference tokens and teacher-forced logits, then ingot's logits
   along the same tokens (re-prompted after each divergence);
3. the verdict (spec §2.4); KV analysis of the first prompt (informative);
4. on failure: capture ingot and both HF models on the worst prompt and compare module by
   module;
5. the report: ``validation.json``, ``summary.md``, ``logit_errors.png``, and under
   ``tensor_compare/`` the captures, ``comparison.json`` and ``table.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ingot.accuracy.capture import DEFAULT_PATTERNS, capture_hf, capture_ingot
from ingot.accuracy.compare import MAX_L2_REL_TWO_WAY, CompareReport, compare_captures
from ingot.accuracy.ingot_runner import IngotRunner
from ingot.accuracy.kv_analysis import LayerKV, compare_kv, ingot_request_kv
from ingot.accuracy.logit_validation import (
    GenerateFn,
    PromptResult,
    validate_prompt,
)
from ingot.accuracy.logit_validation import aggregate as aggregate_results
from ingot.accuracy.metrics import DEFAULT_TOLERANCE_MAP, FP32_TOLERANCE_MAP, mantissa_bits_of
from ingot.accuracy.reference import HFReference, ReferenceRun
from ingot.accuracy.report import Prompt, ValidateReport, write_report
from ingot.engine.arg_utils import EngineArgs

logger = logging.getLogger("ingot")

# Sixteen short, varied prompts. The sigma-ratio and BC criteria compare two noise
# distributions, so they need a sample: with 4 prompts x 16 tokens the bf16 engine measured
# sigma 1.07 / BC min 0.979 (fail), with these 16 prompts x 8 tokens sigma 0.99 / BC min 0.998
# (pass); a real bug (wrong RoPE theta) gives sigma ~1.6 with any sample.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "List three colors: red,",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, the first humans",
    "import numpy as np\n\ndef mean(xs):",
    "Translate to French: I like cheese. ->",
    "The three laws of motion are",
    "My favourite recipe for pancakes starts with",
    "Q: What is 12 times 12?\nA:",
    "The mitochondria is",
    "Dear customer, we regret to inform you that",
    "SELECT name FROM users WHERE",
    "The best way to learn a language is",
)
DEFAULT_MAX_TOKENS = 8
MAX_L2_REL_FP32 = 1e-4



def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a file: ``.jsonl`` lines of ``{"prompt": text}`` or
    ``{"prompt_token_ids": [...]}``; any other file holds one text prompt per line (blank lines
    skipped)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist; pass a .jsonl or .txt file")
    prompts: list[Prompt] = []
    if p.suffix == ".jsonl":
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n} is not JSON: {exc}") from exc
            if isinstance(item, dict) and "prompt_token_ids" in item:
                prompts.append([int(t) for t in item["prompt_token_ids"]])
            elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
                prompts.append(item["prompt"])
            else:
                raise ValueError(
                    f'{path}:{n}: each line needs {{"prompt": "..."}} or '
                    '{"prompt_token_ids": [...]}'
                )
    else:
        prompts = [line for line in p.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {str(path)!r} holds no prompt")
    return prompts


def _generate_fn(runner: IngotRunner, prompt_ids: list[int], reference: list[int]) -> GenerateFn:
    def generate(input_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, list[int]]:
        offset = len(input_ids) - len(prompt_ids)
        result = runner.generate(input_ids, num_tokens, stop_at=reference[offset:])
        return result.logits, result.tokens

    return generate


def _tokenize(llm: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids exactly as the engine would encode each prompt (text or ids)."""
    out = []
    for p in prompts:
        _, ids = llm.llm_engine.processor.tokenize_prompt(p)
        if not ids:
            raise ValueError(f"prompt {p!r} has no tokens")
        out.append(ids)
    return out


def run_validation(
    engine_args: EngineArgs,
    prompts: Sequence[Prompt] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    report_dir: str | Path | None = None,
    two_way: bool = False,
    compare: str = "on-failure",
    compare_modules: Sequence[str] = DEFAULT_PATTERNS,
    kv_analysis: bool = True,
    reference: HFReference | None = None,
    references: Sequence[ReferenceRun] | None = None,
    llm: Any = None,
    n_ulps: int = 1,
    progress: bool = True,
) -> ValidateReport:
    """Validate ``engine_args`` against the checkpoint's HF reference; see the module doc.

    ``compare`` is ``"on-failure"``, ``"always"`` or ``"never"``. ``reference`` / ``llm`` may
    be passed in to reuse loaded models (their configs must match ``engine_args``), and
    ``references`` to reuse the teacher data of an earlier run on the same prompts (they depend
    on the checkpoint, prompts and token count only, never on the engine config).
    """
    if compare not in ("on-failure", "always", "never"):
        raise ValueError(f"compare must be on-failure, always or never, got {compare!r}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if llm is None:
        from ingot.entrypoints.llm import LLM

        llm = LLM(**dataclasses.asdict(engine_args))
    runner = IngotRunner(llm)
    model_config = llm.llm_engine.model_config
    dtype = model_config.dtype
    three_way = not two_way and dtype != torch.float32
    prompt_list = list(prompts) if prompts else list(DEFAULT_PROMPTS)
    prompt_ids = _tokenize(llm, prompt_list)
    max_len = model_config.max_model_len
    for ids in prompt_ids:
        if len(ids) + max_tokens + 1 > max_len:
            raise ValueError(
                f"a prompt of {len(ids)} tokens plus {max_tokens} generated tokens does not fit "
                f"max_model_len {max_len}; shorten the prompt, lower --max-tokens or raise "
                "--max-model-len"
            )

    if reference is None:
        # The checkpoint path alone: the reference never sees --hf-overrides.
        reference = HFReference.load(model_config.model, dtype if three_way else None)
    if three_way and reference.expected is None:
        raise ValueError("three-way validation needs an HF reference in the engine dtype")
    timings["load"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    if references is not None:
        refs = list(references)
        if [r.prompt_ids for r in refs] != prompt_ids or any(
            len(r.tokens) != max_tokens or (three_way and r.expected_logits is None) for r in refs
        ):
            raise ValueError("the given references were made for other prompts or settings")
    else:
        refs = [
            reference.run(ids, max_tokens)
            for ids in tqdm(prompt_ids, desc="HF reference", disable=not progress)
        ]
    timings["reference"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tol_map = FP32_TOLERANCE_MAP if dtype == torch.float32 else DEFAULT_TOLERANCE_MAP
    results: list[PromptResult] = []
    for ids, ref in tqdm(
        list(zip(prompt_ids, refs, strict=True)), desc="ingot logits", disable=not progress
    ):
        results.append(
            validate_prompt(
                ids,
                _generate_fn(runner, ids, ref.tokens),
                ref.baseline_logits,
                ref.tokens,
                ref.expected_logits if three_way else None,
                tol_map,
                mantissa_bits_of(dtype),
                n_ulps,
            )
        )
    validation = aggregate_results(results, three_way)
    timings["validation"] = time.perf_counter() - t0

    report = ValidateReport(
        model=model_config.model,
        dtype=str(dtype).removeprefix("torch."),
        hf_overrides=dict(model_config.hf_overrides),
        prompts=prompt_list,
        max_tokens=max_tokens,
        validation=validation,
        references=refs,
        timings=timings,
    )
    out = Path(report_dir) if report_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    if kv_analysis:
        t0 = time.perf_counter()
        report.kv = _kv_analysis(runner, reference, refs[0], three_way)
        timings["kv_analysis"] = time.perf_counter() - t0

    if compare == "always" or (compare == "on-failure" and not validation.passed):
        t0 = time.perf_counter()
        index = _worst_prompt(results)
        report.compare_prompt = index
        report.compare = _tensor_compare(
            runner, llm, reference, refs[index], three_way, compare_modules, out
        )
        timings["tensor_compare"] = time.perf_counter() - t0

    if out is not None:
        write_report(report, out)
        report.report_dir = out
    return report


def _worst_prompt(results: list[PromptResult]) -> int:
    """The prompt whose worst token is worst: the clearest signal for tensor compare."""

    def badness(p: PromptResult) -> float:
        ratios = [t.l2_ratio for t in p.tokens if t.l2_ratio is not None]
        errors = [t.target.l2_rel for t in p.tokens]
        return max(ratios) if ratios else max(errors, default=0.0)

    return max(range(len(results)), key=lambda i: badness(results[i]))


def _kv_analysis(
    runner: IngotRunner, reference: HFReference, ref: ReferenceRun, three_way: bool
) -> list[LayerKV]:
    kv, seq = ingot_request_kv(runner, ref.prompt_ids, ref.tokens)
    baseline = reference.kv_cache(seq)
    expected = reference.kv_cache(seq, reference.expected) if three_way else None
    return compare_kv(kv, baseline, expected)


def _tensor_compare(
    runner: IngotRunner,
    llm: Any,
    reference: HFReference,
    ref: ReferenceRun,
    three_way: bool,
    modules: Sequence[str],
    out: Path | None,
) -> CompareReport:
    import tempfile

    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="ingot-compare-")
        root = Path(tmp.name)
    else:
        root = out / "tensor_compare"
    try:
        logger.info("tensor compare: capturing %s", ", ".join(modules))
        capture_hf(reference.baseline, ref.sequence, root / "hf_fp32", modules, "hf_fp32")
        expected_dir = None
        if three_way:
            expected_dir = root / "hf_dtype"
            capture_hf(reference.expected, ref.sequence, expected_dir, modules, "hf_dtype")
        runner.reset_prefix_cache()  # capture every prompt position, not just the uncached tail
        with capture_ingot(llm, root / "ingot", modules):
            runner.generate(ref.prompt_ids, len(ref.tokens), stop_at=ref.tokens)
        # Two-way module threshold: the static "full model" 1e-2 for half precision; an fp32
        # engine agrees with fp32 HF to ~1e-6, so anything above 1e-4 there is a real change.
        fp32 = runner.dtype == torch.float32
        max_l2_rel = MAX_L2_REL_FP32 if fp32 else MAX_L2_REL_TWO_WAY
        result = compare_captures(
            root / "hf_fp32", root / "ingot", expected_dir, max_l2_rel=max_l2_rel
        )
        if out is not None:
            result.write_json(root / "comparison.json")
            (root / "table.md").write_text(result.table() + "\n")
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()
