"""Data parallelism (spec §2): ``data_parallel_size`` independent engine cores, each in its own
process with its own scheduler, KV cache and executor (its TP group), behind one front end.

``DPEngineCoreClient`` stands where ``LLMEngine`` keeps its ``EngineCore``: the same methods
(``add_request``, ``step``, ``finish_requests``, stats, RPCs), so the offline ``LLM``, the async
engine and the server run unchanged on N replicas. Tokenizing, detokenizing and stop strings
stay in the front end; each engine process runs its own step loop and streams its outputs back,
so one replica can prefill while another decodes. Nothing synchronises the replicas (without
expert parallelism nothing should: their steps have unrelated shapes). With EP across them
(``ep_degree == TP x DP``) their MoE layers exchange tokens, so the engine processes step in
lockstep: one ``busy_loop_turn`` per iteration, a dummy batch where a replica has nothing to
run, every step padded to the largest replica's (distributed/data_parallel.py).

A new request goes to the replica with the fewest unfinished requests (ties: round robin), as
vLLM's front end balances by queue length. Processes and sockets are distributed/supervision.py's
``ChildProcesses`` (as the multiprocess executor's workers): a replica that fails or exits is
reported by its rank, in start-up within ``INGOT_WORKER_STARTUP_TIMEOUT_S`` and while serving
within ``_POLL_S``. Messages are distributed/wire.py's typed, authenticated frames (schemas in
engine/dp_replica.py); replicas on other nodes need the secret every node shares
(``INGOT_RPC_SECRET`` or ``--rpc-secret-file``). A call that raises on a replica raises the same
error class here; only a replica that fails or exits ends the engine.

The server's check of a constraint before a response starts (``submit_structured_output``)
compiles it on the replica the next request would go to, which then finds it cached.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from ingot.buckets import BucketStats
from ingot.config import EngineConfig
from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import Request, RequestStatus
from ingot.distributed.remote_children import RemoteChildren, run_remote_children
from ingot.distributed.supervision import STARTUP_TIMEOUT_S, ChildProcesses, WorkerProcessError
from ingot.distributed.wire import FAILED, require_shared_secret
from ingot.engine.dp_replica import (
    FROM_REPLICA,
    Compile,
    CoreCall,
    Finish,
    RpcReply,
    replica_config,
    replica_main,
    request_message,
    typed_stats,
)
from ingot.sampling_params import SamplingParams
from ingot.worker.executor import RpcMethod

logger = logging.getLogger("ingot")

_POLL_S = 0.02  # how long step() waits for a replica's outputs before it returns
_REPLY_POLL_S = 0.1  # how long a call waits for a reply before it checks the replicas


def merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's stats over all replicas: counts summed, ratios recomputed from the sums;
    each replica's own under ``dp_ranks`` (the server exports them labelled by rank)."""
    first = per_rank[0]
    total = {key: sum(s[key] for s in per_rank) for key in (
        "num_running", "num_waiting", "max_kv_concurrent", "total_padding_tokens",
        "kv_blocks_total", "kv_blocks_free", "kv_blocks_used", "prefix_cache_queries",
        "prefix_cache_hits", "num_steps", "async_steps", "sync_fallback_steps",
        "num_runner_requests")}
    threads = [s["cpu_compute_threads"] for s in per_rank if s["cpu_compute_threads"] is not None]
    total["cpu_compute_threads"] = sum(threads) if threads else None
    states = {s["scheduler_state"] for s in per_rank}
    total["scheduler_state"] = first["scheduler_state"] if len(states) == 1 else "mixed"
    total["kv_usage"] = total["kv_blocks_used"] / max(total["kv_blocks_total"], 1)
    total["prefix_cache_hit_rate"] = (total["prefix_cache_hits"]
                                      / max(total["prefix_cache_queries"], 1))
    total["buckets"] = BucketStats.merged([s["buckets"] for s in per_rank])
    total["compilation"] = {key: sum(s["compilation"].get(key, 0) for s in per_rank)
                            for key in first["compilation"]
                            if isinstance(first["compilation"][key], int | float)}
    total["async_scheduling"] = first["async_scheduling"]
    spec = [s["spec_decode"] for s in per_rank if s["spec_decode"] is not None]
    total["spec_decode"] = spec[0].merged(spec[1:]) if spec else None
    total["dp_ranks"] = per_rank
    return total


