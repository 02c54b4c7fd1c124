"""The DP padding, the global unfinished flag, the busy loop's dummy steps and cross-DP expert
parallelism in the MoE layer, on the single-process simulated group (ranks as threads); the
same checks run over gloo in tests/distributed/test_data_parallel_sync.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
import dp_checks  # noqa: E402

from ingot.distributed.simulated import run_simulated  # noqa: E402


@pytest.mark.parametrize("counts", [[4, 1], [4, 1, 0], [2, 2]])
def test_dp_padding(counts):
    run_simulated(len(counts), dp_checks.padding, counts)


@pytest.mark.parametrize("world", [2, 4])
def test_cross_dp_moe_gives_each_replica_its_own_tokens(world):
    run_simulated(world, dp_checks.cross_dp_moe)


def test_idle_replica_runs_dummy_steps_until_the_other_is_done():
    assert run_simulated(2, dp_checks.busy_loop, {0: 3}, timeout_s=60) == [(3, 0), (0, 3)]


def test_busy_loop_without_ep_runs_no_dummy_step():
    from ingot.distributed.data_parallel import run_busy_loop
    from ingot.distributed.group import GroupCoordinator

    counting = dp_checks.CountingGroup(GroupCoordinator.single())
    left = [2]

    def step() -> None:
        left[0] -= 1

    assert run_busy_loop(lambda: left[0] > 0, step, lambda: 1 / 0, counting, False) == 0
    assert left == [0] and counting.calls == 0
