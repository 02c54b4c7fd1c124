"""`ingot serve` as a command: start-up errors are one line (before the model loads), and
Ctrl-C stops a busy server promptly."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from server_utils import TINY_FLAGS, free_port, run_server


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ingot.cli.main", "--log-level", "warning", "serve", *args],
        capture_output=True, text=True, timeout=timeout,
    )


def serve_in_process(capsys, *args: str) -> str:
    """`ingot serve ARGS` through the CLI's main() in this process (no interpreter start-up);
    returns its one error line."""
    from ingot.cli.main import main

    assert main(["--log-level", "warning", "serve", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    return line


def test_help_lists_server_flags():
    out = serve("--help").stdout
    for flag in ("--host", "--port", "--api-key", "--served-model-name",
                 "--max-request-body-bytes", "--max-model-len", "--additional-config"):
        assert flag in out


def test_port_in_use_fails_before_loading(tiny_llama_dir, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        line = serve_in_process(capsys, str(tiny_llama_dir), "--port", str(port))
        assert f"127.0.0.1:{port}" in line and "--port" in line
        assert time.monotonic() - start < 5  # refused before any model work


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--port", "70000"], "--port must be in 1..65535"),
        (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
        (["--model", "/elsewhere"], "not both"),
        (["--api-key", " "], "--api-key"),
        (["--host", "no.such.host.invalid"], "--host"),
        (["--additional-config", json.dumps({"profiler": {"max_iterations": -2}})],
         "profiler.max_iterations"),
        (["--additional-config", json.dumps({"profiler": {"ranks": 0}})], "profiler.ranks"),
        (["--max-stop-strings", "0"], "--max-stop-strings must be a positive number"),
        (["--chat-template-timeout-s", "nan"], "--chat-template-timeout-s"),
        (["--profiler-dir", "/a", "--additional-config",
          json.dumps({"profiler": {"output_dir": "/b"}})], "--profiler-dir"),
    ],
)
def test_bad_serve_flags(tiny_llama_dir, capsys, flags, fragment):
    port = str(free_port())  # a valid port, so each case fails on its own flag
    line = serve_in_process(capsys, str(tiny_llama_dir), *TINY_FLAGS, "--port", port, *flags)
    assert fragment in line, line


def test_ctrl_c_stops_a_busy_server(tiny_llama_dir, tmp_path):
    with run_server([str(tiny_llama_dir), *TINY_FLAGS], tmp_path) as server:
        # A stream in flight when Ctrl-C arrives must not keep the process alive.
        conn = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        body = json.dumps({"prompt": "x", "max_tokens": 200, "ignore_eos": True,
                           "stream": True}).encode()
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert conn.recv(100).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(timeout=30)
        conn.close()
    assert code == 0, server.log()
    assert time.monotonic() - start < 15
