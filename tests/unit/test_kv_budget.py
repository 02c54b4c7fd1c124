import pytest

from ingot.worker.kv_budget import GiB, compute_kv_budget, num_blocks_for_budget


def test_spec_example_is_capped_by_the_heuristic():
    # total 96 GiB, 20 GiB used, gmu 0.9: user budget 66.4 GiB, cap 25.92 GiB -> 25.92 GiB
    budget = compute_kv_budget(96 * GiB, 20 * GiB, 0.9, 0.30, 1.0)
    assert budget == int(int(96 * GiB * 0.9) * 0.30)
    assert budget / GiB == pytest.approx(25.92, abs=1e-6)


def test_large_model_is_limited_by_the_user_budget():
    # 80 GiB of weights: user budget 86.4 - 80 = 6.4 GiB < cap 25.92 GiB
    assert compute_kv_budget(96 * GiB, 80 * GiB, 0.9, 0.30, 1.0) == int(96 * GiB * 0.9) - 80 * GiB


@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_cap_fraction_out_of_range(cap):
    with pytest.raises(ValueError, match="CAP_FRACTION"):
        compute_kv_budget(96 * GiB, 20 * GiB, 0.9, cap, 1.0)


def test_budget_below_minimum_raises_and_zero_minimum_turns_the_guard_off():
    with pytest.raises(ValueError, match="below the minimum"):
        compute_kv_budget(4 * GiB, 3 * GiB, 0.9, 0.30, 1.0)
    assert compute_kv_budget(4 * GiB, 3 * GiB, 0.9, 0.30, 0.0) == int(4 * GiB * 0.9) - 3 * GiB


def test_gpu_memory_utilization_range():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        compute_kv_budget(96 * GiB, 0, 1.2)


def test_block_count_is_capped_by_what_can_be_used():
    assert num_blocks_for_budget(10 * 2**20, 2**20, 100) == 10
    assert num_blocks_for_budget(10 * 2**30, 2**20, 100) == 100
