"""Workers as Ray actors (``--distributed-executor-backend ray``), for users who already run a
Ray cluster (``pip install 'ingot[ray]'``).

Each rank is one actor holding the same ``Worker`` the multiprocess executor's processes hold,
so the model, the collectives (torch.distributed, gloo on CPU, initialised inside the actors)
and the steps are the same; only the transport of calls differs. Ray runs an actor's calls in
the order one caller submits them, which is the ordering the ``Executor`` interface promises
(a ``collective_rpc`` waits behind the steps in flight). Ray places the actors: with
``RAY_ADDRESS`` set, on that cluster (``ray.init(address="auto")``), else on a local Ray
started here (and stopped at shutdown); a Ray already initialised by the caller is used as it
is. The rendezvous is on rank 0's node (its address, a free port there), since the actors may
be on any node.

A step that raises (executor.py's ``STEP_METHODS``), or an actor that dies (its node lost,
killed), fails the call that waits on it with ``WorkerProcessError`` naming the rank, within
``_POLL_S`` of Ray noticing, and an idle engine's health check finds a dead actor by its name;
every later call fails at once (the engine must be restarted), never a hang. Any other RPC that
raises raises its own exception in the caller once every rank has answered, and the workers
serve on, as under the multiprocess executor.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ingot.config import EngineConfig
from ingot.distributed.supervision import STARTUP_TIMEOUT_S, WorkerProcessError
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
#: CPUs Ray reserves for each worker actor (Ray also sets the actor's OMP_NUM_THREADS to it,
#: which ingot's thread policy then follows).
CPUS_PER_WORKER_ENV = "INGOT_RAY_CPUS_PER_WORKER"
#: The object store of a Ray started here: steps pass only small objects (scheduler outputs,
#: sampled tokens), and Ray's default (30% of memory, in /dev/shm) would take room from the
#: KV cache.
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
INSTALL_HINT = "pip install 'ingot[ray]'"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            f"distributed_executor_backend ray needs Ray, which is not installed: {INSTALL_HINT} "
            "(or use --distributed-executor-backend mp)"
        ) from None
    return ray


class RayWorker:
    """One rank in a Ray actor. ``address`` runs first on rank 0 (where to meet), then
    ``start`` on every rank at once (joining torch.distributed is a collective)."""

    def __init__(self, rank: int, log_level: int) -> None:
        logging.basicConfig(level=log_level,
                            format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s")
        logging.getLogger("ingot").setLevel(log_level)
        self.worker: Any = None
        self.rank = rank

    def address(self, loopback: bool) -> str:
        """A torch.distributed rendezvous on this actor's node: its address, a free port."""
        import ray

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def start(self, config: EngineConfig, init_method: str | None) -> int:
        from ingot.worker.worker import Worker

        self.worker = Worker(config, rank=self.rank, distributed_init_method=init_method)
        return os.getpid()

    def call(self, method: RpcMethod, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        result = run_on_worker(self.worker, method, args, kwargs)
        # Only rank 0's step output is used; the others need not ship theirs.
        return None if (method == "execute_model" and self.rank != 0) else result


class _Reply(Future):
    """One call's results (an object ref per rank), gathered when asked for."""

    def __init__(self, executor: RayExecutor, refs: list[Any], what: str,
                 pick: Callable[[list[Any]], Any]) -> None:
        super().__init__()
        self._executor, self._refs, self._what, self._pick = executor, refs, what, pick

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self.set_result(self._pick(self._executor._gather(
                    self._refs, self._what, step=self._what in STEP_METHODS)))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                self.set_exception(exc)
        return super().result(timeout)


class RayExecutor(FanOutExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = self._ray = import_ray()
        self.world_size = config.parallel_config.tensor_parallel_size
        self._dead: str | None = None
        self._owns_ray = False
        cpus = float(os.environ.get(CPUS_PER_WORKER_ENV, "1"))
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address="auto")
            else:  # room for every actor, even on fewer cores (they share them, as under mp)
                ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(self.world_size * cpus)),
                         object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False)
                self._owns_ray = True
        # One node: the ranks meet over loopback (the node's address may not route to
        # itself in a container); several: on rank 0's address.
        local = self._owns_ray or len([n for n in ray.nodes() if n.get("Alive")]) == 1
        cuda = config.device == "cuda"
        actor = ray.remote(num_cpus=0 if cuda else cpus, num_gpus=1 if cuda else 0)(RayWorker)
        level = logging.getLogger("ingot").getEffectiveLevel()
        # Named, so that check_health can ask Ray whether each is still alive (a dead
        # actor's name is released).
        tag = uuid.uuid4().hex[:12]
        self._names = [f"ingot-worker-{tag}-{rank}" for rank in range(self.world_size)]
        self.workers = [actor.options(name=name).remote(rank, level)
                        for rank, name in enumerate(self._names)]
        try:
            init = None
            if self.world_size > 1:
                init = self._gather([self.workers[0].address.remote(local)], "start",
                                    STARTUP_TIMEOUT_S)[0]
            pids = self._gather([w.start.remote(config, init) for w in self.workers], "start",
                                STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("Ray executor: %d worker actor(s) started (pids %s, rendezvous %s)",
                    self.world_size, pids, init)

    def _gather(self, refs: list[Any], what: str, timeout: float | None = None,
                step: bool = True) -> list[Any]:
        """Every rank's result, rank order. An actor's death, or a step's exception, raises at
        once: the other ranks may be stuck in a collective with it. Another call's exception
        is raised once every rank has answered (within ``RPC_ERROR_GRACE_S``)."""
        ray = self._ray
        if self._dead is not None:
            raise WorkerProcessError(f"the workers are down ({self._dead}); restart the engine")
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        failed: tuple[int, Exception] | None = None
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            for ref in done:
                try:
                    results[index[ref]] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - RayTaskError, RayActorError, ...
                    rank = index[ref]
                    cause = getattr(exc, "cause", None)
                    if (not step and isinstance(exc, ray.exceptions.RayTaskError)
                            and isinstance(cause, Exception)):
                        if failed is None:  # the worker's own exception: the caller's
                            failed = rank, cause
                            grace = time.monotonic() + RPC_ERROR_GRACE_S
                            deadline = grace if deadline is None else min(deadline, grace)
                        continue
                    self._dead = f"worker rank {rank} failed"
                    raise WorkerProcessError(
                        f"worker rank {rank} (Ray actor) failed during {what}:\n{exc}") from None
            if pending and deadline is not None and time.monotonic() > deadline:
                missing = sorted(index[ref] for ref in pending)
                self._dead = f"worker rank(s) {missing} did not {what}"
                why = (f" after rank {failed[0]} failed it (stuck in a collective with it?)"
                       if failed is not None else f" within {timeout:.0f} s (enough free "
                       "CPUs/GPUs in the Ray cluster?)")
                raise WorkerProcessError(f"worker rank(s) {missing} (Ray actors) did not {what}"
                                         f"{why}")
        if failed is not None:
            raise failed[1]
        return [results[rank] for rank in range(len(refs))]

    def _send(self, method: RpcMethod, args: Sequence[Any], kwargs: dict[str, Any] | None,
              pick: Callable[[list[Any]], Any]) -> _Reply:
        if self._dead is not None:
            raise WorkerProcessError(f"the workers are down ({self._dead}); restart the engine")
        refs = [w.call.remote(method, tuple(args), kwargs or {}) for w in self.workers]
        return _Reply(self, refs, rpc_label(method), pick)

    def check_health(self) -> None:
        """Raise if an actor is gone (while a call waits, Ray resolves its refs with the
        error; between calls, a lookup of each actor's name, about 2 ms each)."""
        if self._dead is not None:
            raise WorkerProcessError(f"the workers are down ({self._dead})")
        for rank, name in enumerate(self._names):
            try:
                self._ray.get_actor(name)
            except ValueError:
                self._dead = f"worker rank {rank} (Ray actor {name}) is gone"
                raise WorkerProcessError(self._dead) from None

    def shutdown(self) -> None:
        workers, self.workers = getattr(self, "workers", []), []
        self._names = []
        for w in workers:
            try:
                self._ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._owns_ray:
            self._owns_ray = False
            self._ray.shutdown()
