"""Compile cache: keys, tiers, locking across processes, integrity, hit-only mode, fallback.

Builds are counted through files the build function appends to, so counts are right across
spawned processes. The worker functions live at module level so 'spawn' children can import
them; this module deliberately does not import torch at the top (children start faster).
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing as mp
import os
import re
import threading
import time
from pathlib import Path

import pytest

from ingot.compilation import cache as cache_mod
from ingot.compilation.cache import (
    CompileCache,
    CompileCacheMissError,
    CompileCacheTimeoutError,
    compute_cache_key,
)
from ingot.compilation.cache_entry import SENTINEL

KEY_A = "a" * 32
KEY_B = "b" * 32


def build_artifact(out: Path, *, counter: Path, payload: str, delay_s: float = 0.0) -> None:
    """A stand-in compiler: records that it ran, takes a while, writes two files."""
    with open(counter, "a") as f:
        f.write(f"{payload}\n")
    time.sleep(delay_s)
    (out / "graph.bin").write_text(payload)
    (out / "meta").mkdir()
    (out / "meta" / "io_map.json").write_text(json.dumps({"payload": payload}))


def load_artifact(entry: Path) -> str:
    return (entry / "graph.bin").read_text()


def builds(counter: Path) -> list[str]:
    return counter.read_text().splitlines() if counter.exists() else []


def _worker(root: str, key: str, counter: str, results: str, start) -> None:
    start.wait()
    cache = CompileCache(root=root, remote="", timeout_s=30)
    build = functools.partial(build_artifact, counter=Path(counter), payload=key, delay_s=0.5)
    value = cache.get_or_create(key, build, load_artifact, label=key[:4])
    with open(results, "a") as f:
        f.write(f"{key} {value}\n")


def _hold_lock(lock_path: str, held, release) -> None:
    import filelock

    with filelock.FileLock(lock_path):
        held.set()
        release.wait(30)


@pytest.fixture
def counter(tmp_path: Path) -> Path:
    return tmp_path / "builds.txt"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("INGOT_CACHE_ROOT", "INGOT_REMOTE_CACHE", "INGOT_DISABLE_WARMUP_COMPILE",
                 "INGOT_COMPILATION_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def make_build(counter: Path, payload: str = "compiled"):
    return functools.partial(build_artifact, counter=counter, payload=payload)


# -- multi-process ---------------------------------------------------------------------------


def _run_workers(tmp_path: Path, keys: list[str], counter: Path) -> list[str]:
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    results = tmp_path / "results.txt"
    procs = [ctx.Process(target=_worker, args=(str(tmp_path / "root"), key, str(counter),
                                                 str(results), start)) for key in keys]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * len(keys)
    return sorted(results.read_text().splitlines())


def test_four_processes_same_key_build_once(tmp_path, counter):
    results = _run_workers(tmp_path, [KEY_A] * 4, counter)
    assert builds(counter) == [KEY_A]
    assert results == [f"{KEY_A} {KEY_A}"] * 4


def test_two_keys_each_build_once(tmp_path, counter):
    results = _run_workers(tmp_path, [KEY_A, KEY_B, KEY_A, KEY_B], counter)
    assert sorted(builds(counter)) == [KEY_A, KEY_B]
    assert results == [f"{KEY_A} {KEY_A}"] * 2 + [f"{KEY_B} {KEY_B}"] * 2


def test_stalled_lock_times_out_with_a_clear_error(tmp_path, counter):
    cache = CompileCache(root=tmp_path, timeout_s=1)
    lock_path = cache.lock_path(KEY_A)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(lock_path), held, release))
    holder.start()
    try:
        assert held.wait(30)
        start = time.monotonic()
        with pytest.raises(CompileCacheTimeoutError, match=r"waited 1 s for the compile lock.*"
                           r"INGOT_COMPILATION_TIMEOUT"):
            cache.get_or_create(KEY_A, make_build(counter), load_artifact)
        assert 0.9 < time.monotonic() - start < 10
        assert builds(counter) == []
    finally:
        release.set()
        holder.join(30)


# -- tiers -----------------------------------------------------------------------------------


def test_local_hit_loads_without_building_again(tmp_path, counter):
    first = CompileCache(root=tmp_path)
    assert first.get_or_create(KEY_A, make_build(counter), load_artifact, label="b1") == "compiled"
    second = CompileCache(root=tmp_path)
    assert second.get_or_create(KEY_A, make_build(counter), load_artifact) == "compiled"
    assert builds(counter) == ["compiled"]
    assert (first.stats.misses, first.stats.compiles, first.stats.hits) == (1, 1, 0)
    assert list(first.stats.compile_seconds) == ["b1"]
    assert (second.stats.hits, second.stats.misses, second.stats.compiles) == (1, 0, 0)
    assert sorted(p.name for p in (tmp_path / "compile_cache" / KEY_A).rglob("*")) == [
        SENTINEL, "graph.bin", "io_map.json", "meta"]


@pytest.mark.parametrize("scheme", ["path", "fsspec"])
def test_remote_only_warm_start_builds_nothing(tmp_path, counter, scheme):
    producer = CompileCache(root=tmp_path / "ci")
    producer.get_or_create(KEY_A, make_build(counter, "from-ci"), load_artifact)
    assert producer.save_to(tmp_path / "share", KEY_A) is True
    assert builds(counter) == ["from-ci"]

    share = str(tmp_path / "share")
    remote = share if scheme == "path" else f"file://{share}"
    host = CompileCache(root=tmp_path / "host", remote=remote)
    assert host.get_or_create(KEY_A, make_build(counter), load_artifact) == "from-ci"
    assert host.get_or_create(KEY_A, make_build(counter), load_artifact) == "from-ci"
    assert builds(counter) == ["from-ci"]  # no build on the host
    assert (host.stats.remote_hits, host.stats.hits, host.stats.misses) == (1, 1, 0)
    assert host.contains(KEY_A)  # copied into the local tier


def test_remote_tier_comes_from_the_environment(tmp_path, counter, monkeypatch):
    CompileCache(root=tmp_path / "ci").get_or_create(KEY_A, make_build(counter), load_artifact)
    CompileCache(root=tmp_path / "ci").save_to(tmp_path / "share", KEY_A)
    monkeypatch.setenv("INGOT_CACHE_ROOT", str(tmp_path / "host"))
    monkeypatch.setenv("INGOT_REMOTE_CACHE", str(tmp_path / "share"))
    host = CompileCache()
    assert host.dir == tmp_path / "host" / "compile_cache"
    host.get_or_create(KEY_A, make_build(counter), load_artifact)
    assert host.stats.remote_hits == 1 and len(builds(counter)) == 1


def test_corrupt_remote_entry_is_not_used_and_not_touched(tmp_path, counter):
    producer = CompileCache(root=tmp_path / "ci")
    producer.get_or_create(KEY_A, make_build(counter, "from-ci"), load_artifact)
    producer.save_to(tmp_path / "share", KEY_A)
    remote_file = tmp_path / "share" / "compile_cache" / KEY_A / "graph.bin"
    remote_file.write_text("garbage")
    host = CompileCache(root=tmp_path / "host", remote=str(tmp_path / "share"))
    assert host.get_or_create(KEY_A, make_build(counter, "local"), load_artifact) == "local"
    assert host.stats.remote_hits == 0 and host.stats.compiles == 1
    assert remote_file.read_text() == "garbage"


def test_concurrent_saves_one_wins_without_error(tmp_path, counter):
    source = CompileCache(root=tmp_path / "ci")
    source.get_or_create(KEY_A, make_build(counter), load_artifact)
    barrier = threading.Barrier(8)
    results, errors = [], []

    def save():
        barrier.wait()
        try:
            results.append(source.save_to(tmp_path / "share", KEY_A))
        except Exception as e:  # noqa: BLE001 - collected and asserted empty below
            errors.append(e)

    threads = [threading.Thread(target=save) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(results) == [False] * 7 + [True]
    shared = CompileCache(root=tmp_path / "share")
    assert shared.contains(KEY_A)
    assert not list((tmp_path / "share" / "compile_cache" / ".staging").iterdir())


def test_save_of_an_incomplete_entry_raises(tmp_path):
    cache = CompileCache(root=tmp_path)
    (cache.entry_dir(KEY_A)).mkdir(parents=True)
    (cache.entry_dir(KEY_A) / "graph.bin").write_text("half")
    with pytest.raises(RuntimeError, match="no completion sentinel"):
        cache.save_to(tmp_path / "share", KEY_A)


# -- hit-only mode ---------------------------------------------------------------------------


def test_miss_in_hit_only_mode_raises(tmp_path, counter, monkeypatch):
    monkeypatch.setenv("INGOT_DISABLE_WARMUP_COMPILE", "1")
    cache = CompileCache(root=tmp_path)
    assert cache.hit_only
    with pytest.raises(CompileCacheMissError, match=r"compile cache miss for key a{32} \(bucket"
                       r".*INGOT_DISABLE_WARMUP_COMPILE=1; run `ingot compile` first"):
        cache.get_or_create(KEY_A, make_build(counter), load_artifact, label="bucket-128")
    assert builds(counter) == [] and cache.stats.misses == 1
    assert isinstance(CompileCacheMissError("x"), RuntimeError)


def test_hit_only_mode_still_serves_hits(tmp_path, counter):
    CompileCache(root=tmp_path).get_or_create(KEY_A, make_build(counter), load_artifact)
    cache = CompileCache(root=tmp_path, hit_only=True)
    assert cache.get_or_create(KEY_A, make_build(counter), load_artifact) == "compiled"
    assert len(builds(counter)) == 1


def test_timeout_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("INGOT_COMPILATION_TIMEOUT", "2.5")
    assert CompileCache(root=tmp_path).timeout_s == 2.5
    assert CompileCache(root=tmp_path, timeout_s=7).timeout_s == 7


# -- integrity -------------------------------------------------------------------------------


def _loads_seen(entries: list[str]):
    def load(entry: Path) -> str:
        value = load_artifact(entry)
        entries.append(value)
        return value

    return load


def test_corrupt_entry_is_detected_deleted_and_rebuilt(tmp_path, counter, caplog):
    CompileCache(root=tmp_path).get_or_create(KEY_A, make_build(counter, "v1"), load_artifact)
    (tmp_path / "compile_cache" / KEY_A / "meta" / "io_map.json").write_text("{}")
    loaded: list[str] = []
    cache = CompileCache(root=tmp_path)
    with caplog.at_level(logging.WARNING, logger="ingot"):
        value = cache.get_or_create(KEY_A, make_build(counter, "v2"), _loads_seen(loaded))
    assert value == "v2" and loaded == ["v2"]
    assert builds(counter) == ["v1", "v2"]
    assert any("checksum mismatch in meta/io_map.json" in r.getMessage() for r in caplog.records)
    assert cache.contains(KEY_A)


def test_partial_entry_without_sentinel_is_rebuilt_never_loaded(tmp_path, counter, caplog):
    cache = CompileCache(root=tmp_path)
    cache.entry_dir(KEY_A).mkdir(parents=True)
    (cache.entry_dir(KEY_A) / "graph.bin").write_text("half-written")
    loaded: list[str] = []
    with caplog.at_level(logging.WARNING, logger="ingot"):
        value = cache.get_or_create(KEY_A, make_build(counter, "whole"), _loads_seen(loaded))
    assert value == "whole" and loaded == ["whole"]
    assert any("no completion sentinel" in r.getMessage() for r in caplog.records)


def test_extra_file_in_an_entry_counts_as_corrupt(tmp_path, counter):
    cache = CompileCache(root=tmp_path)
    cache.get_or_create(KEY_A, make_build(counter), load_artifact)
    (cache.entry_dir(KEY_A) / "stray.tmp").write_text("x")
    assert not cache.contains(KEY_A)


def test_failed_build_leaves_no_entry(tmp_path, counter):
    cache = CompileCache(root=tmp_path)

    def broken(out: Path) -> None:
        (out / "graph.bin").write_text("partial")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.get_or_create(KEY_A, broken, load_artifact)
    assert not cache.entry_dir(KEY_A).exists()
    assert not list((cache.dir / ".staging").iterdir())
    assert cache.get_or_create(KEY_A, make_build(counter), load_artifact) == "compiled"


# -- local root fallback ---------------------------------------------------------------------


def test_unwritable_root_falls_back_to_tmp(tmp_path, counter, monkeypatch, caplog):
    monkeypatch.setattr(cache_mod.tempfile, "tempdir", str(tmp_path / "tmp"))
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache root should be")
    with caplog.at_level(logging.WARNING, logger="ingot"):
        cache = CompileCache(root=blocker / "ingot")
    assert cache.dir == tmp_path / "tmp" / f"ingot_cache_{cache_mod._user()}" / "compile_cache"
    assert any("not usable" in r.getMessage() for r in caplog.records)
    assert cache.get_or_create(KEY_A, make_build(counter), load_artifact) == "compiled"


def test_network_filesystem_root_falls_back_to_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod.tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(cache_mod, "_filesystem_type",
                        lambda p: "nfs4" if "home" in str(p) else "ext4")
    cache = CompileCache(root=tmp_path / "home" / ".cache" / "ingot")
    assert cache.dir.is_relative_to(tmp_path / "tmp")
    assert CompileCache(root=tmp_path / "local").dir == tmp_path / "local" / "compile_cache"


def test_default_root_is_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert CompileCache().dir == tmp_path / ".cache" / "ingot" / "compile_cache"


# -- key -------------------------------------------------------------------------------------

GRAPH = "def forward(self, x):\n    y = torch.empty(3, device=device(type='cuda', index=1))\n"


def _key(**overrides) -> str:
    args = {
        "graph_code": GRAPH,
        "inputs": [((4, 8), "float32", (8, 1))],
        "options": {"max_autotune": False, "device": "cuda:1"},
        "platform": "cpu",
        "parallel_layout": {"tp": 2, "groups": [[0, 1]]},
    }
    args.update(overrides)
    return compute_cache_key(**args)


def test_key_is_32_hex_and_deterministic():
    """The format (32 lowercase hex digits: a directory name on every filesystem); each
    ingredient's change changes it (test_key_changes_with_each_ingredient)."""
    key = _key()
    assert re.fullmatch(r"[0-9a-f]{32}", key), key
    assert key == _key(options={"device": "cuda:1", "max_autotune": False})  # order-free


