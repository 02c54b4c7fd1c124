"""Supervision of spawned child processes: start them, talk to them over pyzmq, notice one
that fails, exits or stays silent, and stop them.

Low enough for both of its users to import (stdlib, pyzmq, ingot's errors and the wire):
the multiprocess executor (worker/multiproc_executor.py: one child per TP rank) and data
parallelism (engine/dp_client.py: one child per engine-core replica). Children on other nodes
(heartbeats, the ``--headless`` launcher) are distributed/remote_children.py's.

Every message is a frame of distributed/wire.py (typed, authenticated with the launch's key);
each user declares the kinds its children send and receive (a schema); every child may also
send wire.py's ``CHILD_KINDS``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import zmq

from ingot.distributed import wire
from ingot.distributed.wire import ALIVE, CHILD_KINDS, FAILED, HELLO, ChildLink
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


class Inbox:
    """A child's incoming calls: ``(kind, value)`` frames from its parent, checked and typed."""

    def __init__(self, sock: zmq.Socket, link: wire.Link) -> None:
        self._sock = sock
        self._link = link

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._sock.poll(timeout_ms))

    def recv(self) -> tuple[str, Any] | None:
        """The next call (waiting for it); None for a frame that was dropped."""
        message = self._link.open(self._sock.recv())
        return None if message is None else message[1:]


def _unencodable(kind: str, value: Any, exc: Exception) -> tuple[str, Any]:
    return FAILED, f"a reply could not be sent: {exc}"


def child_links(
    index: int, label: str, link: ChildLink, calls: Mapping[str, Any],
    unencodable: Callable[[str, Any, Exception], tuple[str, Any]] = _unencodable,
) -> tuple[Inbox, Callable[[str, Any], None]]:
    """The preamble of a ``ChildProcesses`` child: logging tagged ``[label]``, the parent-death
    watch, and its two sockets. Returns (the inbox of calls, decoded by the ``calls`` schema,
    and ``reply(kind, value)``, which sends as child ``index``). A value that cannot travel is
    replaced by ``unencodable(kind, value, exc)``'s (kind, value): the parent must still get an
    answer, or it would wait for one forever."""
    logging.basicConfig(level=link.log_level,
                        format=f"%(asctime)s %(levelname)s [{label}] %(message)s")
    logging.getLogger("ingot").setLevel(link.log_level)
    threading.Thread(target=_watch_parent, args=(link.parent_pid,), daemon=True).start()
    wire.allow_rpc_modules(link.rpc_modules)
    ctx = zmq.Context()
    inbox = wire.connect(ctx, zmq.PULL, link.in_addr, link.key)
    outbox = wire.connect(ctx, zmq.PUSH, link.out_addr, link.key)
    ends = wire.Link(link.key, calls, index)

    def reply(kind: str, value: Any) -> None:
        try:
            frame = ends.seal(kind, value)
        except (TypeError, ValueError) as exc:  # see the docstring
            frame = ends.seal(*unencodable(kind, value, exc))
        outbox.send(frame)

    return Inbox(inbox, ends), reply


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
    that fails (a ``FAILED`` reply), exits (``dead_child``) or stays silent for ``timeout_s`` is
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
            if status == FAILED:
                raise WorkerProcessError(f"{kind} {i} failed during start:\n{value}")
            if status == HELLO:
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
    engine cores of data parallelism (engine/dp_client.py). ``target(*args(i), link)`` runs in
    child ``i`` (``args(i, init_method)``: the rendezvous below; ``link``: a ``ChildLink``);
    children send wire frames of the kinds ``replies`` declares (and ``CHILD_KINDS``).

    ``key``: the frames' key (the shared secret when some children are on other nodes; a fresh
    one otherwise). Children ``local ..  count - 1`` (``remote(key)``), when given, run on
    other nodes: their launchers' heartbeats are taken here, and one silent for
    ``HEARTBEAT_TIMEOUT_S`` counts as dead once they have all started."""

    def __init__(self, count: int, target: Callable[..., None],
                 args: Callable[[int, str], tuple[Any, ...]], kind: str, prefix: str,
                 replies: Mapping[str, Any], local: int | None = None,
                 remote: Callable[[bytes], RemoteChildren] | None = None,
                 hint: Callable[[list[int]], str] = lambda missing: "",
                 key: bytes | None = None) -> None:
        self.count = count
        self.local = count if local is None else local
        self.kind = kind  # how errors name a child: "worker rank", "data-parallel rank"
        self.hint = hint  # after the names of children that never connected
        self.tmpdir = tempfile.mkdtemp(prefix=prefix)
        self._ctx = zmq.Context()
        self.link = wire.Link(key or wire.new_key(), {**CHILD_KINDS, **replies})
        out_addr = f"ipc://{self.tmpdir}/out"
        self.results = wire.bind(self._ctx, zmq.PULL, out_addr, self.link.key)
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
                self.remote = remote(self.link.key)
            except BaseException:
                self.close()
                raise
        self._poller = zmq.Poller()
        for sock in (self.results, self.remote and self.remote.results):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
        for i in range(self.local):
            in_addr = f"ipc://{self.tmpdir}/in{i}"
            self.inboxes.append(wire.bind(self._ctx, zmq.PUSH, in_addr, self.link.key))
            link = ChildLink(in_addr, out_addr, self.link.key, os.getpid(), level,
                             wire.rpc_modules())
            proc = spawn.Process(
                target=target,
                args=(*args(i, self.init_method), link),
                name=f"ingot-{kind.replace(' ', '-')}-{i}",
            )
            proc.start()
            self.procs.append(proc)

    @property
    def init_method(self) -> str:
        """A torch.distributed rendezvous in the private directory: no port to pick (and race
        for), and it goes with the directory."""
        return f"file://{self.tmpdir}/dist-init"

    def seal(self, kind: str, value: Any = None) -> bytes:
        """A call as a frame, for ``send`` (to one child or, sealed once, to each)."""
        return self.link.seal(kind, value)

    def send(self, i: int, frame: bytes, flags: int = 0) -> None:
        if i < self.local:
            self.inboxes[i].send(frame, flags)
        else:
            assert self.remote is not None
            self.remote.inboxes[i].send(frame, flags)

    def recv(self, timeout_s: float) -> tuple[int, str, Any] | None:
        """The next reply, (child index, kind, value), or None after ``timeout_s`` without one
        (other nodes' heartbeats are taken here; frames that fail the check are dropped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            events = dict(self._poller.poll(int(max(deadline - time.monotonic(), 0) * 1000)))
            if not events:
                return None
            sock = next(iter(events))
            message = self.link.open(sock.recv())
            if message is None:
                continue
            i, kind, value = message
            if self.remote is not None and i in self.remote.last_seen:
                self.remote.last_seen[i] = time.monotonic()
            if kind != ALIVE:
                return message

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