class LeastLoaded:
    """Routing by queue length: a new request goes to the replica with the fewest unfinished
    requests, ties broken round robin (so equal queues take turns)."""

    def __init__(self, size: int) -> None:
        self.load = [0] * size  # unfinished requests per replica
        self.routed = [0] * size  # requests each replica has been given
        self._next = 0

    def peek(self) -> int:
        """The replica ``pick`` would choose now, without choosing it."""
        least = min(self.load)
        size = len(self.load)
        return next(r % size for r in range(self._next, self._next + size)
                    if self.load[r % size] == least)

    def pick(self) -> int:
        rank = self.peek()
        self._next = (rank + 1) % len(self.load)
        self.load[rank] += 1
        self.routed[rank] += 1
        return rank

    def done(self, rank: int) -> None:
        self.load[rank] -= 1


def remote_addresses(parallel: Any) -> tuple[str, Callable[[int], str]]:
    """Where replicas on other nodes meet the API server's node: (the results address, the
    inbox address of replica ``r``): ``--data-parallel-rpc-port`` and the ports after it."""
    host, port = parallel.data_parallel_address, parallel.data_parallel_rpc_port
    return f"tcp://{host}:{port}", lambda r: f"tcp://{host}:{port + r}"


def RemoteReplicas(parallel: Any, ranks: range, key: bytes) -> RemoteChildren:  # noqa: N802
    """The replicas of other nodes (``ingot serve --headless``): their sockets, bound here at
    ``--data-parallel-address`` from ``--data-parallel-rpc-port``, under ``key``."""
    return RemoteChildren(*remote_addresses(parallel), ranks, "data-parallel rank",
                          "--data-parallel-rpc-port or --data-parallel-address (an address of "
                          "this node)", key)


_ACROSS_NODES = "data parallelism over several nodes (--data-parallel-size-local)"


def run_headless(config: EngineConfig) -> int:
    """``ingot serve --headless``: run this node's replicas (``--data-parallel-start-rank``
    and the ``--data-parallel-size-local`` after it) for the API server at
    ``--data-parallel-address``, report their health there, and return when they have all
    exited (the server shut them down); a replica that dies is reported and stops the rest."""
    parallel = config.parallel_config
    key = require_shared_secret(parallel.rpc_secret_file, _ACROSS_NODES)
    out, inbox = remote_addresses(parallel)
    first = parallel.data_parallel_start_rank
    return run_remote_children(replica_main, range(first, first + parallel.local_replicas),
                               lambda r: (replica_config(config, r, ""), r), out, inbox,
                               "data-parallel rank", key)


def _result(reply: RpcReply, rank: int) -> Any:
    """A replica's answer to a call: its value, or its error raised here."""
    if reply.error is not None:
        raise reply.error.rebuild(f"data-parallel rank {rank}")
    return reply.value


