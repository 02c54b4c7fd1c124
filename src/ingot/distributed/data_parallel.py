"""What data-parallel replicas agree on when expert parallelism spans them (spec §2-3): the
MoE layers then gather every replica's tokens, so every replica must run a step of the same
token count at the same time. Without EP nothing here communicates: the replicas' steps have
unrelated shapes (a 2048-token prefill beside a 1-token decode), and a collective between
them would be a bug.

- ``get_dp_padding``: each replica's token count at its own index of a ``[dp]`` tensor, summed
  over the DP group (an all-gather by all-reduce); a replica pads up to the largest. Counts
  [4, 1, 0] pad by [0, 3, 4]. It runs before attention metadata is built, so every input is
  built at the padded size.
- ``has_global_unfinished_reqs``: whether any replica has work (one more all-reduce per step).
- ``busy_loop_turn`` / ``run_busy_loop``: vLLM's ``DPEngineCoreProc.run_busy_loop``: while
  any replica has work, each steps; a replica with nothing of its own runs a dummy batch, so
  that its MoE layers meet the others' collectives instead of leaving them waiting. The
  engine-core processes of engine/dp_client.py take one turn per loop iteration.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ingot.distributed.group import GroupCoordinator


def _syncs(dp_group: GroupCoordinator | None, ep_enabled: bool) -> bool:
    return ep_enabled and dp_group is not None and dp_group.world_size > 1


def get_dp_padding(num_tokens: int, dp_group: GroupCoordinator | None, ep_enabled: bool,
                   ) -> tuple[int, torch.Tensor | None]:
    """(tokens to add, every replica's count) for this replica's step of ``num_tokens``;
    ``(0, None)`` without EP across replicas (no collective)."""
    if not _syncs(dp_group, ep_enabled):
        return 0, None
    assert dp_group is not None
    counts = torch.zeros(dp_group.world_size, dtype=torch.int64)
    counts[dp_group.rank_in_group] = num_tokens
    dp_group.all_reduce(counts)
    return int(counts.max()) - num_tokens, counts


def has_global_unfinished_reqs(local: bool, dp_group: GroupCoordinator | None,
                               ep_enabled: bool) -> bool:
    """Whether any replica has unfinished requests (without EP: this one's own answer)."""
    if not _syncs(dp_group, ep_enabled):
        return local
    assert dp_group is not None
    flag = torch.tensor([int(local)], dtype=torch.int64)
    dp_group.all_reduce(flag)
    return bool(flag.item())


def busy_loop_turn(has_work: Callable[[], bool], step: Callable[[], bool],
                   dummy_step: Callable[[], None], any_busy: Callable[[bool], bool]) -> bool:
    """One turn of the replicas' lockstep loop under EP across them (vLLM's
    ``DPEngineCoreProc.run_busy_loop``): agree whether any replica has work (``any_busy``, a
    DP all-reduce); if so, step, or run a dummy batch when this replica has nothing or its step
    ran no forward (``step`` returns whether it did), so that every replica's MoE layers meet
    the others' collectives. Returns whether any replica had work."""
    local = has_work()
    if not any_busy(local):
        return False
    if not (local and step()):
        dummy_step()
    return True


def run_busy_loop(has_work: Callable[[], bool], step: Callable[[], None],
                  dummy_step: Callable[[], None], dp_group: GroupCoordinator | None,
                  ep_enabled: bool) -> int:
    """Step until no replica has work; returns the dummy steps this replica ran. Without EP
    across replicas the loop is this replica's own and never runs a dummy step."""
    dummies = [0]

    def dummy() -> None:
        dummy_step()
        dummies[0] += 1

    def real() -> bool:
        step()
        return True

    if not _syncs(dp_group, ep_enabled):
        while has_work():
            step()
        return 0
    while busy_loop_turn(has_work, real, dummy,
                         lambda local: has_global_unfinished_reqs(local, dp_group, ep_enabled)):
        pass
    return dummies[0]
