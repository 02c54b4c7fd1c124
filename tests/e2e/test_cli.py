"""The `ingot` command line, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def ingot(*args: str, timeout: int = 180, stdin: str | None = None,
          log_level: str = "warning") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ingot.cli.main", "--log-level", log_level, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
    )


def assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def test_help_lists_every_option():
    out = ingot("generate", "--help").stdout
    for flag in (
        "--model", "--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
        "--block-size", "--enable-chunked-prefill", "--hf-overrides", "--device",
        "--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--stop",
    ):
        assert flag in out
    top = ingot("--help").stdout
    for command in ("generate", "chat", "convert"):
        assert command in top


def test_generate_on_tiny_model(tiny_llama_dir):
    proc = ingot("generate", "hello", "--model", str(tiny_llama_dir), "--max-tokens", "4",
                 "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr


def test_missing_model_path(tmp_path):
    proc = ingot("generate", "hi", "--model", str(tmp_path / "nope"))
    assert_one_error_line(proc, "does not exist")


def test_unknown_architecture(tmp_path, tiny_llama_dir):
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    proc = ingot("generate", "hi", "--model", str(model))
    assert_one_error_line(proc, "FooForCausalLM", "LlamaForCausalLM")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--n", "0"], "n must be"),
    ],
)
def test_invalid_sampling_values(flags, fragment, tiny_llama_dir):
    proc = ingot("generate", "hi", "--model", str(tiny_llama_dir), *flags)
    assert_one_error_line(proc, fragment)


def test_empty_prompt(tiny_llama_dir):
    proc = ingot("generate", "", "--model", str(tiny_llama_dir), "--dtype", "float32")
    assert_one_error_line(proc, "empty")


def test_prompt_over_max_model_len(tiny_llama_dir):
    proc = ingot("generate", "x" * 100, "--model", str(tiny_llama_dir), "--max-model-len", "32",
                 "--dtype", "float32")
    assert_one_error_line(proc, "max_model_len")


def test_bad_engine_flag_value(tiny_llama_dir):
    proc = ingot("generate", "hi", "--model", str(tiny_llama_dir), "--block-size", "12")
    assert_one_error_line(proc, "block_size")


def test_chat_multi_turn(tiny_llama_dir):
    proc = ingot("chat", "--model", str(tiny_llama_dir), "--max-tokens", "3", "--dtype", "float32",
                 stdin="hello\nagain\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") >= 3


@pytest.mark.slow
def test_convert_writes_a_directory_transformers_loads(tmp_path, default_gguf_path):
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "hf"
    proc = ingot("convert", default_gguf_path, str(out), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert AutoConfig.from_pretrained(out).architectures == ["LlamaForCausalLM"]
    assert AutoTokenizer.from_pretrained(out).encode("Paris") != []


def test_generate_is_sized_to_one_prompt_and_shows_progress(tiny_llama_dir):
    """stderr is a pipe here, not a terminal: progress comes as log lines, not tqdm bars."""
    proc = ingot("generate", "hello", "--model", str(tiny_llama_dir), "--max-tokens", "4",
                 "--dtype", "float32", log_level="info")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "sized for this command: max_num_seqs=1, max_num_batched_tokens=128" in err
    assert "prefill token buckets [128], decode batch buckets [1]," in err
    # float32 linears run MKL's GEMM or oneDNN's float32 kernels, which build nothing or
    # little per shape: no warmup to show.
    for fragment in ("loading weights: started", "loading weights: done, ", "warmup: skipped"):
        assert fragment in err, err
    assert "\r" not in err  # no bar redrawn on a pipe


def test_one_shot_sizing_yields_to_the_given_flags(tiny_llama_dir):
    proc = ingot("generate", "hello", "--model", str(tiny_llama_dir), "--max-tokens", "2",
                 "--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
                 log_level="info")
    assert proc.returncode == 0, proc.stderr
    assert "sized for this command" not in proc.stderr
    assert "prefill token buckets [128, 256], decode batch buckets [1, 2, 4]," in proc.stderr
    # --n 2 runs two sequences at once; the budget follows the prompt's length.
    proc = ingot("generate", "y" * 300, "--model", str(tiny_llama_dir), "--max-tokens", "2",
                 "--dtype", "float32", "--n", "2", "--temperature", "1", log_level="info")
    assert proc.returncode == 0, proc.stderr
    assert "max_num_seqs=2, max_num_batched_tokens=512" in proc.stderr
    assert "decode batch buckets [1, 2]," in proc.stderr


def test_given_flags_and_prefill_budget():
    from ingot.cli.main import given_flags
    from ingot.engine.arg_utils import prefill_budget_for

    flags = given_flags(["generate", "hi", "--max-num-seqs", "3", "--chat"])
    assert {"max_num_seqs", "chat", "prompt"} <= flags
    assert not {"max_model_len", "max_num_batched_tokens", "temperature"} & flags
    # bench's set_defaults (the peer's settings) are defaults, not the user's flags.
    assert "max_num_seqs" not in given_flags(["bench", "single"])
    assert [prefill_budget_for(n) for n in (1, 128, 129, 700, 5000)] == [128, 128, 256, 1024, 2048]


def _default_model_warmup() -> str:
    """The warmup line the default model's engine logs on this CPU with dtype auto: the eager
    warmup runs only where a linear runs oneDNN's packed bf16 kernels (built per shape), i.e.
    bf16 linears that ingot's GEMM does not serve (an AMX CPU, or no build of ingot's kernels)
    where oneDNN has a bf16 linear; float32 linears (MKL's or oneDNN's float32 kernels) need
    none. The default model's widths are even, so ingot's GEMM takes every linear it can.
    Where ingot's quantized kernels load, the GGUF's weights stay quantized (--quantization
    gguf, the default) and every linear, the tied LM head included, runs them: no warmup, but
    where prefill steps run them dense on oneDNN (AMX, quant_dense_preferred)."""
    import torch

    from ingot.model_executor.layers.cpu_kernels import (
        bf16_kernel_isa,
        gemm_preferred,
        load_cpu_kernels,
        load_quant_kernels,
        quant_dense_preferred,
    )
    from ingot.model_executor.layers.linear import cpu_packed_linear_supported
    from ingot.platforms.cpu import CpuPlatform

    bf16 = CpuPlatform.auto_dtype(None, bf16_kernel_isa()).dtype is torch.bfloat16
    if load_quant_kernels() is not None:  # prefill steps dequantize onto oneDNN on AMX
        return "warmup: done, " if bf16 and quant_dense_preferred() else "warmup: skipped"
    onednn = (bf16 and cpu_packed_linear_supported(torch.bfloat16, torch.device("cpu"))
              and not (load_cpu_kernels() is not None and gemm_preferred()))
    return "warmup: done, " if onednn else "warmup: skipped"


@pytest.mark.slow
def test_bench_single_is_sized_and_shows_progress():
    """The default model (the shared workloads' token ids need its vocabulary)."""
    proc = ingot("bench", "single", "--no-progress", log_level="info", timeout=600)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "sized for this command: max_num_seqs=1, max_num_batched_tokens=128" in err
    assert "loading weights: done, " in err
    assert _default_model_warmup() in err, err
    assert "bench 1/1: single, 1 request(s) of 128 prompt -> 128 new tokens" in err
    assert "RESULT workload=single engine=ingot requests=1" in proc.stdout
