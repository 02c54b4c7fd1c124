"""additional_config.sequence_parallel_prefill: its default and its start-up validation (the
SP prefill itself runs over real processes in tests/distributed/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from ingot.engine.arg_utils import EngineArgs


def _config(path, tp=2, **additional):
    return EngineArgs(model=str(path), dtype="float32", skip_tokenizer_init=True,
                      max_model_len=64, tensor_parallel_size=tp,
                      additional_config=additional).create_engine_config()


def test_off_by_default_on_when_asked(tiny_llama_dir):
    assert not _config(tiny_llama_dir).parallel_config.sequence_parallel_prefill
    on = _config(tiny_llama_dir, sequence_parallel_prefill=True)
    assert on.parallel_config.sequence_parallel_prefill
    # One rank has nothing to split: accepted, and off.
    assert not _config(tiny_llama_dir, tp=1, sequence_parallel_prefill=True) \
        .parallel_config.sequence_parallel_prefill


@pytest.mark.parametrize("tp, additional, match", [
    (2, dict(sequence_parallel_prefill="yes"), "must be true or false"),
    (2, dict(sequence_parallel_prefill=True, enable_bucketing=False), "needs enable_bucketing"),
    (2, dict(sequence_parallel_prefill=True, num_batched_tokens_buckets=[2, 64]),
     r"prefill buckets \[2\] .*num_batched_tokens_buckets"),
    (4, dict(sequence_parallel_prefill=True, num_batched_tokens_buckets=[6, 16, 64]),
     r"prefill buckets \[6\] do not split over tensor_parallel_size 4"),
])
def test_bad_settings_name_what_to_change(tiny_llama_dir, tp, additional, match):
    with pytest.raises(ValueError, match=match):
        _config(tiny_llama_dir, tp=tp, **additional)


def test_the_same_buckets_pass_without_sequence_parallel(tiny_llama_dir):
    """The bucket rule is SP's: without it a bucket TP does not divide is fine, and kept."""
    config = _config(tiny_llama_dir, num_batched_tokens_buckets=[6, 16, 64], tp=4)
    assert config.buckets.num_batched_tokens_buckets == (6, 16, 64)
    par = config.parallel_config
    assert (par.tensor_parallel_size, par.sequence_parallel_prefill) == (4, False)


def test_refused_with_expert_parallel_across_replicas(tmp_path):
    from tiny import make_tiny_model

    path = make_tiny_model("qwen3_moe", tmp_path / "moe", vocab_size=259)
    with pytest.raises(ValueError, match="not supported yet with --enable-expert-parallel"):
        EngineArgs(model=str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                   tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True,
                   additional_config={"sequence_parallel_prefill": True}).create_engine_config()
