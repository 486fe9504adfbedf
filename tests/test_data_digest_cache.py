"""A run start or resume re-reads a data file only when its stat key changed since its digest last matched
(issue 43, closing note "Left", item 2): `<dataset>/.verified.json`, `depthtools.data.digest_cache`.

Reads are counted by wrapping the hashing function; every digest the cache holds is compared with hashlib over
the file's bytes. A changed file is refused as before, whether its mtime moved or was set back by hand (the ctime
in the key still moves); `shards.verify` (`changed_data_files` without `cached`) always reads every file.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import depthtools.data.digest_cache as dc
from cli.main import app
from depthtools.data import prepare_inputs, read_meta
from depthtools.errors import DepthToolsError

from tiny_models import TINY_CORPUS

runner = CliRunner()
prep = importlib.import_module("depthtools.data.prepare")  # the module (depthtools.data.prepare is also a function)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    return prepare_inputs([str(p) for p in sorted(TINY_CORPUS.glob("*.txt"))], out_dir=folder, val_fraction=0.3,
                          shard_tokens=4096)


@pytest.fixture
def data(sharded, tmp_path, monkeypatch) -> Path:
    """A fresh copy of a sharded dataset whose files are settled (older than RACY_S), so their digests are cached."""
    folder = tmp_path / "d"
    shutil.copytree(sharded, folder)
    monkeypatch.setattr(dc, "RACY_S", 0.05)
    time.sleep(0.1)
    return folder


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The names of the files hashed, by the cached check and by the full one."""
    seen: list[str] = []
    real = dc.file_sha256

    def counting(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(dc, "file_sha256", counting)
    monkeypatch.setattr(prep, "file_sha256", counting)
    return seen


def _files(folder: Path) -> list[str]:
    return sorted(r["file"] for split in read_meta(folder)["splits"].values() for r in split.get("shards", [split]))


def _rewrite_one_token(path: Path, restore_mtime: bool = False) -> None:
    """Change one token in place (same size, so only the digest can tell)."""
    st = os.stat(path)
    tokens = np.fromfile(path, dtype=np.uint16)
    tokens[5] = (int(tokens[5]) + 1) % 256
    time.sleep(0.02)  # a new mtime tick
    tokens.tofile(path)
    if restore_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_size == st.st_size


def test_unchanged_files_are_read_once_then_answered_from_the_cache(data, reads):
    files = _files(data)
    assert len(files) > 2
    prep.check_data_files(data)
    assert sorted(reads) == sorted(Path(f).name for f in files)
    cache = json.loads((data / dc.CACHE_FILE).read_text())
    assert cache["format"] == dc.CACHE_FORMAT and sorted(cache["files"]) == files
    for name, entry in cache["files"].items():  # the digests are the files' sha256 (hashlib, independently)
        assert entry["sha256"] == hashlib.sha256((data / name).read_bytes()).hexdigest()
        st = os.stat(data / name)
        assert entry["key"] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    reads.clear()
    prep.check_data_files(data)
    prep.check_data_files(data, read_meta(data))
    assert reads == []  # no file read again
    assert prep.changed_data_files(data) == [] and len(reads) == len(files)  # shards.verify: every file, always


@pytest.mark.parametrize("restore_mtime", [False, True], ids=["new mtime", "mtime set back"])
def test_a_changed_file_is_read_again_and_refused(data, reads, restore_mtime):
    """(c) new mtime: refused as without the cache. (b) mtime set back by hand (os.utime): the ctime, which no
    call can set back, is in the key, so it is refused too; the cache's limit is content changed with no stat
    field moving at all (module docstring), which `shards.verify` still catches."""
    prep.check_data_files(data)
    changed = _files(data)[0]
    _rewrite_one_token(data / changed, restore_mtime)
    reads.clear()
    for _ in range(2):  # the bad digest is never cached
        with pytest.raises(DepthToolsError, match="differ from the sha256 meta.json records") as err:
            prep.check_data_files(data)
        assert changed in str(err.value) and "\n" not in str(err.value)
    assert reads == [Path(changed).name] * 2  # only the changed file is read


def test_a_copy_is_hashed_again(data, reads, tmp_path):
    """copy2 keeps size and mtime, and the cache comes along, but inode and ctime differ: every file is read."""
    prep.check_data_files(data)
    copy = tmp_path / "copy"
    shutil.copytree(data, copy, copy_function=shutil.copy2)
    assert (copy / dc.CACHE_FILE).is_file()
    time.sleep(0.1)
    reads.clear()
    prep.check_data_files(copy)
    assert len(reads) == len(_files(copy))


def test_a_file_touched_just_before_its_hash_is_not_cached(data, reads, monkeypatch):
    """Racily clean (git's term): a write in the same timestamp tick after the hash would keep the key."""
    monkeypatch.setattr(dc, "RACY_S", 3600.0)
    prep.check_data_files(data)
    prep.check_data_files(data)
    assert len(reads) == 2 * len(_files(data)) and not (data / dc.CACHE_FILE).exists()


@pytest.mark.parametrize("garbage", [b"{not json", b"[]", b'{"format": "other/1", "files": {}}', b"\xff\xfe"])
def test_an_unreadable_cache_is_ignored_and_rewritten(data, reads, garbage):
    (data / dc.CACHE_FILE).write_bytes(garbage)
    prep.check_data_files(data)
    assert len(reads) == len(_files(data))
    assert sorted(json.loads((data / dc.CACHE_FILE).read_text())["files"]) == _files(data)


def test_a_cache_entry_that_disagrees_with_meta_json_is_refused(data, reads):
    """The cache holds the file's digest, not a verdict: an entry whose digest is not the record's is refused."""
    prep.check_data_files(data)
    cache = json.loads((data / dc.CACHE_FILE).read_text())
    first = _files(data)[0]
    cache["files"][first]["sha256"] = "0" * 64
    (data / dc.CACHE_FILE).write_text(json.dumps(cache))
    with pytest.raises(DepthToolsError, match=first):
        prep.check_data_files(data)


def test_a_second_run_start_reads_no_data(data, reads, tmp_path):
    """The train call site (train_cell) uses the cache: the second start of a run on the same data reads nothing."""
    args = ["train", "--arch", "preln", "--layers", "1", "--d-model", "16", "--n-heads", "2", "--tokens", "256",
            "--batch-size", "4", "--seq-len", "16", "--eval-every", "0", "--threads", "1", "--data", str(data)]
    first = runner.invoke(app, [*args, "--out", str(tmp_path / "c1")])
    assert first.exit_code == 0, (first.output, first.exception)
    assert len(reads) == len(_files(data))
    reads.clear()
    second = runner.invoke(app, [*args, "--out", str(tmp_path / "c2")])
    assert second.exit_code == 0, (second.output, second.exception)
    assert reads == []
