"""The compile backend and warmup wiring, without paying for Inductor: the FX passes run on the
real decoder-layer graph and the result is executed as FX (a stub lowering)."""

from __future__ import annotations

import pytest
import torch

from ingot.compilation.cache import CompileCacheMissError
from ingot.engine.arg_utils import EngineArgs
from ingot.worker.execution.model_compiler import ModelCompiler
from ingot.worker.warmup import warmup_scheduler_output, warmup_shapes
from ingot.worker.worker import Worker

SMALL = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256,
             num_gpu_blocks_override=40)


def _config(model_dir, **kw):
    return EngineArgs(model=str(model_dir), **{**SMALL, **kw}).create_engine_config()


def test_compilation_defaults_and_flag_validation(tiny_llama_dir):
    assert _config(tiny_llama_dir).compilation.enabled is False  # CPU default: eager
    cfg = _config(tiny_llama_dir, compile=True, enable_fx_passes=False, cache_dir="/x")
    assert cfg.compilation.enabled and not cfg.compilation.enable_fx_passes
    assert cfg.compilation.cache_root == "/x"
    assert _config(tiny_llama_dir, compile=True, enforce_eager=False).compilation.enabled
    assert not _config(tiny_llama_dir, enforce_eager=True).compilation.enabled
    with pytest.raises(ValueError, match="contradict"):
        _config(tiny_llama_dir, compile=True, enforce_eager=True)
    with pytest.raises(ValueError, match="static shapes"):
        _config(tiny_llama_dir, compile=True,
                additional_config={"enable_bucketing": False})


def _worker(cfg) -> Worker:
    worker = Worker(cfg)
    worker.initialize_cache(worker.determine_num_blocks())
    return worker


def test_warmup_shapes_cover_every_bucket_once(tiny_llama_dir):
    cfg = _config(tiny_llama_dir, additional_config={"decode_context_length_buckets": [128]})
    shapes = warmup_shapes(cfg)
    labels = [s.label for s in shapes]
    assert len(labels) == len(set(labels))
    # prefill 128/256 at their own width, plus continuations into the 128/256 context buckets
    assert {s.label for s in shapes if s.kind == "prefill"} == {
        "prefill_t128_w4", "prefill_t128_w8", "prefill_t256_w8"}
    assert {s.label for s in shapes if s.kind == "decode"} == {
        f"decode_b{b}_w{w}" for b in (1, 2, 4) for w in (4, 8)}
    no_cont = _config(tiny_llama_dir, enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=256)
    assert {s.label for s in warmup_shapes(no_cont) if s.kind == "prefill"} == {
        "prefill_t128_w4", "prefill_t256_w8"}


def test_warmup_inputs_have_the_bucket_shapes(tiny_llama_dir):
    cfg = _config(tiny_llama_dir, additional_config={"decode_context_length_buckets": [128]})
    worker = _worker(cfg)
    for shape in warmup_shapes(cfg):
        ids, _, meta, _ = worker.model_runner.prepare_inputs(warmup_scheduler_output(shape))
        assert ids.shape[0] == shape.num_tokens
        assert tuple(meta.block_table.shape) == (shape.num_reqs, shape.width), shape


@pytest.mark.parametrize("enable_fx_passes", [True, False])
def test_backend_pipeline_matches_eager_and_layers_share_one_graph(
    tiny_llama_dir, tmp_path, enable_fx_passes, monkeypatch
):
    # The worker is built eagerly and compiled by hand below: keep its linears' plain weights
    # (a compiled engine's binding does so itself; an eager one may release them for oneDNN).
    monkeypatch.setenv("INGOT_DISABLE_PACKED_LINEAR", "1")
    cfg = _config(tiny_llama_dir, compile=True, enable_fx_passes=enable_fx_passes,
                  cache_dir=str(tmp_path))
    cfg.compilation.enabled = False  # build the worker eagerly; compile by hand below
    worker = _worker(cfg)
    runner = worker.model_runner
    shapes = [s for s in warmup_shapes(cfg) if s.start_position == 0][:1] + [
        s for s in warmup_shapes(cfg) if s.kind == "decode"][:2]
    torch.manual_seed(0)
    inputs = []
    for shape in shapes:
        ids, pos, meta, _ = runner.prepare_inputs(warmup_scheduler_output(shape))
        ids = torch.randint(3, 250, ids.shape)
        inputs.append((ids, pos, meta))
    with torch.inference_mode():
        eager = [runner.model(i, p, runner.kv_caches, m) for i, p, m in inputs]

    compiler = ModelCompiler(cfg, runner.model.model.layers, runner.device, progress=False)

    def run_fx(gm, example_inputs):  # the passes' output, executed as plain FX
        return gm.forward

    compiler.backend._lower = run_fx
    with torch.inference_mode():
        for shape, (ids, pos, meta), expected in zip(shapes, inputs, eager, strict=True):
            compiler.backend.label = shape.label
            got = runner.model(ids, pos, runner.kv_caches, meta)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    stats = compiler.backend.stats
    # Two layers, three shapes: one graph per shape, shared by the layers.
    assert stats.backend_calls == len(shapes) == stats.compilations
    timings = compiler.backend.pass_manager.last_timings
    if enable_fx_passes:
        assert list(timings) == ["device_rewriter", "aliasing_output_rewrite",
                                 "inplace_to_outofplace", "copy_back_in_graph"]
    else:
        assert timings == {}


def test_hit_only_miss_is_a_clear_error(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("INGOT_DISABLE_WARMUP_COMPILE", "1")
    cfg = _config(tiny_llama_dir, compile=True, cache_dir=str(tmp_path / "empty"))
    with pytest.raises(CompileCacheMissError, match="ingot compile"):
        _worker(cfg)


def test_compile_cli_rejects_enforce_eager(tiny_llama_dir, capsys):
    from ingot.cli.main import main

    assert main(["compile", str(tiny_llama_dir), "--enforce-eager"]) == 2
    assert "--enforce-eager" in capsys.readouterr().err
