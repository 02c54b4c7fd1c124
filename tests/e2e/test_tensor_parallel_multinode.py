"""TP across nodes with vLLM's flags, two "nodes" on localhost: node 0 is
``LLM(tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr=...)`` (the engine and rank 0),
node 1 is ``ingot serve MODEL ... --nnodes 2 --node-rank 1 --headless`` (rank 1 only), meeting
over TCP. The model is a tiny Qwen3-MoE with one KV head (replicated over the ranks) and a
dense layer, under expert parallelism, so one run checks TP attention and dense MLPs across
nodes and EP across nodes: greedy tokens and logprobs equal TP=1's; each node holds half the
experts; the collectives go over gloo, never the shared memory that one host would also allow;
shutting node 0 down ends node 1's launcher.

The Ray executor (``--distributed-executor-backend ray``) is checked here too, against the same
TP=1 reference: the same Worker in two Ray actors on a small local Ray gives TP=1's tokens, an
RPC that raises is the caller's error (the actors serve on), and killing one actor makes the
next request fail with an error naming the rank, never a hang."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest
import ray  # in the test extra: CI runs this
from server_utils import free_port
from tiny import make_tiny_model

from ingot import LLM, SamplingParams
from ingot.errors import IngotError

pytestmark = pytest.mark.slow  # one engine at TP 1, two ranks on two "nodes", a local Ray

PROMPTS = [[3, 17, 92, 45, 200, 11, 8, 250, 77, 5, 133], [9, 8, 7], list(range(40, 70))]
COMMON = dict(dtype="float32", max_model_len=128, block_size=4, max_num_seqs=4)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-nodes")
    return make_tiny_model("qwen3_moe", path, vocab_size=259, num_key_value_heads=1)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def _outputs(llm: LLM) -> tuple[list, list]:
    out = llm.generate(PROMPTS, GREEDY)
    return ([o.outputs[0].token_ids for o in out],
            [[{t: v.logprob for t, v in step.items()} for step in o.outputs[0].logprobs]
             for o in out])


def _two_nodes(moe_dir, tmp_path_factory, node1_env=None):
    """(tokens and logprobs, per-rank startup stats, node 1's exit code, node 1's log) of the
    engine on two "nodes"; ``node1_env``: node 1's environment (a fault for a twin)."""
    port = free_port(3)  # the rendezvous, node 0's replies, rank 1's calls
    # The secret both nodes share (--rpc-secret-file; the other form, INGOT_RPC_SECRET, is
    # test_data_parallel_hardening.py's).
    secret = tmp_path_factory.mktemp("secret") / "rpc-secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--enable-expert-parallel", "--rpc-secret-file",
             str(secret)]
    log_path = tmp_path_factory.mktemp("node1") / "node1.log"
    # Node 1 first: its rank waits in the rendezvous while node 0 starts.
    with open(log_path, "w") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "ingot.cli.main", "serve", str(moe_dir),
             "--dtype", "float32", "--max-model-len", "128", "--block-size", "4",
             "--max-num-seqs", "4", *nodes, "--node-rank", "1", "--headless"],
            stdout=log, stderr=subprocess.STDOUT, env=node1_env)
    try:
        llm = LLM(str(moe_dir), skip_tokenizer_init=True, tensor_parallel_size=2, nnodes=2,
                  node_rank=0, master_addr="127.0.0.1", master_port=port,
                  enable_expert_parallel=True, rpc_secret_file=str(secret), **COMMON)
        try:
            got = _outputs(llm)
            stats = llm.llm_engine.collective_rpc("startup_stats")
        finally:
            llm.llm_engine.shutdown()
        node1_exit = node1.wait(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    return got, stats, node1_exit, log_path.read_text()


@pytest.fixture(scope="module")
def runs(moe_dir, tmp_path_factory):
    llm = LLM(str(moe_dir), skip_tokenizer_init=True, **COMMON)
    try:
        ref = _outputs(llm)
    finally:
        llm.llm_engine.shutdown()
    return (ref, *_two_nodes(moe_dir, tmp_path_factory))


def _assert_same(got: tuple[list, list], ref: tuple[list, list]) -> None:
    assert got[0] == ref[0]
    for got_req, ref_req in zip(got[1], ref[1], strict=True):
        for g, r in zip(got_req, ref_req, strict=True):
            assert g.keys() == r.keys()
            assert all(abs(g[t] - v) < 1e-5 for t, v in r.items())


def test_two_nodes_give_tp1_greedy_tokens_and_logprobs(runs):
    _assert_same(runs[1], runs[0])


def test_two_nodes_twin_a_perturbed_shard_on_node1_fails(moe_dir, runs, tmp_path_factory):
    """Broken twin: node 1's rank loads its shard of one attention weight 5% off (node 0's is
    right); the equality with TP=1 must fail."""
    from faults import child_env, fails

    env = child_env("weight", name="layers.0.self_attn.o_proj", scale=0.05, rank=1)
    got, _, node1_exit, log = _two_nodes(moe_dir, tmp_path_factory, node1_env=env)
    assert node1_exit == 0, log
    with fails():
        _assert_same(got, runs[0])


def test_each_node_runs_its_rank_over_gloo(runs):
    """Both "nodes" are this host, where shared memory would also work: the ranks must still
    keep to torch.distributed (gloo), since across real hosts nothing else can."""
    stats = runs[2]
    assert [s["node_rank"] for s in stats] == [0, 1]
    assert [s["tp_collectives"] for s in stats] == ["gloo", "gloo"]
    assert stats[0]["pid"] != stats[1]["pid"]
    assert stats[0]["num_blocks"] == stats[1]["num_blocks"] > 0
    # EP over the nodes (the results came back as plain data: lists)
    assert [s["local_experts"] for s in stats] == [[0, 2], [2, 2]]


def test_node1_launcher_exits_cleanly_after_node0_shuts_down(runs):
    assert runs[3] == 0, runs[4]
    assert "worker ranks [1] for the head node at tcp://127.0.0.1" in runs[4]


def test_ray_executor_tp2_equals_tp1_and_a_dead_actor_fails_requests(moe_dir, runs):
    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False,
             log_to_driver=False)
    try:
        llm = LLM(str(moe_dir), skip_tokenizer_init=True, tensor_parallel_size=2,
                  distributed_executor_backend="ray", **COMMON)
        try:
            _assert_same(_outputs(llm), runs[0])
            stats = llm.llm_engine.collective_rpc("startup_stats")
            pids = {s["pid"] for s in stats}
            assert len(pids) == 2 and os.getpid() not in pids  # two actors, not this process
            assert [s["tp_collectives"] for s in stats] == ["shm", "shm"]  # one node
            assert [s["local_experts"] for s in stats] == [(0, 4), (0, 4)]  # TP of experts
            # An RPC's error is the caller's (issue #31): the actors serve on.
            with pytest.raises(AttributeError, match="no RPC method '_nope'"):
                llm.llm_engine.collective_rpc("_nope")
            llm.llm_engine.check_health()  # all alive
            assert _outputs(llm)[0] == runs[0][0]
            executor = llm.llm_engine.engine_core.executor
            ray.kill(executor.workers[1])
            start = time.monotonic()
            with pytest.raises(IngotError, match=r"worker rank 1 \(Ray actor\) failed during"):
                llm.generate(PROMPTS, GREEDY)  # the step's call finds it
            assert time.monotonic() - start < 30
            executor._dead = None  # forget that: an idle engine's health check finds it too
            with pytest.raises(IngotError, match=r"worker rank 1 \(Ray actor .*\) is gone"):
                llm.llm_engine.check_health()
        finally:
            llm.llm_engine.shutdown()
    finally:
        ray.shutdown()


def test_ray_executor_twin_a_perturbed_shard_in_one_actor_fails(moe_dir, runs):
    """Broken twin: the Ray actor of rank 1 loads its shard of one attention weight 5% off
    (Ray starts its workers with the fault in their environment); the equality with TP=1 must
    fail."""
    from faults import child_env, fails

    env = child_env("weight", name="layers.0.self_attn.o_proj", scale=0.05, rank=1)
    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False,
             log_to_driver=False,
             runtime_env={"env_vars": {k: v for k, v in env.items()
                                       if k in ("PYTHONPATH", "INGOT_TEST_FAULT")}})
    try:
        llm = LLM(str(moe_dir), skip_tokenizer_init=True, tensor_parallel_size=2,
                  distributed_executor_backend="ray", **COMMON)
        try:
            got = _outputs(llm)
        finally:
            llm.llm_engine.shutdown()
    finally:
        ray.shutdown()
    with fails():
        _assert_same(got, runs[0])
