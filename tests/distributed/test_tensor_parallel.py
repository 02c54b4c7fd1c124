"""Tensor parallelism over real torch.distributed (gloo, spawned processes, tiny fp32 models):
every sharded module equals its unsharded reference at world 2 and 4, loader shards
concatenate to the checkpoint tensors, the distributed argmax equals argmax of the full
logits (ties included), and the whole model's logits equal TP=1 within 1e-5 (GQA with
TP > KV heads); a rank-blind KV loader must break that comparison.

The checks run inside the ranks (tp_checks.py). Process start-up dominates on a shared 2-core
machine, so one spawn per world size runs every check and the tests read its outcomes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ingot.model_executor.layers.cpu_kernels import load_cpu_kernels

sys.path.insert(0, str(Path(__file__).parent))
import tp_checks  # noqa: E402
from paged_harness import PagedHarness  # noqa: E402
from tiny import make_tiny_model  # noqa: E402

# One spawn per world size runs every check: ~12 s (world 2) + ~13 s (world 4) here.
pytestmark = pytest.mark.slow

MODULE_CHECKS = {
    2: [("collectives", ()), ("shm_collectives", ()), ("linears", ()), ("qkv_loader", (4, 2)), ("qkv_loader", (4, 1)),
        ("attention_and_mlp", (2,)), ("attention_and_mlp", (1,)), ("vocab", (259,)),
        ("moe", (1,)), ("moe", (2,))],
    4: [("collectives", ()), ("shm_collectives", ()), ("linears", ()), ("qkv_loader", (8, 2)),
        ("attention_and_mlp", (2,)), ("attention_and_mlp", (4,)), ("vocab", (259,)),
        ("moe", (1,)), ("moe", (2,)), ("moe", (4,))],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """GQA Llamas with an odd vocab (the last shard padded) and biases: 1 KV head (TP 2 and 4
    > KV heads) and 2 KV heads (for the broken loader: a rank-blind KV shard differs)."""
    root = tmp_path_factory.mktemp("tp-models")
    common = dict(vocab_size=259, attention_bias=True, mlp_bias=True)
    models = {kv: make_tiny_model("llama", root / f"kv{kv}", num_key_value_heads=kv, **common)
              for kv in (1, 2)}
    # The other switches of the family: q/k norm (Qwen3), qkv bias (Qwen2), a tied head.
    models["qwen3"] = make_tiny_model("qwen3", root / "qwen3", vocab_size=259)
    models["qwen2"] = make_tiny_model("qwen2", root / "qwen2", vocab_size=259,
                                      num_key_value_heads=1)
    models["tied"] = make_tiny_model("llama", root / "tied", vocab_size=259,
                                     num_key_value_heads=1, tie_word_embeddings=True)
    # MoE: experts split by TP (Qwen3-MoE with a dense layer; Mixtral).
    models["qwen3_moe"] = make_tiny_model("qwen3_moe", root / "qwen3_moe", vocab_size=259)
    models["mixtral"] = make_tiny_model("mixtral", root / "mixtral", vocab_size=259)
    return models


def _run(tmp: Path, world: int, plan: list) -> dict[str, str]:
    """Spawn ``world`` ranks over ``plan``; the outcome of each check (``"ok"`` or the first
    failing rank's traceback; checks after a failure are missing)."""
    try:
        mp.spawn(tp_checks.entry, args=(world, str(tmp / "init"), str(tmp), plan),
                 nprocs=world, join=True)
    except Exception:  # noqa: BLE001 - the per-check files say what failed
        pass
    outcome: dict[str, str] = {}
    for rank in range(world):
        f = tmp / f"rank{rank}.json"
        for key, value in (json.loads(f.read_text()) if f.exists() else {}).items():
            if outcome.get(key, "ok") == "ok":
                outcome[key] = value if value == "ok" else f"rank {rank}: {value}"
    return outcome


@pytest.fixture(scope="module")
def world_runs(tmp_path_factory, models):
    runs = {}
    for world, checks in MODULE_CHECKS.items():
        tmp = tmp_path_factory.mktemp(f"tp{world}")
        plan = list(checks)
        if load_cpu_kernels() is not None:  # else test_moe_kernel_on_shards_... is a skip
            plan += [("moe", (*args, True)) for name, args in checks if name == "moe"]
        plan.append(("model_logits", (str(models[1]), str(tmp), "good")))
        for name, length in SP_CASES[world]:
            plan.append(("sp_model_logits", (str(models[name]), str(tmp), f"sp-{name}-{length}",
                                             length)))
        if world == 2:
            plan.append(("sp_model_logits", (str(models[1]), str(tmp), "sp-broken", 4, True)))
        if world == 2:
            plan.append(("model_logits", (str(models[2]), str(tmp), "broken", True)))
            plan += [("model_logits", (str(models[name]), str(tmp), name)) for name in VARIANTS]
        runs[world] = (tmp, _run(tmp, world, plan))
    return runs


def _assert_ok(world_runs, world: int, name: str, *args) -> None:  # noqa: ANN002
    key = tp_checks.check_key(name, args)
    outcome = world_runs[world][1].get(key, "not run: an earlier check failed")
    assert outcome == "ok", f"world {world}, {key}:\n{outcome}"


@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world_runs, world):
    _assert_ok(world_runs, world, "collectives")


