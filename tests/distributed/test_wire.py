"""The wire between ingot's processes (distributed/wire.py; issue #31 item 1): every message
type that travels (a step, its output, a DP replica's requests, outputs and stats, errors)
survives the codec unchanged, tensors and arrays as raw bytes; a frame without the launch's
secret (well formed, or a pickle whose ``__reduce__`` would create a file) is dropped and
logged, never decoded; over TCP a peer without the secret can neither send nor take a share of
a PUSH socket's messages (CURVE); functions travel only as registered names; and a launch over
several nodes refuses to start without a shared secret. No model runs here (fast)."""

from __future__ import annotations

import logging
import os
import pickle
import struct
import sys
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from ingot.buckets import BucketCounter, BucketStats
from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import Request, RequestStatus
from ingot.core.spec_policy import SpecDecodingStats
from ingot.distributed import wire
from ingot.distributed.supervision import WorkerProcessError
from ingot.distributed.wire import Link, RemoteError, RpcName, rpc_function
from ingot.engine.dp_replica import (
    FROM_REPLICA,
    TO_REPLICA,
    Outputs,
    RpcReply,
    request_message,
    typed_stats,
)
from ingot.errors import IngotError
from ingot.pooling_params import PoolingParams
from ingot.runner_output import ModelRunnerOutput, PromptLogprobsChunk, SampledLogprobs
from ingot.sampling_params import SamplingParams
from ingot.sched_output import GrammarBitmask, NewRequestData, ScheduledRequest, SchedulerOutput
from ingot.worker.multiproc_executor import FROM_WORKER, TO_WORKER, Call

KEY = b"k" * 32
SCHEMA = {**TO_WORKER, **FROM_WORKER, **TO_REPLICA, **FROM_REPLICA}


def _trip(kind: str, value, schema=SCHEMA):  # noqa: ANN001, ANN202
    index, got_kind, got = Link(KEY, schema).open(Link(KEY, {}, 3).seal(kind, value))
    assert (index, got_kind) == (3, kind)
    return got


def _params() -> SamplingParams:
    params = SamplingParams(temperature=0.5, top_k=4, seed=7, stop=["x"], stop_token_ids=[5],
                            logprobs=2, structured_outputs={"json": {"type": "object"}})
    params.all_stop_token_ids |= {2}  # the engine adds the model's EOS
    return params


def test_a_step_and_its_output_survive_the_codec():
    embeds = torch.randn(3, 8, dtype=torch.bfloat16)
    step = SchedulerOutput(
        scheduled=[ScheduledRequest("a", 3, 0, [1, 2], True, [9, 8])],
        new_requests=[NewRequestData("a", [1, 2, 3], _params(), prompt_embeds=embeds),
                      NewRequestData("p", [4], None, PoolingParams(dimensions=4))],
        finished_req_ids={"z"}, is_prefill=True, num_padded=8, ctx_bucket=64,
        grammar_bitmask=GrammarBitmask(["a"], np.arange(6, dtype=np.int32).reshape(1, 6)),
        propose_drafts=True)
    got = _trip("step", step)
    assert got.new_requests[0].prompt_embeds.dtype == torch.bfloat16
    assert torch.equal(got.new_requests[0].prompt_embeds, embeds)
    assert np.array_equal(got.grammar_bitmask.bitmask, step.grammar_bitmask.bitmask)
    got.new_requests[0].prompt_embeds = step.new_requests[0].prompt_embeds = None
    got.grammar_bitmask.bitmask = step.grammar_bitmask.bitmask = None
    assert got == step
    assert got.new_requests[0].sampling_params.all_stop_token_ids == {2, 5}

    out = ModelRunnerOutput(["a"], [[7, 8]], {"a": [SampledLogprobs([7, 1], [-0.1, -2.0], 1)]},
                            {"a": PromptLogprobsChunk(0, [[1]], [[-1.5]], [1])},
                            {"p": [0.5, 0.25]}, {"compilation": {"graphs": 2}}, {"a": [3]})
    assert _trip("output", out) == out
    assert _trip("output", None) is None


