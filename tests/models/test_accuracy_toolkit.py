"""Accuracy toolkit on the tiny random Llama (fp32): logits, capture alignment with HF, tensor
replacement and KV cache analysis."""

from __future__ import annotations

import json

import pytest
import torch

from ingot import LLM
from ingot.accuracy.capture import DEFAULT_PATTERNS, capture_hf, capture_ingot, load_capture
from ingot.accuracy.compare import compare_captures
from ingot.accuracy.ingot_runner import IngotRunner
from ingot.accuracy.kv_analysis import compare_kv, ingot_request_kv, snapshot_request_kv
from ingot.accuracy.logit_validation import logit_validation
from ingot.accuracy.metrics import FP32_TOLERANCE_MAP
from ingot.accuracy.reference import HFReference
from ingot.accuracy.replace import replace_modules
from ingot.accuracy.validate import _generate_fn

PROMPT = [1, 50, 60, 70, 80, 90, 100, 110, 120, 130]
NUM_TOKENS = 8
# The default set plus the projections (fused in ingot, separate in HF).
PATTERNS = list(DEFAULT_PATTERNS) + [
    "model.layers.*.self_attn.qkv_proj",
    "model.layers.*.self_attn.o_proj",
    "model.layers.*.mlp.gate_up_proj",
    "model.layers.*.mlp.down_proj",
]
FP32_MODULE_TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return HFReference.load(str(tiny_llama_dir), None)


@pytest.fixture(scope="module")
def ref_run(reference):
    return reference.run(PROMPT, NUM_TOKENS)


