"""Persistent compile cache: one compiled artifact per key, shared by ranks, runs and hosts.

Spec section 8. Two tiers:

* local, always on: ``$INGOT_CACHE_ROOT/compile_cache/<key>/`` (default root ``~/.cache/ingot``).
  If that is not writable, or is on a network file system (where ``flock`` is unreliable), the
  cache moves to ``/tmp/ingot_cache_$USER/compile_cache`` with a warning. Entries are code
  that ingot loads and runs, so every cache directory is created 0700 and one owned by another
  user is refused (:func:`private_dir`);
* remote, opt-in (``INGOT_REMOTE_CACHE``: a shared directory or an fsspec URL): read-through
  only, entries are copied into the local tier, never compiled into.

Flow of :meth:`CompileCache.get_or_create`: look in the local tier without a lock (the hot path
of every warm start); on a miss take the key's lock file, look again (another process may have
just published it), then in the remote tier, and only then build. Entries are written into a
staging directory, sealed with a checksummed completion sentinel and renamed into place, so
readers never see partial entries; four ranks compiling the same graph compile it once while
different graphs compile in parallel.

Environment: ``INGOT_CACHE_ROOT``, ``INGOT_REMOTE_CACHE``, ``INGOT_COMPILATION_TIMEOUT``
(seconds to wait for another process's lock, default 600) and
``INGOT_DISABLE_WARMUP_COMPILE=1`` (hit-only: a miss raises instead of compiling, for serving
hosts that must run only what ``ingot compile`` produced ahead of time).
"""

from __future__ import annotations

import getpass
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import filelock

from ingot.compilation.cache_entry import (
    RemoteTier,
    publish,
    verify_entry,
    write_sentinel,
)
from ingot.compilation.cache_key import compute_cache_key

__all__ = [
    "CacheStats",
    "CompileCache",
    "CompileCacheMissError",
    "CompileCacheTimeoutError",
    "UnsafeCacheDirError",
    "compute_cache_key",
    "default_cache_root",
    "private_dir",
]

logger = logging.getLogger("ingot")

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 600.0
_NETWORK_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs"}


class UnsafeCacheDirError(OSError):
    """A cache directory another user owns: its entries could be code they planted."""


class CompileCacheMissError(RuntimeError):
    """A key is missing and the cache is hit-only (``INGOT_DISABLE_WARMUP_COMPILE=1``)."""


class CompileCacheTimeoutError(RuntimeError):
    """Another process held a key's lock for longer than the compilation timeout."""


@dataclass
class CacheStats:
    """Counters of one :class:`CompileCache`; every lookup is exactly one of hit/remote/miss."""

    hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    compiles: int = 0
    #: Seconds spent building, per caller-given label (e.g. the bucket name).
    compile_seconds: dict[str, float] = field(default_factory=dict)


def default_cache_root() -> Path:
    """``$INGOT_CACHE_ROOT``, else ``~/.cache/ingot``."""
    env = os.environ.get("INGOT_CACHE_ROOT")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ingot"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry / no USER in a container
        return str(os.getuid())


def _fallback_root() -> Path:
    return Path(tempfile.gettempdir()) / f"ingot_cache_{_user()}"


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can write: missing components are created 0700;
    an existing one owned by another user raises :class:`UnsafeCacheDirError`; one of ours that
    group or others may write is tightened to 0700 (with a warning)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # another process (or rank) made it meanwhile: checked below
            pass
    st = path.stat()  # follows a symlink: what counts is the directory written into
    if st.st_uid != os.getuid():
        raise UnsafeCacheDirError(
            f"cache directory {path} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.getuid()}): its entries are code ingot would run. Remove it or set "
            "INGOT_CACHE_ROOT to a directory of your own"
        )
    if st.st_mode & 0o022:
        logger.warning("cache directory %s was writable by group or others (mode %o); "
                       "tightened to 0700", path, st.st_mode & 0o777)
        path.chmod(0o700)
    return path


