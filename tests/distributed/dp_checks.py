"""What each rank of a data-parallel sync test runs (TP 1, the world is the DP group): the DP
padding, the global unfinished flag and the busy loop with dummy steps, and the MoE layer under
cross-DP expert parallelism against a dense reference. Shared by the spawned gloo runs
(test_data_parallel_sync.py) and the single-process simulated group (tests/unit)."""

from __future__ import annotations

import torch

from ingot.distributed.data_parallel import (
    get_dp_padding,
    has_global_unfinished_reqs,
    run_busy_loop,
)
from ingot.distributed.group import GroupCoordinator
from ingot.model_executor.layers.fused_moe import FusedMoE, route

ATOL = 1e-5
HIDDEN, EXPERTS, INTER = 32, 4, 48


class CountingGroup(GroupCoordinator):
    """A group that counts the collectives asked of it (and forwards them)."""

    def __init__(self, inner: GroupCoordinator) -> None:
        self.__dict__.update(inner.__dict__)
        self.inner, self.calls = inner, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self.calls += 1
        return self.inner.all_gather(x, dim)


def padding(group: GroupCoordinator, counts: list[int]) -> None:
    """Replica r brings ``counts[r]`` tokens: it pads to the largest; without EP no
    collective happens at all."""
    r = group.rank_in_group
    pad, seen = get_dp_padding(counts[r], group, ep_enabled=True)
    assert seen is not None and seen.tolist() == counts, seen
    assert pad == max(counts) - counts[r], (pad, counts)
    counting = CountingGroup(group)
    assert get_dp_padding(counts[r], counting, ep_enabled=False) == (0, None)
    assert has_global_unfinished_reqs(counts[r] > 0, counting, ep_enabled=False) == (counts[r] > 0)
    assert counting.calls == 0, "a collective between replicas without EP"
    assert has_global_unfinished_reqs(r == 0, counting, ep_enabled=True)
    assert not has_global_unfinished_reqs(False, counting, ep_enabled=True)
    assert counting.calls == 2


def _layers(dp_group: GroupCoordinator) -> tuple[FusedMoE, FusedMoE]:
    """(the dense reference, this rank's cross-DP EP layer loaded from it)."""
    single = GroupCoordinator.single()
    ref = FusedMoE(EXPERTS, 2, HIDDEN, INTER, True, tp_group=single)
    gen = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        ref.gate.weight.mul_(5)  # sharp routing: tokens pick different experts
    dp = dp_group.world_size
    layer = FusedMoE(EXPERTS, 2, HIDDEN, INTER, True, tp_group=single, ep_size=dp,
                     dp_group=dp_group)
    for name, param in layer.named_parameters():
        param.weight_loader(param, dict(ref.named_parameters())[name].detach())
    return ref, layer


def cross_dp_moe(group: GroupCoordinator) -> None:
    """TP 1, DP = world, EP = world: each replica holds E / DP whole experts, brings different
    tokens (the same count) and gets back exactly its own tokens' MoE output."""
    r, dp = group.rank_in_group, group.world_size
    ref, layer = _layers(group)
    assert layer.w13.shape == (EXPERTS // dp, 2 * INTER, HIDDEN), layer.w13.shape
    assert layer.expert_start == r * EXPERTS // dp
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(30 + r))
    with torch.inference_mode():
        out = layer(x)
        torch.testing.assert_close(out, ref(x), atol=ATOL, rtol=0)
        # Deliberately broken: this replica's tokens through its own experts only (no
        # exchange between replicas) miss the other replicas' experts.
        _, ids = route(ref.gate(x), 2, True)
        assert not set(ids.flatten().tolist()) <= set(range(layer.expert_start,
                                                            layer.expert_start + EXPERTS // dp))
        alone = layer.experts(x, *route(layer.gate(x), 2, True))
        assert (alone - ref(x)).abs().max() > 1e-3, "no exchange and still equal"


def busy_loop(group: GroupCoordinator, steps: dict[int, int]) -> tuple[int, int]:
    """Replica r has ``steps[r]`` steps of work (a real step: 3 tokens through the cross-DP MoE
    layer, padded to the replicas' largest count). An idle replica runs dummy steps (1 token,
    padded up) until no replica has work. Returns (real steps, dummy steps) of this rank."""
    r = group.rank_in_group
    ref, layer = _layers(group)
    left = [steps.get(r, 0)]
    real = [0]

    def forward(num_tokens: int) -> None:
        pad, _ = get_dp_padding(num_tokens, group, ep_enabled=True)
        x = torch.randn(num_tokens + pad, HIDDEN, generator=torch.Generator().manual_seed(r))
        with torch.inference_mode():
            out = layer(x)
        torch.testing.assert_close(out[:num_tokens], ref(x)[:num_tokens], atol=ATOL, rtol=0)

    def step() -> None:
        forward(3)
        left[0] -= 1
        real[0] += 1

    dummies = run_busy_loop(lambda: left[0] > 0, step, lambda: forward(1), group,
                            ep_enabled=True)
    return real[0], dummies


def entry(rank: int, world: int, init_file: str, out_dir: str, plan: list) -> None:
    """torch.multiprocessing.spawn target: the world (gloo) is the DP group; runs ``plan``'s
    checks in order and records each outcome (and result) in ``out_dir/rank{r}.json``. A
    deadlock would end in gloo's timeout (60 s), not a hang."""
    import json
    import os
    import traceback
    from pathlib import Path

    from ingot.distributed import parallel_state

    torch.set_num_threads(1)
    group = parallel_state.init_distributed(world, rank, f"file://{init_file}", world,
                                            torch.device("cpu"), timeout_s=60)
    results: dict[str, object] = {}
    path = Path(out_dir) / f"rank{rank}.json"
    for name, args in plan:
        try:
            results[name] = ["ok", globals()[name](group, *args)]
        except BaseException:  # noqa: BLE001 - reported to the test through the file
            results[name] = [traceback.format_exc(), None]
            path.write_text(json.dumps(results))
            os._exit(1)
    path.write_text(json.dumps(results))
    parallel_state.destroy_distributed()
