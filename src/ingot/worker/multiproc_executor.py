"""Workers in child processes (``--distributed-executor-backend mp``).

Each rank is a spawned process holding one Worker, started and watched by
distributed/supervision.py's ``ChildProcesses``. Calls travel over pyzmq as distributed/wire.py's
typed, authenticated frames (``TO_WORKER``, ``FROM_WORKER``): the parent seals a call once and
sends it to every rank (one PUSH socket each) and collects one reply per rank on a shared PULL
socket; only rank 0's ``execute_model`` result is kept. Calls are answered in the order they were
sent, so a step sent without waiting (async scheduling) is a pending reply that is collected
when its result is needed, after those before it.

A worker that raises replies with the error. In a step (executor.py's ``STEP_METHODS``) that is
fatal: the parent raises ``WorkerProcessError`` at once (the other ranks may be stuck in a
collective) and the engine fails the in-flight requests. Any other RPC's error is raised in the
caller as its own class (a ValueError stays one) once every rank has answered, and the workers
serve on; ranks that stay silent ``RPC_ERROR_GRACE_S`` after another rank failed the call are
taken as stuck. A worker process that dies is noticed within ``_POLL_S`` while waiting, and by
``check_health`` between steps. Children watch their parent and exit if it disappears.

TP across nodes (``--nnodes``): node 0's executor spawns its own ranks as above and binds TCP
sockets (``--master-port`` + 1 and after) for the other nodes' ranks, which each node's
``ingot serve --headless`` launcher spawns (``run_headless_workers``); they join
torch.distributed at ``tcp://--master-addr:--master-port``. The remote children and launcher
are distributed/remote_children.py's, shared with the data-parallel replicas of other nodes;
every node needs the same secret (``INGOT_RPC_SECRET`` or ``--rpc-secret-file``).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from ingot.config import EngineConfig
from ingot.distributed.remote_children import RemoteChildren, run_remote_children
from ingot.distributed.supervision import (
    STARTUP_TIMEOUT_S,
    ChildProcesses,
    WorkerProcessError,
    child_links,
)
from ingot.distributed.wire import FAILED, HELLO, ChildLink, RemoteError, require_shared_secret
from ingot.runner_output import ModelRunnerOutput
from ingot.sched_output import SchedulerOutput
from ingot.worker.executor import (
    RPC_ERROR_GRACE_S,
    STEP_METHODS,
    FanOutExecutor,
    RpcMethod,
    rpc_label,
    run_on_worker,
)

logger = logging.getLogger("ingot")

_POLL_S = 0.1


class Call(msgspec.Struct, array_like=True):
    """A ``collective_rpc``: a Worker method's name or a registered function's (``RpcName``)."""

    method: Any
    args: list[Any]
    kwargs: dict[str, Any]


# What a rank receives, and what it answers (wire.py's schemas).
TO_WORKER: dict[str, Any] = {"step": SchedulerOutput, "call": Call, "shutdown": None}
FROM_WORKER: dict[str, Any] = {"started": None, "output": ModelRunnerOutput | None,
                               "result": Any, "error": RemoteError}


def _unencodable(kind: str, value: Any, exc: Exception) -> tuple[str, Any]:
    # A result that cannot travel fails that call, not the worker.
    return "error", RemoteError.of(TypeError(f"the result cannot be sent back: {exc}"))


def _worker_main(config: EngineConfig, rank: int, distributed_init_method: str | None,
                 link: ChildLink) -> None:
    inbox, reply = child_links(rank, f"rank {rank}", link, TO_WORKER, _unencodable)
    # Connected: the start-up wait can tell a rank that is loading (or waiting in the
    # rendezvous for others) from one that never came (another node not launched).
    reply(HELLO, None)
    try:
        from ingot.worker.worker import Worker

        worker = Worker(config, rank=rank, distributed_init_method=distributed_init_method)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        reply(FAILED, traceback.format_exc())
        return
    reply("started", None)
    while True:
        message = inbox.recv()
        if message is None:
            continue
        kind, value = message
        if kind == "shutdown":
            reply("result", None)
            break
        try:
            if kind == "step":
                output = worker.execute_model(value)
                # Only rank 0's step output is used; the others need not ship theirs.
                reply("output", output if rank == 0 else None)
                continue
            result = run_on_worker(worker, value.method, value.args, value.kwargs)
        except Exception as exc:  # noqa: BLE001 - the caller raises it (or ends the workers)
            reply("error", RemoteError.of(exc, traceback.format_exc()))
            continue
        reply("result", result)


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
    key = require_shared_secret(parallel.rpc_secret_file, "--nnodes > 1")
    init, results, inbox = node_addresses(parallel)
    local = parallel.tp_ranks_local
    first = parallel.node_rank * local
    return run_remote_children(_worker_main, range(first, first + local),
                               lambda r: (config, r, init), results, inbox, "worker rank", key)


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
        remote = key = None
        if parallel.nnodes > 1:
            key = require_shared_secret(parallel.rpc_secret_file, "--nnodes > 1")

            def remote(key: bytes) -> RemoteChildren:
                return RemoteChildren(results, inbox, range(parallel.tp_ranks_local,
                                                            self.world_size),
                                      "worker rank", "--master-port or --master-addr (an "
                                      "address of this node)", key)
        self._dead: str | None = None
        # Replies (kind, value) to calls after the one gathered, per rank.
        self._early: dict[int, deque[tuple[str, Any]]] = {}
        # Calls sent whose replies are not collected yet, oldest first.
        self._pending: deque[tuple[_Reply, str, Callable[[list[Any]], Any]]] = deque()
        self._children: ChildProcesses | None = None

        def args(rank: int, init_method: str) -> tuple[Any, ...]:
            if remote is not None:  # ranks on several hosts: a rendezvous they all reach
                init_method = init
            return (config, rank, init_method if self.world_size > 1 else None)

        self._children = ChildProcesses(self.world_size, _worker_main, args, "worker rank",
                                        "ingot-mp-", FROM_WORKER, local=parallel.tp_ranks_local,
                                        remote=remote, hint=_missing_nodes(parallel), key=key)
        try:
            self._children.wait_started(STARTUP_TIMEOUT_S)
        except WorkerProcessError as exc:
            self._dead = str(exc)
            self._children.close()
            raise
        logger.info("multiprocess executor: %d worker process(es) started (%d on this node)",
                    self.world_size, parallel.tp_ranks_local)

    def _gather(self, what: str, step: bool, timeout: float | None = None) -> list[Any]:
        """Every rank's result of the oldest call, rank order. A step's error raises at once
        and ends the workers; another call's error is raised once every rank has answered."""
        assert self._children is not None
        replies: dict[int, tuple[str, Any]] = {}
        # A rank can answer the next call before another rank's answer to this one arrives
        # (a step without collectives, sent ahead under async scheduling): keep it for then.
        for rank, early in self._early.items():
            if early:
                replies[rank] = early.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        failed: tuple[int, RemoteError] | None = None
        while True:
            for rank, (kind, value) in sorted(replies.items()):
                if kind == FAILED:  # another node's launcher: the rank's process exited
                    self._dead = f"worker rank {rank} failed"
                    raise WorkerProcessError(f"worker rank {rank} failed during {what}: {value}")
                if kind == "error" and failed is None:
                    failed = rank, value
                    if step:
                        self._dead = f"worker rank {rank} failed"
                        raise WorkerProcessError(f"worker rank {rank} failed during {what}:\n"
                                                 f"{value.traceback or value.message}")
                    grace = time.monotonic() + RPC_ERROR_GRACE_S
                    deadline = grace if deadline is None else min(deadline, grace)
            if len(replies) == self.world_size:
                break
            message = self._children.recv(_POLL_S)
            if message is not None:
                rank, kind, value = message
                if rank in replies:
                    self._early.setdefault(rank, deque()).append((kind, value))
                else:
                    replies[rank] = kind, value
                continue
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(replies))
                if failed is not None:
                    self._dead = f"worker rank(s) {missing} stuck in {what}"
                    raise WorkerProcessError(
                        f"worker rank(s) {missing} did not answer {what} within "
                        f"{RPC_ERROR_GRACE_S:.0f} s of rank {failed[0]} failing it (stuck in a "
                        f"collective with it?): {failed[1].message}")
                raise WorkerProcessError(f"worker rank(s) {missing} did not {what} within "
                                         f"{timeout:.0f} s")
        if failed is not None:
            raise failed[1].rebuild(f"worker rank {failed[0]}")
        return [replies[r][1] for r in range(self.world_size)]

    def _send(self, method: RpcMethod, args: Sequence[Any], kwargs: dict[str, Any] | None,
              pick: Callable[[list[Any]], Any]) -> _Reply:
        if self._dead is not None:
            raise WorkerProcessError(f"the workers are down ({self._dead}); restart the engine")
        assert self._children is not None
        if method == "execute_model":
            (scheduler_output,) = args
            frame = self._children.seal("step", scheduler_output)
        else:  # TypeError here, before anything is sent, for what cannot travel
            frame = self._children.seal("call", Call(method, list(args), kwargs or {}))
        for rank in range(self.world_size):
            self._children.send(rank, frame)
        reply = _Reply(self)
        self._pending.append((reply, rpc_label(method), pick))
        return reply

    def _collect_until(self, reply: _Reply) -> None:
        while not reply.done() and self._pending:
            pending, name, pick = self._pending.popleft()
            try:
                if self._dead is not None:
                    raise WorkerProcessError(f"the workers are down ({self._dead})")
                pending.set_result(pick(self._gather(name, name in STEP_METHODS)))
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
                frame = self._children.seal("shutdown")
                for rank in range(self.world_size):
                    self._children.send(rank, frame, zmq.NOBLOCK)
                self._gather("shut down", True, timeout=10)
            except (WorkerProcessError, zmq.ZMQError):
                pass
        self._children.close()
