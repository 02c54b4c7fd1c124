"""Workers in child processes (``--distributed-executor-backend mp``).

Each rank is a spawned process holding one Worker, started and watched by
distributed/supervision.py's ``ChildProcesses``. Calls travel over pyzmq: the parent
sends the pickled call once per rank (one PUSH socket each) and collects one reply per rank on
a shared PULL socket; only rank 0's ``execute_model`` result is kept. Calls are answered in the
order they were sent, so a step sent without waiting (async scheduling) is a pending reply that
is collected when its result is needed, after those before it. A worker that raises
replies with the error, which the parent re-raises (the engine then fails the in-flight
requests); a worker process that dies is noticed within ``_POLL_S`` while waiting, and by
``check_health`` between steps. Children watch their parent and exit if it disappears.

TP across nodes (``--nnodes``): node 0's executor spawns its own ranks as above and binds TCP
sockets (``--master-port`` + 1 and after) for the other nodes' ranks, which each node's
``ingot serve --headless`` launcher spawns (``run_headless_workers``); they join
torch.distributed at ``tcp://--master-addr:--master-port``. The remote children and launcher
are distributed/remote_children.py's, shared with the data-parallel replicas of other nodes.
"""

from __future__ import annotations

import logging
import pickle
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from ingot.config import EngineConfig
from ingot.distributed.remote_children import RemoteChildren, run_remote_children
from ingot.distributed.supervision import (
    STARTUP_TIMEOUT_S,
    ChildProcesses,
    WorkerProcessError,
    child_links,
)
from ingot.worker.executor import FanOutExecutor, RpcMethod, run_on_worker

logger = logging.getLogger("ingot")

_POLL_S = 0.1
_SHUTDOWN = "__shutdown__"


def _worker_main(
    config: EngineConfig, rank: int, distributed_init_method: str | None, in_addr: str,
    out_addr: str, parent_pid: int, log_level: int,
) -> None:
    inbox, reply = child_links(rank, f"rank {rank}", in_addr, out_addr, parent_pid, log_level)
    # Connected: the start-up wait can tell a rank that is loading (or waiting in the
    # rendezvous for others) from one that never came (another node not launched).
    reply("hello", None)
    try:
        from ingot.worker.worker import Worker

        worker = Worker(config, rank=rank, distributed_init_method=distributed_init_method)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        reply("error", traceback.format_exc())
        return
    reply("ok", None)
    while True:
        method, args, kwargs = pickle.loads(inbox.recv())
        if method == _SHUTDOWN:
            reply("ok", None)
            break
        try:
            result = run_on_worker(worker, method, args, kwargs)
        except BaseException:  # noqa: BLE001
            reply("error", traceback.format_exc())
            continue
        # Only rank 0's step output is used; the others need not ship theirs.
        reply("ok", None if (method == "execute_model" and rank != 0) else result)


class _Reply(Future):
    """A call's replies, collected (in send order) when the result is asked for."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> Any:
        self._executor._collect_until(self)
        return super().result(timeout)


def node_addresses(parallel: Any) -> tuple[str, str, Callable[[int], str]]:
    """TP across nodes: (the torch.distributed rendezvous, where node 0's executor takes the
    replies, where it sends rank ``r``'s calls): ``--master-port`` and the ports after it."""
    host, port = parallel.master_addr, parallel.master_port
    return (f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}",
            lambda r: f"tcp://{host}:{port + 1 + r}")