def test_a_replicas_messages_survive_the_codec():
    request = Request("r", [1, 2, 3], _params(), 12.5, prompt_embeds=torch.ones(3, 4),
                      cache_salt=b"salt")
    got = Request(**msgspec.structs.asdict(_trip("add", request_message(request))))
    for name in ("request_id", "prompt_token_ids", "sampling_params", "arrival_time",
                 "pooling_params", "cache_salt"):
        assert getattr(got, name) == getattr(request, name), name
    assert torch.equal(got.prompt_embeds, request.prompt_embeds)
    pooling = Request("q", [4], None, 1.0, pooling_params=PoolingParams(normalize=True))
    assert _trip("add", request_message(pooling)).pooling_params == pooling.pooling_params

    outputs = [EngineCoreOutput("r", [5], [SampledLogprobs([5], [-0.5], 1)],
                                finish_status=RequestStatus.FINISHED_STOPPED, stop_reason=5,
                                first_scheduled_time=3.0, error="why")]
    buckets = BucketStats(decode={4: BucketCounter(1, 2, 3)}, decode_ctx={128: 1})
    spec = SpecDecodingStats(2, num_drafts=1, num_accepted_tokens_per_pos=[1, 0])
    got = _trip("outputs", Outputs(outputs, {"num_running": 1, "buckets": buckets,
                                             "spec_decode": spec}))
    assert got.outputs == outputs
    assert typed_stats(got.stats) == {"num_running": 1, "buckets": buckets, "spec_decode": spec}
    assert typed_stats(_trip("ready", {"buckets": BucketStats(), "spec_decode": None})) == \
        {"buckets": BucketStats(), "spec_decode": None}
    reply = RpcReply(4, error=RemoteError.of(ValueError("no")))
    assert _trip("rpc", reply) == reply
    assert _trip("rpc", RpcReply(5, [[1, 2]])) == RpcReply(5, [[1, 2]])


@pytest.mark.parametrize("tensor", [
    torch.randn(2, 3), torch.randn(4).to(torch.bfloat16), torch.arange(5), torch.tensor(True),
    torch.empty(0, 7), torch.randn(3, 4).t(),  # not contiguous
])
def test_tensors_travel_as_raw_bytes_with_dtype_and_shape(tensor):
    got = _trip("result", {"t": [tensor]})["t"][0]
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor)
    array = np.arange(12, dtype=np.uint32).reshape(3, 4)
    assert np.array_equal(_trip("result", array), array)


def test_a_tensor_frame_that_lies_about_its_size_is_refused():
    # float32, shape [3], but the bytes of two
    lying = msgspec.msgpack.Ext(1, struct.pack("<BBQ", 0, 1, 3) + b"\0" * 8)
    with pytest.raises(ValueError, match="does not match its shape"):
        wire.decoder(object).decode(msgspec.msgpack.encode(lying))
    no_such_dtype = msgspec.msgpack.Ext(1, bytes([200, 0]))
    with pytest.raises(ValueError, match="bad header"):
        wire.decoder(object).decode(msgspec.msgpack.encode(no_such_dtype))


