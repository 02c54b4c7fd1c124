"""A data-parallel replica's dummy batch (spec §2, for EP across replicas): its tensors have the
shapes of a real one-request decode batch padded to the same bucket, and running it leaves the
KV cache bit-for-bit unchanged (every slot is PAD_SLOT_ID). A warmup-style dummy request, whose
rows do get slots (the null block's), does write the cache: the check can fail."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tiny_model

from ingot import LLM, SamplingParams
from ingot.worker.model_runner import PAD_SLOT_ID


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("dummy"), vocab_size=259)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              block_size=4, max_num_seqs=4)
    yield llm
    llm.llm_engine.shutdown()


def _runner(llm):  # noqa: ANN001, ANN202
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _shapes(inputs) -> dict:  # noqa: ANN001
    ids, positions, meta, _ = inputs
    return {"input_ids": ids.shape, "positions": positions.shape,
            "slot_mapping": meta.slot_mapping.shape, "block_table": meta.block_table.shape,
            "query_start_loc": meta.query_start_loc.shape, "max_query_len": meta.max_query_len,
            "is_decode": meta.is_decode}


def test_dummy_batch_has_a_real_padded_decode_batchs_shapes(llm):
    runner = _runner(llm)
    real: list = []
    original = runner.prepare_inputs

    def record(so):  # noqa: ANN001, ANN202
        inputs = original(so)
        if not so.is_prefill and so.scheduled:
            real.append((so.num_padded, _shapes(inputs)))
        return inputs

    runner.prepare_inputs = record
    try:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finally:
        del runner.prepare_inputs
    bucket, shapes = real[0]
    assert bucket == 1 and all(s == shapes for _, s in real)
    dummy = runner.dummy_batch_inputs()
    assert _shapes(dummy) == shapes
    assert torch.all(dummy[2].slot_mapping == PAD_SLOT_ID)
    # Padded up to a larger bucket (a busier replica's), it matches that bucket's shapes.
    assert _shapes(runner.dummy_batch_inputs(4))["input_ids"] == (4,)


def test_dummy_batch_leaves_the_kv_cache_unchanged(llm):
    runner = _runner(llm)
    llm.generate([[9, 8, 7, 6]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    before = [c.clone() for c in runner.kv_caches]
    runner.execute_dummy_batch()
    runner.execute_dummy_batch(4)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    # Deliberately broken: a warmup dummy request writes its K/V (into the null block).
    from ingot.worker.warmup import warmup_scheduler_output, warmup_shapes

    shape = next(s for s in warmup_shapes(runner.config) if s.kind == "decode")
    with torch.inference_mode():
        ids, positions, meta, _ = runner.prepare_inputs(warmup_scheduler_output(shape))
        runner.model(ids, positions, runner.kv_caches, meta)
    assert not all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    runner.forget_dummy_steps()
