"""One data-parallel replica, in its own process: an ``EngineCore`` and its step loop, driven
by the front end's ``DPEngineCoreClient`` (engine/dp_client.py) over the sockets of
distributed/supervision.py (or, on another node, distributed/remote_children.py).
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from concurrent.futures import Future
from typing import Any

from ingot.config import EngineConfig
from ingot.distributed.data_parallel import busy_loop_turn
from ingot.distributed.supervision import child_links

_IDLE_POLL_S = 0.1  # how long an idle replica waits for a command
_COMPILE_POLL_S = 0.005  # ... and while the front end waits for one of its compiles


def replica_config(config: EngineConfig, dp_rank: int, init_method: str) -> EngineConfig:
    """The config of replica ``dp_rank``: the same model and limits (``max_num_seqs`` is per
    replica), its own rank, so its workers are global ranks ``dp_rank * TP + i``; with EP
    across the replicas, the rendezvous of their common world."""
    parallel = config.parallel_config
    return dataclasses.replace(config, parallel_config=dataclasses.replace(
        parallel, data_parallel_rank=dp_rank,
        distributed_init_method=init_method if parallel.replicas_synchronise else None))


def _compile_reply(future: Future) -> tuple[str, Any]:
    """A finished constraint check as an RPC result (the grammar itself stays here, cached)."""
    if future.cancelled():
        return "error", ValueError("the constraint's compile was cancelled (the engine is "
                                   "shutting down)")
    exc = future.exception()
    return ("ok", None) if exc is None else ("error", exc)


def replica_main(config: EngineConfig, dp_rank: int, in_addr: str, out_addr: str,
                 parent_pid: int, log_level: int) -> None:
    """One replica: an EngineCore and its step loop. Messages in: ``(kind, payload)``, kind
    "add", "compile" (a constraint check: answered as an "rpc" once compiled), "finish",
    "rpc", "shutdown"; out: ``(dp_rank, status, value)`` with status "ready", "outputs"
    (outputs, stats), "rpc" (call id, result), "error" (a traceback: the replica is gone)."""
    def rpc_error(status: str, value: Any, exc: Exception) -> tuple[str, Any]:
        # An unpicklable RPC result fails that call, not the replica.
        call_id = value[0] if status == "rpc" else None
        return "rpc", (call_id, ("error", RuntimeError(f"result not picklable: {exc!r}")))

    inbox, reply = child_links(dp_rank, f"dp {dp_rank}", in_addr, out_addr, parent_pid,
                               log_level, rpc_error)
    try:
        from ingot.engine.core import EngineCore
        from ingot.engine.tokenizer import load_tokenizer

        core = EngineCore(config, load_tokenizer(config.model_config))
        reply("ready", core.get_stats())
        lockstep = config.parallel_config.replicas_synchronise
        any_busy = False
        compiles: dict[int, Future] = {}  # the front end's constraint checks, by call id

        def wait_ms() -> int:
            """How long to wait for a command: not at all while there is work to step."""
            if core.has_pending_work() or any_busy:
                return 0
            return int((_COMPILE_POLL_S if compiles else _IDLE_POLL_S) * 1000)

        def step() -> bool:
            """One engine step; whether it ran a forward (an empty schedule runs none)."""
            before = core.num_steps
            outputs = core.step()
            if outputs:
                reply("outputs", (outputs, core.get_stats()))
            return core.num_steps > before

        while True:
            while inbox.poll(wait_ms()):
                kind, payload = pickle.loads(inbox.recv())
                if kind == "add":
                    core.add_request(payload)
                elif kind == "compile":
                    call_id, params = payload
                    try:
                        compiles[call_id] = core.submit_structured_output(params)
                    except ValueError as exc:  # structured outputs cannot run at all
                        reply("rpc", (call_id, ("error", exc)))
                elif kind == "finish":
                    core.finish_requests(*payload)
                elif kind == "rpc":
                    call_id, method, args, kwargs = payload
                    try:  # an EngineCore method: collective_rpc, reset_prefix_cache, ...
                        result: Any = ("ok", getattr(core, method)(*args, **kwargs))
                    except Exception as exc:  # noqa: BLE001 - the caller raises it
                        result = ("error", exc)
                    reply("rpc", (call_id, result))
                elif kind == "shutdown":
                    core.shutdown()
                    reply("rpc", (payload, ("ok", None)))
                    return
            for call_id, future in [c for c in compiles.items() if c[1].done()]:
                del compiles[call_id]
                reply("rpc", (call_id, _compile_reply(future)))
            busy = core.has_pending_work() or any_busy
            if lockstep:  # EP across replicas: every turn together (data_parallel.py)
                any_busy = busy_loop_turn(
                    core.has_pending_work, step,
                    lambda: core.collective_rpc("execute_dummy_batch"),
                    lambda local: core.collective_rpc("dp_has_unfinished", (local,))[0])
            elif busy:
                step()
    except BaseException:  # noqa: BLE001 - reported to the front end, which fails requests
        reply("error", traceback.format_exc())