class DPEngineCoreClient:
    """The front end's handle on N engine-core processes (``EngineCore``'s interface)."""

    workers_are_local = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parallel = config.parallel_config
        self.dp_size = parallel.data_parallel_size
        if parallel.data_parallel_start_rank != 0:
            raise ValueError(
                "data_parallel_start_rank is for the other nodes (ingot serve --headless); the "
                "API server's node runs the replicas from rank 0: drop it here"
            )
        self.num_local = parallel.local_replicas
        key = (require_shared_secret(parallel.rpc_secret_file, _ACROSS_NODES)
               if self.num_local < self.dp_size else None)
        self._children = ChildProcesses(
            self.dp_size, replica_main, lambda r, init: (replica_config(config, r, init), r),
            "data-parallel rank", "ingot-dp-", FROM_REPLICA, local=self.num_local,
            remote=lambda key: RemoteReplicas(parallel, range(self.num_local, self.dp_size),
                                              key),
            hint=lambda missing: " (the ranks of other nodes start with ingot serve --headless)"
            if any(r >= self.num_local for r in missing) else "", key=key)
        try:
            # Every replica's first stats, rank order; one that fails, exits or stays silent
            # is named by its rank (as the executor's workers are).
            self._stats = [typed_stats(s)
                           for s in self._children.wait_started(STARTUP_TIMEOUT_S)]
        except BaseException:
            self._children.close()
            raise
        logger.info("data parallelism: %d engine-core processes started (%d on this node)",
                    self.dp_size, self.num_local)
        self._owner: dict[str, int] = {}  # unfinished request -> replica
        self.balancer = LeastLoaded(self.dp_size)
        self._outputs: list[EngineCoreOutput] = []
        self._replies: dict[int, dict[int, RpcReply]] = {}  # by call id, then rank
        self._compiles: dict[int, Future] = {}  # constraint checks sent to a replica, by call id
        self._call_ids = itertools.count()
        self._dead: str | None = None
        self.num_steps = 0

    # ---- requests ------------------------------------------------------------------------
    def _send(self, rank: int, kind: str, payload: Any) -> None:
        self._check_alive()
        self._children.send(rank, self._children.seal(kind, payload))

    def add_request(self, request: Request) -> None:
        message = request_message(request)
        rank = self.balancer.pick()
        self._owner[request.request_id] = rank
        self._send(rank, "add", message)

    def submit_structured_output(self, params: SamplingParams) -> Future | None:
        """Compile the constraint on the replica the next request would go to (it caches the
        grammar); the future completes when that replica answers (``_receive``)."""
        if params.structured_outputs is None:
            return None
        call_id = next(self._call_ids)
        self._send(self.balancer.peek(), "compile", Compile(call_id, params))
        future: Future = Future()
        self._compiles[call_id] = future
        return future

    def release_structured_output(self, params: SamplingParams, future: Future) -> None:
        """Nothing to do: the replica's compile is not withdrawn (its answer is dropped)."""

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._owner.pop(rid, None)
            if rank is not None:
                self.balancer.done(rank)
                by_rank.setdefault(rank, []).append(rid)
        for rank, rids in by_rank.items():
            self._send(rank, "finish", Finish(rids, status))

    def has_pending_work(self) -> bool:
        # A constraint check waiting for its replica keeps the loop receiving.
        return bool(self._owner) or bool(self._outputs) or bool(self._compiles)

    # ---- outputs -------------------------------------------------------------------------
    def _receive(self, timeout_s: float, check: bool = True) -> bool:
        """Take one message (waiting up to ``timeout_s``); False if none came. A replica that
        failed or exited raises, naming its rank."""
        message = self._children.recv(timeout_s)
        if message is None:
            if check:
                self.check_health()
            return False
        rank, kind, value = message
        if kind == "outputs":
            self._stats[rank] = typed_stats(value.stats)
            self.num_steps += 1
            for out in value.outputs:
                if out.finish_status is not None and self._owner.get(out.req_id) == rank:
                    del self._owner[out.req_id]
                    self.balancer.done(rank)
            self._outputs.extend(value.outputs)
        elif kind == "rpc":
            future = self._compiles.pop(value.call_id, None)
            if future is None:
                self._replies.setdefault(value.call_id, {})[rank] = value
            elif future.set_running_or_notify_cancel():
                if value.error is None:
                    future.set_result(value.value)
                else:
                    future.set_exception(value.error.rebuild(f"data-parallel rank {rank}"))
        elif kind == FAILED:
            self._set_dead(f"data-parallel rank {rank} failed")
            raise WorkerProcessError(f"data-parallel rank {rank} failed:\n{value}")
        return True

    def step(self) -> list[EngineCoreOutput]:
        """The outputs the replicas sent since the last call (waiting briefly for some)."""
        if not self._outputs:
            self._receive(_POLL_S)
        while self._receive(0):
            pass
        outputs, self._outputs = self._outputs, []
        return outputs

    # ---- RPCs, stats ---------------------------------------------------------------------
    def _call(self, method: str, args: Sequence[Any] = (),
              kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method`` on every replica; one result per replica, rank order."""
        call_id = next(self._call_ids)
        self._check_alive()
        frame = self._children.seal("rpc", CoreCall(call_id, method, list(args), kwargs or {}))
        for rank in range(self.dp_size):
            self._children.send(rank, frame)
        while len(self._replies.get(call_id, {})) < self.dp_size:
            self._receive(_REPLY_POLL_S)
        replies = self._replies.pop(call_id)
        return [_result(replies[rank], rank) for rank in range(self.dp_size)]

    def collective_rpc(self, method: RpcMethod, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Every worker of every replica: replica 0's workers first (global rank order). A
        function goes by name, as to the multiprocess executor's workers."""
        return [r for per_rank in self._call("collective_rpc", (method, args, kwargs))
                for r in per_rank]

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise WorkerProcessError(f"a data-parallel engine is down ({self._dead}); restart "
                                     "the engine")

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerProcessError(f"a data-parallel engine is down ({self._dead})")
        # Take what arrived (other nodes' heartbeats among it; outputs wait for step()).
        while self._receive(0, check=False):
            pass
        dead = self._children.dead_child()
        if dead:
            self._set_dead(dead)
            raise WorkerProcessError(dead)

    def _set_dead(self, reason: str) -> None:
        """A replica is gone: the engine is down, and constraint checks get no answer."""
        self._dead = reason
        for future in self._compiles.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(WorkerProcessError(f"a data-parallel engine is down "
                                                        f"({reason})"))
        self._compiles.clear()

    def reset_prefix_cache(self) -> bool:
        return all(self._call("reset_prefix_cache"))

    def request_blocks(self, request_id: str) -> list[int]:
        rank = self._owner[request_id]
        call_id = next(self._call_ids)
        self._send(rank, "rpc", CoreCall(call_id, "request_blocks", [request_id], {}))
        while rank not in self._replies.get(call_id, {}):
            self._receive(_REPLY_POLL_S)
        return _result(self._replies.pop(call_id)[rank], rank)

    def get_stats(self) -> dict[str, Any]:
        """Summed over the replicas from the stats each sent with its latest outputs (no
        round trip per call: the server reads them every step); per replica under
        ``dp_ranks``, with the requests routed to it."""
        per_rank = [dict(s, requests_routed=n, dp_rank=r)
                    for r, (s, n) in enumerate(zip(self._stats, self.balancer.routed,
                                                   strict=True))]
        return merge_stats(per_rank)

    def shutdown(self) -> None:
        for future in self._compiles.values():
            future.cancel()
        if not self._children.finalizer.alive:
            return
        if self._dead is None:
            try:
                call_id = next(self._call_ids)
                frame = self._children.seal("shutdown", call_id)
                for rank in range(self.dp_size):
                    self._children.send(rank, frame, zmq.NOBLOCK)
                deadline = 30.0
                while len(self._replies.get(call_id, {})) < self.dp_size and deadline > 0:
                    self._receive(_REPLY_POLL_S)
                    deadline -= _REPLY_POLL_S
            except (WorkerProcessError, zmq.ZMQError):
                pass
        else:  # the engine is down: the other replicas get no shutdown, stop them now
            for proc in self._children.procs:
                if proc.is_alive():
                    proc.terminate()
        self._children.close()
