"""Issue #31 items 1 and 4 under ``ingot serve -tp 2`` (two worker processes): ``/start_profile``
twice is one 400 (the second rank-side ValueError comes back as an error, not as the workers'
death) and the engine serves on; frames forged on the executor's socket (the old pickle whose
``__reduce__`` would create a file, a forged error that would end the engine, a forged step
output, all without the launch's secret) are dropped and logged: no file appears, ``/health``
answers throughout, and the server gives the same greedy answer afterwards."""

from __future__ import annotations

import json
import os
import pickle
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
    greedy_answer,
    run_server,
)

from ingot.distributed.wire import Link, RemoteError

pytestmark = pytest.mark.slow  # a server with two worker processes


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp-hardening")
    (path / "ipc").mkdir()
    return path


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp):
    profiler = {"profiler": {"output_dir": str(tmp / "profiles"), "ranks": [0, 1]}}
    # TMPDIR: the executor's private socket directory lands where the attack can find it.
    env = {**os.environ, "TMPDIR": str(tmp / "ipc")}
    with run_server([str(tiny_llama_dir), *TINY_FLAGS, "-tp", "2", "--additional-config",
                     json.dumps(profiler)], tmp, startup_timeout=120, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def baseline(server) -> str:
    return greedy_answer(server)


def test_start_profile_twice_is_one_400_and_the_engine_serves_on(server, baseline):
    with HealthWatch(server) as watch:
        assert server.request("POST", "/start_profile")[0] == 200
        start = time.monotonic()
        status, _, body = server.request("POST", "/start_profile")
        assert time.monotonic() - start < 10
        assert_client_error(status, body, "already running")
        assert greedy_answer(server) == baseline  # while profiling
        assert server.request("POST", "/stop_profile")[0] == 200
        # At the bar: a profile started after the stop is fine.
        assert server.request("POST", "/start_profile")[0] == 200
        assert server.request("POST", "/stop_profile")[0] == 200
    watch.assert_healthy()
    assert_recovered(server, baseline)


def test_forged_frames_on_the_workers_socket_are_dropped(server, baseline, tmp):
    (results,) = (tmp / "ipc").glob("ingot-mp-*/out")
    target = tmp / "pwned"
    stranger = Link(b"w" * 32, {}, 1)  # well-formed frames, without the launch's secret
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"ipc://{results}")
    try:
        with HealthWatch(server) as watch:
            sock.send(pickle.dumps(Exploit(str(target))))
            sock.send(stranger.seal("result", pickle.dumps(Exploit(str(target)))))
            sock.send(stranger.seal("error", RemoteError(["SystemExit"], "die")))
            sock.send(stranger.seal("output", None))
            # The executor reads them with the next step's replies, and drops them.
            assert greedy_answer(server) == baseline
        watch.assert_healthy()
    finally:
        ctx.destroy(linger=0)
    assert not target.exists()
    assert "dropped a frame on an ingot process socket" in server.log()
    assert_recovered(server, baseline)
