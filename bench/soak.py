"""Soak: minutes of mixed traffic from many concurrent clients against one `ingot serve`.

Each client loops until the time is up, picking a kind of request at random (weights below):
plain completions, streamed chats read to the end, streams dropped after two chunks, bad
requests (each must get a 4xx), constrained requests (one schema, compiled once), constrained
requests with a new schema that the client abandons while it compiles, and streams whose reader
stalls. A background thread polls ``/health`` throughout.

Reports requests by kind and outcome, ``/health``'s slowest answer, the server's RSS after the
warm-up and at the end, and the free KV blocks when idle before and after (they must be equal:
every request's blocks came back). Exits non-zero when a check fails: an unexpected outcome, a
``/health`` answer slower than 2 s, free blocks that did not come back.

Usage (the default model unless ``--model``; extra `ingot serve` flags after ``--``):
  python bench/soak.py [--minutes 10] [--clients 16] [--model M] [-- --max-num-seqs 16 ...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

from serve_util import ingot_server

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches near the old river bank").split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
          "age": {"type": "integer"}}, "required": ["name", "age"]}
# kind -> weight: mostly valid traffic, a steady share of abuse.
KINDS = {"complete": 6, "stream": 6, "disconnect": 3, "bad": 4, "constrained": 2,
         "abandoned_compile": 1, "stall": 1}
STALL_S = 75.0  # a stalled reader sleeps this long: past --stream-idle-timeout (60 s), to be dropped


def bad_requests(model: str) -> list[tuple[str, str, bytes]]:
    """(path, content type, body): each must be answered with a 4xx."""
    def js(body: dict) -> bytes:
        return json.dumps({"model": model, **body}).encode()
    msgs = [{"role": "user", "content": "hi"}]
    return [
        ("/v1/completions", "application/json", b"{not json"),
        ("/v1/completions", "application/json", js({"prompt": "hi", "max_tokens": -1})),
        ("/v1/completions", "application/json", js({"prompt": "hi", "stop_token_ids": [2**40]})),
        ("/v1/completions", "application/json", js({"prompt": [10**9]})),
        ("/v1/completions", "application/json",
         b'{"prompt": "hi", "repetition_penalty": 1e400}'),
        ("/v1/completions", "text/plain", js({"prompt": "hi"})),
        ("/v1/completions", "application/json", js({"prompt": ["hi"] * 5000, "n": 128})),
        ("/v1/completions", "application/json", js({"prompt": "hi", "stop": ["x" * 300] * 64})),
        ("/v1/completions", "application/json", b"[" * 100_000 + b"]" * 100_000),
        ("/v1/chat/completions", "application/json", js({
            "messages": msgs,
            "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
                             "{% endfor %}{% endfor %}"})),
        ("/v1/chat/completions", "application/json", js({"messages": msgs, "tools": [
            {"type": "function", "function": {"name": f"f{i}"}} for i in range(5000)]})),
    ]


class Client:
    def __init__(self, base: str, model: str, seed: int, deadline: float,
                 tally: Counter, lock: threading.Lock) -> None:
        url = urlparse(base)
        self.host, self.port = url.hostname, url.port
        self.model, self.deadline = model, deadline
        self.rng = random.Random(seed)
        self.tally, self.lock = tally, lock
        self.bad_bodies = bad_requests(model)

    def conn(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 30)))

    def record(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.tally[(kind, outcome)] += 1

    def post(self, path: str, body: dict | bytes, ctype: str = "application/json",
             timeout: float = 120) -> tuple[int, bytes]:
        c = self.conn(timeout)
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            c.request("POST", path, body=data, headers={"Content-Type": ctype})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    @staticmethod
    def outcome(status: int) -> str:
        if status == 200:
            return "ok"
        if status == 503:
            return "shed (503)"  # overload answered with Retry-After: a valid outcome
        return f"error {status}"

    def run(self) -> None:
        kinds, weights = zip(*KINDS.items(), strict=True)
        while time.monotonic() < self.deadline:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                self.record(kind, getattr(self, kind)())
            except (OSError, http.client.HTTPException) as exc:
                self.record(kind, f"connection {type(exc).__name__}")

    def complete(self) -> str:
        status, _ = self.post("/v1/completions", {
            "model": self.model, "prompt": self.prompt(), "max_tokens": 16, "temperature": 0.7})
        return self.outcome(status)

    def _stream(self, chunks: int | None, stall_s: float = 0.0) -> str:
        """A streamed chat; ``chunks``: read that many lines then drop the connection;
        ``stall_s``: read nothing for that long first."""
        c = self.conn()
        try:
            c.request("POST", "/v1/chat/completions", body=json.dumps({
                "model": self.model, "stream": True, "max_tokens": 48 if chunks is None else 256,
                "messages": [{"role": "user", "content": self.prompt()}],
            }).encode(), headers={"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                return self.outcome(r.status)
            if stall_s:
                time.sleep(stall_s)
                return "ok (stalled, then left)"
            seen = 0
            for line in r:
                if line.startswith(b"data: [DONE]"):
                    return "ok"
                seen += line.startswith(b"data: ")
                if chunks is not None and seen >= chunks:
                    return "ok (dropped)"
            return "stream ended without [DONE]"
        finally:
            c.close()

    def stream(self) -> str:
        return self._stream(None)

    def disconnect(self) -> str:
        return self._stream(2)

    def stall(self) -> str:
        return self._stream(None, stall_s=min(STALL_S, max(0.0, self.deadline - time.monotonic())))

    def bad(self) -> str:
        path, ctype, body = self.rng.choice(self.bad_bodies)
        status, raw = self.post(path, body, ctype, timeout=30)
        if not 400 <= status < 500:
            return f"bad request answered {status}"
        return "refused (4xx)" if b"Traceback" not in raw else "refused, but leaks a traceback"

    def _constrained(self, schema: dict, timeout: float) -> str:
        status, _ = self.post("/v1/chat/completions", {
            "model": self.model, "max_tokens": 24,
            "messages": [{"role": "user", "content": "a person as JSON"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": schema}},
        }, timeout=timeout)
        return self.outcome(status)

    def constrained(self) -> str:
        return self._constrained(SCHEMA, 120)

    def abandoned_compile(self) -> str:
        """A new schema each time (a compile the cache cannot answer), abandoned after 0.3 s."""
        props = {f"k{self.rng.randrange(10**9)}_{i}": {"type": "string", "maxLength": 40}
                 for i in range(12)}
        try:
            return self._constrained({"type": "object", "properties": props,
                                      "required": list(props)}, 0.3)
        except TimeoutError:
            return "ok (abandoned)"


def metric(base: str, name: str) -> float:
    c = http.client.HTTPConnection(urlparse(base).hostname, urlparse(base).port, timeout=10)
    try:
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
    finally:
        c.close()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_idle(base: str, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(base, "ingot:num_requests_running") == 0
                and metric(base, "ingot:num_requests_waiting") == 0):
            return True
        time.sleep(0.5)
    return False


def health_watch(base: str, stop: threading.Event, out: dict) -> None:
    host, port = urlparse(base).hostname, urlparse(base).port
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            c = http.client.HTTPConnection(host, port, timeout=10)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
        except OSError:
            ok = False
        out["worst_s"] = max(out["worst_s"], time.monotonic() - t0)
        out["polls"] += 1
        out["failures"] += not ok
        stop.wait(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--model", default=None, help="default: ingot's default model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="soak-server.log", help="the server's log file")
    ap.add_argument("serve_flags", nargs="*", help="extra `ingot serve` flags (after --)")
    ns = ap.parse_args()
    flags = ([ns.model] if ns.model else []) + ns.serve_flags
    procs: list = []
    with open(ns.log, "wb") as log, ingot_server(flags, log=log, procs=procs) as base:
        c = http.client.HTTPConnection(urlparse(base).hostname, urlparse(base).port, timeout=10)
        c.request("GET", "/v1/models")
        model = json.loads(c.getresponse().read())["data"][0]["id"]
        c.close()
        pid = procs[0].pid
        free_start = metric(base, "ingot:kv_cache_free_blocks")
        # Warm-up: one of each valid kind, so that RSS at start includes what every path loads.
        warm = Client(base, model, ns.seed, time.monotonic() + 3600, Counter(), threading.Lock())
        for kind in ("complete", "stream", "constrained"):
            getattr(warm, kind)()
        wait_idle(base)
        rss_start = rss_mb(pid)

        tally: Counter = Counter()
        lock = threading.Lock()
        health = {"worst_s": 0.0, "polls": 0, "failures": 0}
        stop = threading.Event()
        watcher = threading.Thread(target=health_watch, args=(base, stop, health), daemon=True)
        watcher.start()
        t0 = time.monotonic()
        deadline = t0 + ns.minutes * 60
        clients = [threading.Thread(target=Client(base, model, ns.seed + 1 + i, deadline,
                                                  tally, lock).run, daemon=True)
                   for i in range(ns.clients)]
        rss_peak = rss_start
        # RSS at each tenth of the run: growth that levels off (allocator pools filling)
        # reads differently from growth that goes on (a leak).
        timeline: list[float] = []
        for t in clients:
            t.start()
        while any(t.is_alive() for t in clients):
            rss_now = rss_mb(pid)
            rss_peak = max(rss_peak, rss_now)
            if len(timeline) < 10 and time.monotonic() >= t0 + (len(timeline) + 1) * (deadline - t0) / 10:
                timeline.append(round(rss_now, 1))
            time.sleep(1)
        elapsed = time.monotonic() - t0
        idle = wait_idle(base)
        stop.set()
        watcher.join(timeout=15)
        free_end = metric(base, "ingot:kv_cache_free_blocks")
        rss_end = rss_mb(pid)

    served = sum(n for (_, outcome), n in tally.items() if outcome.startswith(("ok", "refused")))
    print(f"soak: {ns.minutes:g} min, {ns.clients} clients, {elapsed:.0f} s of traffic")
    print(f"{'kind':<20} {'outcome':<36} {'count':>7}")
    for (kind, outcome), n in sorted(tally.items()):
        print(f"{kind:<20} {outcome:<36} {n:>7}")
    unexpected = {f"{k}: {o}": n for (k, o), n in tally.items()
                  if not o.startswith(("ok", "refused (4xx)", "shed (503)"))}
    result = {
        "minutes": ns.minutes, "clients": ns.clients, "requests": sum(tally.values()),
        "served_as_expected": served, "unexpected": unexpected,
        "health_worst_s": round(health["worst_s"], 3), "health_polls": health["polls"],
        "health_failures": health["failures"], "rss_start_mb": round(rss_start, 1),
        "rss_peak_mb": round(rss_peak, 1), "rss_end_mb": round(rss_end, 1),
        "rss_mb_each_tenth": timeline,
        "kv_free_blocks_start": free_start, "kv_free_blocks_end": free_end, "idle_at_end": idle,
    }
    print("RESULT " + json.dumps(result))
    ok = (not unexpected and health["failures"] == 0 and health["worst_s"] < 2.0
          and free_end == free_start and idle)
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
