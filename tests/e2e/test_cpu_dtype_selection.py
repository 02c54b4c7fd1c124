"""What a CPU chooses for a model loaded with ``dtype="auto"`` (issue #32): a bf16 checkpoint
on a CPU whose bf16 runs at full speed stays bf16 on ingot's kernels, logged with why; the
same checkpoint where bf16 would be emulated computes float32; an explicit bf16 there warns.
And the AVX2 selection pin: what an AVX2 CPU runs (dtype, attention backend, decode program,
kernel build, packed linears)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from tiny import make_byte_tokenizer, make_tiny_model

from ingot import LLM, SamplingParams
from ingot.model_executor.layers import cpu_kernels
from ingot.model_executor.layers.attention_backend import AttentionBindable
from ingot.model_executor.layers.linear import LinearBase
from ingot.platforms.cpu import CpuPlatform

# Kernel-sized (head_dim 32: the decode-attention kernel's multiple), as the fast-path tests.
SHAPE = dict(vocab_size=259, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=160)
ENGINE = dict(max_model_len=128, max_num_seqs=2)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Llama saved as bf16 safetensors (config.json says bfloat16)."""
    import json

    import transformers

    path = tmp_path_factory.mktemp("tiny-bf16")
    make_tiny_model("llama", path, **SHAPE)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    make_byte_tokenizer(path)
    return path


def _greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": list(range(3, 40))}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def _bound(llm: LLM) -> tuple:
    """(attention backend, decode program present, ISAs of the packed linears' kernels,
    linears with a GEMV layout, linears) of the in-process worker."""
    worker = llm.llm_engine.engine_core.executor.worker
    model = worker.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    isas = {m.cpu_kernels.isa for m in linears if m.cpu_kernels is not None}
    packed = sum(getattr(m, "gemv_weight", None) is not None for m in linears)
    backends = {m.attn_backend.name for m in model.modules() if isinstance(m, AttentionBindable)}
    return (worker.attn_backend.name, backends, worker.model_runner.program.decode_program
            is not None, isas, packed, len(linears))


def test_a_bf16_checkpoint_stays_bf16_on_the_kernels_where_they_serve(bf16_checkpoint, caplog):
    """The issue's done-when: ``ingot serve`` of a bf16 safetensors checkpoint on an AVX2 CPU
    picks a dtype that computes at full speed. The LLM class builds the engine the server
    builds (same EngineArgs, same worker, same log lines); the chosen dtype and the kernels
    are logged and asserted."""
    isa = cpu_kernels.bf16_kernel_isa()
    if isa is None:
        pytest.skip("no vector build of ingot's bf16 kernels loads here (no C compiler, "
                    "INGOT_CPU_KERNELS=0, or no AVX2 + FMA)")
    with caplog.at_level(logging.INFO, logger="ingot"):
        llm = LLM(str(bf16_checkpoint), **ENGINE)
    assert llm.llm_engine.model_config.dtype is torch.bfloat16
    assert f"dtype auto -> bfloat16: bf16 weights on ingot's {isa} kernels" in caplog.text
    bound = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bound ")]
    assert len(bound) == 1 and bound[0].endswith(f"on ingot's CPU kernels (bf16: {isa})")
    assert int(bound[0].split(" layers on ")[0].rsplit(" ", 1)[1]) > 0
    assert llm.llm_engine.startup_stats()["cpu_kernels"] == {"bf16": isa}
    assert len(_greedy(llm)) == 8


def _run_cli(path, *flags: str) -> subprocess.CompletedProcess:  # noqa: ANN001
    # A fresh process: INGOT_CPU_KERNELS=0 works from the first load (the loader caches). On a
    # CPU with bf16 arithmetic, the child's platform sees the flags of one without it.
    from faults import child_env

    env = child_env("cpu_without_bf16") if CpuPlatform.supports_bf16() else dict(os.environ)
    env["INGOT_CPU_KERNELS"] = "0"
    return subprocess.run(
        [sys.executable, "-m", "ingot.cli.main", "--log-level", "info", "generate", "hi",
         "--model", str(path), "--max-tokens", "2", "--max-model-len", "64", *flags],
        capture_output=True, text=True, timeout=300, env=env,
    )