@pytest.mark.parametrize("change", [
    {"inputs": [((4, 16), "float32", (16, 1))]},
    {"inputs": [((4, 8), "bfloat16", (8, 1))]},
    {"inputs": [((4, 8), "float32", (1, 4))]},
    {"options": {"max_autotune": True, "device": "cuda:1"}},
    {"graph_code": GRAPH + "    return y\n"},
    {"platform": "cuda:sm90"},
    {"parallel_layout": {"tp": 4, "groups": [[0, 1, 2, 3]]}},
], ids=["shape", "dtype", "stride", "options", "graph", "platform", "layout"])
def test_key_changes_with_each_ingredient(change):
    assert _key(**change) != _key()


def test_key_changes_with_versions(monkeypatch):
    import torch

    import ingot.version

    key = _key()
    monkeypatch.setattr(ingot.version, "__version__", "99.0")
    ingot_changed = _key()
    monkeypatch.setattr(torch, "__version__", "99.0+cpu")
    assert len({key, ingot_changed, _key()}) == 3


def test_device_index_does_not_change_the_key():
    import torch

    rank1 = _key(options={"max_autotune": False, "device": torch.device("cuda:1")},
                 graph_code=GRAPH)
    rank0 = _key(options={"max_autotune": False, "device": torch.device("cuda:0")},
                 graph_code=GRAPH.replace("index=1", "index=0"))
    assert rank0 == rank1
    assert _key(options={"device": "cuda:0"}) == _key(options={"device": "cuda:3"})
    assert _key(options={"device": "cuda:0"}) != _key(options={"device": "cpu"})


