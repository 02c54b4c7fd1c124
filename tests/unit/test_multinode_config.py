"""TP across nodes (--nnodes, --node-rank, --master-addr, --master-port): the start-up rules,
each naming the flag to change, the per-node rank arithmetic, and a node that never comes
reported by node and ranks within the start-up timeout (stand-in children, no model). The
two-"node" run itself is tests/e2e/test_tensor_parallel_multinode.py."""

from __future__ import annotations

import os

import pytest
from dp_child_stub import REPLIES, child

from ingot.cli.main import check_headless
from ingot.distributed.remote_children import RemoteChildren
from ingot.distributed.supervision import ChildProcesses, WorkerProcessError
from ingot.engine.arg_utils import EngineArgs
from ingot.worker.multiproc_executor import MultiprocExecutor, _missing_nodes, node_addresses


def _args(path, **kw) -> EngineArgs:
    return EngineArgs(model=str(path), dtype="float32", skip_tokenizer_init=True,
                      max_model_len=64, **kw)


def test_each_node_holds_a_contiguous_block_of_ranks(tiny_llama_dir):
    two = dict(tensor_parallel_size=4, nnodes=2, master_addr="10.0.0.1")
    node1 = _args(tiny_llama_dir, node_rank=1, **two).create_engine_config().parallel_config
    assert (node1.tp_ranks_local, node1.host_ranks) == (2, 2)
    assert [node1.host_index(r) for r in (2, 3)] == [0, 1]  # its CPUs and bind lists
    assert node1.distributed_executor_backend == "mp"
    assert (node1.master_addr, node1.master_port) == ("10.0.0.1", 29501)  # vLLM's default port
    node0 = _args(tiny_llama_dir, node_rank=0, **two).create_engine_config().parallel_config
    assert [node0.host_index(r) for r in (0, 1)] == [0, 1]
    assert node_addresses(node0)[0] == "tcp://10.0.0.1:29501"
    one = _args(tiny_llama_dir, tensor_parallel_size=2).create_engine_config().parallel_config
    assert (one.nnodes, one.tp_ranks_local, one.host_ranks) == (1, 2, 2)


@pytest.mark.parametrize("kw, match", [
    (dict(nnodes=0), "nnodes must be an integer >= 1"),
    (dict(nnodes=2, node_rank=2, master_addr="h"), r"node_rank must be from 0 to nnodes - 1 \(1\)"),
    (dict(node_rank=1), r"node_rank must be from 0 to nnodes - 1 \(0\)"),
    (dict(tensor_parallel_size=1, nnodes=2, master_addr="h"),
     "tensor_parallel_size 1 must be a multiple of nnodes 2.*--nnodes"),
    (dict(tensor_parallel_size=2, nnodes=2), "--nnodes > 1 needs --master-addr"),
    (dict(tensor_parallel_size=2, nnodes=2, master_addr="h", data_parallel_size=2),
     "--data-parallel-size-local"),
    (dict(tensor_parallel_size=2, nnodes=2, master_addr="h",
          distributed_executor_backend="ray"), "--nnodes is for the mp executor"),
    (dict(tensor_parallel_size=2, nnodes=2, master_addr="h", master_port=65534),
     "master_port must be from 1024 to 65533"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
     "--distributed-executor-backend mp"),
])
def test_bad_node_settings_name_the_flag(tiny_llama_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        _args(tiny_llama_dir, **kw).create_engine_config()


def test_headless_is_for_the_other_nodes(tiny_llama_dir):
    two = dict(tensor_parallel_size=2, nnodes=2, master_addr="h")
    assert check_headless(_args(tiny_llama_dir, node_rank=1, **two)) == "workers"
    with pytest.raises(ValueError, match=r"give --node-rank R \(>= 1\)"):
        check_headless(_args(tiny_llama_dir, node_rank=0, **two))
    with pytest.raises(ValueError, match="--nnodes N --node-rank R"):
        check_headless(_args(tiny_llama_dir))  # neither TP across nodes nor DP
    assert check_headless(_args(tiny_llama_dir, data_parallel_size=2, data_parallel_size_local=1,
                                data_parallel_start_rank=1)) == "replicas"
    # The engine is node 0's: a node_rank > 0 engine (LLM(...), serve without --headless) is
    # refused before any process starts.
    config = _args(tiny_llama_dir, node_rank=1, **two).create_engine_config()
    with pytest.raises(ValueError, match="runs only its worker ranks.*--headless"):
        MultiprocExecutor(config)


def test_ranks_of_two_nodes_on_one_host_decline_shared_memory():
    """What makes the two-"node" e2e run gloo: the node index is part of the identity the
    ranks compare. The same ranks on one node take shared memory (so without the node index,
    two nodes on one host would too)."""
    from ingot.distributed.shm_comm import decline_reason, node_identity

    assert decline_reason([(None, node_identity(0), 1), (None, node_identity(1), 2)]) == \
        "the ranks are on several hosts"
    assert decline_reason([(None, node_identity(0), 1), (None, node_identity(0), 2)]) is None


def test_a_node_never_launched_is_reported_by_node_and_ranks():
    """Node 0's rank has connected and waits in the rendezvous for node 1's, which never
    comes: the error names rank 1 and node 1 (not rank 0, which is only waiting), and says
    how to start it, within the timeout."""
    from types import SimpleNamespace

    port = 20000 + (os.getpid() * 7) % 20000
    parallel = SimpleNamespace(master_addr="127.0.0.1", master_port=port, nnodes=2,
                               tensor_parallel_size=2, tp_ranks_local=1)
    _, results, inbox = node_addresses(parallel)
    children = ChildProcesses(
        2, child, lambda i, _: (i, {0: "hello"}), "worker rank", "ingot-test-", REPLIES, local=1,
        remote=lambda key: RemoteChildren(results, inbox, range(1, 2), "worker rank",
                                          "--master-port", key),
        hint=_missing_nodes(parallel))
    try:
        with pytest.raises(WorkerProcessError, match=(
                r"worker rank\(s\) \[1\] did not start within 3 s \(node 1 holds ranks \[1\]: "
                r"start each with ingot serve MODEL --tensor-parallel-size 2 --nnodes 2 "
                rf"--node-rank N --master-addr 127.0.0.1 --master-port {port} --headless\)")):
            children.wait_started(3)
    finally:
        for proc in children.procs:
            proc.terminate()
        children.close()


def test_ray_backend_needs_ray_and_says_how_to_install_it(tiny_llama_dir, monkeypatch):
    import importlib.util
    import sys

    from ingot.worker.ray_executor import import_ray

    ray_tp2 = dict(tensor_parallel_size=2, distributed_executor_backend="ray")
    # Installed (the test extra): accepted.
    assert _args(tiny_llama_dir, **ray_tp2).create_engine_config() \
        .parallel_config.distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="ray is not supported with data_parallel_size > 1"):
        _args(tiny_llama_dir, data_parallel_size=2, **ray_tp2).create_engine_config()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "ray" else real(name, *a, **k))
    with pytest.raises(ValueError, match=r"needs Ray.*pip install 'ingot\[ray\]'"):
        _args(tiny_llama_dir, **ray_tp2).create_engine_config()
    monkeypatch.setitem(sys.modules, "ray", None)  # the executor's own import, too
    with pytest.raises(ImportError, match=r"pip install 'ingot\[ray\]'"):
        import_ray()