@pytest.mark.parametrize("world", [2, 4])
def test_shared_memory_collectives_equal_gloo_and_the_rank_order_sum(world_runs, world):
    """Every rank is on this host, so the TP group's collectives take shared memory: 1x576,
    8x576, 2048x576 and a tensor larger than one slot, float32 and bfloat16."""
    _assert_ok(world_runs, world, "shm_collectives")


def test_shared_memory_all_reduce_with_a_dead_peer_raises(tmp_path):
    """Never a hang: rank 1 exits, rank 0's all-reduce fails naming it (the check is in the
    rank: a spawn failure is the test failing)."""
    mp.spawn(tp_checks.shm_dead_peer_entry, args=(2, str(tmp_path / "init")), nprocs=2,
             join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_column_row_gate_up_linears_and_a_rank_blind_loader(world_runs, world):
    _assert_ok(world_runs, world, "linears")


@pytest.mark.parametrize("world, heads, kv_heads", [(2, 4, 2), (2, 4, 1), (4, 8, 2)])
def test_qkv_loader_shards_concatenate(world_runs, world, heads, kv_heads):
    _assert_ok(world_runs, world, "qkv_loader", heads, kv_heads)


@pytest.mark.parametrize("world, kv_heads", [(2, 2), (2, 1), (4, 2), (4, 4)])
def test_attention_and_mlp_match_unsharded(world_runs, world, kv_heads):
    """kv_heads < world: each KV head replicated over world / kv_heads ranks."""
    _assert_ok(world_runs, world, "attention_and_mlp", kv_heads)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_embedding_lm_head_and_argmax(world_runs, world):
    _assert_ok(world_runs, world, "vocab", 259)


@pytest.mark.parametrize("world, ep_size", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_moe_layer_matches_unsharded(world_runs, world, ep_size):
    """TP of experts (ep_size 1), full EP and EP 2 x TP 2 inside world 4; under full EP a
    token routed only to rank 0's experts contributes exactly zero elsewhere."""
    _assert_ok(world_runs, world, "moe", ep_size)


@pytest.mark.needs_kernels
@pytest.mark.parametrize("world, ep_size", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_moe_kernel_on_shards_matches_unsharded(world_runs, world, ep_size):
    """ingot's fused expert kernel binds to every rank's shard (global expert ids, local
    experts) and gives the unsharded layer's output."""
    _assert_ok(world_runs, world, "moe", ep_size, True)


def _reference_logits(path: Path, prompt_len: int | None = None) -> torch.Tensor:
    prompt = (tp_checks.MODEL_PROMPT if prompt_len is None
              else (tp_checks.MODEL_PROMPT * 2)[:prompt_len])
    harness = PagedHarness(path)
    steps = list(harness.step([(0, prompt, 0)]))
    for i, tok in enumerate(tp_checks.MODEL_DECODE):
        steps += harness.step([(0, [tok], len(prompt) + i)])
    return torch.cat(steps)


# Sequence-parallel prefill: (model, prompt tokens) per world size; the spec's T = 4 at world 2.
SP_CASES = {2: [(1, 4), (1, 12), ("qwen3_moe", 12)], 4: [(1, 8), ("mixtral", 12)]}


@pytest.mark.parametrize("world, name, length",
                         [(w, n, t) for w, cases in SP_CASES.items() for n, t in cases])
def test_sequence_parallel_prefill_matches_tp1(world_runs, models, world, name, length):
    """SP prefill (reduce-scatter into [T/TP, H], all-gathers before attention and the MLP or
    MoE) then decode: TP 1's logits within 1e-5 and its greedy tokens; T = world and
    T = world + 1 raise (checked in the ranks)."""
    tmp, _ = world_runs[world]
    tag = f"sp-{name}-{length}"
    _assert_ok(world_runs, world, "sp_model_logits", str(models[name]), str(tmp), tag, length)
    got = torch.load(tmp / f"{tag}.pt")
    ref = _reference_logits(models[name], length)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_sequence_parallel_with_the_wrong_rows_breaks_the_logits(world_runs, models):
    """The gate can fail: each rank keeping the next rank's reduce-scattered rows."""
    tmp, _ = world_runs[2]
    _assert_ok(world_runs, 2, "sp_model_logits", str(models[1]), str(tmp), "sp-broken", 4, True)
    got = torch.load(tmp / "sp-broken.pt")
    assert (got - _reference_logits(models[1], 4)).abs().max() > 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_model_logits_match_tp1(world_runs, models, world):
    tmp, _ = world_runs[world]
    _assert_ok(world_runs, world, "model_logits", str(models[1]), str(tmp), "good")
    got = torch.load(tmp / "good.pt")
    ref = _reference_logits(models[1])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


VARIANTS = ("qwen3", "qwen2", "tied", "qwen3_moe", "mixtral")


@pytest.mark.parametrize("name", VARIANTS)
def test_family_variants_match_tp1_at_world_2(world_runs, models, name):
    tmp, _ = world_runs[2]
    _assert_ok(world_runs, 2, "model_logits", str(models[name]), str(tmp), name)
    got = torch.load(tmp / f"{name}.pt")
    torch.testing.assert_close(got, _reference_logits(models[name]), atol=1e-5, rtol=0)


def test_rank_blind_kv_loader_breaks_the_logits(world_runs, models):
    """The gate can fail: every rank loading KV shard 0 must change the logits."""
    tmp, _ = world_runs[2]
    _assert_ok(world_runs, 2, "model_logits", str(models[2]), str(tmp), "broken", True)
    got = torch.load(tmp / "broken.pt")
    assert (got - _reference_logits(models[2])).abs().max() > 1e-3