class _Exploit:
    """A pickle payload whose unpickling creates a file (what a forged frame would carry)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


def test_frames_without_the_secret_are_dropped_and_logged_never_decoded(tmp_path, caplog):
    target = tmp_path / "pwned"
    receiver = Link(KEY, SCHEMA)
    forged = [
        Link(b"w" * 32, {}, 0).seal("result", pickle.dumps(_Exploit(str(target)))),
        pickle.dumps(_Exploit(str(target))),  # the old protocol's frame
        Link(b"w" * 32, {}, 0).seal("error", RemoteError(["SystemExit"], "die")),
        b"\0" * 32 + Link(KEY, {}, 0).seal("result", 1)[32:],  # a right frame, no MAC
        Link(KEY, {}, 0).seal("result", 1)[:-1],  # one byte short
        Link(KEY, {}, 0).seal("result", 1)[:33],  # shorter than its header says
        b"",
    ]
    with caplog.at_level(logging.WARNING, logger="ingot"):
        assert [receiver.open(f) for f in forged] == [None] * len(forged)
    assert not target.exists()
    assert "failed the HMAC check" in caplog.text
    assert len(caplog.records) == 1  # rate-limited: one line, with the count, per 10 s
    # At the bar: the same message under the launch's key is taken.
    assert receiver.open(Link(KEY, {}, 0).seal("result", [1, "x"])) == (0, "result", [1, "x"])
    # An authentic frame of a kind this end does not receive is dropped too.
    assert Link(KEY, TO_WORKER).open(Link(KEY, {}, 0).seal("result", 1)) is None


def test_tcp_peers_without_the_secret_cannot_send_or_take_messages():
    """CURVE under keys derived from the secret: a plain zmq peer and one with another secret
    never complete the handshake, so nothing they send arrives and a PUSH socket never hands
    them a share of its messages."""
    ctx = zmq.Context()
    try:
        results = wire.bind(ctx, zmq.PULL, "tcp://127.0.0.1:*", KEY)
        addr = results.getsockopt(zmq.LAST_ENDPOINT).decode()
        plain = ctx.socket(zmq.PUSH)
        plain.connect(addr)
        wrong = wire.connect(ctx, zmq.PUSH, addr, b"w" * 32)
        for sock in (plain, wrong):
            sock.send(Link(b"w" * 32, {}, 0).seal("result", "forged"), zmq.NOBLOCK)
        right = wire.connect(ctx, zmq.PUSH, addr, KEY)
        right.send(Link(KEY, {}, 1).seal("result", "ours"))
        assert results.poll(5000)
        assert Link(KEY, SCHEMA).open(results.recv()) == (1, "result", "ours")
        assert not results.poll(500)  # the others' frames never arrived

        calls = wire.bind(ctx, zmq.PUSH, "tcp://127.0.0.1:*", KEY)
        addr = calls.getsockopt(zmq.LAST_ENDPOINT).decode()
        thief = ctx.socket(zmq.PULL)
        thief.connect(addr)
        worker = wire.connect(ctx, zmq.PULL, addr, KEY)
        time.sleep(0.5)  # both connected (or refused) before the calls go out
        for i in range(10):
            calls.send(Link(KEY, {}, 0).seal("result", i))
        got = []
        while worker.poll(2000) and len(got) < 10:
            got.append(Link(KEY, SCHEMA).open(worker.recv())[2])
        assert got == list(range(10))  # every call reached the worker, none the thief
        assert not thief.poll(200)
    finally:
        ctx.destroy(linger=0)


@rpc_function
def _double(worker, x: int) -> int:  # noqa: ANN001
    return 2 * x


def test_functions_travel_only_as_registered_names():
    got = _trip("call", Call(_double, [3], {}))
    assert isinstance(got.method, RpcName) and got.method.resolve() is _double
    with pytest.raises(TypeError, match="not a registered RPC function.*@rpc_function"):
        Link(KEY, {}).seal("call", Call(os.system, ["true"], {}))
    with pytest.raises(TypeError, match="cannot travel"):
        Link(KEY, {}).seal("result", object())
    with pytest.raises(ValueError, match="module-level"):
        rpc_function(lambda worker: None)
    # A name that arrives is looked up, never imported unless this process's registry (or its
    # parent's, from the spawn arguments) holds its module.
    with pytest.raises(ValueError, match="not a registered RPC function here"):
        RpcName("ingot_wire_probe_never_imported:fn").resolve()
    assert "ingot_wire_probe_never_imported" not in sys.modules
    with pytest.raises(ValueError, match="not a registered RPC function here"):
        RpcName("os:system").resolve()


class _RequestValueError(ValueError):
    """A ValueError subclass the receiver does not know (the server's RequestValueError)."""


def test_errors_are_rebuilt_as_the_nearest_known_class():
    def remote(exc: BaseException) -> Exception:
        return _trip("error", RemoteError.of(exc, "Traceback ...\nValueError: x")).rebuild(
            "worker rank 1")

    err = remote(_RequestValueError("the profiler is already running"))
    assert type(err) is ValueError and str(err) == "the profiler is already running"
    assert "worker rank 1" in err.__notes__[0]  # the remote traceback, for the log only
    assert type(remote(KeyError("k"))) is KeyError
    assert type(remote(WorkerProcessError("gone"))) is WorkerProcessError
    assert isinstance(remote(WorkerProcessError("gone")), IngotError)
    assert type(remote(SystemExit(3))) is RuntimeError  # not an Exception: never rebuilt


def test_the_shared_secret(tmp_path, monkeypatch):
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    assert wire.shared_secret(None) is None
    with pytest.raises(ValueError, match=r"INGOT_RPC_SECRET.*--rpc-secret-file"):
        wire.require_shared_secret(None, "--nnodes > 1")
    monkeypatch.setenv(wire.SECRET_ENV, "x" * 15)
    with pytest.raises(ValueError, match="holds 15 characters; a secret needs at least 16"):
        wire.shared_secret(None)
    monkeypatch.setenv(wire.SECRET_ENV, " " + "x" * 16 + "\n")
    assert wire.shared_secret(None) == b"x" * 16
    path = tmp_path / "secret"
    path.write_text("y" * 64 + "\n")
    assert wire.shared_secret(str(path)) == b"y" * 64  # the file wins over the env var
    with pytest.raises(ValueError, match="cannot read it"):
        wire.shared_secret(str(tmp_path / "missing"))


@pytest.mark.parametrize("kw, what", [
    (dict(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1"), "--nnodes > 1"),
    (dict(data_parallel_size=2, data_parallel_size_local=1), "over several nodes"),
])
def test_a_launch_over_several_nodes_needs_the_secret(tiny_llama_dir, monkeypatch, kw, what):
    """Refused before any process starts or socket opens, naming both ways to give it."""
    from ingot.engine.arg_utils import EngineArgs
    from ingot.engine.dp_client import DPEngineCoreClient
    from ingot.worker.multiproc_executor import MultiprocExecutor

    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    config = EngineArgs(model=str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True,
                        max_model_len=64, **kw).create_engine_config()
    cls = MultiprocExecutor if "nnodes" in kw else DPEngineCoreClient
    with pytest.raises(ValueError, match=rf"{what}.*INGOT_RPC_SECRET.*--rpc-secret-file"):
        cls(config)
