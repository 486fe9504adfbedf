"""Verified sha256s of a dataset's files, cached inside the dataset so that a run start or resume re-reads a file
only when it changed (issue 43, closing note "Left", item 2).

`train_cell` checks every data file against the sha256 meta.json records before it trains (issue 43 item 7).
Reading a dataset of 8B tokens (16 GB) in full at every cell start and resume is most of a start's time, so a
digest that matched is kept in `<dataset>/.verified.json` (written atomically) under the file's stat key
(size, mtime_ns, ctime_ns, inode, device); while the key is the same, the file is not read again. Any write
through the filesystem changes the mtime and the ctime (which no user call can set back), a copy or a replaced
file changes the inode, so a changed file is hashed again and refused as before.

Limits, as for git's index (which keys on the same stat fields): content changed without a change to any of
them (a write to the block device under the filesystem, a filesystem whose ctime does not move, or a clock set
back to the very nanosecond) is not seen by the cached check; `shards.verify` (`changed_data_files` uncached) always
re-reads every file. A file whose mtime or ctime is within `RACY_S` of the moment its hash began is not cached
("racily clean" in git's words): a write in the same timestamp tick after the hash would keep its key.
The cache is a hint: unreadable, of another format or not writable (a read-only dataset), it is ignored.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from depthtools.fsutil import atomic_write_json, file_sha256, read_json_object

CACHE_FILE = ".verified.json"
CACHE_FORMAT = "depthtools.data.verified/1"
RACY_S = 1.0  # a file touched less than this before its hash began is not cached (timestamp granularity, clock skew)


def stat_key(st: os.stat_result) -> list[int]:
    """What must stay the same for a cached digest to hold: size, mtime_ns, ctime_ns, inode, device."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class DigestCache:
    """The verified digests of one dataset folder: `sha256(file)` answers from the cache while the file's stat
    key holds, else hashes the file; `verified(file, digest)` records a digest that matched meta.json; `save()`
    writes the cache when it changed (best effort)."""

    def __init__(self, data_dir: str | os.PathLike):
        self.path = Path(data_dir) / CACHE_FILE
        self.files: dict[str, dict] = _read(self.path)
        self.changed = False
        self._fresh: dict[str, list[int]] = {}  # file -> key of a digest computed now that may be cached

    def sha256(self, name: str, path: Path) -> str:
        """sha256 of the data file `path` (`name`: its name in meta.json), from the cache when its key holds."""
        before = stat_key(os.stat(path))
        entry = self.files.get(name)
        if entry is not None and entry.get("key") == before and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        began = time.time_ns()
        digest = file_sha256(path)
        after = os.stat(path)
        settled = max(after.st_mtime_ns, after.st_ctime_ns) < began - int(RACY_S * 1e9)
        if stat_key(after) == before and settled:
            self._fresh[name] = before
        return digest

    def verified(self, name: str, digest: str) -> None:
        """`digest`, just computed by `sha256(name, ...)`, matched the record: keep it (if its key was stable)."""
        key = self._fresh.pop(name, None)
        if key is not None:
            self.files[name] = {"key": key, "sha256": digest}
            self.changed = True

    def save(self) -> None:
        """Write the cache atomically when it changed; a dataset folder that cannot be written is left as it is."""
        if not self.changed:
            return
        try:
            atomic_write_json(self.path, {"format": CACHE_FORMAT, "files": self.files}, fsync=False)
        except OSError:
            pass
        self.changed = False


def _read(path: Path) -> dict[str, dict]:
    """The cache's `files`, or {} when it is missing, unreadable or of another format."""
    if not path.is_file():
        return {}
    try:
        obj = read_json_object(path, "the data files' digest cache", error=ValueError)
    except ValueError:
        return {}
    files = obj.get("files")
    if obj.get("format") != CACHE_FORMAT or not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(v, dict)}
