"""Children on other nodes: the head node's end (``RemoteChildren``: their sockets, bound over
TCP, and their launchers' heartbeats) and the other node's end (``run_remote_children``: the
``ingot serve --headless`` launcher). Generic over what the children run: TP worker ranks
(worker/multiproc_executor.py) and data-parallel replicas (engine/dp_client.py).

Everything between nodes travels over TCP as distributed/wire.py's frames under the secret all
nodes share (``require_shared_secret``): CURVE-encrypted sockets that a peer without it cannot
join, and HMAC-checked messages.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from ingot.distributed import wire
from ingot.distributed.wire import ALIVE, CHILD_KINDS, FAILED, ChildLink

logger = logging.getLogger("ingot")

HEARTBEAT_S = 1.0  # how often a --headless node reports its children
#: A child on another node silent this long (no reply, no heartbeat) is taken as gone.
HEARTBEAT_TIMEOUT_S = float(os.environ.get("INGOT_DP_HEARTBEAT_TIMEOUT_S", "10"))


class RemoteChildren:
    """The children of other nodes (each node's ``ingot serve --headless`` launcher spawns its
    own, ``run_remote_children``, and reports their health every ``HEARTBEAT_S``): their
    sockets, bound here over TCP at ``results_addr`` and ``inbox_addr(i)``, under ``key`` (the
    shared secret). ``flags``: what to change when an address cannot be bound."""

    def __init__(self, results_addr: str, inbox_addr: Callable[[int], str], indices: range,
                 kind: str, flags: str, key: bytes) -> None:
        self.kind = kind
        self._ctx = zmq.Context()
        self.inboxes: dict[int, zmq.Socket] = {}
        try:
            self.results = wire.bind(self._ctx, zmq.PULL, results_addr, key)
            for i in indices:
                self.inboxes[i] = wire.bind(self._ctx, zmq.PUSH, inbox_addr(i), key)
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
                        inbox_addr: Callable[[int], str], kind: str, key: bytes) -> int:
    """A ``--headless`` node's launcher: spawn ``target(*args(i), link)`` for each of
    ``indices`` (``link``: a ``ChildLink`` to the head node over TCP, under ``key``, the shared
    secret), report their health there every ``HEARTBEAT_S``, and return when they have all
    exited (the head shut them down: 0); a child that dies is reported and stops the rest
    (1)."""
    spawn = multiprocessing.get_context("spawn")
    level = logging.getLogger("ingot").getEffectiveLevel()
    procs = {i: spawn.Process(target=target,
                              args=(*args(i), ChildLink(inbox_addr(i), results_addr, key,
                                                        os.getpid(), level, wire.rpc_modules())),
                              name=f"ingot-{kind.replace(' ', '-')}-{i}")
             for i in indices}
    for proc in procs.values():
        proc.start()
    logger.info("headless: %ss %s for the head node at %s", kind, list(indices), results_addr)
    ctx = zmq.Context()
    beat = wire.connect(ctx, zmq.PUSH, results_addr, key)
    # Each child's heartbeat goes out under its index (the head counts them per child).
    links = {i: wire.Link(key, CHILD_KINDS, i) for i in indices}
    try:
        while True:
            running = 0
            for i, proc in procs.items():
                if proc.is_alive():
                    running += 1
                    beat.send(links[i].seal(ALIVE))
                elif proc.exitcode != 0:
                    beat.send(links[i].seal(FAILED, f"exited with code {proc.exitcode}"))
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

