"""Issue #31 items 1 and 4 under data parallelism over two "nodes" on localhost (the API
server's node runs replica 0, an ``ingot serve --headless`` node replica 1, over TCP at
``--data-parallel-rpc-port``, sharing ``INGOT_RPC_SECRET``):

* over TCP, a peer without the secret cannot deliver a frame (a pickle whose ``__reduce__``
  would create a file, a well-formed forged error) nor take a share of replica 1's calls;
* on the local replica's ipc socket, frames without the secret are dropped and logged;
* ``/start_profile`` twice is one 400 and the engine serves on (the replicas' errors return);
* a node started without the secret is refused, saying how to give one.
Throughout, ``/health`` answers within 2 s, and afterwards the greedy answer is the same and
both replicas still serve."""

from __future__ import annotations

import json
import os
import pickle
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from server_utils import (
    TINY_FLAGS,
    Exploit,
    HealthWatch,
    assert_client_error,
    assert_recovered,
    free_port,
    greedy_answer,
    run_server,
)

from ingot.distributed import wire
from ingot.distributed.wire import Link, RemoteError

pytestmark = pytest.mark.slow  # two replicas, one on a --headless "node"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dp-hardening")
    (path / "ipc").mkdir()
    return path


@pytest.fixture(scope="module")
def nodes(tiny_llama_dir, tmp):
    """(the server, its --data-parallel-rpc-port)."""
    port = free_port(2)  # DP rank r listens at the port + r
    profiler = {"profiler": {"output_dir": str(tmp / "profiles"), "ranks": [0, 1]}}
    flags = [str(tiny_llama_dir), *TINY_FLAGS, "--data-parallel-size", "2",
             "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(port), "--additional-config", json.dumps(profiler)]
    env = {**os.environ, "INGOT_RPC_SECRET": secrets.token_hex(32), "TMPDIR": str(tmp / "ipc")}
    with open(tmp / "headless.log", "w") as log:
        headless = subprocess.Popen(
            [sys.executable, "-m", "ingot.cli.main", "serve", *flags,
             "--data-parallel-start-rank", "1", "--headless"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with run_server(flags, tmp, startup_timeout=120, env=env) as server:
            yield server, port
        assert headless.wait(timeout=30) == 0, (tmp / "headless.log").read_text()
    finally:
        if headless.poll() is None:
            headless.kill()
            headless.wait()


@pytest.fixture(scope="module")
def baseline(nodes) -> str:
    return greedy_answer(nodes[0])


def _routed(server) -> list[float]:  # noqa: ANN001
    """Requests routed to each replica (a replica's series appears with its first one)."""
    samples = server.metrics()
    key = "ingot:dp_requests_routed_total"
    return [samples.get((key, (("dp_rank", str(r)),)), 0.0) for r in (0, 1)]


def test_peers_without_the_secret_reach_nothing_over_tcp(nodes, baseline, tmp):
    server, port = nodes
    target = tmp / "pwned-tcp"
    exploit = pickle.dumps(Exploit(str(target)))
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.PUSH)  # no CURVE at all: the old protocol's peer
        plain.connect(f"tcp://127.0.0.1:{port}")
        wrong = wire.connect(ctx, zmq.PUSH, f"tcp://127.0.0.1:{port}", b"w" * 32)
        thief = ctx.socket(zmq.PULL)  # would take a round-robin share of replica 1's calls
        thief.connect(f"tcp://127.0.0.1:{port + 1}")
        stranger = Link(b"w" * 32, {}, 1)
        routed = _routed(server)
        with HealthWatch(server) as watch:
            for sock in (plain, wrong):
                for frame in (exploit, stranger.seal("failed", "forged: replica 1 is gone"),
                              stranger.seal("rpc", RemoteError(["SystemExit"], "die"))):
                    try:
                        sock.send(frame, zmq.NOBLOCK)
                    except zmq.Again:
                        # The server already refused this peer's handshake and zmq dropped
                        # its pipe (a race with the sends): the frame reaches nothing either.
                        pass
            for _ in range(4):  # both replicas serve: every call reached replica 1 whole
                assert greedy_answer(server) == baseline
        watch.assert_healthy()
        assert not thief.poll(100)
    finally:
        ctx.destroy(linger=0)
    after = _routed(server)
    assert after[1] > routed[1] and after[0] > routed[0]
    assert not target.exists()
    assert_recovered(server, baseline)


def test_frames_without_the_secret_on_the_local_replicas_socket_are_dropped(nodes, baseline,
                                                                           tmp):
    server, _ = nodes
    (results,) = (tmp / "ipc").glob("ingot-dp-*/out")
    target = tmp / "pwned-ipc"
    stranger = Link(b"w" * 32, {}, 0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"ipc://{results}")
    try:
        with HealthWatch(server) as watch:
            sock.send(pickle.dumps(Exploit(str(target))))
            sock.send(stranger.seal("failed", "forged: replica 0 is gone"))
            time.sleep(1)  # the front end's health check reads (and drops) them
            assert greedy_answer(server) == baseline
        watch.assert_healthy()
    finally:
        ctx.destroy(linger=0)
    assert not target.exists()
    assert "dropped a frame on an ingot process socket" in server.log()
    assert_recovered(server, baseline)


def test_start_profile_twice_is_one_400_and_the_engine_serves_on(nodes, baseline):
    server, _ = nodes
    with HealthWatch(server) as watch:
        assert server.request("POST", "/start_profile")[0] == 200
        start = time.monotonic()
        status, _, body = server.request("POST", "/start_profile")
        assert time.monotonic() - start < 10
        assert_client_error(status, body, "already running")
        assert server.request("POST", "/stop_profile")[0] == 200
    watch.assert_healthy()
    assert_recovered(server, baseline)


def test_a_node_without_the_secret_is_refused(tiny_llama_dir):
    env = {k: v for k, v in os.environ.items() if k != "INGOT_RPC_SECRET"}
    done = subprocess.run(
        [sys.executable, "-m", "ingot.cli.main", "serve", str(tiny_llama_dir), *TINY_FLAGS,
         "--data-parallel-size", "2", "--data-parallel-size-local", "1",
         "--data-parallel-start-rank", "1", "--data-parallel-rpc-port", str(free_port(2)),
         "--headless"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "INGOT_RPC_SECRET" in done.stderr and "--rpc-secret-file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
