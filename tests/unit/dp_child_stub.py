"""A stand-in child process for ChildProcesses' start-up tests (test_data_parallel.py): it
imports nothing heavy, so the spawned interpreters start in a fraction of a second."""

from __future__ import annotations

import os
import pickle
import time

import zmq


def child(index: int, behaviour: dict, in_addr: str, out_addr: str, parent_pid: int,
          log_level: int) -> None:
    """Answers its start-up, unless ``behaviour[index]`` says "hang", "exit" or "hello" (says
    it has connected, then hangs: a rank waiting in the rendezvous for another node's)."""
    what = behaviour.get(index, "answer")
    if what == "exit":
        os._exit(3)
    if what == "hang":
        time.sleep(60)
        return
    out = zmq.Context().socket(zmq.PUSH)
    out.connect(out_addr)
    out.send(pickle.dumps((index, "hello", None)))
    if what != "hello":
        out.send(pickle.dumps((index, "ok", f"ready {index}")))
    time.sleep(60)  # alive until the test stops it
