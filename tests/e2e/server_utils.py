"""Helpers for tests that drive a real `ingot serve` subprocess over loopback HTTP."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

TINY_FLAGS = ["--dtype", "float32", "--max-model-len", "256"]


def free_port(count: int = 1) -> int:
    """A port free now, with the ``count - 1`` after it free too (multi-node TP and DP take
    the ports after --master-port / --data-parallel-rpc-port: a free port's neighbour could be
    some connection's ephemeral port, which once failed a run)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + count > 65536:
            continue
        held = []
        try:
            for p in range(port, port + count):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.base = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> tuple[int, dict[str, str], bytes]:
        """One raw HTTP request on a fresh connection. ``body``: bytes are sent as they are,
        anything else as JSON."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, _, raw = self.request(method, path, body, **kw)
        return status, json.loads(raw) if raw else None

    def metrics_text(self) -> str:
        status, _, raw = self.request("GET", "/metrics")
        assert status == 200
        return raw.decode()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample as {(name, sorted labels without model_name): value}."""
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                out[(sample.name, labels)] = sample.value
        return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (KeyError if absent: a missing child is a failure, not a zero)."""
    return samples[(name, tuple(sorted(labels.items())))]


@contextmanager
def run_server(
    args: list[str], log_dir: Path, startup_timeout: float = 60, log_level: str = "warning",
    launcher: list[str] | None = None, env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """`ingot serve ARGS` on a free loopback port, ready (polled on /health) when yielded;
    stopped with SIGINT (as Ctrl-C would) afterwards. ``launcher``: the command that stands for
    `ingot` (default ``python -m ingot.cli.main``), e.g. a script that patches the engine
    first."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*(launcher or [sys.executable, "-m", "ingot.cli.main"]),
             "--log-level", log_level, "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    server = Server(proc, port, log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ingot serve exited with {proc.returncode}:\n{server.log()}")
            try:
                if server.request("GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"ingot serve not ready in {startup_timeout}s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def wait_until(predicate: Any, timeout: float = 15, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class HealthWatch:
    """Polls ``/health`` from a background thread while an attack runs (issue #31's bar: the
    server answers within 2 s throughout). ``worst`` is the slowest answer in seconds and
    ``failures`` lists every poll that was not a 200 or did not answer at all."""

    def __init__(self, server: Server, interval: float = 0.2, timeout: float = 5) -> None:
        import threading

        self.server = server
        self.interval = interval
        self.timeout = timeout
        self.worst = 0.0
        self.polls = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                status = self.server.request("GET", "/health", timeout=self.timeout)[0]
                if status != 200:
                    self.failures.append(f"/health answered {status}")
            except OSError as exc:
                self.failures.append(f"/health did not answer: {exc!r}")
            self.worst = max(self.worst, time.monotonic() - start)
            self.polls += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout + 1)

    def assert_healthy(self, limit_s: float = 2.0) -> None:
        assert self.polls > 0, "the health watch never polled"
        assert not self.failures, self.failures
        assert self.worst < limit_s, f"/health took {self.worst:.2f}s (limit {limit_s}s)"


def assert_client_error(status: int, body: bytes, *fragments: str) -> dict:
    """An attack's answer: a 4xx in OpenAI's error shape whose body leaks nothing of the server
    (no traceback, no source path)."""
    assert 400 <= status < 500, (status, body[:500])
    text = body.decode(errors="replace")
    for leak in ("Traceback", 'File "', ".py", "/site-packages/", "/src/ingot"):
        assert leak not in text, f"error body leaks {leak!r}: {text[:500]}"
    err = json.loads(body)["error"]
    assert err["message"] and err["code"] == status, err
    for fragment in fragments:
        assert fragment in err["message"], err["message"]
    return err


def greedy_answer(server: Server, model: str | None = None, prompt: str = "The capital of") -> str:
    """One greedy completion (8 tokens): compared before and after an attack."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    if model is not None:
        body["model"] = model
    status, out = server.json("POST", "/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]["text"]


def assert_recovered(server: Server, baseline: str, model: str | None = None) -> None:
    """After an attack: the same greedy answer as before, and nothing left running."""
    assert greedy_answer(server, model) == baseline
    assert wait_until(
        lambda: metric(server.metrics(), "ingot:num_requests_running") == 0, timeout=15
    ), "requests still running after the attack"


class Exploit:
    """A pickle whose unpickling would create ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))
