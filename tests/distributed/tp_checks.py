"""What each rank of a spawned tensor-parallel test runs (gloo, CPU, fp32). Every check builds
the unsharded reference in-process (the single-process group) from the same seed, loads the
sharded module from the reference's full tensors through the per-parameter loaders, and
asserts inside the rank; a failure surfaces as the spawn's exception."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import transformers

from ingot.distributed import parallel_state
from ingot.distributed.group import GroupCoordinator
from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.bindable import Kernels
from ingot.model_executor.layers.fused_moe import FusedMoE, route
from ingot.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    sharding_weight_loader,
)
from ingot.model_executor.layers.rotary import RotaryEmbedding, rope_parameters_of
from ingot.model_executor.layers.vocab_parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    distributed_argmax,
)
from ingot.model_executor.models.llama import DecoderAttention, DecoderMLP, head_dim_of

ATOL = 1e-5


def entry(rank: int, world: int, init_file: str, out_dir: str,
          plan: list[tuple[str, tuple[Any, ...]]]) -> None:
    """torch.multiprocessing.spawn target: join the world, run the checks of ``plan`` in order
    (one process start for all of them: spawning is the slow part) and record each one's
    outcome in ``out_dir/rank{r}.json``. A failed check ends the rank at once, so the other
    ranks fail in their next collective instead of waiting on it."""
    torch.set_num_threads(1)  # several ranks share the test machine's cores
    group = parallel_state.init_distributed(world, rank, f"file://{init_file}", world,
                                            torch.device("cpu"), timeout_s=120)
    results: dict[str, str] = {}
    path = Path(out_dir) / f"rank{rank}.json"
    for name, args in plan:
        key = check_key(name, args)
        try:
            globals()[name](group, *args)
            results[key] = "ok"
        except BaseException:  # noqa: BLE001 - reported to the test through the file
            results[key] = traceback.format_exc()
            path.write_text(json.dumps(results))
            os._exit(1)
    path.write_text(json.dumps(results))
    parallel_state.destroy_distributed()


def check_key(name: str, args: tuple[Any, ...]) -> str:
    return f"{name}{tuple(a for a in args if not isinstance(a, str) or '/' not in a)}"


def _build(factory, group: GroupCoordinator | None):  # noqa: ANN001, ANN202
    """Build a module under ``group`` (None: the single-process reference)."""
    previous = parallel_state.get_tp_group()
    parallel_state.set_tp_group(group if group is not None else GroupCoordinator.single())
    try:
        return factory()
    finally:
        parallel_state.set_tp_group(previous)


def shm_dead_peer_entry(rank: int, world: int, init_file: str) -> None:
    """Rank 1 exits after the set-up; rank 0's next shared-memory all-reduce must raise
    naming it, within seconds, never wait forever."""
    import time

    torch.set_num_threads(1)
    group = parallel_state.init_distributed(world, rank, f"file://{init_file}", world,
                                            torch.device("cpu"), timeout_s=60)
    assert group.shm is not None
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        assert "rank(s) [1]" in str(exc) and "exited" in str(exc), exc
        assert time.monotonic() - start < 30
        os._exit(0)
    raise AssertionError("the all-reduce with a dead peer returned")


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _load_from(sharded: torch.nn.Module, reference: torch.nn.Module) -> None:
    full = dict(reference.named_parameters())
    for name, param in sharded.named_parameters():
        param.weight_loader(param, full[name].detach())


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


def _tiny_config(**kw: Any) -> Any:
    base = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-6, attention_bias=True, mlp_bias=True)
    return transformers.LlamaConfig(**{**base, **kw})


# ---- collectives ----------------------------------------------------------------------------


def collectives(group: GroupCoordinator) -> None:
    r, w = group.rank_in_group, group.world_size
    x = torch.full((2, 3), float(r + 1))
    assert torch.equal(group.all_reduce(x.clone()), torch.full((2, 3), w * (w + 1) / 2))
    gathered = group.all_gather(torch.tensor([[float(r)]]), dim=1)
    assert gathered.tolist() == [[float(i) for i in range(w)]]
    b = torch.tensor([float(r) + 7])
    assert group.broadcast(b, src=0).item() == 7.0
    full = torch.arange(w * 2, dtype=torch.float32) * (r + 1)
    expect = (torch.arange(w * 2, dtype=torch.float32) * w * (w + 1) / 2)[2 * r : 2 * r + 2]
    assert torch.equal(group.reduce_scatter(full, dim=0), expect)
    # all_to_all: rank r sends value 10*r + j to rank j.
    sent = torch.tensor([10.0 * r + j for j in range(w)])
    assert group.all_to_all(sent).tolist() == [10.0 * i + r for i in range(w)]


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The shared-memory path's definition: rank order, half types accumulated in float32."""
    acc = parts[0].float() if parts[0].dtype in (torch.bfloat16, torch.float16) else parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc.to(parts[0].dtype)


