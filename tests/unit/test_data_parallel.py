"""Data parallelism without processes of engines: the front end's routing by queue length, the
stats summed over replicas, and the child-process start-up that reports a missing replica (or
worker) by its rank within a timeout."""

from __future__ import annotations

import os

import pytest
from dp_child_stub import REPLIES, child

from ingot.buckets import BucketCounter, BucketStats
from ingot.core.spec_policy import SpecDecodingStats
from ingot.distributed.remote_children import HEARTBEAT_TIMEOUT_S
from ingot.distributed.supervision import ChildProcesses, WorkerProcessError
from ingot.engine.dp_client import LeastLoaded, merge_stats


def test_least_loaded_takes_turns_on_equal_queues():
    lb = LeastLoaded(2)
    assert [lb.pick() for _ in range(4)] == [0, 1, 0, 1]
    assert lb.load == [2, 2] and lb.routed == [2, 2]


def test_least_loaded_fills_the_shorter_queue_first():
    lb = LeastLoaded(3)
    for _ in range(6):
        lb.pick()  # 2 each
    lb.done(2)
    lb.done(2)  # replica 2 finished both of its requests
    # Round robin would go on with 0, 1, 2; by queue length replica 2 takes the next two.
    assert [lb.pick(), lb.pick()] == [2, 2]
    assert lb.pick() == 0 and lb.load == [3, 2, 2]


def _stats(running: int, used: int, total: int, hits: int, queries: int, bucket_runs: int,
           spec: SpecDecodingStats | None = None) -> dict:
    buckets = BucketStats(decode={4: BucketCounter(bucket_runs, bucket_runs, 4 * bucket_runs)},
                          decode_ctx={128: bucket_runs})
    return {
        "scheduler_state": "active_decode", "num_running": running, "num_waiting": 1,
        "max_kv_concurrent": 8, "total_padding_tokens": 3, "kv_blocks_total": total,
        "kv_blocks_free": total - used, "kv_blocks_used": used, "kv_usage": used / total,
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries, "num_steps": 10, "buckets": buckets,
        "compilation": {"compilations": 1, "cache_hits": 2}, "cpu_compute_threads": 1,
        "async_scheduling": True, "async_steps": 5, "sync_fallback_steps": 0,
        "num_runner_requests": running, "spec_decode": spec,
    }


def test_stats_are_summed_over_replicas_and_kept_per_rank():
    a = _stats(running=2, used=10, total=100, hits=1, queries=4, bucket_runs=3,
               spec=SpecDecodingStats(2, 1, 2, 1, [1, 0]))
    b = _stats(running=3, used=30, total=100, hits=3, queries=4, bucket_runs=5,
               spec=SpecDecodingStats(2, 2, 4, 3, [2, 1]))
    total = merge_stats([a, b])
    assert (total["num_running"], total["kv_blocks_used"], total["num_steps"]) == (5, 40, 20)
    assert total["kv_usage"] == pytest.approx(0.2)  # 40 / 200, not the mean of the two ratios
    assert total["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert total["buckets"].decode[4] == BucketCounter(8, 8, 32)
    assert total["buckets"].decode_ctx == {128: 8}
    assert total["compilation"] == {"compilations": 2, "cache_hits": 4}
    spec = total["spec_decode"]
    assert (spec.num_drafts, spec.num_accepted_tokens, spec.num_accepted_tokens_per_pos) == \
        (3, 4, [3, 1])
    assert total["dp_ranks"] == [a, b]
    # The inputs are untouched (they are the replicas' latest reports).
    assert a["buckets"].decode[4] == BucketCounter(3, 3, 12) and a["spec_decode"].num_drafts == 1


def _stop(children: ChildProcesses) -> None:
    for proc in children.procs:
        proc.terminate()
    children.close()


def test_children_start_in_rank_order():
    children = ChildProcesses(2, child, lambda i, _: (i, {}), "data-parallel rank", "ingot-test-",
                              REPLIES)
    try:
        assert children.wait_started(60) == ["ready 0", "ready 1"]
    finally:
        _stop(children)


@pytest.mark.parametrize("behaviour, match", [
    ({1: "hang"}, r"data-parallel rank\(s\) \[1\] did not start within 5 s"),
    ({1: "exit"}, r"data-parallel rank 1 \(pid \d+\) exited with code 3"),
])
def test_a_missing_child_is_reported_by_rank(behaviour, match):
    children = ChildProcesses(2, child, lambda i, _: (i, behaviour), "data-parallel rank",
                              "ingot-test-", REPLIES)
    try:
        with pytest.raises(WorkerProcessError, match=match):
            # Rank 0 answers well within the timeout (its interpreter imports only zmq);
            # rank 1 never does.
            children.wait_started(5 if behaviour[1] == "hang" else 60)
    finally:
        _stop(children)


def test_a_silent_remote_replica_is_reported_by_rank():
    from types import SimpleNamespace

    from ingot.engine import dp_client

    port = 20000 + os.getpid() % 20000
    remote = dp_client.RemoteReplicas(
        SimpleNamespace(data_parallel_address="127.0.0.1", data_parallel_rpc_port=port),
        range(1, 3), b"k" * 32)
    try:
        assert remote.dead_child() is None  # just heard from (start-up)
        remote.last_seen[2] -= HEARTBEAT_TIMEOUT_S + 1
        assert remote.dead_child() == (
            f"data-parallel rank 2 (on another node) sent nothing for "
            f"{HEARTBEAT_TIMEOUT_S:.0f} s")
        # A port in use is an error naming the flag.
        with pytest.raises(ValueError, match="--data-parallel-rpc-port"):
            dp_client.RemoteReplicas(
                SimpleNamespace(data_parallel_address="127.0.0.1", data_parallel_rpc_port=port),
                range(1, 2), b"k" * 32)
    finally:
        remote.close()