def _filesystem_type(path: Path) -> str | None:
    """The type of the file system holding ``path`` (from /proc/mounts; None if unknown)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    resolved, best, fstype = str(path.resolve()), "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mountpoint = parts[1].replace("\\040", " ")
        inside = resolved == mountpoint or resolved.startswith(mountpoint.rstrip("/") + "/")
        if inside and len(mountpoint) > len(best):
            best, fstype = mountpoint, parts[2]
    return fstype


def _usable_cache_dir(root: Path) -> Path:
    """``root/compile_cache`` if we can write and lock there, else the /tmp fallback."""
    cache_dir = root / "compile_cache"
    try:
        private_dir(cache_dir)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".probe"):
            pass
        fstype = _filesystem_type(cache_dir)
        if fstype in _NETWORK_FILESYSTEMS:
            raise OSError(f"{cache_dir} is on {fstype}, where file locks are unreliable")
        return cache_dir
    except OSError as e:
        fallback = _fallback_root() / "compile_cache"
        logger.warning("compile cache root %s is not usable (%s); using %s", root, e, fallback)
        # /tmp is shared: another user may have made this directory first.
        private_dir(fallback.parent)
        return private_dir(fallback)


class CompileCache:
    """Two-tier, multi-process safe store of compiled artifacts, one directory per key.

    Args:
        root: cache root (the entries live under ``root/compile_cache``); default
            :func:`default_cache_root`.
        remote: read-only remote tier (directory or fsspec URL); default ``$INGOT_REMOTE_CACHE``.
        timeout_s: how long to wait for another process that holds a key's lock; default
            ``$INGOT_COMPILATION_TIMEOUT`` or 600.
        hit_only: raise :class:`CompileCacheMissError` instead of building; default
            ``$INGOT_DISABLE_WARMUP_COMPILE == "1"``.
    """

    def __init__(
        self,
        root: str | Path | None = None,
        remote: str | None = None,
        timeout_s: float | None = None,
        hit_only: bool | None = None,
    ) -> None:
        root = Path(root).expanduser() if root is not None else default_cache_root()
        self.dir = _usable_cache_dir(root)
        remote = remote if remote is not None else os.environ.get("INGOT_REMOTE_CACHE") or None
        self.remote = RemoteTier(remote) if remote else None
        if timeout_s is None:
            timeout_s = float(os.environ.get("INGOT_COMPILATION_TIMEOUT", DEFAULT_TIMEOUT_S))
        self.timeout_s = timeout_s
        if hit_only is None:
            hit_only = os.environ.get("INGOT_DISABLE_WARMUP_COMPILE") == "1"
        self.hit_only = hit_only
        self.stats = CacheStats()

    def __repr__(self) -> str:
        return (f"CompileCache(dir={str(self.dir)!r}, remote={self.remote!r}, "
                f"hit_only={self.hit_only})")

    def entry_dir(self, key: str) -> Path:
        """Where the entry for ``key`` lives (whether or not it exists)."""
        return self.dir / key

    def lock_path(self, key: str) -> Path:
        """The lock file guarding the creation of ``key``."""
        return self.dir / ".locks" / f"{key}.lock"

    def _staging(self, key: str) -> Path:
        # Same file system as the entries, so publishing is a rename.
        return self.dir / ".staging" / f"{key}.{os.getpid()}.{uuid.uuid4().hex}"

    def contains(self, key: str) -> bool:
        """Whether an intact local entry exists for ``key``."""
        return verify_entry(self.entry_dir(key), key) is None

    def get_or_create(
        self,
        key: str,
        build: Callable[[Path], None],
        load: Callable[[Path], T],
        label: str = "default",
    ) -> T:
        """Load the entry for ``key``, creating it first if needed.

        Args:
            key: from :func:`compute_cache_key`.
            build: writes the artifact files into the (empty, private) directory it is given.
                Called at most once per key across all processes sharing the cache.
            load: turns an entry directory into the artifact; only ever sees intact entries.
            label: names the thing being compiled in :attr:`CacheStats.compile_seconds`.
        """
        entry = self.entry_dir(key)
        if verify_entry(entry, key) is None:  # hot path: no lock
            self.stats.hits += 1
            return load(entry)
        with self._locked(key):
            problem = verify_entry(entry, key)
            if problem is None:  # another process created it while we waited
                self.stats.hits += 1
            else:
                if problem != "missing":
                    logger.warning("compile cache entry %s is broken (%s); deleting it", entry,
                                   problem)
                    self._discard(entry)
                self._fill(key, build, label)
        return load(entry)

    def _fill(self, key: str, build: Callable[[Path], None], label: str) -> None:
        """Under the key's lock: copy the entry from the remote tier, or build it."""
        entry = self.entry_dir(key)
        staging = self._staging(key)
        if self.remote is not None and self.remote.fetch(key, staging):
            publish(staging, entry)
            self.stats.remote_hits += 1
            logger.info("compile cache: %s copied from %s", key, self.remote.location)
            return
        self.stats.misses += 1
        if self.hit_only:
            raise CompileCacheMissError(
                f"compile cache miss for key {key} ({label}) with "
                "INGOT_DISABLE_WARMUP_COMPILE=1; run `ingot compile` first with the same model, "
                "buckets and versions (into this INGOT_CACHE_ROOT or the INGOT_REMOTE_CACHE "
                f"share), or unset INGOT_DISABLE_WARMUP_COMPILE. Local cache: {self.dir}, "
                f"remote: {self.remote.location if self.remote else 'none'}")
        staging.mkdir(parents=True)
        start = time.perf_counter()
        try:
            build(staging)
            write_sentinel(staging, key)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        elapsed = time.perf_counter() - start
        publish(staging, entry)
        self.stats.compiles += 1
        self.stats.compile_seconds[label] = self.stats.compile_seconds.get(label, 0.0) + elapsed
        logger.info("compile cache: built %s (%s) in %.2f s", key, label, elapsed)

    def _locked(self, key: str) -> _Held:
        path = self.lock_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(path))
        try:
            lock.acquire(timeout=self.timeout_s)
        except filelock.Timeout as e:
            raise CompileCacheTimeoutError(
                f"waited {self.timeout_s:g} s for the compile lock of key {key} ({path}); "
                "another process is compiling it or is stuck. Raise INGOT_COMPILATION_TIMEOUT "
                "if compiles are this slow, or stop the stuck process (a lock of a process "
                "that has exited is released automatically)") from e
        return _Held(lock)

    def _discard(self, entry: Path) -> None:
        # Rename first: a lock-free reader then sees "missing", never a half-deleted entry.
        trash = self.dir / ".trash" / f"{entry.name}.{uuid.uuid4().hex}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def save_to(self, dest_root: str | Path, key: str) -> bool:
        """Copy the local entry for ``key`` into another cache root (e.g. the remote share).

        The copy is staged next to its destination and renamed into place. Returns False if the
        destination already has the entry (another writer won; not an error). Raises
        RuntimeError if the local entry is missing or incomplete.
        """
        entry = self.entry_dir(key)
        problem = verify_entry(entry, key)
        if problem is not None:
            raise RuntimeError(f"cannot save compile cache entry {key}: local entry {problem}")
        dest_dir = Path(dest_root).expanduser() / "compile_cache"
        final = dest_dir / key
        if final.exists():
            return False
        staging = dest_dir / ".staging" / f"{key}.{os.getpid()}.{uuid.uuid4().hex}"
        staging.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(entry, staging)
        return publish(staging, final)


class _Held:
    """Context manager releasing an already-acquired lock."""

    def __init__(self, lock: filelock.BaseFileLock) -> None:
        self._lock = lock

    def __enter__(self) -> filelock.BaseFileLock:
        return self._lock

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
