"""One data-parallel replica, in its own process: an ``EngineCore`` and its step loop, driven
by the front end's ``DPEngineCoreClient`` (engine/dp_client.py) over the sockets of
distributed/supervision.py (or, on another node, distributed/remote_children.py), in
distributed/wire.py's typed, authenticated frames (``TO_REPLICA``, ``FROM_REPLICA``).
"""

from __future__ import annotations

import dataclasses
import inspect
import traceback
import typing
from concurrent.futures import Future
from typing import Any

import msgspec

from ingot.buckets import BucketStats
from ingot.config import EngineConfig
from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import Request, RequestStatus
from ingot.core.spec_policy import SpecDecodingStats
from ingot.distributed.data_parallel import busy_loop_turn
from ingot.distributed.supervision import child_links
from ingot.distributed.wire import FAILED, ChildLink, RemoteError, convert
from ingot.sampling_params import SamplingParams

_IDLE_POLL_S = 0.1  # how long an idle replica waits for a command
_COMPILE_POLL_S = 0.005  # ... and while the front end waits for one of its compiles


def _constructor_message(cls: type, name: str) -> type[msgspec.Struct]:
    """A message of ``cls``'s constructor arguments, typed by its signature: a new request
    travels as what it was made from (its state before the core touched it)."""
    hints = typing.get_type_hints(cls.__init__)
    fields: list[tuple[Any, ...]] = []
    for arg, param in inspect.signature(cls.__init__).parameters.items():
        if arg != "self":
            fields.append((arg, hints[arg]) if param.default is param.empty
                          else (arg, hints[arg], param.default))
    return msgspec.defstruct(name, fields, array_like=True)


NewRequest = _constructor_message(Request, "NewRequest")


def request_message(request: Request) -> msgspec.Struct:
    return NewRequest(**{f: getattr(request, f) for f in NewRequest.__struct_fields__})


class Compile(msgspec.Struct, array_like=True):
    call_id: int
    params: SamplingParams


class Finish(msgspec.Struct, array_like=True):
    request_ids: list[str]
    status: RequestStatus


class CoreCall(msgspec.Struct, array_like=True):
    """An ``EngineCore`` method of ``CORE_CALLS`` on the replica."""

    call_id: int
    method: str
    args: list[Any]
    kwargs: dict[str, Any]


class Outputs(msgspec.Struct, array_like=True):
    outputs: list[EngineCoreOutput]
    stats: dict[str, Any]


class RpcReply(msgspec.Struct, array_like=True):
    call_id: int
    value: Any = None
    error: RemoteError | None = None


#: The EngineCore methods the front end may call on a replica.
CORE_CALLS = frozenset({"collective_rpc", "reset_prefix_cache", "request_blocks"})
# What a replica receives, and what it answers (wire.py's schemas).
TO_REPLICA: dict[str, Any] = {"add": NewRequest, "compile": Compile, "finish": Finish,
                              "rpc": CoreCall, "shutdown": int}
FROM_REPLICA: dict[str, Any] = {"ready": dict[str, Any], "outputs": Outputs, "rpc": RpcReply}
# The stats entries that are objects, not plain numbers (get_stats).
_STATS_TYPES: dict[str, Any] = {"buckets": BucketStats, "spec_decode": SpecDecodingStats | None}


def typed_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """A replica's stats as they arrived (plain data), with their objects rebuilt."""
    return {**stats, **{k: convert(stats[k], tp) for k, tp in _STATS_TYPES.items()}}


def replica_config(config: EngineConfig, dp_rank: int, init_method: str) -> EngineConfig:
    """The config of replica ``dp_rank``: the same model and limits (``max_num_seqs`` is per
    replica), its own rank, so its workers are global ranks ``dp_rank * TP + i``; with EP
    across the replicas, the rendezvous of their common world."""
    parallel = config.parallel_config
    return dataclasses.replace(config, parallel_config=dataclasses.replace(
        parallel, data_parallel_rank=dp_rank,
        distributed_init_method=init_method if parallel.replicas_synchronise else None))


def _compile_reply(call_id: int, future: Future) -> RpcReply:
    """A finished constraint check as an RPC result (the grammar itself stays here, cached)."""
    if future.cancelled():
        return RpcReply(call_id, error=RemoteError.of(ValueError(
            "the constraint's compile was cancelled (the engine is shutting down)")))
    exc = future.exception()
    return RpcReply(call_id, error=None if exc is None else RemoteError.of(exc))


def replica_main(config: EngineConfig, dp_rank: int, link: ChildLink) -> None:
    """One replica: an EngineCore and its step loop. Messages in (``TO_REPLICA``): "add",
    "compile" (a constraint check: answered as an "rpc" once compiled), "finish", "rpc",
    "shutdown"; out (``FROM_REPLICA``): "ready" (stats), "outputs" (outputs, stats), "rpc" (a
    result or an error), ``FAILED`` (a traceback: the replica is gone)."""
    def rpc_error(kind: str, value: Any, exc: Exception) -> tuple[str, Any]:
        if kind != "rpc":
            return FAILED, f"a reply could not be sent: {exc}"
        # A result that cannot travel fails that call, not the replica.
        return "rpc", RpcReply(value.call_id, error=RemoteError.of(
            TypeError(f"the result cannot be sent back: {exc}")))

    inbox, reply = child_links(dp_rank, f"dp {dp_rank}", link, TO_REPLICA, rpc_error)
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
                reply("outputs", Outputs(outputs, core.get_stats()))
            return core.num_steps > before

        while True:
            while inbox.poll(wait_ms()):
                message = inbox.recv()
                if message is None:
                    continue
                kind, payload = message
                if kind == "add":
                    core.add_request(Request(**msgspec.structs.asdict(payload)))
                elif kind == "compile":
                    try:
                        compiles[payload.call_id] = core.submit_structured_output(payload.params)
                    except ValueError as exc:  # structured outputs cannot run at all
                        reply("rpc", RpcReply(payload.call_id, error=RemoteError.of(exc)))
                elif kind == "finish":
                    core.finish_requests(payload.request_ids, payload.status)
                elif kind == "rpc":
                    try:
                        if payload.method not in CORE_CALLS:
                            raise AttributeError(f"{payload.method!r} is not an engine-core "
                                                 f"call ({', '.join(sorted(CORE_CALLS))})")
                        result = RpcReply(payload.call_id, getattr(core, payload.method)(
                            *payload.args, **payload.kwargs))
                    except Exception as exc:  # noqa: BLE001 - the caller raises it
                        result = RpcReply(payload.call_id, error=RemoteError.of(
                            exc, traceback.format_exc()))
                    reply("rpc", result)
                elif kind == "shutdown":
                    core.shutdown()
                    reply("rpc", RpcReply(payload))
                    return
            for call_id, future in [c for c in compiles.items() if c[1].done()]:
                del compiles[call_id]
                reply("rpc", _compile_reply(call_id, future))
            busy = core.has_pending_work() or any_busy
            if lockstep:  # EP across replicas: every turn together (data_parallel.py)
                any_busy = busy_loop_turn(
                    core.has_pending_work, step,
                    lambda: core.collective_rpc("execute_dummy_batch"),
                    lambda local: core.collective_rpc("dp_has_unfinished", (local,))[0])
            elif busy:
                step()
    except BaseException:  # noqa: BLE001 - reported to the front end, which fails requests
        reply(FAILED, traceback.format_exc())