def test_key_accepts_example_tensors():
    import torch

    x = torch.zeros(4, 8)
    assert _key(inputs=[x]) == _key(inputs=[((4, 8), torch.float32, (8, 1), "cpu")])
    assert _key(inputs=[x]) != _key(inputs=[x.t()])


# -- who may write the cache (issue #31 item 8): entries are code ingot runs -------------------


def test_cache_directories_are_created_private(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod.tempfile, "tempdir", str(tmp_path / "tmp"))
    cache = CompileCache(root=tmp_path / "a" / "b")
    for made in (tmp_path / "a", tmp_path / "a" / "b", cache.dir):
        assert made.stat().st_mode & 0o777 == 0o700, oct(made.stat().st_mode)


def test_fallback_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    """Another user made /tmp/ingot_cache_$USER first (as anyone can in /tmp): refused, with a
    message that says what to do, instead of loading their 'entries'."""
    monkeypatch.setattr(cache_mod.tempfile, "tempdir", str(tmp_path / "tmp"))
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache root should be")
    planted = tmp_path / "tmp" / f"ingot_cache_{cache_mod._user()}"
    planted.mkdir(parents=True)
    real_uid = os.getuid()
    monkeypatch.setattr(cache_mod.os, "getuid", lambda: real_uid + 1)  # we are someone else
    with pytest.raises(cache_mod.UnsafeCacheDirError, match="INGOT_CACHE_ROOT"):
        CompileCache(root=blocker / "ingot")
    monkeypatch.setattr(cache_mod.os, "getuid", lambda: real_uid)  # our own: accepted
    assert CompileCache(root=blocker / "ingot").dir == planted / "compile_cache"


def test_root_owned_by_another_user_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cache_mod.tempfile, "tempdir", str(tmp_path / "tmp"))
    shared = tmp_path / "shared"
    (shared / "compile_cache").mkdir(parents=True)
    real_uid, real_stat = os.getuid(), Path.stat

    def stat_as_other(self, *a, **kw):
        st = real_stat(self, *a, **kw)
        if self == shared / "compile_cache":
            return os.stat_result((st.st_mode, *st[1:4], real_uid + 1, *st[5:]))
        return st

    monkeypatch.setattr(Path, "stat", stat_as_other)
    with caplog.at_level(logging.WARNING, logger="ingot"):
        cache = CompileCache(root=shared)
    assert cache.dir.is_relative_to(tmp_path / "tmp")
    assert any("belongs to uid" in r.getMessage() for r in caplog.records)


def test_group_writable_own_directory_is_tightened(tmp_path, caplog):
    (tmp_path / "r" / "compile_cache").mkdir(parents=True)
    (tmp_path / "r" / "compile_cache").chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="ingot"):
        cache = CompileCache(root=tmp_path / "r")
    assert cache.dir.stat().st_mode & 0o777 == 0o700
    assert any("tightened" in r.getMessage() for r in caplog.records)
