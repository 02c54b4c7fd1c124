"""A stand-in child process for ChildProcesses' start-up tests (test_data_parallel.py): it
imports nothing heavy, so the spawned interpreters start in a fraction of a second."""

from __future__ import annotations

import os
import time

import zmq

from ingot.distributed import wire

#: What the stand-in answers (ChildProcesses' ``replies``).
REPLIES = {"ok": str}


def child(index: int, behaviour: dict, link: wire.ChildLink) -> None:
    """Answers its start-up, unless ``behaviour[index]`` says "hang", "exit" or "hello" (says
    it has connected, then hangs: a rank waiting in the rendezvous for another node's)."""
    what = behaviour.get(index, "answer")
    if what == "exit":
        os._exit(3)
    if what == "hang":
        time.sleep(60)
        return
    out = wire.connect(zmq.Context(), zmq.PUSH, link.out_addr, link.key)
    frames = wire.Link(link.key, {}, index)
    out.send(frames.seal(wire.HELLO))
    if what != "hello":
        out.send(frames.seal("ok", f"ready {index}"))
    time.sleep(60)  # alive until the test stops it
