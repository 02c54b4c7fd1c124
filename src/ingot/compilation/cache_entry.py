"""On-disk format of one compile cache entry, and the remote tier that serves entries.

An entry is a directory ``<cache>/compile_cache/<key>/`` holding the artifact files the build
wrote plus a completion sentinel, ``.ingot_complete.json``::

    {"format": 1, "key": "<key>", "files": {"<relative path>": "<sha256>", ...}}

The sentinel is written last, inside a private staging directory that is then renamed into
place, so a reader never sees a half-written entry under the final name. The checksums catch
what the rename cannot: an entry copied in non-atomically (rsync of a share, a crashed tool) or
altered afterwards. Such an entry is reported by :func:`verify_entry` and never loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger("ingot")

SENTINEL = ".ingot_complete.json"
ENTRY_FORMAT = 1


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def payload_files(entry: Path) -> list[str]:
    """Relative paths of the artifact files in ``entry`` (everything but the sentinel)."""
    return sorted(
        p.relative_to(entry).as_posix()
        for p in entry.rglob("*")
        if p.is_file() and p.name != SENTINEL
    )


def write_sentinel(entry: Path, key: str) -> None:
    """Mark ``entry`` complete: record each payload file's checksum."""
    files = {rel: _sha256(entry / rel) for rel in payload_files(entry)}
    doc = {"format": ENTRY_FORMAT, "key": key, "files": files}
    (entry / SENTINEL).write_text(json.dumps(doc, indent=1, sort_keys=True))


def verify_entry(entry: Path, key: str) -> str | None:
    """None if ``entry`` is complete and intact, else why not (for the log)."""
    if not entry.is_dir():
        return "missing"
    try:
        doc = json.loads((entry / SENTINEL).read_text())
    except FileNotFoundError:
        return "no completion sentinel (partial entry)"
    except (OSError, ValueError) as e:
        return f"unreadable completion sentinel ({e})"
    if not isinstance(doc, dict) or doc.get("format") != ENTRY_FORMAT or doc.get("key") != key:
        return "completion sentinel of another key or format"
    files = doc.get("files")
    if not isinstance(files, dict) or sorted(files) != payload_files(entry):
        return "files differ from the completion sentinel"
    for rel, digest in files.items():
        if _sha256(entry / rel) != digest:
            return f"checksum mismatch in {rel}"
    return None


def publish(staging: Path, final: Path) -> bool:
    """Atomically rename a complete ``staging`` dir to ``final``.

    Returns False (and removes ``staging``) if ``final`` already exists: another process
    published the same key first, which is fine, the entries are interchangeable.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(staging, final)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return False
    return True


class RemoteTier:
    """A read-only second tier: a shared directory, or any fsspec URL (``s3://...``).

    Entries have the local layout under ``<remote>/compile_cache/<key>/``, so a cache root
    filled by ``INGOT_CACHE_ROOT=/shared ingot compile`` can be served as
    ``INGOT_REMOTE_CACHE=/shared``. Nothing is ever compiled into or deleted from it.
    """

    def __init__(self, location: str) -> None:
        self.location = location
        if "://" in location:
            try:
                import fsspec
            except ImportError as e:
                raise ValueError(
                    f"remote compile cache {location!r} is a URL, which needs fsspec "
                    "(pip install fsspec); or point INGOT_REMOTE_CACHE at a mounted directory"
                ) from e
            self._fs, self._root = fsspec.core.url_to_fs(location)
        else:
            self._fs, self._root = None, location

    def __repr__(self) -> str:
        return f"RemoteTier({self.location!r})"

    def _path(self, key: str, rel: str) -> str:
        return f"{self._root.rstrip('/')}/compile_cache/{key}/{rel}"

    def _read(self, path: str) -> bytes | None:
        try:
            if self._fs is None:
                return Path(path).read_bytes()
            return self._fs.cat_file(path)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _copy(self, path: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if self._fs is None:
            shutil.copyfile(path, dest)
        else:
            self._fs.get_file(path, str(dest))

    def fetch(self, key: str, staging: Path) -> bool:
        """Copy the remote entry for ``key`` into ``staging`` (a new dir); False on a miss.

        The copy is verified against the remote sentinel, so a remote entry that is partial,
        altered or still being synced counts as a miss (and is logged), never as a hit.
        """
        sentinel = self._read(self._path(key, SENTINEL))
        if sentinel is None:
            return False
        try:
            files = json.loads(sentinel)["files"]
            if any(Path(rel).is_absolute() or ".." in Path(rel).parts for rel in files):
                raise ValueError("file path outside the entry")
            staging.mkdir(parents=True)
            for rel in files:
                self._copy(self._path(key, rel), staging / rel)
            (staging / SENTINEL).write_bytes(sentinel)
            problem = verify_entry(staging, key)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"unreadable ({e})"
        if problem is not None:
            logger.warning("ignoring remote compile cache entry %s in %s: %s", key,
                           self.location, problem)
            shutil.rmtree(staging, ignore_errors=True)
            return False
        return True
