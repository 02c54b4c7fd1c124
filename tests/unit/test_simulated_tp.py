"""The sharded modules under the single-process simulated group (ranks as threads): the same
checks as the spawned gloo tests (tests/distributed/tp_checks.py), in a fraction of the time,
at world sizes 2 and 4; and the simulated group itself fails loudly rather than hanging."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ingot.distributed.simulated import run_simulated

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
import tp_checks  # noqa: E402

CHECKS = [
    (2, "collectives", ()), (4, "collectives", ()),
    (2, "linears", ()), (4, "linears", ()),
    (2, "qkv_loader", (4, 1)), (4, "qkv_loader", (8, 2)),
    (2, "attention_and_mlp", (1,)), (4, "attention_and_mlp", (2,)),
    (2, "vocab", (259,)), (4, "vocab", (259,)),
    (2, "moe", (1,)), (4, "moe", (1,)), (2, "moe", (2,)), (4, "moe", (4,)), (4, "moe", (2,)),
]


@pytest.mark.parametrize("world, check, args", CHECKS,
                         ids=[f"{c}-w{w}-{a}" for w, c, a in CHECKS])
def test_sharded_modules_under_the_simulated_group(world, check, args):
    torch.set_num_threads(1)
    run_simulated(world, getattr(tp_checks, check), *args)


def test_a_failing_rank_releases_the_others():
    def fn(group):  # noqa: ANN001, ANN202
        if group.rank_in_group == 1:
            raise RuntimeError("rank 1 broke")
        group.all_reduce(torch.ones(2))  # would wait for rank 1 forever

    with pytest.raises(RuntimeError, match="rank 1 broke"):
        run_simulated(2, fn, timeout_s=20)


def test_simulated_sum_is_identical_on_every_rank():
    def fn(group):  # noqa: ANN001, ANN202
        x = torch.randn(64, generator=torch.Generator().manual_seed(group.rank_in_group))
        return group.all_reduce(x)

    a, b, c = run_simulated(3, fn)
    assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.parametrize("world, arch, ep", [
    (2, "qwen3_moe", 1), (2, "mixtral", 1), (4, "qwen3_moe", 1),  # TP of experts
    (2, "qwen3_moe", 2), (2, "mixtral", 2), (4, "mixtral", 2), (4, "mixtral", 4),  # EP
])
def test_moe_model_logits_under_tp_equal_tp1(tmp_path, world, arch, ep):
    """The whole MoE model from its per-expert checkpoint on each rank's shard (prefill and
    teacher-forced decode) gives TP=1's logits within 1e-5, with and without EP."""
    from paged_harness import PagedHarness
    from tiny import make_tiny_model

    from ingot.distributed.parallel_state import set_ep_size

    torch.set_num_threads(1)
    path = make_tiny_model(arch, tmp_path / "model", vocab_size=259)

    def fn(group):  # noqa: ANN001, ANN202
        set_ep_size(ep, this_thread_only=True)
        try:
            model = tp_checks.model_logits(group, str(path), str(tmp_path), "tp")
            layer = next(m for m in model.modules() if hasattr(m, "w13"))
            return layer.num_local_experts, tuple(layer.w13.shape)
        finally:
            set_ep_size(None, this_thread_only=True)

    shapes = run_simulated(world, fn)
    assert all(n == 4 // ep for n, _ in shapes)
    harness = PagedHarness(path)
    steps = list(harness.step([(0, tp_checks.MODEL_PROMPT, 0)]))
    for i, tok in enumerate(tp_checks.MODEL_DECODE):
        steps += harness.step([(0, [tok], len(tp_checks.MODEL_PROMPT) + i)])
    ref = torch.cat(steps)
    got = torch.load(tmp_path / "tp.pt")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