SHM_SHAPES = ((1, 576), (8, 576), (2048, 576), (4100, 576))  # the last: more than one slot


def shm_collectives(group: GroupCoordinator) -> None:
    """The shared-memory path (on: every rank is on this host) against gloo (the same process
    group without it) and against the exact rank-order sum, for decode- and prefill-sized
    tensors in float32 and bfloat16; bit-identical on every rank; the other collectives too."""
    r, w = group.rank_in_group, group.world_size
    assert group.shm is not None, "all ranks are on this host: the shm path should be on"
    gloo = GroupCoordinator(group.ranks, group.rank, group.device_group, group.backend)
    assert gloo.shm is None
    rounds = group.shm.rounds
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHM_SHAPES:
            parts = [torch.randn(shape, generator=torch.Generator().manual_seed(100 + j)).to(dtype)
                     for j in range(w)]
            got = group.all_reduce(parts[r].clone())
            what = f"all_reduce {dtype} {shape}"
            assert torch.equal(got, _rank_order_sum(parts)), f"{what}: not the rank-order sum"
            # Every rank holds the same bits (compared over gloo).
            assert torch.equal(gloo.broadcast(got.clone(), 0), got), f"{what}: ranks differ"
            ref = gloo.all_reduce(parts[r].clone())
            if w == 2:  # one addition: any order gives the same bits
                assert torch.equal(got, ref), f"{what}: differs from gloo"
            else:  # gloo's order is its own; on exactly representable sums it must agree
                torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.02)
                ints = [torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(j))
                        .to(dtype) for j in range(w)]
                assert torch.equal(group.all_reduce(ints[r].clone()),
                                   gloo.all_reduce(ints[r].clone())), f"{what}: exact sums"
    assert group.shm.rounds > rounds, "the collectives did not go through shared memory"
    # The exactness gate can fail: another summation order changes float32 bits at world 4.
    if w == 4:
        parts = [torch.randn(2048, 576, generator=torch.Generator().manual_seed(100 + j))
                 for j in range(w)]
        assert not torch.equal(_rank_order_sum(parts), _rank_order_sum(parts[::-1]))
    # reduce_scatter (each rank sums its rows only), all_gather, broadcast, all_to_all: gloo's.
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randint(-8, 8, (8 * w, 576), generator=torch.Generator().manual_seed(r)).to(dtype)
        assert torch.equal(group.reduce_scatter(x, 0), gloo.reduce_scatter(x, 0))
        for dim in (0, 1, -1):
            assert torch.equal(group.all_gather(x, dim), gloo.all_gather(x, dim))
        b = x.clone() + r
        assert torch.equal(group.broadcast(b.clone(), 1), gloo.broadcast(b.clone(), 1))
    pairs = torch.tensor([[[1.5, float(r)]]], dtype=torch.float64)  # the argmax's (value, index)
    assert torch.equal(group.all_gather(pairs, 0), gloo.all_gather(pairs, 0))
    big = torch.randn(4100, 576, generator=torch.Generator().manual_seed(r))  # > a slot: gloo
    assert torch.equal(group.all_gather(big, 0), gloo.all_gather(big, 0))
    group.barrier()


