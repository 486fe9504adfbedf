"""One atomic write (issue 46): fsutil.AtomicFile and its bytes/text/JSON helpers, used by every writer of a file
that readers may see half-written (checkpoints, heartbeat, tokenizer, dataset metadata, shard parts)."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from depthtools import fsutil
from depthtools.fsutil import AtomicFile, atomic_write_bytes, atomic_write_json, atomic_write_text, os_error_line


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_each_form_writes_the_whole_file_with_an_ordinary_mode(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_bytes(tmp_path / "new" / "a.bin", b"\x00\x01")  # the folder is created
        atomic_write_text(tmp_path / "b.txt", "ü\n")
        atomic_write_json(tmp_path / "c.json", {"b": 1, "a": [2]})
        atomic_write_json(tmp_path / "d.json", {"b": 1, "a": 2}, indent=1, sort_keys=False)
    finally:
        os.umask(old)
    assert (tmp_path / "new" / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_bytes() == "ü\n".encode("utf-8")
    assert (tmp_path / "c.json").read_text() == json.dumps({"a": [2], "b": 1}, indent=2) + "\n"
    assert (tmp_path / "d.json").read_text() == '{\n "b": 1,\n "a": 2\n}\n'
    for name in ("new/a.bin", "b.txt", "c.json", "d.json"):  # 0o666 less the umask, not mkstemp's 0600
        assert _mode(tmp_path / name) == 0o640, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt", "c.json", "d.json", "new"]  # no temporary left


def test_fsync_only_where_asked(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(fsutil.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    atomic_write_text(tmp_path / "hint.json", "{}\n", fsync=False)
    assert synced == []
    atomic_write_text(tmp_path / "ckpt.json", "{}\n")
    assert len(synced) == 1


def test_a_failed_rename_keeps_the_old_file_removes_the_temporary_and_names_the_target(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    atomic_write_json(path, {"v": 1})

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device", "/somewhere/.a.json.xyz.tmp")

    monkeypatch.setattr(fsutil.os, "replace", full)
    with pytest.raises(OSError) as info:
        atomic_write_json(path, {"v": 2})
    assert os_error_line(info.value) == f"cannot write {path}: No space left on device"
    assert json.loads(path.read_text()) == {"v": 1}
    assert list(tmp_path.iterdir()) == [path]


def test_a_folder_that_cannot_be_written_is_an_error_naming_the_file(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as a user that can write anywhere")
        with pytest.raises(OSError) as info:
            atomic_write_text(folder / "x.txt", "x")
        assert os_error_line(info.value) == f"cannot use {folder / 'x.txt'}: Permission denied"
    finally:
        folder.chmod(0o700)
    assert list(folder.iterdir()) == []


def test_an_exception_in_the_block_discards_and_propagates_unchanged(tmp_path):
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with AtomicFile(tmp_path / "part.bin") as out:
            out.write(b"half")
            raise Boom
    assert list(tmp_path.iterdir()) == []


def test_a_path_writer_writes_the_temporary_file_itself(tmp_path):
    """safetensors' save_file takes a path: it writes `temp`, and commit renames it."""
    with AtomicFile(tmp_path / "w.bin") as out:
        assert out.temp.parent == tmp_path and out.temp.name.startswith(".w.bin.") and out.temp.suffix == ".tmp"
        out.temp.write_bytes(b"weights")
    assert (tmp_path / "w.bin").read_bytes() == b"weights"
    assert list(tmp_path.iterdir()) == [tmp_path / "w.bin"]


def test_a_unit_that_fails_leaves_no_part_files(tmp_path, monkeypatch):
    """Shard parts are streamed through AtomicFile; a unit whose input breaks mid-way leaves nothing in work/."""
    from depthtools.data import shards
    from depthtools.data.inputs import expand_inputs, plan_units
    from depthtools.data.tokenizer import ByteTokenizer
    from depthtools.errors import DepthToolsError

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": f"doc {k}"}) + "\n" for k in range(40)))
    unit = plan_units(expand_inputs([str(source)]), 10**9)[0]
    work = tmp_path / "work"
    work.mkdir()
    real_read = shards.read_unit

    def breaks_mid_way(unit, fields):
        for k, item in enumerate(real_read(unit, fields)):
            if k == 20:
                raise DepthToolsError(f"{unit.path}: damaged at line {k + 1}")
            yield item

    monkeypatch.setattr(shards, "BATCH_CHARS", 10)  # flush often: the part files have data when it breaks
    monkeypatch.setattr(shards, "read_unit", breaks_mid_way)
    with pytest.raises(DepthToolsError, match="damaged at line 21"):
        shards.tokenize_unit(0, unit, str(work), "text", None, 0, 0.1, tok=ByteTokenizer())
    assert list(work.iterdir()) == []
    monkeypatch.setattr(shards, "read_unit", real_read)
    record = shards.tokenize_unit(0, unit, str(work), "text", None, 0, 0.1, tok=ByteTokenizer())
    names = sorted(p.name for p in work.iterdir())
    assert names == sorted(["u000000.json"] + [f"u000000.{s}.{e}" for s in ("train", "val") for e in ("bin", "idx", "dom")])
    assert record["documents"] == 40
    assert shards.unit_done(work, 0) is not None