@pytest.mark.slow
def test_without_the_kernels_auto_widens_and_an_explicit_bf16_warns(bf16_checkpoint):
    """The broken twin of the above, with the kernels off (INGOT_CPU_KERNELS=0): on a CPU
    without bf16 arithmetic the bf16 checkpoint computes float32, not its emulated bf16; and
    ``--dtype bfloat16`` there runs as asked with a warning that names the cost and the
    alternative. (On a CPU with bf16 arithmetic the child sees one without: tests/faults.py's
    ``cpu_without_bf16``.)"""
    auto = _run_cli(bf16_checkpoint)
    assert auto.returncode == 0, auto.stderr
    assert "dtype auto -> float32: this CPU has no bf16 arithmetic" in auto.stderr
    assert "the bfloat16 checkpoint widens exactly" in auto.stderr
    assert "WARNING" not in auto.stderr
    given = _run_cli(bf16_checkpoint, "--dtype", "bfloat16")
    assert given.returncode == 0, given.stderr
    (warning,) = [line for line in given.stderr.splitlines() if line.startswith("WARNING")]
    assert "dtype bfloat16 on a CPU that only emulates it" in warning
    assert "(4.3x)" in warning and "Pass --dtype float32" in warning
    assert "dtype auto" not in given.stderr


@pytest.fixture
def avx2(monkeypatch):
    """INGOT_CPU_ISA=avx2: what an AVX2 CPU runs, on any AVX2-or-wider machine."""
    if "avx2" not in cpu_kernels.cpu_isas():
        pytest.skip("this CPU cannot run the avx2 build (no AVX2 + FMA)")
    # needs_kernels (on the test) has skipped where the kernels are off or cannot build: here
    # the avx2 build must load.
    assert cpu_kernels.load_cpu_kernels("avx2") is not None, cpu_kernels.unavailable
    monkeypatch.setenv("INGOT_CPU_ISA", "avx2")


@pytest.mark.needs_kernels
def test_avx2_selection(avx2, tmp_path, caplog, monkeypatch):
    """A float32 checkpoint with dtype auto on an AVX2 CPU: bf16, every linear packed for
    ingot's avx2 GEMV, its attention backend, and decode steps on its decode program. Broken
    twin: test_portable_build_alone_computes_float32_on_torch."""
    make_tiny_model("llama", tmp_path / "m", **SHAPE)
    make_byte_tokenizer(tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="ingot"):
        llm = LLM(str(tmp_path / "m"), **ENGINE)
    assert llm.llm_engine.model_config.dtype is torch.bfloat16
    assert "dtype auto -> bfloat16: bf16 weights on ingot's avx2 kernels (float32 " \
           "arithmetic" in caplog.text
    backend, backends, program, isas, packed, linears = _bound(llm)
    assert (backend, backends, program, isas) == ("cpu-kernels", {"cpu-kernels"}, True, {"avx2"})
    assert packed == linears > 0
    assert llm.llm_engine.startup_stats()["cpu_kernels"] == {"bf16": "avx2"}
    assert len(_greedy(llm)) == 8


def test_portable_build_alone_computes_float32_on_torch(tmp_path, monkeypatch):
    """The broken twin of test_avx2_selection: capped to the portable build (no vector build),
    a CPU without native bf16 computes float32 on torch ops (a CPU with it is seen without,
    tests/faults.py's ``cpu_without_bf16``)."""
    from faults import FAULTS

    if CpuPlatform.supports_bf16():
        FAULTS["cpu_without_bf16"](monkeypatch)
    assert not CpuPlatform.supports_bf16()
    make_tiny_model("llama", tmp_path / "m", **SHAPE)
    make_byte_tokenizer(tmp_path / "m")
    monkeypatch.setenv("INGOT_CPU_ISA", "portable")
    llm = LLM(str(tmp_path / "m"), **ENGINE)
    assert llm.llm_engine.model_config.dtype is torch.float32
    backend, backends, program, isas, packed, _ = _bound(llm)
    assert (backend, program, isas, packed) == ("torch", False, set(), 0)
    assert llm.llm_engine.startup_stats()["cpu_kernels"] == {}
