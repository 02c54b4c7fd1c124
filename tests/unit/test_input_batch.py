"""The runner's persistent input batch (worker/input_batch.py): rows that live as long as their
request and are reused, a block table extended in place and gathered per step, growth past its
first size, and sampling metadata kept exactly while the batch's requests stay the same."""

from __future__ import annotations

from ingot.model_executor.layers.sampler import SamplingMetadata
from ingot.sampling_params import SamplingParams
from ingot.sched_output import NULL_BLOCK_ID
from ingot.worker.input_batch import InputBatch


def test_rows_hold_block_ids_and_a_step_gathers_them():
    batch = InputBatch(max_num_reqs=2, max_blocks_per_req=3)
    batch.add("a")
    batch.add("b")
    batch.append_block_ids("a", [5, 6])
    batch.append_block_ids("b", [9])
    batch.append_block_ids("a", [7])  # a later step's new block
    assert batch.block_ids("a") == [5, 6, 7] and batch.block_ids("b") == [9]
    rows = batch.rows(["b", "a"])
    assert batch.max_num_blocks(rows) == 3
    # Two real rows, then a padded batch's dummy row; one column wider than the table.
    table = batch.table(rows, num_rows=3, width=4)
    n = NULL_BLOCK_ID
    assert table.tolist() == [[9, n, n, n], [5, 6, 7, n], [n, n, n, n]]


def test_a_finished_request_frees_its_row_for_the_next_one_clean():
    batch = InputBatch(max_num_reqs=1, max_blocks_per_req=2)
    row = batch.add("a")
    batch.append_block_ids("a", [3, 4])
    batch.remove("a")
    assert batch.add("b") == row and batch.block_ids("b") == []
    assert batch.table(batch.rows(["b"]), 1, 2).tolist() == [[NULL_BLOCK_ID] * 2]
    batch.remove("missing")  # an id the runner never saw (aborted before scheduling): no-op
    assert batch.num_reqs == 1


def test_rows_and_blocks_grow_past_the_first_size():
    batch = InputBatch(max_num_reqs=1, max_blocks_per_req=1)
    for i in range(5):
        batch.add(f"r{i}")
        batch.append_block_ids(f"r{i}", list(range(10 * i + 1, 10 * i + 1 + i + 1)))
    assert [batch.block_ids(f"r{i}") for i in range(5)] == [
        list(range(10 * i + 1, 10 * i + 2 + i)) for i in range(5)]
    assert len(set(batch.row_of.values())) == 5


def _metadata(params, outputs):
    return SamplingMetadata.from_params(params, outputs, [[1, 2]] * len(params), {}, 50, "cpu")


def test_sampling_metadata_is_kept_while_the_requests_stay_the_same():
    batch = InputBatch(4, 4)
    for r in "ab":
        batch.add(r)
    outputs = [[], []]
    params = [SamplingParams(temperature=0, min_tokens=2), SamplingParams(temperature=0)]
    built = []

    def build():
        built.append(_metadata(params, outputs))
        return built[-1]

    first = batch.sampling_metadata(["a", "b"], build)
    assert first.min_tokens.keys() == {0} and not first.argmax_only
    outputs[0].extend([7, 8])  # request a reaches its min_tokens
    again = batch.sampling_metadata(["a", "b"], build)
    assert again is first and len(built) == 1
    assert again.min_tokens == {} and again.argmax_only
    # Another order, another request set, or a finished request: built anew.
    assert batch.sampling_metadata(["b", "a"], build) is built[-1] and len(built) == 2
    batch.sampling_metadata(["b", "a"], build)
    batch.remove("a")
    batch.sampling_metadata(["b", "a"], build)
    assert len(built) == 3
