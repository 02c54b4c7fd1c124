"""The multiprocess executor's reply collection: a rank that answers the next call before
another rank's answer to this one arrives (a step without collectives, sent ahead under async
scheduling) must not have its answer counted for this call (that lost a reply and hung a
TP 2 engine with the faster shared-memory collectives)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from ingot.worker.multiproc_executor import MultiprocExecutor


def test_an_early_reply_waits_for_its_own_call():
    ex = MultiprocExecutor.__new__(MultiprocExecutor)  # no processes: scripted replies
    ex.world_size, ex._early, ex._dead = 2, {}, None
    ex.check_health = lambda: None
    arrivals = deque([(1, "ok", "a1"), (1, "ok", "b1"), (0, "ok", "a0"), (0, "ok", "b0")])
    ex._children = SimpleNamespace(recv=lambda s: arrivals.popleft() if arrivals else None)
    assert ex._gather("execute_model", True, timeout=5) == ["a0", "a1"]
    assert ex._gather("execute_model", True, timeout=5) == ["b0", "b1"]