def _missing_nodes(parallel: Any) -> Callable[[list[int]], str]:
    """The hint after the names of ranks that never connected: which nodes to launch."""
    local = parallel.tp_ranks_local

    def hint(ranks: list[int]) -> str:
        nodes = sorted({r // local for r in ranks if r >= local})
        if not nodes:
            return ""
        held = "; ".join(f"node {n} holds ranks {list(range(n * local, (n + 1) * local))}"
                         for n in nodes)
        return (f" ({held}: start each with ingot serve MODEL --tensor-parallel-size "
                f"{parallel.tensor_parallel_size} --nnodes {parallel.nnodes} --node-rank N "
                f"--master-addr {parallel.master_addr} --master-port {parallel.master_port} "
                "--headless)")

    return hint


def run_headless_workers(config: EngineConfig) -> int:
    """``ingot serve --headless --node-rank R``: this node's worker ranks for node 0's
    executor at ``--master-addr`` (returns when node 0 has shut them down)."""
    parallel = config.parallel_config
    init, results, inbox = node_addresses(parallel)
    local = parallel.tp_ranks_local
    first = parallel.node_rank * local
    return run_remote_children(_worker_main, range(first, first + local),
                               lambda r: (config, r, init), results, inbox, "worker rank")


class MultiprocExecutor(FanOutExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        parallel = config.parallel_config
        if parallel.node_rank != 0:
            raise ValueError(
                f"node_rank {parallel.node_rank} runs only its worker ranks, for node 0's "
                "engine: start it with ingot serve MODEL ... --headless"
            )
        # This engine core's ranks: its TP group (each data-parallel replica has its own),
        # the first tp_ranks_local of them here, the others on the other nodes.
        self.world_size = parallel.tensor_parallel_size
        init, results, inbox = node_addresses(parallel)
        remote = None
        if parallel.nnodes > 1:
            def remote() -> RemoteChildren:
                return RemoteChildren(results, inbox, range(parallel.tp_ranks_local,
                                                            self.world_size),
                                      "worker rank", "--master-port or --master-addr (an "
                                      "address of this node)")
        self._dead: str | None = None
        self._early: dict[int, deque[Any]] = {}  # replies to calls after the one gathered
        # Calls sent whose replies are not collected yet, oldest first.
        self._pending: deque[tuple[_Reply, str, Callable[[list[Any]], Any]]] = deque()
        self._children: ChildProcesses | None = None

        def args(rank: int, init_method: str) -> tuple[Any, ...]:
            if remote is not None:  # ranks on several hosts: a rendezvous they all reach
                init_method = init
            return (config, rank, init_method if self.world_size > 1 else None)

        self._children = ChildProcesses(self.world_size, _worker_main, args, "worker rank",
                                        "ingot-mp-", local=parallel.tp_ranks_local,
                                        remote=remote, hint=_missing_nodes(parallel))
        try:
            self._children.wait_started(STARTUP_TIMEOUT_S)
        except WorkerProcessError as exc:
            self._dead = str(exc)
            self._children.close()
            raise
        logger.info("multiprocess executor: %d worker process(es) started (%d on this node)",
                    self.world_size, parallel.tp_ranks_local)

    def _gather(self, what: str = "call", timeout: float | None = None) -> list[Any]:
        assert self._children is not None
        replies: dict[int, Any] = {}
        # A rank can answer the next call before another rank's answer to this one arrives
        # (a step without collectives, sent ahead under async scheduling): keep it for then.
        for rank, early in self._early.items():
            if early:
                replies[rank] = early.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.world_size:
            message = self._children.recv(_POLL_S)
            if message is not None:
                rank, status, value = message
                if status == "error":
                    self._dead = f"worker rank {rank} failed: {value}"
                    raise WorkerProcessError(f"worker rank {rank} failed during {what}:\n{value}")
                if rank in replies:
                    self._early.setdefault(rank, deque()).append(value)
                else:
                    replies[rank] = value
                continue
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(replies))
                raise WorkerProcessError(f"worker rank(s) {missing} did not {what} within "
                                         f"{timeout:.0f} s")
        return [replies[r] for r in range(self.world_size)]

    def _send(self, method: RpcMethod, args: Sequence[Any], kwargs: dict[str, Any] | None,
              pick: Callable[[list[Any]], Any]) -> _Reply:
        if self._dead is not None:
            raise WorkerProcessError(f"the workers are down ({self._dead}); restart the engine")
        message = pickle.dumps((method, tuple(args), kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        assert self._children is not None
        for rank in range(self.world_size):
            self._children.send(rank, message)
        reply = _Reply(self)
        name = method if isinstance(method, str) else getattr(method, "__name__", "rpc")
        self._pending.append((reply, name, pick))
        return reply

    def _collect_until(self, reply: _Reply) -> None:
        while not reply.done() and self._pending:
            pending, name, pick = self._pending.popleft()
            try:
                if self._dead is not None:
                    raise WorkerProcessError(f"the workers are down ({self._dead})")
                pending.set_result(pick(self._gather(what=name)))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                pending.set_exception(exc)

    def check_health(self) -> None:
        assert self._children is not None
        dead = self._children.dead_child()
        if dead is not None:
            self._dead = dead
            raise WorkerProcessError(dead)

    def shutdown(self) -> None:
        if self._children is None or not self._children.finalizer.alive:
            return
        if self._pending:  # let the steps in flight finish (their errors are theirs)
            self._collect_until(self._pending[-1][0])
        if self._dead is None:
            try:
                message = pickle.dumps((_SHUTDOWN, (), {}))
                for rank in range(self.world_size):
                    self._children.send(rank, message, zmq.NOBLOCK)
                self._gather(what="shut down", timeout=10)
            except (WorkerProcessError, zmq.ZMQError):
                pass
        self._children.close()