def _llm(path, **kwargs):
    # block_size 4: a request spans several (non-contiguous) blocks; bucketing stays on so the
    # prefill is padded and the capture must strip the padding rows. Fixed threads: the
    # bit-identity checks compare runs, and a thread-count switch under a busy machine (CI
    # once) changes MKL's float32 rounding (documented with cpu_adaptive_threads).
    return LLM(str(path), dtype="float32", max_model_len=256, block_size=4,
               cpu_adaptive_threads=False, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return _llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_capture(reference, ref_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-capture")
    return capture_hf(reference.baseline, ref_run.sequence, root / "hf", PATTERNS)


def _capture_ingot(llm, ref_run, out, patterns=PATTERNS, **kwargs):
    runner = IngotRunner(llm)
    runner.reset_prefix_cache()
    with capture_ingot(llm, out, patterns, **kwargs):
        runner.generate(ref_run.prompt_ids, NUM_TOKENS, stop_at=ref_run.tokens)
    return out


def test_fp32_logits_match_hf_two_way(llm, ref_run):
    runner = IngotRunner(llm)
    result = logit_validation(
        [PROMPT],
        lambda i: _generate_fn(runner, PROMPT, ref_run.tokens),
        [ref_run.baseline_logits],
        [ref_run.tokens],
        tol_map=FP32_TOLERANCE_MAP,
        mantissa_bits=23,
        per_prompt_fn=True,
    )
    assert result.passed and result.mode == "two-way"
    (prompt,) = result.prompts
    assert prompt.divergence_index is None and prompt.calls == 1
    assert prompt.target_tokens == ref_run.tokens
    assert max(t.target.linf_rel for t in prompt.tokens) < 1e-5
    # The prefill-only path (prompt logprobs) gives the same logits.
    tf = runner.teacher_forced_logits(PROMPT, ref_run.tokens)
    assert torch.allclose(tf, ref_run.baseline_logits, atol=1e-4, rtol=0)


def test_capture_layout_and_metadata(llm, ref_run, tmp_path):
    out = _capture_ingot(llm, ref_run, tmp_path / "ingot", ["model.layers.0", "model.norm"])
    index = json.loads((out / "index.json").read_text())
    assert index["format_version"] == 1 and index["source"] == "ingot"
    assert index["modules"] == ["model.layers.0", "model.norm"]  # execution order
    assert index["metadata"]["dtype"] == "float32"
    phases = [s.split("_")[-1] for s in index["steps"]]
    assert phases == ["prefill"] + ["decode"] * (NUM_TOKENS - 1)
    prefill = json.loads((out / index["steps"][0] / "meta.json").read_text())
    assert prefill["num_real_tokens"] == len(PROMPT)
    assert prefill["num_padded_tokens"] > len(PROMPT)  # bucket padding, stripped
    assert prefill["positions"] == list(range(len(PROMPT)))
    assert prefill["input_ids"] == PROMPT
    assert len(set(prefill["req_ids"])) == 1
    info = prefill["modules"]["model.layers.0"]
    assert info["shape"] == [len(PROMPT), 64] and info["dtype"] == "float32"
    t = torch.load(out / index["steps"][0] / info["file"], weights_only=True)
    assert t.shape == (len(PROMPT), 64)
    decode = json.loads((out / index["steps"][2] / "meta.json").read_text())
    assert decode["positions"] == [len(PROMPT) + 1] and decode["num_real_tokens"] == 1


def test_capture_step_and_phase_filters(llm, ref_run, tmp_path):
    out = _capture_ingot(llm, ref_run, tmp_path / "steps", ["model.norm"], steps={0, 2})
    assert [s.meta["step"] for s in load_capture(out).steps] == [0, 2]
    out = _capture_ingot(llm, ref_run, tmp_path / "decode", ["model.norm"], phases={"decode"})
    assert {s.phase for s in load_capture(out).steps} == {"decode"}


def test_captures_align_name_for_name_with_hf(llm, ref_run, hf_capture, reference, tmp_path):
    ingot_dir = _capture_ingot(llm, ref_run, tmp_path / "ingot")
    ingot, hf = load_capture(ingot_dir), load_capture(hf_capture)
    assert ingot.modules == hf.modules  # same names, same execution order
    assert "model.layers.1.self_attn.qkv_proj" in ingot.modules  # HF's q/k/v concatenated
    report = compare_captures(hf, ingot, max_l2_rel=FP32_MODULE_TOL)
    assert report.passed, report.table()
    assert report.only_in_target == [] and report.only_in_reference == []
    assert report.compared_positions == len(ref_run.sequence)
    assert {p for m in report.modules for p in m.phases} == {"prefill", "decode"}
    # A captured layer output is HF's hidden state after that layer (residual included).
    with torch.no_grad():
        states = reference.baseline(
            torch.tensor([ref_run.sequence]), output_hidden_states=True
        ).hidden_states
    step0 = ingot.steps[0]
    for i in range(2):
        got = step0.tensor(f"model.layers.{i}")
        want = states[i + 1][0, : len(PROMPT)]
        if i == 1:  # HF's last hidden state is after the final norm
            continue
        assert torch.allclose(got, want, atol=1e-5)


def test_replacement_restores_downstream_of_a_broken_module(
    tiny_llama_dir, ref_run, hf_capture, tmp_path, monkeypatch
):
    # The bug goes into a plain weight: no linear may trade it for a packed copy (float32
    # linears pack for oneDNN on CPUs not made by Intel).
    monkeypatch.setenv("INGOT_DISABLE_PACKED_LINEAR", "1")
    llm = _llm(tiny_llama_dir)
    runner = IngotRunner(llm)
    with torch.no_grad():  # a bug confined to one module
        runner.model.model.layers[0].mlp.down_proj.weight.mul_(1.05)
    broken = compare_captures(
        hf_capture, _capture_ingot(llm, ref_run, tmp_path / "broken"), max_l2_rel=FP32_MODULE_TOL
    )
    assert broken.first_failure.name == "model.layers.0.mlp.down_proj"
    assert not broken.module("model.norm").passed  # the error is inherited downstream
    assert broken.module("model.layers.0.self_attn").passed

    with replace_modules(llm, hf_capture, ["model.layers.0.mlp"]) as replacer:
        fixed_dir = _capture_ingot(llm, ref_run, tmp_path / "fixed")
    assert replacer.replaced_rows > 0
    fixed = compare_captures(hf_capture, fixed_dir, max_l2_rel=FP32_MODULE_TOL)
    # Only the broken module itself still differs (down_proj is inside the replaced mlp);
    # everything downstream of it is back under tolerance.
    assert [m.name for m in fixed.modules if not m.passed] == ["model.layers.0.mlp.down_proj"]
    order = [m.name for m in fixed.modules]
    downstream = order[order.index("model.layers.0.mlp") :]
    assert all(fixed.module(n).passed for n in downstream)


def test_replacement_with_own_capture_is_bit_identical(llm, ref_run, tmp_path):
    runner = IngotRunner(llm)
    own = _capture_ingot(llm, ref_run, tmp_path / "own", ["model.layers.0"])
    runner.reset_prefix_cache()
    plain = runner.generate(PROMPT, NUM_TOKENS)
    # The engine's own capture covers every position it was fed, so a prefill + decode run
    # that replaces layer 0 with it reproduces its logits bit for bit.
    runner.reset_prefix_cache()
    with replace_modules(llm, own, ["model.layers.0"]):
        replaced = runner.generate(PROMPT, NUM_TOKENS)
    assert torch.equal(plain.logits, replaced.logits)


def test_replacement_tells_origin_from_inheritance(tiny_llama_dir, ref_run, hf_capture, tmp_path):
    # A wrong RoPE theta breaks attention in every layer. Replacing layer 0's attention output
    # fixes layer 0, but layer 1's attention still fails on clean inputs: its error originates
    # there, it is not inherited.
    llm = _llm(tiny_llama_dir, hf_overrides={"rope_theta": 500.0})
    broken = compare_captures(
        hf_capture, _capture_ingot(llm, ref_run, tmp_path / "b"), max_l2_rel=FP32_MODULE_TOL
    )
    assert broken.first_failure.name == "model.layers.0.self_attn.o_proj"
    assert broken.module("model.layers.0.self_attn.qkv_proj").passed  # RoPE comes after it
    with replace_modules(llm, hf_capture, ["model.layers.0.self_attn"]):
        fixed_dir = _capture_ingot(llm, ref_run, tmp_path / "f")
    fixed = compare_captures(hf_capture, fixed_dir, max_l2_rel=FP32_MODULE_TOL)
    # (o_proj inside the replaced attention still records its own, broken output)
    failures = [m.name for m in fixed.modules if not m.passed]
    assert failures[0] == "model.layers.0.self_attn.o_proj"
    outside = [n for n in failures if not n.startswith("model.layers.0.self_attn.")]
    assert outside[0] == "model.layers.1.self_attn.o_proj"
    assert fixed.module("model.layers.0").passed
    assert fixed.module("model.layers.1.input_layernorm").passed
    assert fixed.module("model.layers.1.self_attn.qkv_proj").passed


def test_kv_analysis_fp32_matches_hf_cache(llm, reference, ref_run):
    runner = IngotRunner(llm)
    kv, seq = ingot_request_kv(runner, PROMPT, ref_run.tokens)
    # K/V of the prompt (prefill) and of the generated tokens (decode writes) but the last.
    assert seq == PROMPT + ref_run.tokens[:-1]
    layers = compare_kv(kv, reference.kv_cache(seq))
    assert len(layers) == 2
    for layer in layers:
        assert layer.positions == len(seq)
        assert layer.k_max_abs < 1e-5 and layer.v_max_abs < 1e-5, layer
        assert layer.k_cos > 0.99999 and layer.v_cos > 0.99999

    # Paired negative: reading the request's blocks in the wrong order is caught.
    def wrong_table(req_id, generated):
        blocks = runner.request_blocks(req_id)[::-1]
        return snapshot_request_kv(runner.worker.kv_caches, blocks, len(seq))

    bad = runner.generate(PROMPT, NUM_TOKENS, stop_at=ref_run.tokens, on_last_step=wrong_table).kv
    wrong = compare_kv(bad, reference.kv_cache(seq))
    assert all(layer.k_max_abs > 0.1 for layer in wrong)
