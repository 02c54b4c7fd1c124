import pytest

from ingot.buckets import (
    BucketGrid,
    default_num_batched_tokens_buckets,
    default_num_seqs_buckets,
    get_bucket_for_count,
    select_ctx_bucket,
    validate_buckets,
    validate_ctx_buckets,
)


def test_defaults_from_the_spec():
    assert default_num_batched_tokens_buckets(2048, 8192) == [128, 256, 512, 1024, 2048]
    assert default_num_batched_tokens_buckets(8192, 4096) == [128, 256, 512, 1024, 2048, 4096]
    assert default_num_batched_tokens_buckets(100, 8192) == [100]
    assert default_num_seqs_buckets(6) == [1, 2, 4, 6]
    assert default_num_seqs_buckets(8) == [1, 2, 4, 8]
    assert default_num_seqs_buckets(1) == [1]


@pytest.mark.parametrize("n, bucket", [(50, 128), (127, 128), (128, 128), (129, 256), (1500, 2048)])
def test_prefill_lookup(n, bucket):
    assert get_bucket_for_count(n, [128, 256, 512, 1024, 2048]) == bucket


def test_lookup_edges(caplog):
    assert get_bucket_for_count(129, [128, 256, 512, 1024]) == 256
    assert get_bucket_for_count(0, [128, 256]) == 128
    assert get_bucket_for_count(2000, [128, 256, 512, 1024]) == 1024
    assert "exceeds every bucket" in caplog.text


def test_decode_padding_amounts():
    # Padding for n = 1..8 with buckets [1, 2, 4, 8]: 0, 0, 1, 0, 3, 2, 1, 0.
    pads = [get_bucket_for_count(n, [1, 2, 4, 8]) - n for n in range(1, 9)]
    assert pads == [0, 0, 1, 0, 3, 2, 1, 0]


@pytest.mark.parametrize(
    "buckets, match",
    [
        ([], "non-empty"),
        ([1, 2.5, 4], "positive integers"),
        ([True, 2, 4], "positive integers"),
        ([0, 2, 4], "positive integers"),
        ([4, 2, 8], "strictly ascending"),
        ([2, 2, 8], "strictly ascending"),
        ([1, 2, 4], "end exactly at"),
        ("1,2,8", "non-empty list"),
    ],
)
def test_validator_rejects(buckets, match):
    with pytest.raises(ValueError, match=match):
        validate_buckets("num_seqs_buckets", buckets, 8, "max_num_seqs")


@pytest.mark.parametrize("buckets", [[256, 128], [100], [8192], [True], []])
def test_ctx_validator_rejects(buckets):
    with pytest.raises(ValueError, match="decode_context_length_buckets"):
        validate_ctx_buckets(buckets, 8192)


def test_ctx_bucket_selection_at_the_boundaries():
    buckets, max_len = [1024, 2048, 4096], 8192
    assert select_ctx_bucket(4095, buckets, max_len) == 4096
    assert select_ctx_bucket(4096, buckets, max_len) == 4096
    # needed = computed + 1 (+ speculative tokens): 4096 computed needs 4097
    assert select_ctx_bucket(4096 + 1, buckets, max_len) == 8192
    assert select_ctx_bucket(4093 + 1 + 3, buckets, max_len) == 8192  # with k = 3
    assert select_ctx_bucket(1, buckets, max_len) == 1024
    assert select_ctx_bucket(9000, buckets, max_len) == 8192
    assert select_ctx_bucket(10, None, max_len) == 8192  # off: always max_model_len


def test_grid_from_additional_config():
    grid = BucketGrid.from_config({"num_seqs_buckets": [2, 8]}, 2048, 8, 4096, 32)
    assert grid.num_seqs_buckets == (2, 8)
    assert grid.decode_bucket(1) == 2 and grid.decode_bucket(3) == 8
    assert grid.num_batched_tokens_buckets == (128, 256, 512, 1024, 2048)
    # Unset: the default ladder (powers of two from 256 below max_model_len); null: off.
    assert grid.decode_context_length_buckets == (256, 512, 1024, 2048)
    assert grid.decode_ctx_bucket(129) == 256 and grid.decode_ctx_bucket(2049) == 4096
    no_ctx = BucketGrid.from_config({"decode_context_length_buckets": None}, 2048, 8, 4096, 32)
    assert "decode context buckets off" in no_ctx.describe()
    assert no_ctx.decode_ctx_bucket(10) == 4096
    small = BucketGrid.from_config({}, 256, 8, 256, 32)
    assert small.decode_context_length_buckets is None  # nothing below max_model_len
    off = BucketGrid.from_config({"enable_bucketing": False}, 2048, 8, 4096, 32)
    assert off.decode_bucket(3) == 3 and off.prefill_bucket(77) == 77
    with pytest.raises(ValueError, match="num_batched_tokens_buckets must end exactly"):
        BucketGrid.from_config({"num_batched_tokens_buckets": [128, 1024]}, 2048, 8, 4096, 32)
    with pytest.raises(ValueError, match="enable_bucketing"):
        BucketGrid.from_config({"enable_bucketing": "yes"}, 2048, 8, 4096, 32)
