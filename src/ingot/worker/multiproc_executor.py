"""Workers in child processes (``--distributed-executor-backend mp``).

Each rank is a spawned process holding one Worker. Calls travel over pyzmq: the parent
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
torch.distributed at ``tcp://--master-addr:--master-port``. The same remote children and
launcher carry the data-parallel replicas of other nodes (engine/dp_client.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from ingot.config import EngineConfig
from ingot.errors import IngotError
from ingot.worker.executor import FanOutExecutor, RpcMethod, run_on_worker

logger = logging.getLogger("ingot")

_POLL_S = 0.1
_SHUTDOWN = "__shutdown__"
#: Seconds a rank may take to start (import, load the model) before it is reported missing.
STARTUP_TIMEOUT_S = float(os.environ.get("INGOT_WORKER_STARTUP_TIMEOUT_S", "600"))
HEARTBEAT_S = 1.0  # how often a --headless node reports its children
#: A child on another node silent this long (no reply, no heartbeat) is taken as gone.
HEARTBEAT_TIMEOUT_S = float(os.environ.get("INGOT_DP_HEARTBEAT_TIMEOUT_S", "10"))


class WorkerProcessError(IngotError, RuntimeError):
    """A worker process failed or exited; the engine must be restarted."""


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)  # orphaned: the engine is gone, nobody will ever call us again
        time.sleep(1.0)


def _unpicklable(status: str, value: Any, exc: Exception) -> tuple[str, Any]:
    return "error", f"result not picklable: {exc!r}"


def child_links(
    index: int, label: str, in_addr: str, out_addr: str, parent_pid: int, log_level: int,
    unpicklable: Callable[[str, Any, Exception], tuple[str, Any]] = _unpicklable,
) -> tuple[zmq.Socket, Callable[[str, Any], None]]:
    """The preamble of a ``ChildProcesses`` child: logging tagged ``[label]``, the parent-death
    watch, and its two sockets. Returns (the inbox to receive calls on, ``reply(status,
    value)``, which sends ``(index, status, value)``). A value that does not pickle is replaced
    by ``unpicklable(status, value, exc)``'s (status, value): the parent must still get an
    answer, or it would wait for one forever."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{label}] %(message)s")
    logging.getLogger("ingot").setLevel(log_level)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(out_addr)

    def reply(status: str, value: Any) -> None:
        try:
            message = pickle.dumps((index, status, value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            message = pickle.dumps((index, *unpicklable(status, value, exc)))
        outbox.send(message)

    return inbox, reply


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


def _cleanup(procs: list[Any], ctx: zmq.Context, tmpdir: str) -> None:
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    ctx.destroy(linger=0)
    shutil.rmtree(tmpdir, ignore_errors=True)


def wait_started(count: int, recv: Callable[[float], tuple[int, str, Any] | None],
                 dead_child: Callable[[], str | None], timeout_s: float, kind: str,
                 hint: Callable[[list[int]], str] = lambda missing: "") -> list[Any]:
    """The first reply of each of ``count`` children (their start-up), in index order. A child
    that fails (an "error" reply), exits (``dead_child``) or stays silent for ``timeout_s`` is
    named by its index (``kind``: "worker rank", "data-parallel rank"). A child may say
    "hello" first (connected, still starting): the silent ones are then those that never
    connected (another node's ranks waiting for a launch), which ``hint(indices)`` follows,
    rather than every rank stuck waiting for them."""
    replies: dict[int, Any] = {}
    connected: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(replies) < count:
        message = recv(_POLL_S)
        if message is not None:
            i, status, value = message
            if status == "error":
                raise WorkerProcessError(f"{kind} {i} failed during start:\n{value}")
            if status == "hello":
                connected.add(i)
            else:
                replies[i] = value
            continue
        dead = dead_child()
        if dead is not None:
            raise WorkerProcessError(dead)
        if time.monotonic() > deadline:
            missing = sorted(set(range(count)) - set(replies))
            silent = [i for i in missing if i not in connected] or missing
            raise WorkerProcessError(f"{kind}(s) {silent} did not start within "
                                     f"{timeout_s:.0f} s{hint(silent)}")
    return [replies[i] for i in range(count)]


class RemoteChildren:
    """The children of other nodes (each node's ``ingot serve --headless`` launcher spawns its
    own, ``run_remote_children``, and reports their health every ``HEARTBEAT_S``): their
    sockets, bound here over TCP at ``results_addr`` and ``inbox_addr(i)``. ``flags``: what to
    change when an address cannot be bound."""

    def __init__(self, results_addr: str, inbox_addr: Callable[[int], str], indices: range,
                 kind: str, flags: str) -> None:
        self.kind = kind
        self._ctx = zmq.Context()
        self.results = self._ctx.socket(zmq.PULL)
        self.inboxes: dict[int, zmq.Socket] = {}
        try:
            self.results.bind(results_addr)
            for i in indices:
                self.inboxes[i] = self._ctx.socket(zmq.PUSH)
                self.inboxes[i].bind(inbox_addr(i))
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(
                f"cannot listen for the other nodes' {kind}s on {results_addr} and the next "
                f"{len(indices)} ports ({exc}); choose another {flags}"
            ) from None
        self.last_seen = dict.fromkeys(indices, time.monotonic())

    def dead_child(self) -> str | None:
        now = time.monotonic()
        for i, seen in self.last_seen.items():
            if now - seen > HEARTBEAT_TIMEOUT_S:
                return (f"{self.kind} {i} (on another node) sent nothing for "
                        f"{HEARTBEAT_TIMEOUT_S:.0f} s")
        return None

    def close(self) -> None:
        self._ctx.destroy(linger=0)


def run_remote_children(target: Callable[..., None], indices: range,
                        args: Callable[[int], tuple[Any, ...]], results_addr: str,
                        inbox_addr: Callable[[int], str], kind: str) -> int:
    """A ``--headless`` node's launcher: spawn ``target(*args(i), inbox_addr(i), results_addr,
    ...)`` for each of ``indices`` (they connect to the head node over TCP), report their health
    there every ``HEARTBEAT_S``, and return when they have all exited (the head shut them
    down: 0); a child that dies is reported and stops the rest (1)."""
    spawn = multiprocessing.get_context("spawn")
    level = logging.getLogger("ingot").getEffectiveLevel()
    procs = {i: spawn.Process(target=target,
                              args=(*args(i), inbox_addr(i), results_addr, os.getpid(), level),
                              name=f"ingot-{kind.replace(' ', '-')}-{i}")
             for i in indices}
    for proc in procs.values():
        proc.start()
    logger.info("headless: %ss %s for the head node at %s", kind, list(indices), results_addr)
    ctx = zmq.Context()
    beat = ctx.socket(zmq.PUSH)
    beat.connect(results_addr)
    try:
        while True:
            running = 0
            for i, proc in procs.items():
                if proc.is_alive():
                    running += 1
                    beat.send(pickle.dumps((i, "alive", None)))
                elif proc.exitcode != 0:
                    beat.send(pickle.dumps((i, "error", f"exited with code {proc.exitcode}")))
                    logger.error("%s %d exited with code %s", kind, i, proc.exitcode)
                    return 1
            if running == 0:
                return 0
            time.sleep(HEARTBEAT_S)
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=10)
        ctx.destroy(linger=1000)


class ChildProcesses:
    """Spawned child processes, each with a PUSH socket from the parent (``send``) and one PULL
    socket they all answer on (``recv``), in a private temporary directory that also holds the
    torch.distributed rendezvous file. Used for the TP workers of one engine core and for the
    engine cores of data parallelism (engine/dp_client.py). ``target(*args(i), in_addr,
    out_addr, parent_pid, log_level)`` runs in child ``i`` (``args(i, init_method)``: the
    rendezvous below); children answer with pickled ``(index, status, value)`` tuples.

    Children ``local ..  count - 1`` (``remote``), when given, run on other nodes: their
    launchers' heartbeats are taken here, and one silent for ``HEARTBEAT_TIMEOUT_S`` counts as
    dead once they have all started."""

    def __init__(self, count: int, target: Callable[..., None],
                 args: Callable[[int, str], tuple[Any, ...]], kind: str, prefix: str,
                 local: int | None = None, remote: Callable[[], RemoteChildren] | None = None,
                 hint: Callable[[list[int]], str] = lambda missing: "") -> None:
        self.count = count
        self.local = count if local is None else local
        self.kind = kind  # how errors name a child: "worker rank", "data-parallel rank"
        self.hint = hint  # after the names of children that never connected
        self.tmpdir = tempfile.mkdtemp(prefix=prefix)
        self._ctx = zmq.Context()
        self.results = self._ctx.socket(zmq.PULL)
        out_addr = f"ipc://{self.tmpdir}/out"
        self.results.bind(out_addr)
        self.inboxes = []
        self.procs: list[Any] = []
        self.remote: RemoteChildren | None = None
        self._started = False
        spawn = multiprocessing.get_context("spawn")
        level = logging.getLogger("ingot").getEffectiveLevel()
        self.finalizer = weakref.finalize(self, _cleanup, self.procs, self._ctx, self.tmpdir)
        if self.local < count:
            assert remote is not None
            try:
                self.remote = remote()
            except BaseException:
                self.close()
                raise
        self._poller = zmq.Poller()
        for sock in (self.results, self.remote and self.remote.results):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
        for i in range(self.local):
            sock = self._ctx.socket(zmq.PUSH)
            in_addr = f"ipc://{self.tmpdir}/in{i}"
            sock.bind(in_addr)
            self.inboxes.append(sock)
            proc = spawn.Process(
                target=target,
                args=(*args(i, self.init_method), in_addr, out_addr, os.getpid(), level),
                name=f"ingot-{kind.replace(' ', '-')}-{i}",
            )
            proc.start()
            self.procs.append(proc)

    @property
    def init_method(self) -> str:
        """A torch.distributed rendezvous in the private directory: no port to pick (and race
        for), and it goes with the directory."""
        return f"file://{self.tmpdir}/dist-init"

    def send(self, i: int, message: bytes, flags: int = 0) -> None:
        if i < self.local:
            self.inboxes[i].send(message, flags)
        else:
            assert self.remote is not None
            self.remote.inboxes[i].send(message, flags)

    def recv(self, timeout_s: float) -> tuple[int, str, Any] | None:
        """The next reply, or None after ``timeout_s`` without one (other nodes' heartbeats
        are taken here)."""
        deadline = time.monotonic() + timeout_s
        while True:
            events = dict(self._poller.poll(int(max(deadline - time.monotonic(), 0) * 1000)))
            if not events:
                return None
            sock = next(iter(events))
            i, status, value = pickle.loads(sock.recv())
            if self.remote is not None and i in self.remote.last_seen:
                self.remote.last_seen[i] = time.monotonic()
            if status != "alive":
                return i, status, value

    def dead_child(self) -> str | None:
        """A description of the first child that exited, else None."""
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                return f"{self.kind} {i} (pid {proc.pid}) exited with code {proc.exitcode}"
        if self._started and self.remote is not None:
            return self.remote.dead_child()
        return None

    def wait_started(self, timeout_s: float) -> list[Any]:
        """Each child's first reply (its start-up), in index order (``wait_started``)."""
        replies = wait_started(self.count, self.recv, self.dead_child, timeout_s, self.kind,
                               self.hint)
        if self.remote is not None:  # from now on their launchers' heartbeats count
            self.remote.last_seen = dict.fromkeys(self.remote.last_seen, time.monotonic())
        self._started = True
        return replies

    def close(self) -> None:
        self.finalizer()
        if self.remote is not None:
            self.remote.close()


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