# ---- sharded modules vs their unsharded reference --------------------------------------------


def linears(group: GroupCoordinator) -> None:
    r, w = group.rank_in_group, group.world_size
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    # Column-parallel: this rank's slice of the output; the loaded shards concatenate back.
    ref = _build(lambda: ColumnParallelLinear(32, 48, bias=True), None)
    _randomise(ref, 2)
    col = _build(lambda: ColumnParallelLinear(32, 48, bias=True), group)
    _load_from(col, ref)
    per = 48 // w
    _close(col(x), ref(x)[:, r * per : (r + 1) * per], "column-parallel output")
    _close(group.all_gather(col.weight.data, dim=0), ref.weight.data, "column shards")
    # Row-parallel: the all-reduced output on every rank, bias counted once.
    ref = _build(lambda: RowParallelLinear(32, 24, bias=True), None)
    _randomise(ref, 3)
    row = _build(lambda: RowParallelLinear(32, 24, bias=True), group)
    _load_from(row, ref)
    _close(row(x[:, r * 32 // w : (r + 1) * 32 // w]), ref(x), "row-parallel output")
    _close(group.all_gather(row.weight.data, dim=1), ref.weight.data, "row shards")
    # Deliberately broken: a loader that skips the rank offset must give a different output.
    bad = _build(lambda: RowParallelLinear(32, 24, bias=True), group)
    bad.weight.weight_loader = sharding_weight_loader(1, 0, w)
    _load_from(bad, ref)
    broken = bad(x[:, r * 32 // w : (r + 1) * 32 // w])
    assert (broken - ref(x)).abs().max() > 1e-2, "a rank-blind loader went unnoticed"
    # Gate-up from separate checkpoint tensors: both parts sharded, laid end to end.
    gate, up = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(4))
    merged = _build(lambda: MergedColumnParallelLinear(32, [64, 64]), group)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    per = 64 // w
    _close(merged.weight.data, torch.cat([gate[r * per : (r + 1) * per],
                                          up[r * per : (r + 1) * per]]), "gate-up shard")


def qkv_loader(group: GroupCoordinator, num_heads: int, num_kv_heads: int) -> None:
    """QKV shards: q concatenates to the checkpoint's q; k/v too, each replica taken once when
    TP > num_kv_heads."""
    w, hd = group.world_size, 8
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(num_heads * hd, 32, generator=gen)
    k, v = torch.randn(2, num_kv_heads * hd, 32, generator=gen)
    layer = _build(lambda: QKVParallelLinear(32, hd, num_heads, num_kv_heads), group)
    for shard_id, t in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, t, shard_id)
    mq, mk, mv = layer.weight.data.split([layer.q_size, layer.kv_size, layer.kv_size])
    _close(group.all_gather(mq, 0), q, "q shards")
    replicas = max(1, w // num_kv_heads)
    for mine, full, what in ((mk, k, "k"), (mv, v, "v")):
        parts = group.all_gather(mine.unsqueeze(0), 0)  # [world, kv_size, 32]
        _close(torch.cat(list(parts[::replicas])), full, f"{what} shards")


def _attention_step(attn: DecoderAttention, cache: torch.Tensor, hidden: torch.Tensor,
                    start: int) -> torch.Tensor:
    """One step of one request over blocks 1, 2, 3 (block size 4) of ``cache``."""
    n = hidden.shape[0]
    positions = torch.arange(start, start + n)
    table = torch.tensor([[1, 2, 3]])
    slots = table[0, positions // 4] * 4 + positions % 4
    meta = AttentionMetadata.build(positions, [n], slots, table, is_decode=n == 1)
    return attn(positions, hidden, cache, meta)


def attention_and_mlp(group: GroupCoordinator, num_kv_heads: int) -> None:
    """QKV -> RoPE -> paged attention -> O (row-parallel) and the MLP, prefill of 6 tokens then
    2 decode steps, equal to the unsharded layers; the KV cache holds this rank's heads."""
    config = _tiny_config(num_key_value_heads=num_kv_heads)
    rotary = RotaryEmbedding(head_dim_of(config), 64, rope_parameters_of(config))
    ref = _build(lambda: DecoderAttention(config, rotary, False, (True, True)), None)
    _randomise(ref, 6)
    tp = _build(lambda: DecoderAttention(config, rotary, False, (True, True)), group)
    _load_from(tp, ref)
    hd = head_dim_of(config)
    assert tp.num_heads == config.num_attention_heads // group.world_size
    assert tp.num_kv_heads == max(1, num_kv_heads // group.world_size)
    ref_cache = torch.zeros(2, 4, 4, num_kv_heads, hd)
    tp_cache = torch.zeros(2, 4, 4, tp.num_kv_heads, hd)
    gen = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for start, n in ((0, 6), (6, 1), (7, 1)):
            h = torch.randn(n, 64, generator=gen)
            _close(_attention_step(tp, tp_cache, h, start),
                   _attention_step(ref, ref_cache, h, start), f"attention at {start}")
        mref = _build(lambda: DecoderMLP(config), None)
        _randomise(mref, 8)
        mtp = _build(lambda: DecoderMLP(config), group)
        _load_from(mtp, mref)
        h = torch.randn(5, 64, generator=gen)
        _close(mtp(h), mref(h), "MLP")


def moe(group: GroupCoordinator, ep_size: int = 1, kernel: bool = False) -> None:
    """The MoE layer under TP of experts (``ep_size`` 1: every expert, its intermediate slice)
    or EP (whole experts in contiguous blocks, the intermediate split over the partition's
    ranks), loaded from per-expert checkpoint tensors: output equal to the unsharded layer,
    the spec's shapes, shards that concatenate back, and under full EP a token routed only to
    rank 0's experts contributes exactly zero on the other ranks. ``kernel``: then the same on
    ingot's fused expert kernel, which must bind to this rank's shard (the test asks for this
    check only where the kernels load; elsewhere it is a reported skip)."""
    w, r = group.world_size, group.rank_in_group
    experts, inter, hidden = 8, 48, 32
    ref = _build(lambda: FusedMoE(experts, 2, hidden, inter, True), None)
    _randomise(ref, 13)
    with torch.no_grad():
        ref.gate.weight.mul_(5)  # sharp routing: tokens pick different experts
    layer = _build(lambda: FusedMoE(experts, 2, hidden, inter, True, ep_size=ep_size), group)
    local_e, shards = experts // ep_size, w // ep_size
    assert layer.w13.shape == (local_e, 2 * inter // shards, hidden), layer.w13.shape
    assert layer.w2.shape == (local_e, hidden, inter // shards)
    for e in range(experts):  # the checkpoint's per-expert tensors
        layer.w13.weight_loader(layer.w13, ref.w13[e, :inter].detach(), 0, e)
        layer.w13.weight_loader(layer.w13, ref.w13[e, inter:].detach(), 1, e)
        layer.w2.weight_loader(layer.w2, ref.w2[e].detach(), 2, e)
    layer.gate.weight.weight_loader(layer.gate.weight, ref.gate.weight.detach())
    x = torch.randn(13, hidden, generator=torch.Generator().manual_seed(14))
    with torch.inference_mode():
        weights, ids = route(ref.gate(x), 2, True)
        assert len(set(ids.flatten().tolist())) == experts, "every expert should get tokens"
        _close(layer(x), ref(x), f"MoE (ep_size {ep_size})")
        if ep_size == 1:
            # down shards concatenate back along the intermediate dim
            _close(group.all_gather(layer.w2.data, dim=2), ref.w2.data, "down shards")
        # HF 5's fused [E, 2I, H] / [E, H, I] tensors load to the same shards.
        fused = _build(lambda: FusedMoE(experts, 2, hidden, inter, True, ep_size=ep_size), group)
        _load_from(fused, ref)
        assert torch.equal(fused.w13, layer.w13) and torch.equal(fused.w2, layer.w2)
        if shards > 1:
            # Deliberately broken: every rank of a partition loading intermediate shard 0.
            blind = _build(lambda: FusedMoE(experts, 2, hidden, inter, True, ep_size=ep_size),
                           group)
            blind.shard_index = 0
            _load_from(blind, ref)
            assert (blind(x) - ref(x)).abs().max() > 1e-3, "a rank-blind expert loader passed"
        only_rank0 = torch.randint(0, local_e, ids.shape,
                                   generator=torch.Generator().manual_seed(15))
        if ep_size == w and w > 1:
            part = layer.experts(x, weights, only_rank0)
            if r == 0:
                _close(part, ref.experts(x, weights, only_rank0), "rank 0's experts")
            else:
                assert torch.equal(part, torch.zeros_like(part)), "nonzero off-rank output"
        if not kernel:
            return
        # ingot's fused expert kernel on this rank's shard (global ids, local experts).
        assert layer.bind_kernels(Kernels(cpu=True)), "the fused expert kernel did not bind"
        assert layer.kernel_weights is not None
        _close(layer(x), ref(x), f"MoE kernel (ep_size {ep_size})")
        if ep_size == w and w > 1 and r > 0:
            part = layer.experts(x, weights, only_rank0)
            assert torch.equal(part, torch.zeros_like(part)), "nonzero off-rank kernel output"


def vocab(group: GroupCoordinator, vocab_size: int) -> None:
    """Embedding with tokens on every shard (an uneven vocab: the last shard is padded), the LM
    head's gathered logits, and the greedy argmax over shards without gathering."""
    r = group.rank_in_group
    ref_emb = _build(lambda: VocabParallelEmbedding(vocab_size, 16), None)
    _randomise(ref_emb, 9)
    emb = _build(lambda: VocabParallelEmbedding(vocab_size, 16), group)
    _load_from(emb, ref_emb)
    ids = torch.tensor([0, 1, vocab_size // 2, vocab_size // 2 + 1, vocab_size - 2, vocab_size - 1])
    starts = group.all_gather(torch.tensor([emb.vocab_start]), 0).tolist()
    assert len({sum(s <= int(t) for s in starts) for t in ids}) == group.world_size, \
        "the token ids must land on every shard"
    with torch.inference_mode():
        _close(emb(ids), ref_emb(ids), "embedding")
    ref_head = _build(lambda: ParallelLMHead(16, vocab_size), None)
    _randomise(ref_head, 10)
    head = _build(lambda: ParallelLMHead(16, vocab_size), group)
    _load_from(head, ref_head)
    h = torch.randn(4, 16, generator=torch.Generator().manual_seed(11))
    full = ref_head(h)
    _close(head.gather(head(h)), full, "LM head logits")
    assert torch.equal(head.greedy(head(h)), full.argmax(-1)), "distributed argmax"
    # Ties: the lowest token id wins, within a shard and across shards.
    logits = torch.zeros(4, vocab_size)
    logits[0, [3, vocab_size - 1]] = 5.0  # across the first and the last shard
    logits[1, [vocab_size - 3, vocab_size - 2]] = 2.0  # inside the last shard
    logits[3, vocab_size - 1] = 1.0  # only on the last shard; row 2: all equal -> 0
    local = logits[:, head.vocab_start : head.vocab_start + head.num_real]
    got = distributed_argmax(local, head.vocab_start, group)
    assert got.tolist() == logits.argmax(-1).tolist() == [3, vocab_size - 3, 0, vocab_size - 1], \
        (r, got.tolist())


def model_logits(group: GroupCoordinator, model_dir: str, out_dir: str, tag: str,
                 broken: bool = False) -> torch.nn.Module:
    """The whole model from its checkpoint (separate q/k/v, gate/up tensors) on this rank's
    shard: prefill + teacher-forced decode logits (gathered: the same on every rank), saved
    as ``out_dir/{tag}.pt`` for the parent to compare with TP=1. ``broken``: the KV shard
    loader ignores the rank (the comparison must catch it). Returns this rank's model."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from paged_harness import PagedHarness

    original = QKVParallelLinear._source_shard
    if broken:
        def rank_blind(self: QKVParallelLinear, i: int) -> tuple[int, int]:
            index, count = original(self, i)
            return (0, count) if i > 0 else (index, count)

        QKVParallelLinear._source_shard = rank_blind
    parallel_state.set_tp_group(group)
    try:
        harness = PagedHarness(model_dir)
    finally:
        QKVParallelLinear._source_shard = original
        parallel_state.set_tp_group(None)
    steps = list(harness.step([(0, MODEL_PROMPT, 0)]))
    for i, tok in enumerate(MODEL_DECODE):
        steps += harness.step([(0, [tok], len(MODEL_PROMPT) + i)])
    out = torch.cat(steps)
    torch.testing.assert_close(out, group.broadcast(out.clone(), 0), atol=0, rtol=0)
    hidden = torch.randn(3, harness.hf_config.hidden_size,
                         generator=torch.Generator().manual_seed(12))
    with torch.inference_mode():
        full = harness.model.compute_logits(hidden)
        assert torch.equal(harness.model.greedy_token_ids(hidden), full.argmax(-1))
    if group.rank_in_group == 0:
        torch.save(out, os.path.join(out_dir, f"{tag}.pt"))
    return harness.model  # this rank's, for shape checks under the simulated group


def sp_model_logits(group: GroupCoordinator, model_dir: str, out_dir: str, tag: str,
                    prompt_len: int, broken: bool = False) -> None:
    """The model with sequence-parallel prefill: a prompt of ``prompt_len`` tokens (its
    prefill in SP layout: one reduce-scatter for the embedding and per row-parallel output)
    then teacher-forced decode steps (all-reduce), saved as ``out_dir/{tag}.pt`` for the
    parent to compare with TP=1. Prompts of ``world`` tokens (not more than the ranks) and
    ``world + 1`` (not a multiple) must raise, naming the bucket flag. ``broken``: every rank
    keeps the next rank's rows of each reduce-scatter (the comparison must catch it)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from paged_harness import PagedHarness

    w, r = group.world_size, group.rank_in_group
    parallel_state.set_tp_group(group)
    parallel_state.set_sequence_parallel(True)
    try:
        harness = PagedHarness(model_dir)
    finally:
        parallel_state.set_tp_group(None)
        parallel_state.set_sequence_parallel(None)
    assert harness.model.model.sequence_parallel
    calls = []
    original = group.reduce_scatter

    def counting(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        calls.append(tuple(x.shape))
        if broken:
            rows = x.shape[0] // w
            return group.all_reduce(x.clone()).narrow(0, (r + 1) % w * rows, rows)
        return original(x, dim)

    group.reduce_scatter = counting
    try:
        for bad in (w, w + 1):
            try:
                harness.step([(99 + bad, MODEL_PROMPT[:bad], 0)])
            except ValueError as exc:
                assert "num_batched_tokens_buckets" in str(exc), exc
            else:
                raise AssertionError(f"an SP prefill of {bad} tokens over {w} ranks ran")
        calls.clear()
        prompt = (MODEL_PROMPT * 2)[:prompt_len]
        steps = list(harness.step([(0, prompt, 0)]))
        layers = harness.hf_config.num_hidden_layers
        assert calls == [(prompt_len, harness.hf_config.hidden_size)] * (1 + 2 * layers), calls
        for i, tok in enumerate(MODEL_DECODE):
            steps += harness.step([(0, [tok], prompt_len + i)])
        assert len(calls) == 1 + 2 * layers, "decode steps must not reduce-scatter"
    finally:
        group.reduce_scatter = original
    out = torch.cat(steps)
    torch.testing.assert_close(out, group.broadcast(out.clone(), 0), atol=0, rtol=0)
    if r == 0:
        torch.save(out, os.path.join(out_dir, f"{tag}.pt"))


MODEL_PROMPT = [3, 17, 92, 45, 200, 11, 8, 250, 77, 5, 133]
MODEL_DECODE = [5, 9, 200, 31]
