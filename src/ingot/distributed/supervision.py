"""Supervision of spawned child processes: start them, talk to them over pyzmq, notice one
that fails, exits or stays silent, and stop them.

Low enough for both of its users to import (stdlib, pyzmq and ingot's errors only): the
multiprocess executor (worker/multiproc_executor.py: one child per TP rank) and data
parallelism (engine/dp_client.py: one child per engine-core replica). Children on other nodes
(heartbeats, the ``--headless`` launcher) are distributed/remote_children.py's.
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
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from ingot.errors import IngotError

if TYPE_CHECKING:
    from ingot.distributed.remote_children import RemoteChildren

_POLL_S = 0.1
#: Seconds a rank may take to start (import, load the model) before it is reported missing.
STARTUP_TIMEOUT_S = float(os.environ.get("INGOT_WORKER_STARTUP_TIMEOUT_S", "600"))


class WorkerProcessError(IngotError, RuntimeError):
    """A child process (a worker rank, a data-parallel engine) failed or exited; the engine
    must be restarted."""


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


