"""Rank layouts and parallel-flag validation (spec §0-3), pure functions, no processes."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from ingot.cli.main import build_parser
from ingot.distributed.layouts import (
    ParallelSizes,
    dp_column_group_ranks,
    ep_group_ranks,
    ep_rank_of,
    ep_tp_group_ranks,
    kv_head_start,
    kv_heads_per_rank,
    local_expert_range,
    tp_group_ranks,
    validate_parallel_sizes,
)
from ingot.engine.arg_utils import EngineArgs


def test_tp_groups_are_contiguous():
    assert tp_group_ranks(16, 8) == [list(range(8)), list(range(8, 16))]
    assert tp_group_ranks(4, 4) == [[0, 1, 2, 3]]
    assert tp_group_ranks(3, 1) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        tp_group_ranks(8, 3)


def test_dp_columns_are_strided():
    # --tensor-parallel-size 8 --data-parallel-size 4: 32 ranks, 8 DP groups of 4.
    groups = dp_column_group_ranks(32, 8, 4)
    assert len(groups) == 8
    assert groups[0] == [0, 8, 16, 24]
    assert groups[7] == [7, 15, 23, 31]
    assert sorted(r for g in groups for r in g) == list(range(32))
    with pytest.raises(ValueError):
        dp_column_group_ranks(30, 8, 4)


def test_ep_groups_for_8_ranks():
    ranks = list(range(8))
    # Full EP: one EP group of all, single-rank EP-TP groups.
    assert ep_group_ranks(ranks, 8) == [ranks]
    assert ep_tp_group_ranks(ranks, 8) == [[r] for r in ranks]
    # ep_degree 2: the TP sub-group inside each partition, EP strided across them.
    assert ep_tp_group_ranks(ranks, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ep_group_ranks(ranks, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [ep_rank_of(r, 8, 2) for r in ranks] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_ep_groups_for_world_4_ep_degree_2():
    assert ep_tp_group_ranks([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert ep_group_ranks([0, 1, 2, 3], 2) == [[0, 2], [1, 3]]


def test_expert_placement_is_contiguous():
    # The spec's table: 32 experts, EP=8 -> 4 per rank; EP=2 -> 16.
    assert local_expert_range(32, 8, 1) == range(4, 8)
    assert local_expert_range(32, 2, 1) == range(16, 32)
    with pytest.raises(ValueError, match="experts"):
        local_expert_range(6, 4, 0)


def test_kv_heads_split_or_replicated():
    # TP 8, 8 KV heads: one each. TP 16: each KV head on 2 ranks.
    assert kv_heads_per_rank(8, 8) == 1
    assert [kv_head_start(8, 8, r) for r in range(8)] == list(range(8))
    assert kv_heads_per_rank(8, 16) == 1
    assert [kv_head_start(8, 16, r) for r in range(4)] == [0, 0, 1, 1]
    assert kv_heads_per_rank(4, 2) == 2
    assert [kv_head_start(4, 2, r) for r in range(2)] == [0, 2]


DENSE = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64)
MOE = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64,
                      num_experts=8)


@pytest.mark.parametrize("sizes, hf, match", [
    (ParallelSizes(tensor_parallel_size=3), DENSE, "num_attention_heads.*--tensor-parallel-size"),
    (ParallelSizes(tensor_parallel_size=0), DENSE, "positive integer"),
    (ParallelSizes(tensor_parallel_size=2),
     SimpleNamespace(num_attention_heads=6, num_key_value_heads=3, intermediate_size=64),
     "num_key_value_heads 3"),
    (ParallelSizes(tensor_parallel_size=2),
     SimpleNamespace(num_attention_heads=8, num_key_value_heads=8, intermediate_size=63),
     "intermediate_size"),
    (ParallelSizes(ep_degree=2), MOE, "without --enable-expert-parallel"),
    (ParallelSizes(tensor_parallel_size=4, enable_expert_parallel=True, ep_degree=3), MOE,
     "does not divide the world size 4"),
    (ParallelSizes(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True,
                   ep_degree=2), MOE, "must equal tensor_parallel_size x data_parallel_size"),
    (ParallelSizes(tensor_parallel_size=4, enable_expert_parallel=True),
     SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64,
                     num_experts=6), "does not divide the model's 6 experts"),
    (ParallelSizes(enable_expert_parallel=True), DENSE, "needs a mixture-of-experts model"),
    (ParallelSizes(tensor_parallel_size=4),
     SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64,
                     num_experts=8, moe_intermediate_size=6), "moe_intermediate_size"),
    (ParallelSizes(tensor_parallel_size=4, enable_expert_parallel=True, ep_degree=2),
     SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64,
                     num_experts=8, moe_intermediate_size=5), "over 2 ranks"),
    (ParallelSizes(tensor_parallel_size=4),  # Mixtral: intermediate_size is the experts'
     SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=6,
                     num_local_experts=8), "intermediate_size \\(6\\) does not split over 4"),
    # Valid requests for what is not built yet: refused, never ignored.
    (ParallelSizes(pipeline_parallel_size=2), DENSE, "pipeline_parallel_size"),
])
def test_validation_names_the_flag(sizes, hf, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel_sizes(sizes, hf)


def test_valid_tensor_parallel_sizes_pass():
    """Each accepted configuration, and the layout it then runs (the validator returns
    nothing, so what is checked is that the sizes it let through lay out as the spec says)."""

    def ok(sizes: ParallelSizes, hf: object) -> None:
        validate_parallel_sizes(sizes, hf)  # raises on a refusal

    ok(ParallelSizes(tensor_parallel_size=2), DENSE)
    assert tp_group_ranks(2, 2) == [[0, 1]] and kv_heads_per_rank(4, 2) == 2
    ok(ParallelSizes(tensor_parallel_size=2, data_parallel_size=2), DENSE)
    assert tp_group_ranks(4, 2) == [[0, 1], [2, 3]]
    assert dp_column_group_ranks(4, 2, 2) == [[0, 2], [1, 3]]
    ok(ParallelSizes(data_parallel_size=3), MOE)  # TP of experts per replica: all 8 each
    assert dp_column_group_ranks(3, 1, 3) == [[0, 1, 2]] and local_expert_range(8, 1, 0) == range(8)
    # EP across the replicas: ep_degree (default) TP x DP, 2 experts per rank.
    ok(ParallelSizes(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True),
       MOE)
    assert [local_expert_range(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4),
                                                               range(4, 6), range(6, 8)]
    ok(ParallelSizes(tensor_parallel_size=8), DENSE)  # KV replicated: each head on 2 ranks
    assert kv_heads_per_rank(4, 8) == 1
    assert [kv_head_start(4, 8, r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # Expert parallelism over the TP group (DP 1): full, and ep_degree 2 inside TP 4.
    ok(ParallelSizes(tensor_parallel_size=2, enable_expert_parallel=True), MOE)
    assert ep_group_ranks([0, 1], 2) == [[0, 1]] and local_expert_range(8, 2, 1) == range(4, 8)
    ok(ParallelSizes(tensor_parallel_size=4, enable_expert_parallel=True, ep_degree=2), MOE)
    assert ep_tp_group_ranks([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert ep_group_ranks([0, 1, 2, 3], 2) == [[0, 2], [1, 3]]
    assert [ep_rank_of(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]
    # Full EP: whole experts per rank, so the experts' width need not divide TP.
    ok(ParallelSizes(tensor_parallel_size=4, enable_expert_parallel=True),
       SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=6,
                       num_local_experts=8))
    assert ep_tp_group_ranks([0, 1, 2, 3], 4) == [[0], [1], [2], [3]]
    assert local_expert_range(8, 4, 3) == range(6, 8)


def _args(path, **kw) -> EngineArgs:
    return EngineArgs(model=str(path), dtype="float32", skip_tokenizer_init=True,
                      max_model_len=64, **kw)


def test_engine_args_resolve_tensor_parallel(tiny_llama_dir):
    config = _args(tiny_llama_dir, tensor_parallel_size=2).create_engine_config()
    par = config.parallel_config
    assert (par.tensor_parallel_size, par.world_size, par.distributed_executor_backend) == \
        (2, 2, "mp")
    assert not config.compilation.enabled and not config.compilation.cuda_graphs
    one = _args(tiny_llama_dir).create_engine_config().parallel_config
    assert (one.world_size, one.distributed_executor_backend) == (1, "uni")
    # Data parallelism: each replica's workers; TP 1 runs in the replica's own process.
    dp = _args(tiny_llama_dir, data_parallel_size=2).create_engine_config().parallel_config
    assert (dp.data_parallel_size, dp.world_size, dp.distributed_executor_backend) == \
        (2, 2, "uni")
    both = _args(tiny_llama_dir, data_parallel_size=2, tensor_parallel_size=2)
    par = both.create_engine_config().parallel_config
    assert (par.world_size, par.distributed_executor_backend, par.global_rank(1)) == (4, "mp", 1)
    assert dataclasses.replace(par, data_parallel_rank=1).global_rank(1) == 3


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=3), "--tensor-parallel-size"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
     "--distributed-executor-backend mp"),
    (dict(tensor_parallel_size=2, compile=True), "drop --compile"),
    (dict(tensor_parallel_size=2, runner="pooling"), "--runner pooling"),
    (dict(data_parallel_size=0), "data_parallel_size must be a positive integer"),
    (dict(data_parallel_size=2, cpu_threads_bind="0|1|0"), "3 parts for 2 ranks"),
    (dict(additional_config={"ep_degree": 2}), "--enable-expert-parallel"),
    (dict(enable_expert_parallel=True), "mixture-of-experts"),
    (dict(tensor_parallel_size=2, cpu_threads_bind="0|1|0"), "one list per rank"),
])
def test_engine_args_reject_bad_parallel_flags(tiny_llama_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        _args(tiny_llama_dir, **kw).create_engine_config()


def test_cli_accepts_vllm_parallel_flags():
    ns = build_parser().parse_args(["serve", "m", "-tp", "2", "-dp", "1", "-pp", "1",
                                    "--enable-expert-parallel"])
    assert (ns.tensor_parallel_size, ns.data_parallel_size, ns.pipeline_parallel_size,
            ns.enable_expert_parallel) == (2, 1, 1, True)
    ns = build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "4"])
    assert ns.tensor_parallel_size == 4


def test_kv_cache_per_rank_holds_its_share_of_kv_heads(tiny_llama_dir):
    import torch

    from ingot.worker.worker import kv_bytes_per_block, rank_kv_heads

    one = _args(tiny_llama_dir).create_engine_config()  # 2 KV heads
    two = _args(tiny_llama_dir, tensor_parallel_size=2).create_engine_config()
    four = _args(tiny_llama_dir, tensor_parallel_size=4).create_engine_config()
    assert [rank_kv_heads(c) for c in (one, two, four)] == [2, 1, 1]  # 4: replicated
    assert kv_bytes_per_block(two, torch.float32) * 2 == kv_bytes_per_block(one, torch.float32)
    assert kv_bytes_per_block(four, torch.float32) == kv_bytes_per_block(two, torch.float32)


def test_executor_agrees_on_the_smallest_block_count():
    from ingot.worker.executor import Executor

    class TwoRanks(Executor):
        def __init__(self) -> None:
            self.calls = []

        def collective_rpc(self, method, args=(), kwargs=None):
            self.calls.append((method, tuple(args)))
            return [10, 7] if method == "determine_num_blocks" else [None, None]

        execute_model = check_health = shutdown = lambda self, *a, **k: None

    ex = TwoRanks()
    assert ex.initialize() == 7
    assert ex.calls[-1] == ("initialize_cache", (7,))


def test_ranks_split_the_cpus_and_bind_lists(tiny_llama_dir, monkeypatch):
    from ingot.platforms.cpu_threads import BIND_ENV
    from ingot.worker.worker import rank_thread_config

    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one = _args(tiny_llama_dir).create_engine_config()
    assert rank_thread_config(one, 0) is one  # TP = 1: untouched
    two = _args(tiny_llama_dir, tensor_parallel_size=2).create_engine_config()
    threads = rank_thread_config(two, 1).cpu_threads.threads
    assert threads is not None and threads >= 1
    assert two.cpu_threads.threads is None  # the engine's config is not mutated
    # vLLM's form: one CPU list per rank, '|'-separated.
    monkeypatch.setenv(BIND_ENV, "0|1")
    assert [rank_thread_config(two, r).cpu_threads.bind for r in (0, 1)] == ["0", "1"]


def test_cpu_ranks_plan_the_kv_cache_with_their_share_of_memory(tiny_llama_dir, monkeypatch):
    import torch

    from ingot.worker.worker import plan_num_blocks

    monkeypatch.delenv("INGOT_MIN_KV_BUDGET_GIB", raising=False)
    monkeypatch.delenv("INGOT_KV_BUDGET_CAP_FRACTION", raising=False)
    config = _args(tiny_llama_dir, tensor_parallel_size=4).create_engine_config()
    gib = 2**30
    # One rank alone with 1 GiB is below the 1 GiB minimum's budget; four ranks sharing 4 GiB
    # each plan with 1 GiB and a quarter of the minimum.
    with pytest.raises(ValueError, match="below the minimum"):
        plan_num_blocks(config, gib, 0, torch.float32)
    assert plan_num_blocks(config, 4 * gib, 0, torch.float32, ranks_sharing=4) > 0


def test_rank_bind_lists_must_not_share_cpus(tiny_llama_dir, monkeypatch):
    from ingot.platforms.cpu_threads import BIND_ENV

    monkeypatch.setenv(BIND_ENV, "0-1|1")
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND='0-1|1': CPU 1 is in the "
                                         "lists of ranks 0 and 1"):
        _args(tiny_llama_dir, tensor_parallel_size=2).create_engine_config()


@pytest.mark.parametrize("kw, match", [
    (dict(async_scheduling=True), "drop --async-scheduling"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config is not supported with --enable-expert-parallel"),
    (dict(additional_config={"ep_degree": 1}), "ep_degree must equal"),
])
def test_ep_across_replicas_refuses_what_breaks_lockstep(tmp_path, kw, match):
    from tiny import make_tiny_model

    path = make_tiny_model("qwen3_moe", tmp_path / "moe", vocab_size=259)
    ok = _args(path, data_parallel_size=2, enable_expert_parallel=True).create_engine_config()
    par = ok.parallel_config
    assert (par.ep_degree, par.replicas_synchronise) == (2, True)
    assert not ok.scheduler_config.async_scheduling
    with pytest.raises(ValueError, match=match):
        _args(path, data_parallel_size=2, enable_expert_parallel=True, **kw).create_engine_config()


@pytest.mark.parametrize("kw, match", [
    (dict(data_parallel_size_local=3), "data_parallel_size_local must be from 1 to"),
    (dict(data_parallel_size_local=1, data_parallel_start_rank=2),
     "data_parallel_start_rank must be from 0 to"),
    (dict(data_parallel_rpc_port=80), "data_parallel_rpc_port must be from 1024"),
])
def test_multi_node_flags_are_checked(tiny_llama_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        _args(tiny_llama_dir, data_parallel_size=2, **kw).create_engine_config()


def test_multi_node_ep_is_refused(tmp_path):
    from tiny import make_tiny_model

    path = make_tiny_model("qwen3_moe", tmp_path / "moe", vocab_size=259)
    with pytest.raises(ValueError, match="several nodes is not supported yet"):
        _args(path, data_parallel_size=2, data_parallel_size_local=1,
              enable_expert_parallel=True).create_engine_config()


def test_cli_parses_the_multi_node_flags(tiny_llama_dir):
    from ingot.cli.main import cmd_serve
    from ingot.engine.arg_utils import engine_args_from

    argv = ["serve", str(tiny_llama_dir), "-dp", "4", "--data-parallel-size-local", "2",
            "--data-parallel-start-rank", "2", "--data-parallel-address", "10.0.0.1",
            "--data-parallel-rpc-port", "13345", "--headless"]
    ns = build_parser().parse_args(argv)
    args = engine_args_from(ns)
    assert (args.data_parallel_size_local, args.data_parallel_start_rank,
            args.data_parallel_address, args.data_parallel_rpc_port, ns.headless) == \
        (2, 2, "10.0.0.1", 13345, True)
    par = _args(tiny_llama_dir, data_parallel_size=4, data_parallel_size_local=2,
                data_parallel_start_rank=2).create_engine_config().parallel_config
    # This node's ranks share its CPUs: 2 of them, global ranks 2 and 3 its parts 0 and 1.
    assert (par.host_ranks, par.host_index(2), par.host_index(3)) == (2, 0, 1)
    # --headless is for the nodes other than the API server's.
    bad = build_parser().parse_args(["serve", str(tiny_llama_dir), "-dp", "2", "--headless"])
    with pytest.raises(ValueError, match="--data-parallel-start-rank R"):
        cmd_serve(bad)


def test_the_api_servers_node_starts_at_rank_0(tiny_llama_dir):
    from ingot import LLM

    with pytest.raises(ValueError, match="is for the other nodes"):
        LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, max_model_len=64,
            data_parallel_size=2, data_parallel_size_local=1, data_parallel_start_rank=1)
