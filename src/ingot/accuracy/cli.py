"""`ingot validate [MODEL] [--prompts FILE] [--dtype] [--hf-overrides JSON] [--report DIR]`.

Exit status: 0 when validation passes, 1 when it fails (a verdict, not an error), 2 for errors
a user can fix (printed as one ``error:`` line by the main CLI).
"""

from __future__ import annotations

import argparse

from ingot.engine.arg_utils import add_engine_args, engine_args_from, size_one_shot

DEFAULT_REPORT_DIR = "ingot-validate-report"


def add_validate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="check a model's logits against HF transformers",
        description=(
            "Teacher-forced logit validation against HF transformers in fp32 (ground truth) and "
            "in the engine's dtype (the noise the dtype alone causes). On failure, tensor "
            "capture + compare names the first module whose error breaks the threshold. "
            "--hf-overrides changes only the config ingot builds, never the reference."
        ),
    )
    p.add_argument(
        "model_pos", nargs="?", default=None, metavar="MODEL",
        help="HF model directory or .gguf file (same as --model; default: the embedded model)",
    )  # fmt: skip
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help='.jsonl of {"prompt": ...} / {"prompt_token_ids": [...]}, or a text '
        "file with one prompt per line (default: 16 built-in prompts; the sigma and BC "
        "criteria need that many to be more than noise)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        dest="validate_max_tokens",
        metavar="N",
        help="generated tokens validated per prompt (default: 8)",
    )
    p.add_argument(
        "--report",
        default=DEFAULT_REPORT_DIR,
        metavar="DIR",
        help="report directory (default: %(default)s)",
    )
    p.add_argument(
        "--two-way",
        action="store_true",
        help="compare with HF fp32 only (static thresholds), no HF-in-dtype yardstick",
    )
    p.add_argument(
        "--compare",
        choices=["on-failure", "always", "never"],
        default="on-failure",
        help="when to run tensor capture + compare (default: %(default)s)",
    )
    p.add_argument(
        "--compare-modules",
        nargs="+",
        default=None,
        metavar="GLOB",
        help="module name globs to capture ('*' within a name part, '**' across, "
        "'0-3' a layer range); default: embeddings, each layer's norms, attention, "
        "MLP and output, final norm",
    )
    p.add_argument("--no-kv-analysis", action="store_true", help="skip the KV cache analysis")
    add_engine_args(p)

    def run(ns: argparse.Namespace) -> int:
        from ingot.accuracy.capture import DEFAULT_PATTERNS
        from ingot.accuracy.report import verdict_table
        from ingot.accuracy.validate import DEFAULT_MAX_TOKENS, load_prompts, run_validation

        if ns.model_pos is not None:
            if ns.model is not None and ns.model != ns.model_pos:
                raise ValueError(
                    f"two models given ({ns.model_pos!r} and --model {ns.model!r}); give one"
                )
            ns.model = ns.model_pos
        if ns.quantization is None:
            # The reference is HF on the checkpoint's weights dequantized; the kept-quantized
            # path (a GGUF's default on CPU) also quantizes activations, an error the dtype's
            # noise criteria would report as a bug. Validate the engine's math unless asked.
            ns.quantization = "none"
        prompts = load_prompts(ns.prompts) if ns.prompts else None
        # One prompt at a time; prompts of any length, so the token budget stays the default.
        size_one_shot(ns, 1, None)
        report = run_validation(
            engine_args_from(ns),
            prompts=prompts,
            max_tokens=ns.validate_max_tokens or DEFAULT_MAX_TOKENS,
            report_dir=ns.report,
            two_way=ns.two_way,
            compare=ns.compare,
            compare_modules=ns.compare_modules or DEFAULT_PATTERNS,
            kv_analysis=not ns.no_kv_analysis,
        )
        print(verdict_table(report))
        return 0 if report.passed else 1

    p.set_defaults(func=run)
